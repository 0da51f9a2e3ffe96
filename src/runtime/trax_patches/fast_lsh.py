"""A faster one-token decoding step for Trax's LSH attention.

Measured on the benchmark model (bench/decode_speed.py): in Trax 1.4.1's
predict mode each new token of `LSHSelfAttention` sorts the priorities of
every position in its memory (`sort_key_val` over `predict_mem_len`, per
head and layer) only to keep the last `n_hashes * chunk_len * (1 +
n_chunks_before)` of them. The sort was ~80% of a token's time (34.6 ms of
a step at an 8192-token memory; 7.7 ms without it) and made decoding slow
down as the conversation grew.

`install()` replaces the one-token path with the same computation. The
chat decoder's layers (whose memory never rolls) keep a bucket index and
their hashing rotations in their predict state, pick the positions from
O(n_keep) candidates (`select_indexed`), and take a token through all
heads at once, writing its few new state entries in place
(`indexed_layer_step`; Trax's per-head loop copied the whole state, and
drew the rotations again, at every token). Other predict-mode layers
find them with prefix sums in one linear pass over the memory
(`select_kv`; `lax.top_k` is no help here: XLA on CPU lowers it to a
sort). The priorities are distinct
integers, so either way the selection is exactly the set and order the
sort kept: outputs are bit-identical (pinned by tests/test_fast_lsh.py).
A block read in predict mode goes through Trax's step and then rebuilds
the index.

Training runs Trax's computation with two costs cut (bench/train_speed.py,
32k tokens): the buckets' argmax is a scan over the rotations
(`bucket_ids`, 8x faster on long inputs) and the hash sort sorts its keys
alone (`lsh_forward`). Buckets, outputs and gradients are bit-identical
to Trax's (pinned by tests/test_fast_lsh.py).

The attention layers' weights are made here too: the directed LSH
term's two projections (`lsh.directed`), and zero output projections
where a model starts its attention branches at zero
(`residual.zero_attention`, `zero_output`).
"""

from __future__ import annotations

import functools

import jax
from jax import numpy as jnp
from trax import fastmath
from trax.layers.research import efficient_attention as ea
from trax.layers.research import position_encodings as pe

_ORIGINAL = ea.LSHSelfAttention._incremental_forward_unbatched
_ORIGINAL_MEM = ea.LSHSelfAttention._use_predict_mem
_ORIGINAL_LOCAL_MEM = ea.SelfAttention._use_predict_mem
NO_ROLL = '_jade_memory_never_rolls'


def _use_predict_mem(self, inputs, state):
  """Appends one token to the memory without Trax's in-graph roll.

  Trax drops the oldest `predict_drop_len` positions inside the step when
  the memory is full, through a `cond` whose result XLA must copy: every
  token then copies each layer's whole memory (3 of the 13 ms of a token at
  an 8192-token memory). A layer marked with `NO_ROLL` (the chat decoder
  marks its layers and never lets the context outgrow the memory: it drops
  whole turns and re-reads them first) appends in place instead.
  """
  seqlen = inputs[0].shape[-2]
  original = (
    _ORIGINAL_MEM
    if isinstance(self, ea.LSHSelfAttention)
    else _ORIGINAL_LOCAL_MEM
  )
  if not getattr(self, NO_ROLL, False):
    return original(self, inputs, state)
  if seqlen > 1:
    # The chat decoder feeds blocks only at the start of a context. Trax
    # takes a block longer than `predict_drop_len` for one (start 0, a
    # Python int) but a shorter one for a few appended tokens (a traced
    # start), which its chunked local attention cannot read (it asserts
    # the start is 0): a 1k-4k-token re-read of a gin/reformer_32k.gin
    # model (drop length 4096) failed. So every block takes Trax's
    # start-of-context branch (which turns the output to NaN if the
    # memory was not empty, so a misuse cannot pass silently).
    drop, self._predict_drop_len = self._predict_drop_len, 0
    try:
      return original(self, inputs, state)
    finally:
      self._predict_drop_len = drop
  mem_end, mem, state = state

  def append(buf, new):
    return buf.at[:, mem_end].set(new[:, 0])

  inputs = fastmath.nested_map_multiarg(append, mem, inputs)
  return inputs, state, mem_end, inputs, mem_end + 1


def _roll_buckets(self, buckets, buckets_idx, q_start):
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


_ORIGINAL_STATE = ea.LSHSelfAttention.create_state_unbatched


def _n_keep(self) -> int:
  """Candidates Trax keeps for a new token (before `min` with the memory)."""
  return self._n_hashes * self._chunk_len * (1 + self._n_chunks_before)


def _indexed(self) -> bool:
  """Whether this predict-mode layer keeps a bucket index (see
  `select_indexed`): one-token steps of a causal layer with plain bucket
  counts."""
  return (
    self._incremental
    and isinstance(self._n_buckets, int)
    and self._n_chunks_after == 0
  )


def _create_state_unbatched(self, input_signature, rng):
  """Trax's state, plus (predict mode) the bucket index: for each hash
  round and bucket, a ring of its last `_n_keep` positions
  (`[n_hashes, n_buckets, n_keep] int32`, -1 where empty) and how many
  positions it holds (`[n_hashes, n_buckets] int32`); and the head's
  random rotations (`rotations`)."""
  state = _ORIGINAL_STATE(self, input_signature, rng)
  if not _indexed(self):
    return state
  shape = (self._n_hashes, self._n_buckets)
  ring = jnp.full(shape + (_n_keep(self),), -1, jnp.int32)
  return (*state, ring, jnp.zeros(shape, jnp.int32), rotations(self, rng))


def rotations(self, hash_rng):
  """The random rotations Trax's `hash_vecs` draws from `hash_rng` for
  every hashing (`draw_rotations`). Trax draws them again at every token:
  at 512 buckets, 2 hashes and 8 heads that is 262,144 normal numbers per
  layer and token, more time than the token's attention itself. A
  predict-mode state keeps them instead."""
  return draw_rotations(hash_rng, self._d_qk, self._n_hashes, self._n_buckets)


def draw_rotations(hash_rng, d: int, n_hashes: int, n_buckets: int):
  """Trax's random rotations, drawn as `hash_vecs` draws them (Trax's
  `[d, n_hashes, n_buckets // 2]`), returned as `[n_hashes, n_buckets //
  2, d] float32`, the layout XLA's products want."""
  shape = (d, n_hashes, n_buckets // 2)
  drawn = fastmath.random.normal(hash_rng, shape).astype(jnp.float32)
  return jnp.transpose(drawn, (1, 2, 0))


def _hash(self, vecs, rotations):
  """Trax's `hash_vectors` (int `n_buckets`, no mask) with its rotations
  given: `[n_hashes * len(vecs)]`, round r's buckets from `r * n_buckets`."""
  buckets = bucket_ids(vecs, rotations)
  offsets = jnp.arange(self._n_hashes, dtype=jnp.int32) * self._n_buckets
  return jnp.reshape(buckets + offsets[:, None], (-1,))


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
  same buckets (pinned by tests/test_fast_lsh.py) in ~10 ms.
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


_TRAX_HASH_VECS = ea.hash_vecs


def _hash_vecs(vecs, n_buckets_in, n_hashes, rng):
  """Trax's `hash_vecs` with its rotations drawn as Trax draws them and the
  buckets from `bucket_ids`; factorized bucket lists go to Trax's."""
  if not isinstance(n_buckets_in, int):
    return _TRAX_HASH_VECS(vecs, n_buckets_in, n_hashes, rng)
  turns = draw_rotations(rng, vecs.shape[-1], n_hashes, n_buckets_in)
  # Buckets are integers: no gradient flows through them (Trax stops it
  # after), and none need be traced through the scan.
  vecs = jax.lax.stop_gradient(vecs)
  return bucket_ids(vecs, turns), n_buckets_in


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
  valid = jnp.any(all_buckets[:, safe] == q_buckets[:, None], axis=0)
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


def _query_buckets(self, x, q_start, w_q, hash_rng, rotations=None):
  """The new token's query (`[2, d_qk]`, the row twice: Trax duplicates
  it so matmul rounding matches its tests) and its bucket in each hash
  round (`[n_hashes]`, numbered as Trax's `hash_vectors`), hashed with
  `rotations` if given (the same as Trax draws from `hash_rng`)."""
  q_range = q_start + jnp.arange(1, dtype=jnp.int32)
  q = jnp.matmul(jnp.concatenate([x[q_range]] * 2, 0), w_q)
  if rotations is None:
    hashed = self.hash_vectors(q, hash_rng)
  else:
    hashed = _hash(self, q, rotations)
  q_buckets = jnp.reshape(hashed, (self._n_hashes, 2))
  return q, q_buckets[:, 0]


def _attend_selected(self, x, q, q_start, kv_indices, weights, rng):
  """Attention of the new token (query `q`) over the memory positions
  `kv_indices` of `x` (`[mem, d]`), as Trax's one-token step: `[1, d]`."""
  attend_rng, output_rng = fastmath.random.split(rng)
  w_q, w_v, w_o = weights[:3]
  q_range = q_start + jnp.arange(1, dtype=jnp.int32)
  x_attend_to = x[kv_indices]
  k = ea.length_normalized(jnp.matmul(x_attend_to, w_q))
  if len(weights) == 5:  # Directed (see `_forward_unbatched`).
    w_a, w_b = weights[3:]
    a = jnp.matmul(jnp.concatenate([x[q_range]] * 2, 0), w_a)
    q, k = _directed(q, k, a, jnp.matmul(x_attend_to, w_b))
  v = jnp.matmul(x_attend_to, w_v)
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
  out = jnp.matmul(o, w_o)[:1]
  return ea.apply_broadcasted_dropout(out, self._output_dropout, output_rng)


def indexed_token(self, x, *, q_start, weights, q, qb, buckets, lists, rng):
  """One head's attention of the newest token through the bucket index
  (the token already written into it, `_write_index`).

  Args:
    x: `[mem, d]` the memory, the new token at `q_start`.
    q, qb: the token's query and buckets (`_query_buckets`).
    buckets: `[n_hashes * mem]` each position's buckets (the new
      token's own entry is not read).
    lists: `[n_hashes, n_keep]` the rings of the token's buckets.

  Returns:
    `[1, d_v]`, exactly as Trax's one-token step.
  """
  mem = x.shape[0]
  all_buckets = jnp.reshape(buckets, (self._n_hashes, mem))
  n_keep = min(_n_keep(self), mem)
  kv_indices = select_indexed(all_buckets, qb, lists, q_start, n_keep)
  return _attend_selected(self, x, q, q_start, kv_indices, weights, rng)


def one_token_step(
  self, x, *, q_start, weights, state, rng, index=None, rotations=None
):
  """LSH attention of the newest token over the memory `x` (`[mem, d]`),
  one head, in Trax's per-head loop.

  With `index` (`(ring, counts)`, see `_create_state_unbatched`; only for
  a memory that never rolls) the candidates come from the bucket index in
  O(n_keep) (`indexed_token`); without it, from `select_kv` over the whole
  memory. Both give the positions Trax's sort keeps.

  Returns:
    `(out [1, d_v], new_state)` exactly as Trax's one-token path (the
    state with the updated index, if any).
  """
  buckets, buckets_idx, hash_rng = state
  new_idx = jnp.array(q_start + 1, dtype=buckets_idx.dtype)
  if index is not None:
    q, qb = _query_buckets(self, x, q_start, weights[0], hash_rng, rotations)
    own = _own(self, qb)
    ring, counts = _write_index(*(i[None] for i in index), own[None], q_start)
    out = indexed_token(
      self,
      x,
      q_start=q_start,
      weights=weights,
      q=q,
      qb=qb,
      buckets=buckets,
      lists=_lists(ring, own[None])[0],
      rng=rng,
    )
    buckets = _write_buckets(buckets[None], qb[None], q_start)[0]
    return out, (buckets, new_idx, hash_rng, ring[0], counts[0])
  buckets = _roll_buckets(self, buckets, buckets_idx, q_start)
  q, qb = _query_buckets(self, x, q_start, weights[0], hash_rng)
  all_buckets = fastmath.dynamic_update_slice_in_dim(
    jnp.reshape(buckets, (self._n_hashes, -1)), qb[:, None], q_start, axis=1
  )
  n_keep = min(_n_keep(self), x.shape[0])
  is_valid_target = jnp.any(all_buckets == qb[:, None], axis=0)
  kv_indices = select_kv(is_valid_target, q_start, n_keep)
  out = _attend_selected(self, x, q, q_start, kv_indices, weights, rng)
  return out, (jnp.reshape(all_buckets, (-1,)), new_idx, hash_rng)


def _write_buckets(buckets, qb, q_start):
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


def _write_index(ring, counts, own, q_start):
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


def _own(self, qb):
  """The token's buckets `qb` (`[..., n_hashes]`, Trax's numbering: round
  r's from `r * n_buckets`) in each round's own numbering, as the index
  keeps them."""
  return qb - jnp.arange(self._n_hashes) * self._n_buckets


def _lists(ring, own):
  """`[heads, n_hashes, n_keep]`: the rings of the buckets `own`
  (`[heads, n_hashes]`)."""
  heads, n_hashes = own.shape
  h = jnp.arange(heads)[:, None]
  return ring[h, jnp.arange(n_hashes)[None, :], own]


def _incremental_forward_unbatched(
  self, x, *, q_start, q_len, weights, state, rng, update_state
):
  index = rotations = None
  if _indexed(self):  # The state holds the index (`_create_state_unbatched`).
    state, index, rotations = tuple(state[:3]), tuple(state[3:5]), state[5]
  if q_len != 1 or self._n_chunks_after != 0 or not update_state:
    out, new = _ORIGINAL(
      self,
      x,
      q_start=q_start,
      q_len=q_len,
      weights=weights,
      state=state,
      rng=rng,
      update_state=update_state,
    )
    if index is not None:  # A block at the start: index what it read.
      buckets = jnp.reshape(new[0], (self._n_hashes, -1))
      ring = index[0]
      new = (*new, *rebuilt_index(buckets, new[1], *ring.shape[1:]), rotations)
    return out, new
  # A memory that may roll moves its positions: its index is not used.
  used = index is not None and getattr(self, NO_ROLL, False)
  out, new = one_token_step(
    self,
    x,
    q_start=q_start,
    weights=weights,
    state=state,
    rng=rng,
    index=index if used else None,
    rotations=rotations if used else None,
  )
  if index is not None and not used:
    new = (*new, *index)
  return out, new if index is None else (*new, rotations)


_ORIGINAL_FAB = ea.LSHSelfAttention.forward_and_or_backward


def _forward_and_or_backward(
  self,
  inputs,
  weights,
  state,
  rng,
  output_grad=None,
  compute_output=True,
  update_state=True,
):
  """Trax's LSH step, except for one token of the chat decoder
  (`indexed_layer_step`)."""
  one = not isinstance(inputs, (tuple, list)) and inputs.shape[-2] == 1
  batch = inputs.shape[0] if one else 0
  if (
    one
    and _indexed(self)
    and getattr(self, NO_ROLL, False)
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
  return _ORIGINAL_FAB(
    self,
    inputs,
    weights,
    state,
    rng,
    output_grad=output_grad,
    compute_output=compute_output,
    update_state=update_state,
  )


def indexed_layer_step(self, x, weights, state, rng):
  """One new token through a whole LSH layer (all examples and heads),
  for a memory that never rolls and keeps a bucket index.

  Trax's per-head loop gathers each head's state, returns a whole new one
  (the `[n_hashes * mem]` buckets, the index) and scatters it back: every
  token copied those arrays, a cost that grew with the memory. Here the
  few entries a token changes are written into the (donated) state in
  place (`_write_index`, `_write_buckets`) and each head only reads
  (`indexed_token`). The output is Trax's: all heads at once, summed over
  heads.

  Args:
    x: `[batch, 1, d_model]` the new token's input.
    state: `(mem_end, mem, (buckets, buckets_idx, hash_rng, ring, counts,
      rotations))` with the per-head entries stacked `[batch * n_heads,
      ...]`.

  Returns:
    `(out [batch, 1, d_model], new_state)`.
  """
  (mem,), per_head, q_start, new_mem, new_mem_end = _use_predict_mem(
    self, (x,), state
  )
  buckets, buckets_idx, hash_rng, ring, counts, turns = per_head
  batch, heads = x.shape[0], self._n_heads

  def by_example(a):
    return jnp.reshape(a, (batch, heads) + a.shape[1:])

  def flat(a):
    return jnp.reshape(a, (batch * heads,) + a.shape[2:])

  def each_head(fn, *args):  # args: per example, per head, per both.
    per_example = jax.vmap(fn, in_axes=(None, 0, 0))
    return jax.vmap(per_example, in_axes=(0, None, 0))(*args)

  def query(x_b, w_h, turns_h):
    return _query_buckets(self, x_b, q_start, w_h[0], None, turns_h)

  q, qb = each_head(query, mem, weights, by_example(turns))
  own = _own(self, qb)
  ring, counts = _write_index(ring, counts, flat(own), q_start)

  def attend(x_b, w_h, per):
    q_h, qb_h, buckets_h, lists_h = per
    return indexed_token(
      self,
      x_b,
      q_start=q_start,
      weights=w_h,
      q=q_h,
      qb=qb_h,
      buckets=buckets_h,
      lists=lists_h,
      rng=rng,
    )

  lists = _lists(ring, flat(own))
  out = each_head(
    attend, mem, weights, (q, qb, by_example(buckets), by_example(lists))
  )
  out = jnp.sum(out, axis=1).astype(x.dtype)  # Over heads: [batch, 1, d].
  buckets = _write_buckets(buckets, flat(qb), q_start)
  buckets_idx = jnp.full_like(buckets_idx, q_start + 1)
  per_head = (buckets, buckets_idx, hash_rng, ring, counts, turns)
  return out, (new_mem_end, new_mem, per_head)


_ORIGINAL_AXIAL = pe.AxialPositionalEncoding.forward


def _axial_forward(self, inputs):
  """Axial position embedding of one new token, without the whole table.

  In predict mode Trax builds the full `[max_len, d_model]` table every
  token and slices one row out of it. For one token we look up the row's
  coordinates instead: position p is `unravel_index(p, shape)`, and its
  embedding is the concatenation of each axis' vector at its coordinate.
  """
  if self._mode != 'predict' or inputs.shape[1] != 1:
    return _ORIGINAL_AXIAL(self, inputs)
  position = self.state
  parts = []
  for axis, ax_emb in enumerate(self.weights):
    size = self._shape[axis]
    stride = 1
    for later in self._shape[axis + 1 :]:
      stride *= later
    coord = (position // stride) % size
    table = jnp.reshape(ax_emb, (size, ax_emb.shape[-1]))
    parts.append(fastmath.dynamic_slice_in_dim(table, coord, 1, axis=0))
  emb = jnp.concatenate(parts, -1)  # [1, d_model]
  self.state = position + 1
  return inputs + emb[None]


_ORIGINAL_LOCAL = ea.SelfAttention._incremental_forward_unbatched
_TRAX_MASK = ea.mask_self_attention


def window_mask(dots, q_info, kv_info, *, chunk_len, n_chunks_before, **kw):
  """Trax's self-attention mask plus the local window training used.

  Chunked `SelfAttention` in training lets a query in chunk c see chunks
  c - n_chunks_before .. c. `attend` numbers positions from 1.
  """
  dots = _TRAX_MASK(dots, q_info, kv_info, **kw)
  q = q_info.astype(jnp.int32) - 1
  k = kv_info.astype(jnp.int32) - 1
  first = (q // chunk_len - n_chunks_before) * chunk_len
  return dots - 1e9 * (k < first).astype(dots.dtype)


def local_one_token_step(self, x, *, q_start, weights, rng):
  """Local attention of the newest token over its window of the memory.

  Reads only the `chunk_len * (1 + n_chunks_before)` positions that can
  be in the token's training window (a fixed-size slice of the memory
  `x`, `[mem, d]`), so a token costs the same at any position; Trax's
  step projects the whole memory's keys for every token.

  Returns:
    `[1, d_v]`, as Trax's one-token path with `window_mask`.
  """
  attend_rng, output_rng = fastmath.random.split(rng)
  if self._share_qk:
    w_q, w_v, w_o = weights
  else:
    w_q, w_k, w_v, w_o = weights
  chunk, before = int(self._chunk_len), int(self._n_chunks_before)
  size = min(chunk * (1 + before), x.shape[0])
  first = jnp.maximum((q_start // chunk - before) * chunk, 0)
  start = jnp.minimum(first, x.shape[0] - size)
  window = fastmath.dynamic_slice_in_dim(x, start, size, axis=0)
  q_range = q_start + jnp.arange(1, dtype=jnp.int32)
  # Trax duplicates the query row so matmul rounding matches its tests.
  q = jnp.matmul(jnp.concatenate([x[q_range]] * 2, 0), w_q)
  if self._share_qk:
    k = ea.length_normalized(jnp.matmul(window, w_q))
  else:
    k = jnp.matmul(window, w_k)
  v = jnp.matmul(window, w_v)
  mask_fn = functools.partial(
    window_mask,
    chunk_len=chunk,
    n_chunks_before=before,
    causal=True,
    exclude_self=self._share_qk,
    masked=False,
  )
  o, _ = ea.attend(
    q,
    k,
    v,
    mask_fn=mask_fn,
    q_info=q_range.astype(jnp.int32),
    kv_info=(start + jnp.arange(size)).astype(jnp.int32),
    dropout=self._attention_dropout,
    rng=attend_rng,
  )
  out = jnp.matmul(o, w_o)[:1]
  return ea.apply_broadcasted_dropout(out, self._output_dropout, output_rng)


def _local_incremental_forward_unbatched(self, x, mask=None, **kwargs):
  """`SelfAttention`'s predict step, seeing only what training saw.

  Trax's chunked (local) `SelfAttention` attends within a chunk and the
  `n_chunks_before` before it in training, but its predict mode attends
  to the whole memory: a local block of a mixed model would read, while
  chatting, thousands of tokens it never learned to weigh. Here the
  predict step keeps the training window: one token at a time through
  `local_one_token_step`, longer feeds through Trax's step with
  `window_mask`. Unchunked (full) attention is untouched.
  """
  if not self._chunk_len:
    return _ORIGINAL_LOCAL(self, x, mask, **kwargs)
  if kwargs['q_len'] == 1 and mask is None and not self._bias:
    out = local_one_token_step(
      self,
      x,
      q_start=kwargs['q_start'],
      weights=kwargs['weights'],
      rng=kwargs['rng'],
    )
    return out, kwargs['state']
  windowed = functools.partial(
    window_mask,
    chunk_len=int(self._chunk_len),
    n_chunks_before=int(self._n_chunks_before),
  )
  ea.mask_self_attention = windowed  # Read by Trax's step as it is traced.
  try:
    return _ORIGINAL_LOCAL(self, x, mask, **kwargs)
  finally:
    ea.mask_self_attention = _TRAX_MASK


DIRECTED = '_jade_directed'  # Set on LSH layers by model.reformer_lm.
# Set on attention layers by model.reformer_lm (`residual.zero_attention`).
ZERO_OUTPUT = '_jade_zero_output'
_ORIGINAL_WEIGHTS = ea.LSHSelfAttention.create_weights_unbatched
_ORIGINAL_LOCAL_WEIGHTS = ea.SelfAttention.create_weights_unbatched
_ORIGINAL_FORWARD = ea.LSHSelfAttention.forward_unbatched


def _directed(q, k_unit, a, b):
  """Queries and keys for `attend` (which divides keys by the square root
  of their width) whose dot product is Trax's shared score `|q| cos`
  plus a directed one, `a . b / sqrt(d)`.

  Args:
    q: `[n, d]` shared queries. k_unit: `[m, d]` their keys as Trax makes
      them (`length_normalized`: length sqrt(d)). a: `[n, d]`. b: `[m, d]`.
  """
  scale = jnp.sqrt(jnp.asarray(2.0, q.dtype))
  return jnp.concatenate([q, a], -1), scale * jnp.concatenate([k_unit, b], -1)


def output_index(layer) -> int:
  """Where `w_o` is in an attention head's weights, Trax's order
  `w_q, [w_k,] w_v, w_o, ...` (`w_k` only without shared queries/keys)."""
  return 2 if layer._share_qk else 3


def zero_output(self, weights):
  """One head's `weights` with the output projection `w_o` zero where the
  layer is marked `ZERO_OUTPUT`: the head then adds nothing until it has
  learned to."""
  if not getattr(self, ZERO_OUTPUT, False):
    return weights
  at = output_index(self)
  return (*weights[:at], jnp.zeros_like(weights[at]), *weights[at + 1 :])


def _local_create_weights_unbatched(self, input_signature, rng):
  """Trax's weights of one local or full attention head (`zero_output`)."""
  weights = _ORIGINAL_LOCAL_WEIGHTS(self, input_signature, rng)
  return zero_output(self, weights)


def _create_weights_unbatched(self, input_signature, rng):
  """Trax's weights of one head (`zero_output`), plus `w_a` and `w_b` when
  directed."""
  weights = zero_output(self, _ORIGINAL_WEIGHTS(self, input_signature, rng))
  if not getattr(self, DIRECTED, False):
    return weights
  if isinstance(input_signature, (tuple, list)):
    input_signature = input_signature[0]
  shape = (input_signature.shape[-1], self._d_qk)
  rng_a, rng_b = fastmath.random.split(fastmath.random.split(rng, 5)[4])
  w_a = self._kernel_initializer(shape, rng_a)
  w_b = self._kernel_initializer(shape, rng_b)
  return (*weights, w_a, w_b)


def _forward_unbatched(self, x, mask=None, *, weights, **kwargs):
  """LSH attention whose in-bucket score has a directed term.

  LSH shares queries and keys: a score is `|q_i| cos(q_i, q_j)`, so a head
  finds what resembles its query, never a different thing it needs ("the
  word after Repeat"; BENCHMARKS.md, "Why LSH did not learn"). A directed
  layer hashes, sorts and chunks exactly as Trax does (the buckets still
  group similar positions, and are learned through the shared term), and
  scores a pair in view with `|q_i| cos(q_i, q_j) + a_i . b_j / sqrt(d)`,
  `a = x w_a`, `b = x w_b`: a query and a key projection of its own.
  """
  if not getattr(self, DIRECTED, False):
    return lsh_forward(self, x, mask, weights=weights, **kwargs)
  w_q, w_v, w_o, w_a, w_b = weights
  a, b = jnp.matmul(x, w_a), jnp.matmul(x, w_b)

  def directed_attend(q, k=None, v=None, **kw):
    at = kw['q_info']  # The positions of `q`'s rows, as sorted.
    q, k = _directed(q, ea.length_normalized(q), a[at], b[at])
    kw['kv_chunk_len'] = kw['q_chunk_len']
    if kw.get('kv_info') is None:
      kw['kv_info'] = at
    return ea.attend(q, k, v, **kw)

  return lsh_forward(
    self, x, mask, weights=(w_q, w_v, w_o), attend=directed_attend, **kwargs
  )


def lsh_forward(
  self, x, mask=None, *, weights, state, rng, update_state, attend=None
):
  """Trax 1.4.1's `LSHSelfAttention.forward_unbatched`, the same
  computation, with a cheaper sort: `[length, d]` -> `([length, d],
  state)`.

  Trax sorts `(bucket, position)` keys carrying their indices along
  (`sort_key_val`), then sorts again to invert the permutation. The keys
  are distinct and hold the position (`key % length`), and the hash
  rounds' buckets do not overlap (round r's start at r * n_buckets), so
  sorted slot i belongs to round `i // length`: sorting the keys alone
  gives the same permutation, and a scatter inverts it (~2 ms per head
  at 32k positions instead of ~13.6); the logits' sort is undone by a
  gather, as the outputs' are. `attend` replaces Trax's `attend` (the
  directed score).
  """
  attend = attend or ea.attend
  attend_rng, output_rng = fastmath.random.split(rng)
  w_q, w_v, w_o = weights

  q = jnp.matmul(x, w_q)
  v = jnp.matmul(x, w_v)

  if update_state:
    _, old_hash_rng = state
    hash_rng, hash_subrng = fastmath.random.split(old_hash_rng)
    buckets = self.hash_vectors(q, hash_subrng, mask)
    s_buckets = buckets
    if self._max_length_for_buckets:
      length = self._n_hashes * self._max_length_for_buckets
      if buckets.shape[0] < length:
        s_buckets = jnp.concatenate(
          [buckets, jnp.zeros(length - buckets.shape[0], dtype=jnp.int32)],
          axis=0,
        )
    state = (s_buckets, hash_rng)
  else:
    buckets, _ = state
    if self._max_length_for_buckets:
      buckets = buckets[: self._n_hashes * x.shape[0]]

  seqlen = x.shape[0]
  if int(buckets.shape[0]) != self._n_hashes * seqlen:
    raise ValueError(
      f'LSH state holds {buckets.shape[0]} buckets for {seqlen} positions '
      f'and {self._n_hashes} hash rounds; build the layer for this length.'
    )

  ticker = jnp.arange(self._n_hashes * seqlen, dtype=jnp.int32)
  buckets_and_t = seqlen * buckets + (ticker % seqlen)
  buckets_and_t = jax.lax.stop_gradient(buckets_and_t)

  # Hash-based sort ("s" at the start of variable names means "sorted").
  sbuckets_and_t = jax.lax.sort(buckets_and_t)
  sticker = (ticker // seqlen) * seqlen + sbuckets_and_t % seqlen
  undo_sort = jnp.zeros_like(ticker).at[sticker].set(ticker)
  sticker = jax.lax.stop_gradient(sticker)
  undo_sort = jax.lax.stop_gradient(undo_sort)

  st = sticker % seqlen
  sq = jnp.take(q, st, axis=0)
  sv = jnp.take(v, st, axis=0)

  mask_fn = functools.partial(
    ea.mask_self_attention,
    causal=self._causal,
    exclude_self=True,
    masked=self._masked,
  )
  q_info = st

  kv_info = None
  if self._masked:
    # mask is a boolean array (True means "is valid token")
    smask = jnp.take(mask, st, axis=0)
    ones_like_mask = jnp.ones_like(smask, dtype=jnp.int32)
    kv_info = q_info * jnp.where(smask, ones_like_mask, -ones_like_mask)

  so, slogits = attend(
    sq,
    k=None,
    v=sv,
    q_chunk_len=self._chunk_len,
    n_chunks_before=self._n_chunks_before,
    n_chunks_after=self._n_chunks_after,
    mask_fn=mask_fn,
    q_info=q_info,
    kv_info=kv_info,
    dropout=self._attention_dropout,
    rng=attend_rng,
  )

  # Trax undoes the logits' sort with another sort; a gather is the same
  # permutation.
  o = ea.permute_via_gather(so, undo_sort, sticker, axis=0)
  logits = ea.permute_via_gather(slogits, undo_sort, sticker, axis=0)

  if self._n_hashes > 1:
    o = jnp.reshape(o, (self._n_hashes, seqlen, o.shape[-1]))
    logits = jnp.reshape(logits, (self._n_hashes, seqlen, 1))
    probs = jnp.exp(logits - fastmath.logsumexp(logits, axis=0, keepdims=True))
    o = jnp.sum(o * probs, axis=0)

  out = jnp.matmul(o, w_o)
  out = ea.apply_broadcasted_dropout(out, self._output_dropout, output_rng)
  return out, state


def install():
  """Routes LSH attention's one-token predict step through `select_kv`;
  local attention's predict step keeps its training window."""
  ea.LSHSelfAttention._incremental_forward_unbatched = (
    _incremental_forward_unbatched
  )
  ea.SelfAttention._incremental_forward_unbatched = (
    _local_incremental_forward_unbatched
  )
  ea.SelfAttention._use_predict_mem = _use_predict_mem
  ea.LSHSelfAttention._use_predict_mem = _use_predict_mem
  ea.LSHSelfAttention.forward_and_or_backward = _forward_and_or_backward
  ea.LSHSelfAttention.create_weights_unbatched = _create_weights_unbatched
  ea.SelfAttention.create_weights_unbatched = _local_create_weights_unbatched
  ea.LSHSelfAttention.create_state_unbatched = _create_state_unbatched
  ea.LSHSelfAttention.forward_unbatched = _forward_unbatched
  ea.hash_vecs = _hash_vecs
  pe.AxialPositionalEncoding.forward = _axial_forward


def uninstall():
  """Restores Trax's sorting step (for comparisons)."""
  ea.LSHSelfAttention._incremental_forward_unbatched = _ORIGINAL
  ea.SelfAttention._incremental_forward_unbatched = _ORIGINAL_LOCAL
  ea.SelfAttention._use_predict_mem = _ORIGINAL_LOCAL_MEM
  ea.LSHSelfAttention._use_predict_mem = _ORIGINAL_MEM
  ea.LSHSelfAttention.forward_and_or_backward = _ORIGINAL_FAB
  ea.LSHSelfAttention.create_weights_unbatched = _ORIGINAL_WEIGHTS
  ea.SelfAttention.create_weights_unbatched = _ORIGINAL_LOCAL_WEIGHTS
  ea.LSHSelfAttention.create_state_unbatched = _ORIGINAL_STATE
  ea.LSHSelfAttention.forward_unbatched = _ORIGINAL_FORWARD
  ea.hash_vecs = _TRAX_HASH_VECS
  pe.AxialPositionalEncoding.forward = _ORIGINAL_AXIAL
