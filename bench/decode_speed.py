"""Decode speed: Jade V8's incremental decoder against naive re-running.

Both contenders use the same small model and weights (4 layers, d_model 256,
4 heads of 64, d_ff 1024, vocabulary 500, local attention (chunks of 64)
and directed LSH attention (chunks of 64, 1 hash) in turns as shipped,
`--attention lsh-only` or `lsh-shared` for LSH in every block, with or
without the directed term; a 4160-token context = 4096 + 64) and run one
after another in this process:

- incremental: `src.inference.decoding.Decoder`, the path `evaluate.py` uses: a
  predict-mode ReformerLM jitted once, state carried between tokens.
- naive: the eval-mode model re-run on the whole (padded) prefix for every
  new token, jitted once for the padded length.

For prefix lengths 512 and 4096 it reports ms per generated token (64 tokens
each, greedy), plus compile times and the time from a new 20-token user
message to the first reply token after compilation.

  python bench/decode_speed.py [--tokens 64] [--json out.json]

`--contexts 4096,32768` times the incremental decoder alone at each amount
of context instead: a model whose context is that many tokens (+ 128 for
the message and the reply), filled with that many tokens (the last 20 a
new user message), then 64 greedy tokens (the median token's time is
reported). `--shape 32k` times the shipped
`gin/reformer_32k.gin` model (6 layers, d_model 512, 8 heads, local and
directed-LSH blocks, 2 hashes; its own 32,768-token memory, filled to each
context) with `--vocab 500` or `32000`. `--json FILE` then writes
`{"4096": ms_per_token, ...}` (the keys are the contexts), and the log
gives the first reply token's time and the process's peak memory.

  python bench/decode_speed.py --contexts 4096,32768 --json decode.json
  python bench/decode_speed.py --shape 32k --vocab 32000 \
      --contexts 4096,16384,32640
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from src import runtime  # noqa: E402

runtime.bootstrap()  # XLA flags, quiet logs, Trax patches: first.
import jax  # noqa: E402
import numpy as np  # noqa: E402
import trax  # noqa: E402

from src.inference import decoding, scoring  # noqa: E402
from src.inference.decoding import Decoder  # noqa: E402
from src.model import ginconf  # noqa: E402

CONTEXT = common.DECODE_CONTEXT
VOCAB = 500
BINDINGS = common.DECODE_BINDINGS
ATTENTION = {
  'lsh': (),  # common.DECODE_BINDINGS: LSH and local blocks in turns.
  'lsh-only': ('ReformerLM.attention_type = @DirectedLSHSelfAttention',),
  'lsh-shared': (  # Trax's LSH (its computation, our speed) in every block.
    'ReformerLM.attention_type = @FastLSHSelfAttention',
  ),
  # Trax's own classes (its sorting step; no directed term, local blocks
  # reading the whole memory): `--trax-sort`.
  'trax': ('ReformerLM.attention_type = [@LSHSelfAttention, @SelfAttention]',),
}
CHOSEN = ['lsh']
GIN = os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin')


def build(mode: str, length: int):
  extra = decoding.predict_bindings(4) if mode == 'predict' else []
  ginconf.parse(GIN, BINDINGS + ATTENTION[CHOSEN[0]] + tuple(extra))
  layer = ginconf.model(VOCAB, mode)
  layer.rng = jax.random.PRNGKey(0)  # Same weights for both contenders.
  layer.init(trax.shapes.ShapeDtype((1, length), np.int32))
  return layer


def incremental(prefixes, n_tokens, prompt):
  t0 = time.time()
  layer = build('predict', 1)
  decoder = Decoder(layer, CONTEXT)
  decoder.feed([5])
  compile_s = time.time() - t0
  out = {'compile_s': compile_s}
  for p in prefixes:
    decoder.reset()
    decoder.feed(list(prompt[: p - 21]))  # The conversation so far (+ pad).
    # A new 20-token user message, then the first reply token.
    t0 = time.time()
    logits = decoder.feed(list(prompt[p - 21 : p - 1]))
    int(np.argmax(logits))
    out[f'first_token_{p}_s'] = time.time() - t0
    t0 = time.time()
    for _ in range(n_tokens):
      logits = decoder.feed([int(np.argmax(logits))])
    out[p] = (time.time() - t0) / n_tokens * 1000
  out['traces'] = decoder.traces
  return out


def naive(prefixes, n_tokens, prompt):
  t0 = time.time()
  layer = build('eval', CONTEXT)
  forward = scoring.forward_fn(layer)
  x = np.zeros((1, CONTEXT), np.int32)
  forward(x).block_until_ready()
  out = {'compile_s': time.time() - t0}
  for p in prefixes:
    seq = list(prompt[:p])
    t0 = time.time()
    for _ in range(n_tokens):
      x = np.zeros((1, CONTEXT), np.int32)
      x[0, : len(seq)] = seq
      logits = np.asarray(forward(x))[0, len(seq)]
      seq.append(int(np.argmax(logits)))
    out[p] = (time.time() - t0) / n_tokens * 1000
  return out


def context_bindings(context: int) -> tuple[str, ...]:
  """The bench shape with a memory of `context` + 128 tokens."""
  n = context + 128
  rows = -(-n // 64)
  n = rows * 64
  changed = {
    'ReformerLM.max_len': n,
    'ReformerLM.pos_axial_shape': (rows, 64),
    'LSHSelfAttention.n_buckets': max(2, 2 * (rows // 2)),
    'LSHSelfAttention.predict_mem_len': n,
    'SelfAttention.predict_mem_len': n,
  }
  kept = [b for b in BINDINGS if b.split(' =')[0] not in changed]
  return tuple(kept) + tuple(f'{k} = {v}' for k, v in changed.items())


def peak_rss_mb() -> float:
  import resource

  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def by_context(contexts, n_tokens, shape: str, vocab: int):
  """ms/token of the incremental decoder at each context (see the module)."""
  rng = np.random.default_rng(0)
  out = {}
  decoder = None
  # The first context is timed twice and the first timing dropped: a new
  # process' first tokens were 30% slower than the same ones later.
  for i, c in enumerate([contexts[0]] + list(contexts)):
    if decoder is None or (shape == 'bench' and i != 1):
      t0 = time.time()
      if shape == 'bench':
        gin_file, bindings, max_len = GIN, context_bindings(c), None
      else:
        gin_file = os.path.join(common.ROOT, 'gin', 'reformer_32k.gin')
        bindings, max_len = ('ReformerLM.dropout = 0.0',), 32768
      setup = ginconf.parse(gin_file, bindings)
      heads = setup.model['n_heads']
      ginconf.parse(
        gin_file, bindings + tuple(decoding.predict_bindings(heads))
      )
      layer = ginconf.model(vocab, 'predict')
      layer.rng = jax.random.PRNGKey(0)
      layer.init(trax.shapes.ShapeDtype((1, 1), np.int32))
      decoder = Decoder(layer, max_len or setup.model['max_len'])
      decoder.feed([5])
      compile_s = time.time() - t0
    if c + n_tokens + 2 > decoder.max_len:
      raise SystemExit(
        f'error: --contexts {c}: {c} + {n_tokens} tokens do not fit the '
        f"model's {decoder.max_len}-token memory"
      )
    prompt = rng.integers(3, vocab, c)
    decoder.reset()
    t0 = time.time()
    decoder.feed(list(prompt[:-20]))
    fill_s = time.time() - t0
    t0 = time.time()
    logits = decoder.feed(list(prompt[-20:]))
    int(np.argmax(logits))
    first = time.time() - t0
    times = []
    for _ in range(n_tokens):
      t0 = time.perf_counter()
      logits = decoder.feed([int(np.argmax(logits))])
      times.append(time.perf_counter() - t0)
    # The median token: a shared 2-core machine has stalls that a mean
    # of 64 tokens carries into the figure.
    ms = float(np.median(times)) * 1000
    if i == 0:
      first_fill = fill_s  # A block length's first read compiles it.
      continue
    if i == 1:
      fill_s = first_fill
    out[str(c)] = ms
    print(
      f'| {c} | {ms:.1f} | {first:.2f} s | {fill_s:.1f} s | '
      f'{compile_s:.1f} s | {peak_rss_mb():.0f} MB |',
      flush=True,
    )
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tokens', type=int, default=64)
  parser.add_argument('--prefixes', default='512,4096')
  parser.add_argument('--json', default=None)
  parser.add_argument(
    '--trax-sort',
    action='store_true',
    help="also time Trax's stock one-token step (sorting) for comparison",
  )
  parser.add_argument(
    '--attention',
    choices=sorted(ATTENTION),
    default='lsh',
    help='lsh: directed LSH and local blocks in turns; lsh-only: '
    "directed LSH in every block; lsh-shared: Trax's LSH (the design "
    'before)',
  )
  parser.add_argument(
    '--contexts',
    default=None,
    help='comma-separated contexts: time the incremental decoder at each',
  )
  parser.add_argument('--shape', choices=('bench', '32k'), default='bench')
  parser.add_argument('--vocab', type=int, default=VOCAB)
  args = parser.parse_args()
  CHOSEN[0] = args.attention
  if args.contexts:
    contexts = [int(c) for c in args.contexts.split(',')]
    print(
      f'machine: {platform.machine()}, {os.cpu_count()} cores; trax '
      f'{metadata.version("trax")}, jax {jax.__version__}; shape '
      f'{args.shape}, vocabulary {args.vocab}, {args.attention}'
    )
    print(
      '| context | ms/token | first reply token after a 20-token message '
      '| fill (block re-read) | compile | peak memory |\n|---:|---:|---:|'
      '---:|---:|---:|'
    )
    results = by_context(contexts, args.tokens, args.shape, args.vocab)
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(results, f, indent=2)
    return
  prefixes = [int(p) for p in args.prefixes.split(',')]
  prompt = np.random.default_rng(0).integers(3, VOCAB, CONTEXT)
  results = {
    'machine': f'{platform.machine()}, {os.cpu_count()} cores, '
    f'{jax.devices()[0].platform}',
    'versions': f'trax {metadata.version("trax")}, jax {jax.__version__}, '
    f'python {platform.python_version()}',
  }
  results['incremental'] = incremental(prefixes, args.tokens, prompt)
  if args.trax_sort:
    chosen, CHOSEN[0] = CHOSEN[0], 'trax'
    results['incremental_trax_sort'] = incremental(
      prefixes, args.tokens, prompt
    )
    CHOSEN[0] = chosen
  results['naive'] = naive(prefixes, args.tokens, prompt)
  inc, nav = results['incremental'], results['naive']
  print(f'machine: {results["machine"]}; {results["versions"]}')
  print(
    f'compile: incremental {inc["compile_s"]:.1f} s, naive '
    f'{nav["compile_s"]:.1f} s'
  )
  print(
    '| prefix | incremental ms/token | naive ms/token | speed-up |'
    + (' Trax sort ms/token |' if args.trax_sort else '')
  )
  print('|---:|---:|---:|---:|' + ('---:|' if args.trax_sort else ''))
  for p in prefixes:
    row = f'| {p} | {inc[p]:.1f} | {nav[p]:.1f} | {nav[p] / inc[p]:.1f}x |'
    if args.trax_sort:
      row += f' {results["incremental_trax_sort"][p]:.1f} |'
    print(row)
  for p in prefixes:
    print(
      f'first reply token after a 20-token message at {p}: '
      f'{inc[f"first_token_{p}_s"]:.3f} s'
    )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=2, default=str)


if __name__ == '__main__':
  main()
