"""LSH buckets as Trax hashes them, faster on long inputs.

Trax's LSH draws random rotations, rotates each vector and takes the
argmax over `[r, -r]`. `bucket_ids` gives the same buckets (pinned by
tests/test_attention.py) for long inputs by a CPU kernel (`lsh_hash.cc`,
the rotations' products and their argmax fused) or, without it, a scan
over the rotations (8x faster than Trax's at 32k positions), and the
decode cache keeps the rotations it draws (`draw_rotations`) instead of
drawing them at every token.
"""

from __future__ import annotations

import jax
from jax import numpy as jnp
from trax import fastmath

from src.model import kernels


def draw_rotations(hash_rng, d: int, n_hashes: int, n_buckets: int):
  """Trax's random rotations, drawn as `hash_vecs` draws them (Trax's
  `[d, n_hashes, n_buckets // 2]`), returned as `[n_hashes, n_buckets //
  2, d] float32`, the layout XLA's products want."""
  shape = (d, n_hashes, n_buckets // 2)
  drawn = fastmath.random.normal(hash_rng, shape).astype(jnp.float32)
  return jnp.transpose(drawn, (1, 2, 0))


# From this many vectors on, `bucket_ids` scans the rotations instead of
# taking an argmax (below it the scan's loop costs more than it saves).
SCAN_FROM = 256


def bucket_ids(vecs, rotations):
  """Trax's LSH buckets: `argmax(concatenate([r, -r]))` over each rotated
  vector `r` (the first maximum on ties, as argmax).

  Args:
    vecs: `[length, d] float32`, the vectors to hash.
    rotations: `[n_hashes, n_buckets // 2, d] float32`.

  Returns:
    `[n_hashes, length] int32` buckets in `[0, n_buckets)`.

  For a training sequence the argmax was most of a layer's hashing: at
  32k positions and 512 buckets, XLA's CPU argmax over the last axis took
  ~65 ms per head of an ~80 ms hash, longer than the head's attention. So
  for long inputs the rotated vectors are made as `[n_buckets // 2,
  length]` rows, a few rows at a time inside a scan that keeps each
  position's running maximum and minimum (a minimum of `r` is a maximum
  of `-r`): the same buckets (pinned by tests/test_attention.py).
  """
  if vecs.shape[0] < SCAN_FROM:
    rotated = jnp.einsum('tf,hbf->htb', vecs, rotations)
    rotated = jnp.concatenate([rotated, -rotated], axis=-1)
    return jnp.argmax(rotated, axis=-1).astype(jnp.int32)
  if _fusable(vecs, rotations):
    return fused_ids(vecs, rotations)
  return scanned_ids(vecs, rotations)


def _fusable(vecs, rotations) -> bool:
  return (
    vecs.dtype == jnp.float32
    and rotations.dtype == jnp.float32
    and kernels.available()
  )


def fused_ids(vecs, rotations):
  """`bucket_ids` by the CPU kernel (`lsh_hash.cc`): each vector's rotated
  values made a few rotations at a time in registers and folded into its
  running maximum and minimum, the same first-maximum rule as the scan
  (the products' sums in another order: a near-tie can flip, as between
  any two products). On an AMD Zen 3 the 4 heads' hash of a 32k layer
  took 30-32 ms against the scan's 111-128 (BENCHMARKS.md "The LSH hash
  and the row gathers as kernels"). Buckets are integers: nothing flows
  back through them."""
  out = jax.ShapeDtypeStruct((rotations.shape[0], vecs.shape[0]), jnp.int32)
  call = jax.ffi.ffi_call('jade_lsh_buckets', out, vmap_method='broadcast_all')
  return call(jax.lax.stop_gradient(vecs), jax.lax.stop_gradient(rotations))


def scanned_ids(vecs, rotations):
  """`bucket_ids` in XLA for long inputs (where the kernels cannot run):
  a scan over the rotations (`_first_extremes`)."""
  columns = jnp.transpose(vecs)  # [d, length]: each product's right side.
  return jnp.stack([_first_extremes(r, columns) for r in rotations])


def _first_extremes(rotations, columns):
  """`[n, d]` rotations and `[d, length]` vectors -> `[length] int32`: for
  each vector, the index in `concatenate([rows, -rows])` of its first
  maximum, where `rows = rotations @ columns`.

  The rows are made in the scan, a group at a time (`[group, length]`,
  which stays in the CPU's cache), not as one `[n, length]` product
  beforehand: at 32k positions and 512 buckets the whole product took
  ~23 ms per head and its scan ~9 more; made in the scan, the hash takes
  ~12 ms (~50 ms for 4 heads under `vmap`, was ~170). Rows go 32 at a
  time: on an AMD Zen 3 (AVX2) the 4 heads' hash took ~130 ms against
  ~250 with 16 at a time (BENCHMARKS.md "A 32k step on an AVX2 Zen 3").
  """
  n, length = rotations.shape[0], columns.shape[1]
  group = next(g for g in (32, 16, 8, 4, 2, 1) if n % g == 0)  # Rows a step.

  def step(carry, group_rotations):
    hi, at_hi, lo, at_lo = carry
    first, turns = group_rotations
    block = turns @ columns
    for j in range(group):
      row = block[j]
      up = row > hi  # Strict: an equal later row keeps the first.
      hi, at_hi = jnp.where(up, row, hi), jnp.where(up, first + j, at_hi)
      down = row < lo
      lo, at_lo = jnp.where(down, row, lo), jnp.where(down, first + j, at_lo)
    return (hi, at_hi, lo, at_lo), None

  zeros = jnp.zeros(length, jnp.int32)
  start = (
    jnp.full(length, -jnp.inf, columns.dtype),
    zeros,
    jnp.full(length, jnp.inf, columns.dtype),
    zeros,
  )
  firsts = jnp.arange(0, n, group, dtype=jnp.int32)
  groups = jnp.reshape(rotations, (n // group, group, rotations.shape[1]))
  (hi, at_hi, lo, at_lo), _ = jax.lax.scan(step, start, (firsts, groups))
  # `-rows` come second in the concatenation: a tie goes to `rows`.
  return jnp.where(hi >= -lo, at_hi, at_lo + n)


def hash_rounds(vecs, rotations, n_buckets: int):
  """Trax's `hash_vectors` (int `n_buckets`, no mask) with its rotations
  given: `[n_hashes * len(vecs)]`, round r's buckets from `r * n_buckets`."""
  buckets = bucket_ids(vecs, rotations)
  offsets = jnp.arange(rotations.shape[0], dtype=jnp.int32) * n_buckets
  return jnp.reshape(buckets + offsets[:, None], (-1,))
