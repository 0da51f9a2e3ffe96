"""Long chats through the chat engine: the first read of a long
conversation, and the first reply token of a follow-up once it was read.

  python bench/long_chat.py MODEL_DIR [--lengths 4000 24000] [--data DIR]
      [--n-hashes H] [--far-keys K] [--follow-ups N]

For each length, a conversation of about that many tokens is built from
the turns of the line-format files in `--data` (repeated in order), then
sent as an API request would be (`src.inference.engine.Conversations`, the
server's and the REPL's engine; unseeded sampling, 8 reply tokens), twice
(the first pass compiles the programs; the second is reported):
- the first read: the whole conversation and its question, read from an
  empty context, to the reply's first token;
- follow-ups: the same conversation, the reply, and one more question:
  only the new tokens are read, then the first reply token; `--follow-ups`
  of them in a row (each after the last one's reply), their median
  reported with the lowest and highest; and the time of each reply token
  after the first (a step of one token; median over the follow-ups).
The conversation is never trimmed (it is checked to fit the context).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from src import runtime  # noqa: E402

runtime.bootstrap(light=True)

from src.data import chatformat  # noqa: E402
from src.inference import decoding, engine, sampling  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLLOW_UPS = (
  'And what about tomorrow?',
  'Really?',
  'Tell me more.',
  'Why do you say that?',
  'OK, and then?',
)


def conversation(turns, tok, length: int) -> list[tuple[str, str]]:
  """Messages `(role, text)` of about `length` tokens, user first, ending
  with an AI turn (the question is added by the caller)."""
  out, used, i = [], 0, 0
  while used < length:
    role, text = turns[i % len(turns)]
    i += 1
    if (role == chatformat.USER) != (len(out) % 2 == 0):
      continue  # Keep the sides alternating.
    out.append((role, text))
    used += len(tok.encode(text)) + 2
  if out[-1][0] == chatformat.USER:
    out.pop()
  return out


_TOKENS: list[float] = []  # When each of a reply's tokens came.


def _clocked(generate):
  """`generate.generate` noting when each token comes (the reply's first
  text may wait for a second token: a piece that shows nothing)."""

  def clocked(*args, **kwargs):
    tokens = generate(*args, **kwargs)
    try:
      for token in tokens:
        _TOKENS.append(time.perf_counter())
        yield token
    finally:
      tokens.close()  # Feeds its last token, as the engine's close does.

  return clocked


engine.generate.generate = _clocked(engine.generate.generate)


def timed(convs, messages, settings) -> tuple[float, float | None, dict]:
  """Seconds to the reply's first token, seconds a token after it (None:
  one token), and the result."""
  _TOKENS.clear()
  started = time.perf_counter()
  job = engine.Request(list(messages), settings)
  result = convs.run(job, threading.Event())
  clock = _TOKENS or [time.perf_counter()]
  each = (clock[-1] - clock[0]) / (len(clock) - 1) if len(clock) > 1 else None
  return clock[0] - started, each, result


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('model_dir')
  parser.add_argument('--lengths', type=int, nargs='+', default=[4000, 24000])
  parser.add_argument('--data', default=os.path.join(ROOT, 'data', 'examples'))
  parser.add_argument(
    '--n-hashes', type=int, help='LSH hash rounds (evaluate.py --n-hashes)'
  )
  parser.add_argument(
    '--far-keys', type=int, help='far keys read (evaluate.py --far-keys)'
  )
  parser.add_argument(
    '--follow-ups', type=int, default=5, help='follow-ups timed (median)'
  )
  args = parser.parse_args(argv)
  decoder = decoding.Decoder.load(args.model_dir, args.n_hashes, args.far_keys)
  tok = decoder.tokenizer
  turns = [
    (t.role, t.text) for c in chatformat.read_data(args.data) for t in c.turns
  ]
  settings = sampling.SamplingSettings(max_new_tokens=8)
  print(
    f'model {args.model_dir}: context {decoder.max_len}, step '
    f'{decoder.step}; hash rounds {args.n_hashes or "chat.n_hashes"}; '
    f'far keys {"chat.far_keys" if args.far_keys is None else args.far_keys}; '
    f'{os.cpu_count()} cores'
  )
  print(
    '| conversation | first read, to the first reply token | '
    f'follow-up: tokens read | follow-up: first reply token (median of '
    f'{args.follow_ups}; lowest-highest) | a reply token after the first '
    '(median) |'
  )
  print('|---:|---:|---:|---:|---:|')
  for length in args.lengths:
    messages = conversation(turns, tok, length)
    for _ in range(2):  # The first pass compiles; the second is timed.
      convs = engine.Conversations(decoder)
      asked = messages + [(chatformat.USER, 'How are you?')]
      read, _, result = timed(convs, asked, settings)
      if result['dropped_turns']:
        sys.exit(f'{length} tokens do not fit the context: trimmed')
      read_tokens = result['prompt_tokens']
      firsts, later, history = [], [], asked
      for n in range(args.follow_ups):
        history = history + [
          (chatformat.AI, result['text'] or '.'),
          (chatformat.USER, FOLLOW_UPS[n % len(FOLLOW_UPS)]),
        ]
        first, each, result = timed(convs, history, settings)
        firsts.append(first)
        if each is not None:  # A reply of one token has no later ones.
          later.append(each)
    new = result['prompt_tokens'] - result['reused_tokens']
    firsts.sort()
    each = f'{sorted(later)[len(later) // 2] * 1000:.1f} ms' if later else '-'
    print(
      f'| {read_tokens:,} tokens | {read:.2f} s | {new} | '
      f'{firsts[len(firsts) // 2] * 1000:.1f} ms ({firsts[0] * 1000:.1f}-'
      f'{firsts[-1] * 1000:.1f}) | {each} |'
    )


if __name__ == '__main__':
  main()
