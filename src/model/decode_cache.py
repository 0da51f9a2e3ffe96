"""The decode cache of LSH attention: a bucket index for one-token steps.

Measured on the benchmark model (bench/decode_speed.py): in Trax 1.4.1's
predict mode each new token of `LSHSelfAttention` sorts the priorities of
every position in its memory (`sort_key_val` over `predict_mem_len`, per
head and layer) only to keep the last `n_hashes * chunk_len * (1 +
n_chunks_before)` of them. The sort was ~80% of a token's time (34.6 ms of
a step at an 8192-token memory; 7.7 ms without it) and made decoding slow
down as the conversation grew.

`attention.FastLSHSelfAttention` takes a token through this module instead,
the same computation. The chat decoder's layers (whose memory never rolls:
`never_roll`) keep a bucket index and their hashing rotations in their
predict state, pick the positions from O(n_keep) candidates
(`select_indexed`), and take a token through all heads at once, writing
its few new state entries in place (`indexed_layer_step`; Trax's per-head
loop copied the whole state, and drew the rotations again, at every
token). Other predict-mode layers find them with prefix sums in one linear
pass over the memory (`select_kv`; `lax.top_k` is no help here: XLA on CPU
lowers it to a sort). The priorities are distinct integers, so either way
the selection is exactly the set and order the sort kept: outputs are
bit-identical (pinned by tests/test_attention.py). A start block (position 0)
goes through Trax's step and then rebuilds the index; other blocks are
`decode_block`'s.
"""

from __future__ import annotations

import functools

import jax
from jax import numpy as jnp
from trax import fastmath
from trax.layers.research import efficient_attention as ea

from src.model import lsh_hash


def never_roll(layer):
  """Marks a predict-mode attention layer whose memory never rolls: the
  chat decoder never lets the context outgrow it (it drops whole turns and
  re-reads them first), so tokens are appended in place
  (`use_predict_mem`) and an LSH layer keeps its bucket index."""
  layer._never_rolls = True


def use_predict_mem(self, inputs, state, trax_mem):
  """Appends one token to the memory without Trax's in-graph roll
  (`trax_mem`: Trax's `_use_predict_mem` of the layer).

  Trax drops the oldest `predict_drop_len` positions inside the step when
  the memory is full, through a `cond` whose result XLA must copy: every
  token then copies each layer's whole memory (3 of the 13 ms of a token at
  an 8192-token memory). A layer marked by `never_roll` (the chat decoder
  marks its layers and never lets the context outgrow the memory: it drops
  whole turns and re-reads them first) appends in place instead.
  """
  seqlen = inputs[0].shape[-2]
  if not self._never_rolls:
    return trax_mem(inputs, state)
  if seqlen > 1:
    # Only the chat decoder's start block comes here (its other blocks go
    # through `decode_block`). Trax takes a block longer than
    # `predict_drop_len` for one (start 0, a Python int) but a shorter one
    # for a few appended tokens (a traced start), which its chunked local
    # attention cannot read (it asserts the start is 0): a 1k-4k-token
    # re-read of a gin/reformer_32k.gin model (drop length 4096) failed.
    # So a start block takes Trax's start-of-context branch (which turns
    # the output to NaN if the memory was not empty, so a misuse cannot
    # pass silently).
    drop, self._predict_drop_len = self._predict_drop_len, 0
    try:
      return trax_mem(inputs, state)
    finally:
      self._predict_drop_len = drop
  mem_end, mem, state = state

  def append(buf, new):
    return buf.at[:, mem_end].set(new[:, 0])

  inputs = fastmath.nested_map_multiarg(append, mem, inputs)
  return inputs, state, mem_end, inputs, mem_end + 1


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


def keep_count(self) -> int:
  """Candidates Trax keeps for a new token (before `min` with the memory)."""
  return self._n_hashes * self._chunk_len * (1 + self._n_chunks_before)


def indexed(self) -> bool:
  """Whether this predict-mode layer keeps a bucket index (see
  `select_indexed`): one-token steps of a causal layer with plain bucket
  counts."""
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
  ring = jnp.full(shape + (keep_count(self),), -1, jnp.int32)
  keys = jnp.zeros((self._predict_mem_len, self._key_width()), jnp.float32)
  counts = jnp.zeros(shape, jnp.int32)
  return (*state, ring, counts, rotations(self, rng), keys)


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


def attend_parts(self, x_q, q, q_start, kv_indices, parts, weights, rng):
  """Attention of the new token at `q_start` (query `q`, `[2, d_qk]`;
  input row `x_q`, `[1, d]`) over the memory positions `kv_indices`,
  whose keys and values are `parts` (`[n, width]`, the layer's
  `_key_parts`), as Trax's one-token step computes it: `[1, d]`."""
  attend_rng, output_rng = fastmath.random.split(rng)
  q_range = q_start + jnp.arange(1, dtype=jnp.int32)
  # Trax duplicates the query row so matmul rounding matches its tests.
  q, k, v = self._cached_qkv(q, parts, jnp.concatenate([x_q] * 2, 0), weights)
  mask_fn = functools.partial(
    ea.mask_self_attention, causal=True, masked=True, exclude_self=True
  )
  o, _ = ea.attend(
    q,
    k,
    v,
    mask_fn=mask_fn,
    q_info=q_range.astype(jnp.int32),
    kv_info=kv_indices.astype(jnp.int32),
    dropout=self._attention_dropout,
    rng=attend_rng,
  )
  out = jnp.matmul(o, weights[2])[:1]
  return ea.apply_broadcasted_dropout(out, self._output_dropout, output_rng)


def attend_selected(self, x, q, q_start, kv_indices, weights, rng):
  """`attend_parts` for a memory without a key cache: the candidates'
  keys and values projected from the memory `x` (`[mem, d]`)."""
  x_q = x[q_start + jnp.arange(1, dtype=jnp.int32)]
  parts = self._key_parts(x[kv_indices], weights)
  return attend_parts(self, x_q, q, q_start, kv_indices, parts, weights, rng)


def indexed_token(
  self, x_q, *, q_start, weights, q, qb, buckets, lists, keys, rng
):
  """One head's attention of the newest token through the bucket index
  (the token already written into it, `write_index`) and the key cache
  (its own entry written, `write_keys`).

  Args:
    x_q: `[1, d]` the token's input.
    q, qb: the token's query and buckets (`query_buckets`).
    buckets: `[n_hashes * mem]` each position's buckets (read only
      before `q_start`).
    lists: `[n_hashes, n_keep]` the rings of the token's buckets.
    keys: `[mem, width]` the key cache.

  Returns:
    `[1, d_v]`: Trax's one-token step over the positions its sort keeps.
  """
  mem = keys.shape[0]
  all_buckets = jnp.reshape(buckets, (self._n_hashes, mem))
  n_keep = min(keep_count(self), mem)
  kv_indices = select_indexed(all_buckets, qb, lists, q_start, n_keep)
  parts = keys[kv_indices]
  return attend_parts(self, x_q, q, q_start, kv_indices, parts, weights, rng)


def write_keys(keys, parts, q_start):
  """The key cache `keys` (`[..., mem, width]`) with `parts` (`[...,
  n, width]`, new positions' `_key_parts`) written from `q_start` on, in
  place."""
  at = (0,) * (keys.ndim - 2) + (q_start, 0)
  return jax.lax.dynamic_update_slice(keys, parts.astype(keys.dtype), at)


def one_token_step(
  self, x, *, q_start, weights, state, rng, index=None, rotations=None
):
  """LSH attention of the newest token over the memory `x` (`[mem, d]`),
  one head, in Trax's per-head loop.

  With `index` (`(ring, counts, keys)`, see `create_state`; only for a
  memory that never rolls) the candidates come from the bucket index in
  O(n_keep) and their keys from the key cache (`indexed_token`); without
  it, from `select_kv` over the whole memory. Both give the positions
  Trax's sort keeps.

  Returns:
    `(out [1, d_v], new_state)` as Trax's one-token path (the state with
    the updated index, if any).
  """
  buckets, buckets_idx, hash_rng = state
  new_idx = jnp.array(q_start + 1, dtype=buckets_idx.dtype)
  if index is not None:
    ring, counts, keys = index
    q, qb = query_buckets(self, x, q_start, weights[0], hash_rng, rotations)
    own = own_buckets(self, qb)
    ring, counts = write_index(ring[None], counts[None], own[None], q_start)
    x_q = x[q_start + jnp.arange(1, dtype=jnp.int32)]
    keys = write_keys(keys, self._key_parts(x_q, weights), q_start)
    out = indexed_token(
      self,
      x_q,
      q_start=q_start,
      weights=weights,
      q=q,
      qb=qb,
      buckets=buckets,
      lists=bucket_lists(ring, own[None])[0],
      keys=keys,
      rng=rng,
    )
    buckets = write_buckets(buckets[None], qb[None], q_start)[0]
    return out, (buckets, new_idx, hash_rng, ring[0], counts[0], keys)
  buckets = roll_buckets(self, buckets, buckets_idx, q_start)
  q, qb = query_buckets(self, x, q_start, weights[0], hash_rng)
  all_buckets = fastmath.dynamic_update_slice_in_dim(
    jnp.reshape(buckets, (self._n_hashes, -1)), qb[:, None], q_start, axis=1
  )
  n_keep = min(keep_count(self), x.shape[0])
  is_valid_target = jnp.any(all_buckets == qb[:, None], axis=0)
  kv_indices = select_kv(is_valid_target, q_start, n_keep)
  out = attend_selected(self, x, q, q_start, kv_indices, weights, rng)
  return out, (jnp.reshape(all_buckets, (-1,)), new_idx, hash_rng)


def write_buckets(buckets, qb, q_start):
  """`buckets` (`[heads, n_hashes * mem]`) with the new token's buckets
  `qb` (`[heads, n_hashes]`) at `q_start`: one `dynamic_update_slice`,
  after the attention has read the old array (the new token's own entry
  is not needed there, see `select_indexed`). XLA still copies the array
  twice per token (it does not order that read before the in-place
  write; `optimization_barrier` did not change that), but no longer
  several times as Trax's per-head scatter did."""
  heads, n_hashes = qb.shape
  new = jax.lax.dynamic_update_slice(
    jnp.reshape(buckets, (heads, n_hashes, -1)),
    qb[:, :, None].astype(buckets.dtype),
    (0, 0, q_start),
  )
  return jnp.reshape(new, buckets.shape)


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


def incremental_forward(
  self, trax_step, x, *, q_start, q_len, weights, state, rng, update_state
):
  """LSH's predict step for `x` (`[mem, d]`, one head): one token through
  `one_token_step`, anything else through Trax's (`trax_step`), after
  which the bucket index is rebuilt from what it read (the key cache is
  filled only for a memory that never rolls: its blocks are read by
  `decode_block`)."""
  extra = None
  if indexed(self):  # (ring, counts, rotations, keys): `create_state`.
    state, extra = tuple(state[:3]), tuple(state[3:])
  if q_len != 1 or self._n_chunks_after != 0 or not update_state:
    out, new = trax_step(
      x,
      q_start=q_start,
      q_len=q_len,
      weights=weights,
      state=state,
      rng=rng,
      update_state=update_state,
    )
    if extra is not None:  # A block at the start: index what it read.
      ring, _, rotations, keys = extra
      buckets = jnp.reshape(new[0], (self._n_hashes, -1))
      index = rebuilt_index(buckets, new[1], *ring.shape[1:])
      if self._never_rolls:  # Its keys: `x` holds it from position 0.
        keys = write_keys(keys, self._key_parts(x[:q_len], weights), 0)
      new = (*new, *index, rotations, keys)
    return out, new
  # A memory that may roll moves its positions: its index is not used.
  used = extra is not None and self._never_rolls
  ring, counts, rotations, keys = extra if extra is not None else (None,) * 4
  out, new = one_token_step(
    self,
    x,
    q_start=q_start,
    weights=weights,
    state=state,
    rng=rng,
    index=(ring, counts, keys) if used else None,
    rotations=rotations if used else None,
  )
  if used:
    buckets, idx, hash_rng, ring, counts, keys = new
    return out, (buckets, idx, hash_rng, ring, counts, rotations, keys)
  return out, new if extra is None else (*new, *extra)


def forward_and_or_backward(
  self,
  trax_fab,
  inputs,
  weights,
  state,
  rng,
  output_grad=None,
  compute_output=True,
  update_state=True,
):
  """Trax's LSH step (`trax_fab`), except for one token of the chat
  decoder (`indexed_layer_step`)."""
  one = not isinstance(inputs, (tuple, list)) and inputs.shape[-2] == 1
  batch = inputs.shape[0] if one else 0
  if (
    one
    and indexed(self)
    and self._never_rolls
    and update_state
    and compute_output
    and output_grad is None
    and (
      not self._n_parallel_heads
      or self._n_parallel_heads >= batch * self._n_heads
    )
  ):
    out, new_state = indexed_layer_step(self, inputs, weights, state, rng)
    return out, new_state, None, None
  return trax_fab(
    inputs,
    weights,
    state,
    rng,
    output_grad=output_grad,
    compute_output=compute_output,
    update_state=update_state,
  )


def _each_head(fn, *args):
  """`fn` over every example and head: args per example, per head, and
  per both."""
  per_example = jax.vmap(fn, in_axes=(None, 0, 0))
  return jax.vmap(per_example, in_axes=(0, None, 0))(*args)


def indexed_layer_step(self, x, weights, state, rng):
  """One new token through a whole LSH layer (all examples and heads),
  for a memory that never rolls and keeps a bucket index.

  Trax's per-head loop gathers each head's state, returns a whole new one
  (the `[n_hashes * mem]` buckets, the index) and scatters it back: every
  token copied those arrays, a cost that grew with the memory. Here the
  few entries a token changes are written into the (donated) state in
  place (`write_index`, `write_buckets`, `write_keys`) and each head only
  reads (`indexed_token`). The output is Trax's: all heads at once,
  summed over heads.

  Args:
    x: `[batch, 1, d_model]` the new token's input.
    state: `(mem_end, mem, (buckets, buckets_idx, hash_rng, ring, counts,
      rotations, keys))` with the per-head entries stacked `[batch *
      n_heads, ...]`.

  Returns:
    `(out [batch, 1, d_model], new_state)`.
  """
  _, per_head, q_start, new_mem, new_mem_end = self._use_predict_mem(
    (x,), state
  )
  buckets, buckets_idx, hash_rng, ring, counts, turns, keys = per_head
  batch, heads = x.shape[0], self._n_heads

  def by_example(a):
    return jnp.reshape(a, (batch, heads) + a.shape[1:])

  def flat(a):
    return jnp.reshape(a, (batch * heads,) + a.shape[2:])

  def query(x_b, w_h, turns_h):  # The row as a memory of one position.
    q, qb = query_buckets(self, x_b, 0, w_h[0], None, turns_h)
    return q, qb, self._key_parts(x_b, w_h)

  q, qb, parts = _each_head(query, x, weights, by_example(turns))
  own = own_buckets(self, qb)
  ring, counts = write_index(ring, counts, flat(own), q_start)
  keys = write_keys(keys, flat(parts), q_start)

  def attend(x_b, w_h, per):
    q_h, qb_h, buckets_h, lists_h, keys_h = per
    return indexed_token(
      self, x_b, q_start=q_start, weights=w_h, q=q_h, qb=qb_h,
      buckets=buckets_h, lists=lists_h, keys=keys_h, rng=rng,
    )  # fmt: skip

  lists = bucket_lists(ring, flat(own))
  per = (q, qb, by_example(buckets), by_example(lists), by_example(keys))
  out = _each_head(attend, x, weights, per)
  out = jnp.sum(out, axis=1).astype(x.dtype)  # Over heads: [batch, 1, d].
  buckets = write_buckets(buckets, flat(qb), q_start)
  buckets_idx = jnp.full_like(buckets_idx, q_start + 1)
  per_head = (buckets, buckets_idx, hash_rng, ring, counts, turns, keys)
  return out, (new_mem_end, new_mem, per_head)
