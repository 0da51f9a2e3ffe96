"""LSH buckets as Trax hashes them, faster on long inputs.

Trax's LSH draws random rotations, rotates each vector and takes the
argmax over `[r, -r]`. `bucket_ids` gives the same buckets (pinned by
tests/test_attention.py) with a scan over the rotations for long inputs
(8x faster at 32k positions), and the decode cache keeps the rotations it
draws (`draw_rotations`) instead of drawing them at every token.
"""

from __future__ import annotations

import jax
from jax import numpy as jnp
from trax import fastmath


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
  length]` rows and scanned a few rows at a time, keeping each position's
  running maximum and minimum (a minimum of `r` is a maximum of `-r`): the
  same buckets (pinned by tests/test_attention.py) in ~10 ms.
  """
  if vecs.shape[0] < SCAN_FROM:
    rotated = jnp.einsum('tf,hbf->htb', vecs, rotations)
    rotated = jnp.concatenate([rotated, -rotated], axis=-1)
    return jnp.argmax(rotated, axis=-1).astype(jnp.int32)
  rows = jnp.einsum('tf,hbf->hbt', vecs, rotations)
  return jnp.stack([_first_extremes(r) for r in rows])


def _first_extremes(rows):
  """`[n, length]` rows -> `[length] int32`: for each column, the index in
  `concatenate([rows, -rows])` of its first maximum."""
  n, length = rows.shape
  group = next(g for g in (8, 4, 2, 1) if n % g == 0)  # Rows per step.

  def step(carry, group_rows):
    hi, at_hi, lo, at_lo = carry
    first, block = group_rows
    for j in range(group):
      row = block[j]
      up = row > hi  # Strict: an equal later row keeps the first.
      hi, at_hi = jnp.where(up, row, hi), jnp.where(up, first + j, at_hi)
      down = row < lo
      lo, at_lo = jnp.where(down, row, lo), jnp.where(down, first + j, at_lo)
    return (hi, at_hi, lo, at_lo), None

  zeros = jnp.zeros(length, jnp.int32)
  start = (
    jnp.full(length, -jnp.inf, rows.dtype),
    zeros,
    jnp.full(length, jnp.inf, rows.dtype),
    zeros,
  )
  firsts = jnp.arange(0, n, group, dtype=jnp.int32)
  blocks = jnp.reshape(rows, (n // group, group, length))
  (hi, at_hi, lo, at_lo), _ = jax.lax.scan(step, start, (firsts, blocks))
  # `-rows` come second in the concatenation: a tie goes to `rows`.
  return jnp.where(hi >= -lo, at_hi, at_lo + n)


def hash_rounds(vecs, rotations, n_buckets: int):
  """Trax's `hash_vectors` (int `n_buckets`, no mask) with its rotations
  given: `[n_hashes * len(vecs)]`, round r's buckets from `r * n_buckets`."""
  buckets = bucket_ids(vecs, rotations)
  offsets = jnp.arange(rotations.shape[0], dtype=jnp.int32) * n_buckets
  return jnp.reshape(buckets + offsets[:, None], (-1,))
