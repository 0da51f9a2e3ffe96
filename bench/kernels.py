"""How fast this machine runs the matrix products of a training step.

  python bench/kernels.py                 # the benchmark model at 32k
  python bench/kernels.py --length 8192 --peak-gflops 156.8

Times, with JAX under the project's XLA flags (`import src`), the products
one training step of bench/train_speed.py's model is made of: the weight
products of the attention projections and the feed-forward at full length,
and the chunked attention's small batched products (each 64-query chunk
against 128 keys, for every head). From those rates it derives the time a
step would take if it did nothing but these products, counting what the
reversible layers really run: every layer's forward twice (once forward,
once recomputed in the backward pass) plus its backward (2x), i.e. 8 FLOPs
per weight and token, 4x the attention's forward FLOPs, and the output
layer at 6 per weight (it is not reversible).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import CHUNK, D_FF, D_HEAD, HEADS, LAYERS, VOCAB, D  # noqa: E402
from src import runtime  # noqa: E402

runtime.bootstrap()  # XLA flags, quiet logs, Trax patches: first.


def rate(shape_a, shape_b, reps=10):
  """GFLOP/s of `a @ b` (batched when the shapes have 3 dimensions)."""
  import jax
  import jax.numpy as jnp

  a = jnp.ones(shape_a, jnp.float32)
  b = jnp.ones(shape_b, jnp.float32)
  f = jax.jit(jnp.matmul)
  f(a, b).block_until_ready()
  t = time.perf_counter()
  for _ in range(reps):
    f(a, b).block_until_ready()
  seconds = (time.perf_counter() - t) / reps
  batch = shape_a[0] if len(shape_a) == 3 else 1
  m, k = shape_a[-2:]
  return 2 * batch * m * k * shape_b[-1] / seconds / 1e9


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--length', type=int, default=32768)
  parser.add_argument('--peak-gflops', type=float, default=None)
  args = parser.parse_args()
  n = args.length
  chunks = n // CHUNK
  products = {
    # name: (a, b, FLOPs of this product per token in one forward pass)
    'q/k/v/out projections [L,256]x[256,256]': (
      (n, D),
      (D, HEADS * D_HEAD),
      2 * 4 * D * HEADS * D_HEAD,
    ),
    'feed-forward in [L,256]x[256,1024]': ((n, D), (D, D_FF), 2 * D * D_FF),
    'feed-forward out [L,1024]x[1024,256]': (
      (n, D_FF),
      (D_FF, D),
      2 * D * D_FF,
    ),
    'attention scores [H*L/64: 64x64 . 64x128]': (
      (HEADS * chunks, CHUNK, D_HEAD),
      (HEADS * chunks, D_HEAD, 2 * CHUNK),
      2 * 2 * HEADS * D_HEAD * 2 * CHUNK,  # Scores and scores x values.
    ),
    'output layer [L,256]x[256,500]': ((n, D), (D, VOCAB), 2 * D * VOCAB),
  }
  total = 0.0
  print(f'length {n}; per-step seconds count forward + recompute + backward')
  for name, (a, b, flops) in products.items():
    r = rate(a, b)
    runs = 3 if name.startswith('output') else 4  # Reversible: 4 forwards.
    per_layer = 1 if name.startswith('output') else LAYERS
    seconds = runs * per_layer * flops * n / (r * 1e9)
    total += seconds
    share = (
      f' ({100 * r / args.peak_gflops:.0f}% of peak)'
      if args.peak_gflops
      else ''
    )
    print(f'{name}: {r:.1f} GFLOP/s{share}, {seconds:.2f} s per step')
  print(f'products alone: {total:.2f} s per step = {n / total:.0f} tokens/s')


if __name__ == '__main__':
  main()
