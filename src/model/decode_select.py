"""Which memory positions a new LSH token attends to: Trax's sort's choice,
found without the sort.

In Trax 1.4.1's predict mode each new token of `LSHSelfAttention` sorts
the priorities of every position in its memory (`sort_key_val` over
`predict_mem_len`, per head and layer) only to keep the last `n_hashes *
chunk_len * (1 + n_chunks_before)` of them (`keep_count`). The sort was
~80% of a token's time (34.6 ms of a step at an 8192-token memory; 7.7 ms
without it; bench/decode_speed.py) and grew with the conversation.

`select_kv` finds the same positions with prefix sums in one linear pass
over the memory (`lax.top_k` is no help: XLA on CPU lowers it to a sort);
`select_indexed` from O(n_keep) candidates given by the bucket index
(`decode_index`). The priorities are distinct integers, so either way the
selection is exactly the set and order the sort kept: outputs are
bit-identical (pinned by tests/test_attention.py).
"""

from __future__ import annotations

import jax
from jax import numpy as jnp

from src.model import lsh_hash


def keep_count(self) -> int:
  """Candidates Trax keeps for a new token (before `min` with the memory)."""
  return self._n_hashes * self._chunk_len * (1 + self._n_chunks_before)


# Candidates per token from which a layer reads its whole key cache under
# a mask (`keep_mask`) instead of gathering each token's own (when they
# are also a quarter of the memory or more). A layer read wide (few
# buckets, long chunks: BENCHMARKS "Recall in a long chat, fifth round")
# keeps 16,384 at chunks of 4,096: gathered for a block of 32 tokens that
# is 32 x 16,384 rows of keys and values a head (~200 MB), and each
# token sorts 5 x 16,384 candidates; the masked read is one product with
# the key cache and a prefix sum over it.
WIDE_MIN = 1024


def reads_memory(self, mem_len: int) -> bool:
  """Whether this layer's tokens read the whole key cache under a mask
  (`keep_mask`) rather than their gathered candidates (`select_indexed`):
  the same positions, a cheaper way when they are many."""
  keep = keep_count(self)
  return keep >= WIDE_MIN and 4 * keep >= mem_len


def keep_mask(all_buckets, q_buckets, q_start, n_keep: int):
  """`select_indexed`'s positions as a mask over the memory, those at or
  before the query (the only ones its attention does not mask).

  The same ranking as `select_kv`, with the buckets read as
  `select_indexed` reads them (a position's own from the query's on are
  not written yet: 0; the query shares its own). Of the positions up to
  `q_start + 1`, those sharing a bucket rank first, latest first, then
  the others, latest first; the `n_keep` best are kept (later positions
  only fill what is left, and attention masks them).

  Args:
    all_buckets: `[n_hashes, mem]` bucket of each memory position.
    q_buckets: `[n_hashes]` the query's buckets.
    q_start: Position of the query.
    n_keep: How many positions the step keeps (at most `mem`).

  Returns:
    `[mem] bool`.
  """
  mem = all_buckets.shape[1]
  positions = jnp.arange(mem, dtype=jnp.int32)
  if n_keep >= mem:  # All are kept: no ranking (a wide layer read with
    return positions <= q_start  # many hash rounds: 4 passes a query).
  seen = jnp.where(positions < q_start, all_buckets, 0)
  valid = jnp.any(seen == q_buckets[:, None], axis=0) | (positions == q_start)
  shared = ((positions <= q_start + 1) & valid).astype(jnp.int32)
  # Sharing ones after p (one prefix sum, XLA's fastest on CPU: reversed);
  # the others after p are the rest of the positions up to q_start + 1
  # (the memory's last, for a query there).
  later_shared = jax.lax.cumsum(shared, reverse=True) - shared
  last = jnp.minimum(q_start + 1, mem - 1)
  later_other = last - positions - later_shared
  rank = jnp.where(valid, later_shared, jnp.sum(shared) + later_other)
  return (positions <= q_start) & (rank < n_keep)


def select_kv(is_valid_target, q_start, n_keep: int):
  """The positions Trax's sort keeps, found with prefix sums in O(memory).

  Trax ranks position p by the priority `p + mem * valid(p)` if
  `p <= q_start + 1`, else `-(mem + p) + mem * valid(p)`, sorts, and keeps
  the `n_keep` highest in ascending order. Priorities are distinct, so the
  rank of p is a count of positions in higher classes plus those of its own
  class that outrank it; each count is a prefix sum.

  Args:
    is_valid_target: `[mem] bool`, positions sharing a bucket with the query.
    q_start: Position of the new token.
    n_keep: How many positions to keep.

  Returns:
    `[n_keep] int32` positions, lowest priority first (as the sort gives).
  """
  mem = is_valid_target.shape[0]
  positions = jnp.arange(mem, dtype=jnp.int32)
  past = positions <= q_start + 1
  valid = is_valid_target
  classes = [past & valid, past & ~valid, ~past & valid, ~past & ~valid]
  counts = [jnp.sum(c, dtype=jnp.int32) for c in classes]
  as_int = [c.astype(jnp.int32) for c in classes]

  def later(c):  # Members of class c at higher positions than p.
    return jnp.cumsum(c[::-1])[::-1] - c

  def earlier(c):  # Members of class c at lower positions than p.
    return jnp.cumsum(c) - c

  rank = jnp.where(
    classes[0],
    later(as_int[0]),
    jnp.where(
      classes[1],
      counts[0] + later(as_int[1]),
      jnp.where(
        classes[2],
        counts[0] + counts[1] + earlier(as_int[2]),
        counts[0] + counts[1] + counts[2] + earlier(as_int[3]),
      ),
    ),
  )
  slot = jnp.where(rank < n_keep, n_keep - 1 - rank, n_keep)
  return jnp.zeros([n_keep], jnp.int32).at[slot].set(positions, mode='drop')


def select_indexed(all_buckets, q_buckets, lists, q_start, n_keep: int):
  """`select_kv`'s positions, from O(n_keep) candidates instead of the
  whole memory.

  The candidates are the last `n_keep` positions of the new token's bucket
  in each hash round (`lists`, from the index) and a window of positions
  `[q_start + 2 - 2 n_keep, q_start + 2 + n_keep)`. They hold everything
  the sort keeps: the highest-ranked are the latest positions sharing a
  bucket (in the lists or the window); if there are fewer than `n_keep`,
  the latest others (at most as many shared ones as there are among the
  last `2 n_keep` positions, so the window holds enough), then, early in
  a context, the positions after it (in the window). Each candidate gets
  Trax's priority; the `n_keep` highest, lowest first, are the answer.

  Args:
    all_buckets: `[n_hashes, mem]` bucket of each memory position (the
      new token's own entry is not read: it shares its buckets).
    q_buckets: `[n_hashes]` the new token's buckets.
    lists: `[n_hashes, r]` positions of those buckets from the index (-1:
      empty).
    q_start: Position of the new token.
    n_keep: How many positions to keep (at most `mem`).

  Returns:
    `[n_keep] int32` positions, lowest priority first (as `select_kv`).
  """
  mem = all_buckets.shape[1]
  low = q_start + 2 - 2 * n_keep
  window = low + jnp.arange(3 * n_keep, dtype=jnp.int32)
  listed = jnp.reshape(lists, (-1,))
  cand = jnp.concatenate([window, listed])
  ok = jnp.concatenate(
    [(window >= 0) & (window < mem), (listed >= 0) & (listed < low)]
  )
  safe = jnp.clip(cand, 0, mem - 1)
  # A one-token step reads the buckets of positions before it; from its own
  # on they are zero (not written yet). A block has written them, or an
  # older conversation left them: read them as the step does.
  seen = jnp.where(safe < q_start, all_buckets[:, safe], 0)
  valid = jnp.any(seen == q_buckets[:, None], axis=0)
  valid = valid | (cand == q_start)
  priority = jnp.where(cand <= q_start + 1, cand, -(mem + cand))
  none = -4 * mem
  priority = jnp.where(ok, priority + mem * valid, none)
  priority = jnp.sort(priority)
  if lists.shape[0] > 1:  # A position may be listed by several rounds.
    same = jnp.concatenate(
      [jnp.zeros([1], bool), priority[1:] == priority[:-1]]
    )
    priority = jnp.sort(jnp.where(same, none, priority))
  top = priority[-n_keep:]
  # Back from priority to position (see `select_kv` for the classes).
  return jnp.where(
    top >= mem,
    top - mem,
    jnp.where(top >= 0, top, jnp.where(top > -mem, -top, -top - mem)),
  ).astype(jnp.int32)


def query_buckets(self, x, q_start, w_q, hash_rng, rotations=None):
  """The new token's query (`[2, d_qk]`, the row twice: Trax duplicates
  it so matmul rounding matches its tests) and its bucket in each hash
  round (`[n_hashes]`, numbered as Trax's `hash_vectors`), hashed with
  `rotations` if given (the same as Trax draws from `hash_rng`)."""
  q_range = q_start + jnp.arange(1, dtype=jnp.int32)
  q = jnp.matmul(jnp.concatenate([x[q_range]] * 2, 0), w_q)
  if rotations is None:
    hashed = self.hash_vectors(q, hash_rng)
  else:
    hashed = lsh_hash.hash_rounds(q, rotations, self._n_buckets)
  q_buckets = jnp.reshape(hashed, (self._n_hashes, 2))
  return q, q_buckets[:, 0]
