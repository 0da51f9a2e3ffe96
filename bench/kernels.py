"""How fast this machine runs the matrix products of a training step.

  python bench/kernels.py                 # the benchmark model at 32k
  python bench/kernels.py --length 8192 --peak-gflops 156.8
  python bench/kernels.py --batched      # the attention's products, 3 ways
  python bench/kernels.py --batched --bf16   # and with bfloat16 inputs
  python bench/kernels.py --ffi            # XLA's, then OpenBLAS's (FFI)
  python bench/kernels.py --fused          # Trax's attend, then the kernel
  python bench/kernels.py --hash           # the LSH hash: XLA, then kernel
  python bench/kernels.py --split          # one device, then split in two:
  XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    python bench/kernels.py --split

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

`--batched` times the chunked attention's two batched products (scores
`[64, 64] x [64, 128]`, scores x values `[64, 128] x [128, 64]`, for every
chunk and head) as XLA runs them, as numpy's BLAS runs them (the same
shapes, `np.matmul`), and with two chunks' queries against three chunks'
keys (bigger products, 1.5x the FLOPs; the rate counts only the needed
ones). Set `XLA_FLAGS` to compare XLA's other CPU libraries. `--bf16`
adds XLA's products of bfloat16 inputs summed in float32 (what a CPU with
native bfloat16, AVX512-BF16 or AMX, could run), and one flat 4096^3
product both ways.

`--split` times the batched products and the real chunked attention of one
LSH layer (Trax's `attend`, all heads under `vmap`; forward, and forward +
backward) on one device, and with XLA's CPU split into devices
(`XLA_FLAGS` as above) also split over all of them by `shard_map` (the
batch, or the heads): XLA's CPU runs a batched product's small products
one after another, and each device runs its share on its own thread. Run
it both ways: with several devices, one of them alone has fewer threads
than the whole CPU, so its line there is not the one-device baseline.

`--ffi` times the same rows as XLA runs them, then with the products
through OpenBLAS from an XLA FFI call (`bench/blas_ffi.py`: the batch split
over the cores, one OpenBLAS thread a part; its gradient the same
products), and the largest difference between the two.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import CHUNK, D_FF, D_HEAD, HEADS, LAYERS, VOCAB, D  # noqa: E402
from src import runtime  # noqa: E402

runtime.bootstrap()  # XLA flags, quiet logs, Trax patches: first.


def rate(shape_a, shape_b, reps=10, numpy=False, bf16=False):
  """GFLOP/s of `a @ b` (batched when the shapes have 3 dimensions), as
  XLA runs it, or numpy's BLAS (`numpy`: one product a batch entry);
  `bf16`: XLA's product of bfloat16 inputs summed in float32."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  if numpy:
    a, b = np.ones(shape_a, np.float32), np.ones(shape_b, np.float32)
    out = np.matmul(a, b)

    def f(a, b):
      return np.matmul(a, b, out=out)
  else:
    kind = jnp.bfloat16 if bf16 else jnp.float32
    a, b = jnp.ones(shape_a, kind), jnp.ones(shape_b, kind)
    matmul = jax.jit(
      lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)
    )

    def f(a, b):
      return matmul(a, b).block_until_ready()

  f(a, b)
  t = time.perf_counter()
  for _ in range(reps):
    f(a, b)
  seconds = (time.perf_counter() - t) / reps
  batch = shape_a[0] if len(shape_a) == 3 else 1
  m, k = shape_a[-2:]
  return 2 * batch * m * k * shape_b[-1] / seconds / 1e9


def batched(n: int, bf16=False):
  """The attention's batched products at `n` tokens, three ways (`bf16`:
  XLA's with bfloat16 inputs, and one flat 4096^3 product each way)."""
  items = HEADS * n // CHUNK
  scores = ((items, CHUNK, D_HEAD), (items, D_HEAD, 2 * CHUNK))
  values = ((items, CHUNK, 2 * CHUNK), (items, 2 * CHUNK, D_HEAD))
  print(f'XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r}')
  for name, (a, b) in (('scores', scores), ('scores x values', values)):
    print(
      f'{name} {a} x {b}: XLA {rate(a, b):.1f} GFLOP/s, '
      f'numpy {rate(a, b, numpy=True):.1f} GFLOP/s'
      + (f', XLA bfloat16 {rate(a, b, bf16=True):.1f}' if bf16 else '')
    )
  if bf16:
    flat = ((4096, 4096), (4096, 4096))
    print(
      f'flat {flat[0]} x {flat[1]}: XLA {rate(*flat, reps=3):.1f} GFLOP/s, '
      f'bfloat16 {rate(*flat, reps=3, bf16=True):.1f}'
    )
  grouped = ((items // 2, 2 * CHUNK, D_HEAD), (items // 2, D_HEAD, 3 * CHUNK))
  print(
    f'scores, 2 chunks against 3 {grouped[0]} x {grouped[1]}: XLA '
    f'{rate(*grouped) / 1.5:.1f} GFLOP/s of the needed FLOPs'
  )


def split(ffi: bool = False):
  """The batched products and one LSH layer's `attend` on one CPU device,
  then split over all devices (`shard_map`), or (`ffi`) then through
  OpenBLAS from an FFI call (`bench/blas_ffi.py`); the outputs must
  agree."""

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  from trax.layers.research import efficient_attention as ea

  devices = jax.devices()
  mesh = Mesh(np.array(devices), ('d',))
  n, rng = 32768, np.random.default_rng(0)
  items = HEADS * n // CHUNK

  def product(a, b, matmul=jnp.matmul):
    return matmul(a, b)

  def attend(q, v, info, attend=ea.attend):
    mask = functools.partial(
      ea.mask_self_attention, causal=True, exclude_self=True, masked=False
    )
    return attend(
      q,
      None,
      v,
      q_chunk_len=CHUNK,
      n_chunks_before=1,
      n_chunks_after=0,
      mask_fn=mask,
      q_info=info,
      kv_info=None,
      dropout=0.0,
      rng=None,
    )[0]

  def with_backward(fn):
    def both(q, v, info, cotangent):
      out, pull = jax.vjp(lambda q, v: fn(q, v, info), q, v)
      return out, pull(cotangent)

    return both

  def best(fn, args, reps=5):
    """(the median seconds of `reps` calls, the first call's output)."""
    out = jax.block_until_ready(fn(*args))  # Compiles; kept to compare.
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2], out

  def normal(*shape):
    return np.asarray(rng.normal(size=shape), np.float32)

  heads = jax.vmap(attend)
  info = np.stack([rng.permutation(n) for _ in range(HEADS)]).astype(np.int32)
  q, v, cot = (normal(HEADS, n, D_HEAD) for _ in range(3))
  rows = (
    (
      'scores',
      product,
      (normal(items, CHUNK, D_HEAD), normal(items, D_HEAD, 2 * CHUNK)),
      2 * items * CHUNK * D_HEAD * 2 * CHUNK,
    ),
    ('attend forward (one LSH layer, 4 heads)', heads, (q, v, info), 0),
    ('attend forward + backward', with_backward(heads), (q, v, info, cot), 0),
  )
  ffi_version = {}
  if ffi:
    from bench import blas_ffi

    heads_ffi = jax.vmap(functools.partial(attend, attend=blas_ffi.attend))
    ffi_version = {
      rows[0][0]: functools.partial(product, matmul=blas_ffi.matmul),
      rows[1][0]: heads_ffi,
      rows[2][0]: with_backward(heads_ffi),
    }
  print(f'{len(devices)} CPU device(s); median of 5 (ms)')

  def against(label, seconds, out, other, flops):
    """`; LABEL ms (GFLOP/s), largest difference` against `out`."""
    diff = max(
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(other))
    )
    rate = f' ({flops / seconds / 1e9:.1f} GFLOP/s)' if flops else ''
    return f'; {label} {seconds * 1e3:.0f}{rate}, largest difference {diff:.1e}'

  for name, fn, args, flops in rows:
    args = [jax.device_put(a) for a in args]  # Placed once, for both.
    one, out = best(jax.jit(fn), args)
    line = f'{name}: one device {one * 1e3:.0f}' + (
      f' ({flops / one / 1e9:.1f} GFLOP/s)' if flops else ''
    )
    if ffi:
      fast, out_fast = best(jax.jit(ffi_version[name]), args)
      line += against('OpenBLAS from an FFI call', fast, out, out_fast, flops)
    elif len(devices) > 1:  # One of them alone has fewer threads: see above.
      specs = tuple(P('d') for _ in args)
      split = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P('d'))
      placed = [jax.device_put(a, NamedSharding(mesh, P('d'))) for a in args]
      many, out_many = best(jax.jit(split), placed)
      label = f'split over {len(devices)}:'
      line += against(label, many, out, out_many, flops)
    print(line)


# `--fused`'s layers: (name, heads, sorted length, key width, chunk).
FUSED_LAYERS = (
  ('benchmark model at 32k, LSH layer', HEADS, 32768, D_HEAD, CHUNK),
  ('walkthrough run 3 (window 1,024), LSH layer', 2, 2 * 1024, 32, 512),
  ('walkthrough run 4 (window 4,096), LSH layer', 2, 2 * 4096, 32, 2048),
)


def fused(reps=5):
  """One LSH layer's chunked attention (all heads under `vmap`; forward,
  and forward + backward), by Trax's `attend` on XLA and by the fused
  kernel (src/model/chunk_attention.py), float32 and with bfloat16 products
  (`precision.products = 'bfloat16'`: computed so where the kernels were
  built for AVX512-BF16), with the largest difference of each to XLA's
  outputs and gradients."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from trax.layers.research import efficient_attention as ea

  from src.model import chunk_attention, precision

  contenders = (
    ('XLA', ea.attend, False),
    ('fused', chunk_attention.attend, False),
    ('fused bf16', chunk_attention.attend, True),
  )
  leaves = jax.tree_util.tree_leaves
  mask = functools.partial(ea.mask_self_attention, causal=True)
  rng = np.random.default_rng(0)
  for name, heads, n, d, chunk in FUSED_LAYERS:
    q, v, cot = (
      jnp.asarray(rng.normal(size=(heads, n, d)), jnp.float32) for _ in '123'
    )
    info = jnp.asarray(np.stack([rng.permutation(n) for _ in range(heads)]))
    flops = 2 * 2 * heads * n * 2 * chunk * d  # Scores and values, forward.
    print(f'{name}: {heads} heads, {n} positions, chunks of {chunk}, d {d}')
    results = {}
    for label, attend, bf16 in contenders:
      wrap = precision.bfloat16_products if bf16 else lambda fn: fn

      def one(q, v, i, attend=attend):
        return attend(
          q, None, v, q_chunk_len=chunk, n_chunks_before=1, mask_fn=mask,
          q_info=i,
        )[0]  # fmt: skip

      forward = jax.jit(wrap(jax.vmap(one)))
      both = jax.jit(
        wrap(
          lambda q, v, i, c: jax.vjp(lambda q, v: jax.vmap(one)(q, v, i), q, v)[
            1
          ](c)
        )
      )
      for part, fn, args, mult in (
        ('forward', forward, (q, v, info), 1),
        ('forward + backward', both, (q, v, info, cot), 3.5),
      ):
        out = jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
          t = time.perf_counter()
          jax.block_until_ready(fn(*args))
          times.append(time.perf_counter() - t)
        seconds = sorted(times)[reps // 2]
        results.setdefault(part, []).append(out)
        rate = mult * flops / seconds / 1e9
        print(f'  {label} {part}: {1000 * seconds:.0f} ms ({rate:.0f} GFLOP/s)')
    for part, (a, *others) in results.items():
      for (label, *_), b in zip(contenders[1:], others):
        diff = max(
          float(jnp.max(jnp.abs(x - y))) for x, y in zip(leaves(a), leaves(b))
        )
        print(f'  {part}, {label}: largest difference {diff:.1e}')


def hashing(n: int, reps=5):
  """The 4 heads' LSH hash of one layer of the benchmark model (d 64,
  `n / 64` buckets, one round, `vmap` over the heads): XLA's scan over
  the rotations (`lsh_hash.scanned_ids`), then the kernel
  (`lsh_hash.fused_ids`), median and best of `reps`, and whether their
  buckets agree."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from src.model import kernels, lsh_hash

  heads, d, buckets = 4, 64, max(n // CHUNK, 2)
  q = jnp.asarray(
    np.random.default_rng(0).normal(size=(heads, n, d)), jnp.float32
  )
  keys = jax.random.split(jax.random.PRNGKey(0), heads)
  turns = jnp.stack([lsh_hash.draw_rotations(k, d, 1, buckets) for k in keys])
  flops = 2 * heads * n * d * (buckets // 2)
  print(f'hash: {heads} heads, {n} positions, d {d}, {buckets} buckets')
  contenders = [('XLA scan', lsh_hash.scanned_ids)]
  if kernels.available():
    contenders.append(('kernel', lsh_hash.fused_ids))
  outs = []
  for label, fn in contenders:
    f = jax.jit(jax.vmap(fn))
    outs.append(np.asarray(f(q, turns)))
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      jax.block_until_ready(f(q, turns))
      times.append(time.perf_counter() - t)
    median, best = sorted(times)[reps // 2], min(times)
    print(
      f'  {label}: {1000 * median:.1f} ms median, {1000 * best:.1f} best '
      f'({flops / best / 1e9:.0f} GFLOP/s)'
    )
  if len(outs) == 2:
    print(f'  buckets that differ: {int((outs[0] != outs[1]).sum())}')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--length', type=int, default=32768)
  parser.add_argument('--peak-gflops', type=float, default=None)
  parser.add_argument(
    '--batched', action='store_true', help="the attention's products, 3 ways"
  )
  parser.add_argument(
    '--bf16',
    action='store_true',
    help='with --batched: also bfloat16 inputs summed in float32',
  )
  parser.add_argument(
    '--split',
    action='store_true',
    help='batched products and attend on one device, then split over all',
  )
  parser.add_argument(
    '--ffi',
    action='store_true',
    help='batched products and attend by XLA, then through OpenBLAS (FFI)',
  )
  parser.add_argument(
    '--fused',
    action='store_true',
    help="one LSH layer's attend by XLA, then by the fused kernel",
  )
  parser.add_argument(
    '--hash', action='store_true', help="one LSH layer's hash: XLA, kernel"
  )
  args = parser.parse_args()
  if args.hash:
    return hashing(args.length)
  if args.fused:
    return fused()
  if args.split or args.ffi:
    return split(args.ffi)
  n = args.length
  if args.batched:
    return batched(n, args.bf16)
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
