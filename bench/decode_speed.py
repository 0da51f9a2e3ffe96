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
from src.model import ginconf, reformer  # noqa: E402
from src.runtime.trax_patches import fast_lsh  # noqa: E402

CONTEXT = common.DECODE_CONTEXT
VOCAB = 500
BINDINGS = common.DECODE_BINDINGS
ATTENTION = {
  'lsh': (),  # gin/tiny.gin's: a local block and a directed LSH block.
  'lsh-only': ('ReformerLM.attention_type = @LSHSelfAttention',),
  'lsh-shared': (  # Trax's LSH in every block.
    'ReformerLM.attention_type = @LSHSelfAttention',
    'lsh.directed = False',
  ),
}
CHOSEN = ['lsh']
GIN = os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin')


def build(mode: str, length: int):
  extra = decoding.predict_bindings(4) if mode == 'predict' else []
  ginconf.parse(GIN, BINDINGS + ATTENTION[CHOSEN[0]] + tuple(extra))
  layer = reformer.reformer_lm(VOCAB, mode, directed=ginconf.lsh())
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
    help='lsh: a local and a directed LSH block (as shipped); lsh-only: '
    "directed LSH in every block; lsh-shared: Trax's LSH (the design "
    'before)',
  )
  args = parser.parse_args()
  CHOSEN[0] = args.attention
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
    fast_lsh.uninstall()
    results['incremental_trax_sort'] = incremental(
      prefixes, args.tokens, prompt
    )
    fast_lsh.install()
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
