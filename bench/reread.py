"""Re-reading a chat context: token by token vs blocks.

  python bench/reread.py [--contexts 4096,32768] [--sample 2048]

`/load`, a context overflow and a new conversation on the server read a
whole conversation at once. `Decoder.feed` reads it as blocks of `block`
tokens (`src.model.decode_block`: each token attends to what it would fed
alone, all of a block's tokens in one call). For each context this times,
on the same randomly initialized model (the decode benchmark's shape: 4
layers, d_model 256, 4 heads, LSH chunk 64, 1 hash):
- blocks, cold: the first re-read (includes compiling the block program);
- blocks, warm: the same again;
- first reply token after the re-read (block warm + one step);
- token by token: `--sample` tokens fed one at a time, scaled to the
  context (a step costs the same at any position: the memory is allocated
  at its full size), or all of them when the context is at most `--sample`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from src import runtime  # noqa: E402

runtime.bootstrap()  # XLA flags, quiet logs, Trax patches: first.
import jax  # noqa: E402
import numpy as np  # noqa: E402
import trax  # noqa: E402

from src.inference import decoding  # noqa: E402
from src.inference.decoding import Decoder  # noqa: E402
from src.model import ginconf  # noqa: E402

VOCAB = 500
GIN = os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin')


def build(context: int) -> Decoder:
  rows = 64 if context <= 4096 else 128
  by_context = ('max_len', 'pos_axial_shape', 'n_buckets', 'predict_mem_len')
  bindings = (
    *(b for b in common.DECODE_BINDINGS if not any(k in b for k in by_context)),
    f'ReformerLM.max_len = {context}',
    f'ReformerLM.pos_axial_shape = ({rows}, {context // rows})',
    f'LSHSelfAttention.n_buckets = {context // 64}',
    f'LSHSelfAttention.predict_mem_len = {context}',
    f'SelfAttention.predict_mem_len = {context}',
    *decoding.predict_bindings(4),
  )
  ginconf.parse(GIN, bindings)
  layer = ginconf.model(VOCAB, 'predict')
  layer.rng = jax.random.PRNGKey(0)
  layer.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  return Decoder(layer, context)


def measure(context: int, sample: int) -> dict:
  d = build(context)
  ids = list(np.random.default_rng(0).integers(3, VOCAB, context - 2))
  out = {'context': context, 'tokens': len(ids)}
  for name in ('block_cold_s', 'block_warm_s'):
    d.reset()
    t0 = time.time()
    logits = d.feed(ids, exact=False)  # As `/load` and an overflow read.
    out[name] = time.time() - t0
  t0 = time.time()
  d.feed([int(np.argmax(logits))])
  out['first_token_after_s'] = out['block_warm_s'] + time.time() - t0
  n = min(sample, len(ids))
  d.reset()
  d.feed(ids[:1], blocks=False)  # Compile the one-token step.
  d.reset()
  t0 = time.time()
  d.feed(ids[:n], blocks=False)
  per_token = (time.time() - t0) / n
  out['step_ms'] = per_token * 1000
  out['token_by_token_s'] = per_token * len(ids)
  out['token_by_token_measured'] = n == len(ids)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--contexts', default='4096,32768')
  parser.add_argument('--sample', type=int, default=2048)
  args = parser.parse_args(argv)
  print(
    '| context | tokens re-read | token by token | blocks (cold: compile + '
    'run) | blocks (warm) | first reply token after re-read |\n'
    '|-|-|-|-|-|-|'
  )
  for context in (int(c) for c in args.contexts.split(',')):
    r = measure(context, args.sample)
    est = '' if r['token_by_token_measured'] else ' (from a sample)'
    print(
      f'| {context} | {r["tokens"]} | {r["token_by_token_s"]:.1f} s '
      f'({r["step_ms"]:.1f} ms/token){est} | {r["block_cold_s"]:.1f} s | '
      f'{r["block_warm_s"]:.1f} s | {r["first_token_after_s"]:.1f} s |',
      flush=True,
    )
  return 0


if __name__ == '__main__':
  sys.exit(main())
