"""`python evaluate.py`: chat with a trained model, one reply, its
perplexity on files, or the server (its arguments and what each does)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def add_serving_arguments(parser):
  """The `--serve` options: address, key, origins, slots, queue."""
  serve = parser.add_argument_group('serving (--serve)')
  serve.add_argument(
    '--serve',
    action='store_true',
    help='serve the model: OpenAI-compatible /v1/chat/completions and a '
    'chat page at /',
  )
  serve.add_argument('--host', default='127.0.0.1', help='address to listen on')
  serve.add_argument('--port', type=int, default=8000, help='port')
  serve.add_argument(
    '--api-key',
    default=None,
    help='require "Authorization: Bearer KEY" (also JADE_API_KEY)',
  )
  serve.add_argument(
    '--allow-origin',
    action='append',
    default=[],
    metavar='ORIGIN',
    help='let web pages of ORIGIN (e.g. https://example.org) call the API; '
    'other pages are refused (403)',
  )
  serve.add_argument(
    '--allow-host',
    action='append',
    default=[],
    metavar='NAME',
    help='answer to this Host name too (a reverse proxy that forwards the '
    "client's Host); other names get 403",
  )
  serve.add_argument(
    '--open-without-key',
    action='store_true',
    help='allow a non-loopback --host without --api-key',
  )
  serve.add_argument(
    '--slots',
    type=int,
    default=1,
    help='conversations kept at once, each with its own decoder state: '
    'alternating users feed only their new tokens (memory is stated at '
    'start)',
  )
  serve.add_argument(
    '--debug-headers',
    action='store_true',
    help='add X-Jade-Reused-Tokens (context tokens kept from an earlier '
    'request) to replies: it tells a client how much of its conversation '
    "matches another client's, so it is off by default",
  )
  serve.add_argument(
    '--max-queue',
    type=int,
    default=16,
    help='requests that may wait while one is answered (more get 503)',
  )


def parse_args(argv=None):
  from src.config import jsonconfig
  from src.inference import sampling

  defaults = sampling.SamplingSettings()
  parser = argparse.ArgumentParser(
    description='Chat with a trained model (or score files with it).',
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    '--config',
    metavar='FILE',
    default=None,
    help='JSON config (default: ./config.json if present)',
  )
  jsonconfig.add_arguments(parser, 'eval')
  parser.add_argument('--prompt', help='print one reply to this and exit')
  parser.add_argument(
    '--perplexity',
    metavar='PATH',
    help='report loss and perplexity on a conversation file or folder',
  )
  add_serving_arguments(parser)
  parser.add_argument(
    '--n-hashes',
    type=int,
    default=None,
    help="LSH hash rounds while sampling, 1-64 (default: the model's "
    'chat.n_hashes, else as trained)',
  )
  parser.add_argument(
    '--far-keys',
    type=int,
    default=None,
    help='LSH keys read beyond chat.far_from tokens back, the best-scoring, '
    "0-64 (default: the model's chat.far_keys; 0: all)",
  )
  for f in dataclasses.fields(defaults):
    parser.add_argument(
      '--' + f.name.replace('_', '-'),
      type=type(f.default),
      default=f.default,
      help=f'sampling: {f.name} (/set {f.name} VALUE)',
    )
  return parser.parse_args(argv)


def report_perplexity(model_dir: str, path: str):
  """Prints the loss and perplexity of the model on `path`'s conversations,
  overall and by position in the context."""
  from src.inference import scoring

  r = scoring.evaluate(model_dir, path)
  print(
    f'{path}: {r["tokens"]} tokens, loss {r["loss"]:.4f} '
    f'nats/token, perplexity {r["perplexity"]:.2f}, '
    f'{r["bits_per_char"]:.3f} bits/char'
  )
  print(
    'loss by position in the context: '
    + ' | '.join(
      f'{name}: {loss:.3f} ({n} tokens)' for name, n, loss in r['by_position']
    )
  )


def _reading_checks(args) -> None:
  """Refuses a bad --n-hashes or --far-keys before the model loads (the
  gin checks would blame the model's model.gin, not the flag)."""
  from src.core.errors import UserError
  from src.model import reformer, settings

  most = settings.MOST_HASH_ROUNDS
  if args.n_hashes is not None and not 1 <= args.n_hashes <= most:
    raise UserError(f'--n-hashes {args.n_hashes}: 1 to {most} hash rounds')
  most = reformer.MOST_FAR_KEYS
  if args.far_keys is not None and not 0 <= args.far_keys <= most:
    raise UserError(
      f'--far-keys {args.far_keys}: 0 (every key) to {most} (each is a pass '
      'over the keys)'
    )


def _serve_checks(args) -> str | None:
  """Refuses bad serving options before the model loads; returns the API
  key (--api-key or JADE_API_KEY)."""
  from src.apps import serve
  from src.core.errors import UserError

  if not (
    1 <= args.port < 65536 and args.max_queue >= 0 and 1 <= args.slots <= 64
  ):
    raise UserError(
      '--port must be 1-65535, --max-queue 0 or more, --slots 1-64'
    )
  api_key = args.api_key or os.environ.get('JADE_API_KEY')
  serve.check_host(args.host, api_key, args.open_without_key)
  return api_key


def main(argv=None):
  """`python evaluate.py`: chat, one reply, perplexity, or serve."""
  args = parse_args(argv)
  from src import runtime

  runtime.bootstrap(light=True)  # Decoding only: see runtime.bootstrap.
  from src.apps import chat
  from src.config import jsonconfig
  from src.inference import decoding, sampling

  model_dir = jsonconfig.from_args(args, 'eval')['model-dir']
  if args.perplexity:
    report_perplexity(model_dir, args.perplexity)
    return 0
  fields = [f.name for f in dataclasses.fields(sampling.SamplingSettings)]
  sampler = sampling.SamplingSettings(**{k: getattr(args, k) for k in fields})
  sampler.check()
  _reading_checks(args)
  api_key = _serve_checks(args) if args.serve else None
  decoder = decoding.Decoder.load(
    model_dir, n_hashes=args.n_hashes, far_keys=args.far_keys
  )
  if args.serve:
    from src.apps import serve

    settings = serve.ServerSettings(
      model_id=os.path.basename(os.path.normpath(model_dir)),
      host=args.host,
      port=args.port,
      api_key=api_key,
      max_queue=args.max_queue,
      defaults=sampler,
      allow_origins=tuple(args.allow_origin),
      open_without_key=args.open_without_key,
      slots=args.slots,
      allow_hosts=tuple(args.allow_host),
      debug_headers=args.debug_headers,
    )
    serve.serve(decoder, settings)
    return 0
  session = chat.ChatSession(decoder, sampler)
  if args.prompt is not None:
    session.reply(args.prompt)
    return 0
  # Bytes that are not UTF-8 on a pipe become U+FFFD, never an exception.
  if hasattr(sys.stdin, 'reconfigure'):
    sys.stdin.reconfigure(errors='replace')
  chat.run_repl(session, interactive=sys.stdin.isatty())
  return 0
