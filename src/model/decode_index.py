"""The bucket index of a predict-mode LSH layer whose memory never rolls.

For each hash round and bucket the index keeps a ring of its last
`keep_count` positions (`[n_hashes, n_buckets, n_keep] int32`, -1 where
empty) and how many positions it holds (`[n_hashes, n_buckets] int32`);
beside them the head's hashing rotations, drawn once, and the key cache
(`decode_keys`). All live in the layer's predict state
(`decode_state.LSHState`), created here (`create_state`), written a token
at a time in place (`write_index`, `write_buckets`) and rebuilt after a
start block (`rebuilt_index`).
"""

from __future__ import annotations

import jax
from jax import numpy as jnp
from trax import fastmath

from src.model import decode_select, lsh_hash
from src.model.decode_state import LSHState


def indexed(self) -> bool:
  """Whether this predict-mode layer keeps a bucket index (see
  `decode_select.select_indexed`): one-token steps of a causal layer with
  plain bucket counts."""
  return (
    self._incremental
    and isinstance(self._n_buckets, int)
    and self._n_chunks_after == 0
  )


def create_state(self, state, rng):
  """Trax's state `state`, plus (predict mode) the bucket index: for each hash
  round and bucket, a ring of its last `keep_count` positions
  (`[n_hashes, n_buckets, n_keep] int32`, -1 where empty) and how many
  positions it holds (`[n_hashes, n_buckets] int32`); the head's random
  rotations (`rotations`); and the key cache: each position's key, value
  (and directed key) as the layer's `_key_parts` makes them (`[mem,
  width]`), so that a token's candidates are read, not projected again."""
  if not indexed(self):
    return state
  shape = (self._n_hashes, self._n_buckets)
  n_keep = decode_select.keep_count(self)
  buckets, buckets_idx, hash_rng = state  # Trax's.
  return LSHState(
    buckets=buckets,
    buckets_idx=buckets_idx,
    hash_rng=hash_rng,
    ring=jnp.full(shape + (n_keep,), -1, jnp.int32),
    counts=jnp.zeros(shape, jnp.int32),
    rotations=rotations(self, rng),
    keys=jnp.zeros((self._predict_mem_len, self._key_width()), jnp.float32),
  ).plain()


def rotations(self, hash_rng):
  """The random rotations Trax's `hash_vecs` draws from `hash_rng` for
  every hashing (`lsh_hash.draw_rotations`). Trax draws them again at
  every token: at 512 buckets, 2 hashes and 8 heads that is 262,144
  normal numbers per layer and token, more time than the token's
  attention itself. A predict-mode state keeps them instead."""
  return lsh_hash.draw_rotations(
    hash_rng, self._d_qk, self._n_hashes, self._n_buckets
  )


def rebuilt_index(buckets, filled, n_buckets: int, n_keep: int):
  """The bucket index of the first `filled` positions of `buckets`
  (`[n_hashes, mem]`, as Trax's `hash_vectors` numbers them: round r's
  buckets are `r * n_buckets + b`), as a run of one-token steps would
  have built it (after a block is read at the start of a context)."""
  n_hashes, mem = buckets.shape
  positions = jnp.arange(mem, dtype=jnp.int32)
  rows = jnp.arange(n_hashes)[:, None]
  local = buckets - rows * n_buckets  # Each round's own 0..n_buckets-1.
  key = jnp.where(positions < filled, local, n_buckets)  # Dead: extra.
  order = jnp.argsort(key * mem + positions, axis=1)  # By bucket, position.
  bucket = jnp.take_along_axis(key, order, axis=1)
  counts = jnp.zeros((n_hashes, n_buckets + 1), jnp.int32)
  counts = counts.at[rows, key].add(1)
  starts = jnp.cumsum(counts, axis=1) - counts
  index = positions[None, :] - jnp.take_along_axis(starts, bucket, axis=1)
  total = jnp.take_along_axis(counts, bucket, axis=1)
  keep = (bucket < n_buckets) & (index >= total - n_keep)
  ring = jnp.full((n_hashes, n_buckets, n_keep), -1, jnp.int32)
  ring = ring.at[rows, jnp.where(keep, bucket, n_buckets), index % n_keep].set(
    order.astype(jnp.int32), mode='drop'
  )
  return ring, counts[:, :n_buckets]


def roll_buckets(self, buckets, buckets_idx, q_start):
  """Drops the oldest bucket ids once the memory has been rolled."""

  def roll(b):
    b = jnp.reshape(b, (self._n_hashes, -1))
    padded = jnp.concatenate(
      [b, jnp.zeros((self._n_hashes, self._predict_drop_len), b.dtype)],
      axis=1,
    )
    rolled = fastmath.dynamic_slice_in_dim(
      padded, buckets_idx - q_start, b.shape[-1], axis=1
    )
    return jnp.reshape(rolled, (-1,))

  return jax.lax.cond(buckets_idx > q_start, roll, lambda b: b, buckets)


def write_index(ring, counts, own, q_start):
  """Writes a new token's position into the bucket index of `heads`
  heads: into the ring of its bucket in each round (`own`, `[heads,
  n_hashes]`, each round's own numbering).

  Every entry is a `dynamic_update_slice` of one element (unrolled over
  heads and rounds: a few dozen), all counts first and then the ring
  slots (each read from the new counts), and the index is read only after
  it is written: XLA then updates the donated buffers in place (a
  scatter, or a read of an old value, made it copy them every token).

  Args:
    ring: `[heads, n_hashes, n_buckets, n_keep]`. counts: `[heads,
      n_hashes, n_buckets]`.

  Returns:
    `(ring, counts)`, updated.
  """
  heads, n_hashes = own.shape
  one = (1, 1, 1)
  entries = [
    (jnp.int32(h), jnp.int32(r), own[h, r])
    for h in range(heads)
    for r in range(n_hashes)
  ]  # Distinct: each head and round has its own rows.
  for at in entries:
    count = jax.lax.dynamic_slice(counts, at, one) + 1
    counts = jax.lax.dynamic_update_slice(counts, count, at)
  for at in entries:
    slot = (jax.lax.dynamic_slice(counts, at, one) - 1) % ring.shape[-1]
    ring = jax.lax.dynamic_update_slice(
      ring,
      jnp.full((1, 1, 1, 1), q_start, ring.dtype),
      at + (jnp.reshape(slot, ()),),
    )
  return ring, counts


def write_buckets(buckets, qb, q_start):
  """`buckets` (`[heads, n_hashes * mem]`) with the new token's buckets
  `qb` (`[heads, n_hashes]`) at `q_start`: one `dynamic_update_slice`,
  after the attention has read the old array (the new token's own entry
  is not needed there, see `decode_select.select_indexed`). XLA still
  copies the array twice per token (it does not order that read before
  the in-place write; `optimization_barrier` did not change that), but no
  longer several times as Trax's per-head scatter did."""
  heads, n_hashes = qb.shape
  new = jax.lax.dynamic_update_slice(
    jnp.reshape(buckets, (heads, n_hashes, -1)),
    qb[:, :, None].astype(buckets.dtype),
    (0, 0, q_start),
  )
  return jnp.reshape(new, buckets.shape)


def own_buckets(self, qb):
  """The token's buckets `qb` (`[..., n_hashes]`, Trax's numbering: round
  r's from `r * n_buckets`) in each round's own numbering, as the index
  keeps them."""
  return qb - jnp.arange(self._n_hashes) * self._n_buckets


def bucket_lists(ring, own):
  """`[heads, n_hashes, n_keep]`: the rings of the buckets `own`
  (`[heads, n_hashes]`)."""
  heads, n_hashes = own.shape
  h = jnp.arange(heads)[:, None]
  return ring[h, jnp.arange(n_hashes)[None, :], own]
