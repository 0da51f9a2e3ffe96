"""A block of new tokens read after a predict-mode memory in one call.

The chat decoder (`src.inference.decoding.Decoder`) reads a conversation,
and each follow-up message after a kept one, as blocks of a fixed number of
tokens at any position. Each token of a block attends to exactly what it
would attend to if it were fed alone: the same LSH candidates (bucket
index and window, `decode_select.select_indexed`), read from the key cache,
and the same local window; only the arithmetic is shared, all of the
block's tokens at once. Training reads a window differently (buckets sorted
over the window); Trax's predict mode could read a block only at position 0
and then only that way.

A block's last tokens may be padding (a message rarely fills one): the
decoder says how many are real (`decode_state.BlockRead`, the call's
state); only those move the layer's position and enter the bucket index.
What the padding wrote past them is overwritten by what comes next, and no
read looks there (causal masks; `select_indexed` reads no bucket from the
query's position on). The decoder never lets a block run past the memory.
"""

from __future__ import annotations

import functools

import jax
from jax import numpy as jnp
from trax import fastmath
from trax.layers.research import efficient_attention as ea

from src.model import (
  decode_index,
  decode_keys,
  decode_select,
  decode_state,
  lsh_hash,
  memory_attention,
)
from src.model.decode_state import LSHState, Memory

TRAX_MASK = ea.mask_self_attention  # Trax's, before anyone wraps it.


def window_mask(dots, q_info, kv_info, *, chunk_len, n_chunks_before, **kw):
  """Trax's self-attention mask plus the local window training used.

  Chunked `SelfAttention` in training lets a query in chunk c see chunks
  c - n_chunks_before .. c. `attend` numbers positions from 1.
  """
  dots = TRAX_MASK(dots, q_info, kv_info, **kw)
  q = q_info.astype(jnp.int32) - 1
  k = kv_info.astype(jnp.int32) - 1
  first = (q // chunk_len - n_chunks_before) * chunk_len
  return dots - 1e9 * (k < first).astype(dots.dtype)


def append(mem, x, mem_end):
  """The layer's memory of inputs (Trax's: a tuple of one `[batch, mem,
  d]`) with the block `x` written from `mem_end`."""
  (inputs,) = mem
  return (
    jax.lax.dynamic_update_slice_in_dim(
      inputs, x.astype(inputs.dtype), mem_end, axis=1
    ),
  )


def lsh_block(self, x, weights, state, rng, n):
  """A block of tokens through a whole LSH layer with a bucket index and a
  key cache (`decode_index.create_state`).

  Args:
    x: `[batch, length, d_model]` the block's inputs.
    state: a `Memory` whose heads are an `LSHState`, each entry stacked
      `[batch * n_heads, ...]`.
    n: How many of the block's tokens are real (a traced int).

  Returns:
    `(out [batch, length, d_model], new_state)`.
  """
  del rng  # Dropout is off outside training.
  memory = Memory.of(state)
  s = LSHState.of(memory.heads)
  batch = x.shape[0]
  q_start = memory.mem_end
  # The block into the memory of inputs first, then its rows before read
  # from it (the same: the block writes from q_start on): a read of the
  # memory as it was, beside a write in place, made XLA copy the 32k
  # memory twice a block.
  mem = append(memory.mem, x, q_start)
  before = self.key_context(mem[0], x, q_start)
  q, qb, parts = decode_state.each_head(
    functools.partial(_project, self),
    (x, before),
    weights,
    decode_state.by_example(s.rotations, batch, self._n_heads),
  )
  # Each token's own entries first (a later token of the block reads
  # them; `select_indexed` reads no bucket from the token's position on).
  buckets = _write_block_buckets(
    self, s.buckets, decode_state.flat(qb), q_start
  )
  own = decode_index.own_buckets(self, decode_state.flat(qb))
  x_q = self.query_rows(mem[0], x, q_start)
  out, keys = _attend_and_write(
    self, x_q, weights, (q, qb, parts), s, (own, buckets), q_start
  )

  def write(i, index):
    return decode_index.write_index(*index, own[:, i], q_start + i)

  ring, counts = jax.lax.fori_loop(0, n, write, (s.ring, s.counts))
  new = s._replace(
    buckets=jnp.reshape(buckets, s.buckets.shape),
    buckets_idx=jnp.full_like(s.buckets_idx, q_start + n),
    ring=ring,
    counts=counts,
    keys=keys,
  )
  new_memory = Memory(q_start + n, mem, new)
  return out, new_memory.plain()


def _attend_and_write(self, x_q, weights, heads, s, index, q_start):
  """A block's attention (`[batch, length, d_model]`, summed over heads)
  and the key cache with its keys written (`heads`: the block's queries,
  buckets and `_key_parts` by head; `index`: its own buckets and the
  buckets written): by the fused kernel, which writes them, where every
  key up to each query is kept (`memory_attention`), else
  `_attend_all` after `decode_keys.write_keys`."""
  q, qb, parts = heads
  own, buckets = index
  if memory_attention.applies(self, s.keys):
    positions = q_start + jnp.arange(x_q.shape[1], dtype=jnp.int32)
    out, keys = memory_attention.attend(
      self, x_q, weights, q, parts, s.keys, positions
    )
    return out.astype(x_q.dtype), keys
  keys = decode_keys.write_keys(s.keys, decode_state.flat(parts), q_start)
  out = _attend_all(
    self, x_q, weights, q, qb, s.ring, own, buckets, keys, q_start
  )
  return out, keys


def _project(self, rows, w_h, turns_h):
  """One head's queries, buckets (`[length, n_hashes]`) and `_key_parts` of
  a block's rows (`rows`: the rows and their predecessors)."""
  x_b, before = rows
  q = jnp.matmul(x_b, self.weight(w_h, 'q'))
  hashed = lsh_hash.hash_rounds(q, turns_h, self._n_buckets)
  length = x_b.shape[0]
  qb = jnp.transpose(jnp.reshape(hashed, (self._n_hashes, length)))
  return q, qb, self._key_parts(x_b, w_h, before)


def _write_block_buckets(self, buckets, qb, q_start):
  """The buckets (`[batch * heads, n_hashes * mem]`) with a block's `qb`
  (`[batch * heads, length, n_hashes]`) written from `q_start`:
  `[batch * heads, n_hashes, mem]`."""
  rows = buckets.shape[0]
  buckets = jnp.reshape(buckets, (rows, self._n_hashes, -1))
  return jax.lax.dynamic_update_slice(
    buckets,
    jnp.transpose(qb, (0, 2, 1)).astype(buckets.dtype),
    (0, 0, q_start),
  )


def _attend_all(self, x, weights, q, qb, ring, own, buckets, keys, q_start):
  """Every head's attention of each of a block's tokens over its own
  candidates (bucket index and window, `decode_select.select_indexed`),
  summed over heads: `[batch, length, d_model]`."""
  batch, length = x.shape[:2]
  heads, n_hashes = self._n_heads, self._n_hashes
  mem_len = keys.shape[1]
  n_keep = min(decode_select.keep_count(self), mem_len)
  positions = q_start + jnp.arange(length, dtype=jnp.int32)
  if decode_select.reads_memory(self, mem_len):
    return _attend_memory_all(
      self, x, weights, (q, qb, positions), buckets, keys, n_keep
    )
  # The rings as they were before the block: its own tokens are in every
  # query's window (length < 2 n_keep), and what the block would have
  # pushed out of a ring had n_keep newer positions of its bucket.
  h = jnp.arange(batch * heads)[:, None, None]
  lists = ring[h, jnp.arange(n_hashes)[None, None, :], own]

  def select(buckets_h, qb_i, lists_i, at):
    return decode_select.select_indexed(buckets_h, qb_i, lists_i, at, n_keep)

  def head(x_b, w_h, per):
    kv = jax.vmap(select, in_axes=(None, 0, 0, 0))(
      per['buckets'], per['qb'], per['lists'], positions
    )
    parts = per['keys'][kv]
    return attend_block(self, x_b, per['q'], positions, kv, parts, w_h)

  def example(a):
    return decode_state.by_example(a, batch, heads)

  per = dict(q=q, qb=qb, lists=example(lists), buckets=example(buckets),
             keys=example(keys))  # fmt: skip
  out = decode_state.each_head(head, x, weights, per)
  return jnp.sum(out, axis=1).astype(x.dtype)  # Over heads.


def _attend_memory_all(self, x, weights, queries, buckets, keys, n_keep):
  """`_attend_all` for a layer that `reads_memory`: each token's
  candidates (`queries`: the block's `q`, `qb` and positions) as a mask
  over the key cache (`decode_select.keep_mask`), read with one product
  per head from the part of it the block can reach
  (`decode_keys.attend_filled`)."""
  batch = x.shape[0]
  q, qb, positions = queries

  def head(x_b, w_h, per):
    return decode_keys.attend_filled(
      self, x_b, per['q'], positions, per['buckets'], per['qb'], n_keep,
      per['keys'], w_h,
    )  # fmt: skip

  def example(a):
    return decode_state.by_example(a, batch, self._n_heads)

  per = dict(q=q, qb=qb, buckets=example(buckets), keys=example(keys))
  out = decode_state.each_head(head, x, weights, per)
  return jnp.sum(out, axis=1).astype(x.dtype)  # Over heads.


def attend_block(self, x_rows, q, positions, kv, parts, weights):
  """`decode_keys.attend_parts` for all of a block's tokens at once, one
  head: each query (`q`, `[length, d_qk]`, at `positions`) over its own
  candidates `kv` (`[length, n]`), whose keys and values are `parts`
  (`[length, n, width]`): `[length, d_model]`. (Dropout is off outside
  training.)"""
  dots = self._block_scores(q, parts, x_rows, weights)
  dots = ea.mask_self_attention(
    dots, positions[:, None], kv, causal=True, exclude_self=True, masked=True
  )
  if self._far_keys:  # Of the far candidates, the best (`read_far`).
    dots = decode_keys.best_far(self, dots, positions[:, None], kv)
  dots = jnp.exp(dots - fastmath.logsumexp(dots, axis=-1, keepdims=True))
  d = self._d_qk
  o = jnp.sum(dots[..., None] * parts[..., d : d + self._d_v], 1)
  return jnp.matmul(o, self.weight(weights, 'o'))


def local_window(self, x, q_start, length: int, weights, rng):
  """One head of a chunked local attention layer: the `length` positions
  of the memory `x` (`[mem, d]`) from `q_start`, each over the window
  training gave it (`window_mask`), read from one fixed-size slice:
  `[length, d_model]`."""
  attend_rng, output_rng = fastmath.random.split(rng)
  w_q, w_o = self.weight(weights, 'q'), self.weight(weights, 'o')
  mem_len = x.shape[0]
  chunk, before = int(self._chunk_len), int(self._n_chunks_before)
  size = min(chunk * (1 + before) + length - 1, mem_len)
  first = jnp.maximum((q_start // chunk - before) * chunk, 0)
  start = jnp.minimum(first, mem_len - size)
  window = fastmath.dynamic_slice_in_dim(x, start, size, axis=0)
  rows = fastmath.dynamic_slice_in_dim(x, q_start, length, axis=0)
  at = q_start + jnp.arange(length, dtype=jnp.int32)
  if length == 1:  # Trax duplicates a lone query row (matmul rounding).
    rows, at = jnp.concatenate([rows] * 2, 0), jnp.concatenate([at] * 2)
  q = jnp.matmul(rows, w_q)
  preceding = None
  if self._smeared:  # The window's predecessors, from the memory.
    preceding = decode_state.rows_before(x, window, start)
  k = local_keys(self, window, weights, preceding)
  mask_fn = local_mask(self, causal=True, masked=False)
  o, _ = ea.attend(
    q,
    k,
    self._values(window, weights, preceding),
    mask_fn=mask_fn,
    q_info=at,
    kv_info=(start + jnp.arange(size)).astype(jnp.int32),
    dropout=self._attention_dropout,
    rng=attend_rng,
  )
  out = jnp.matmul(o, w_o)[:length]
  return ea.apply_broadcasted_dropout(out, self._output_dropout, output_rng)


def local_block(self, x, weights, state, rng, n):
  """A block of tokens (`n` of them real) through a chunked local attention
  layer, each token over the window `local_window` gives it: `(out [batch,
  length, d_model], new_state)`."""
  memory = Memory.of(state)
  length = x.shape[1]
  mem = append(memory.mem, x, memory.mem_end)

  def head(x_b, w_h, _):
    return local_window(self, x_b, memory.mem_end, length, w_h, rng)

  none = jnp.zeros((x.shape[0], self._n_heads))
  out = decode_state.each_head(head, mem[0], weights, none)
  out = jnp.sum(out, axis=1).astype(x.dtype)  # Over heads.
  return out, Memory(memory.mem_end + n, mem, memory.heads).plain()


def windowed_step(
  self, x, *, q_start, q_len, weights, state, rng, update_state
):
  """Trax 1.4.1's `SelfAttention` predict step of `q_len` tokens from
  `q_start` (`x`: `[mem, d]`, one head), the same computation, masked to
  the local window training used (`window_mask`): `[q_len, d_model]`."""
  del state, update_state
  attend_rng, output_rng = fastmath.random.split(rng)
  w_q, w_o = self.weight(weights, 'q'), self.weight(weights, 'o')
  q_range = q_start + jnp.arange(q_len, dtype=jnp.int32)
  if q_len == 1:  # Trax duplicates a lone query row (matmul rounding).
    q = jnp.matmul(jnp.concatenate([x[q_range]] * 2, 0), w_q)
  else:
    q = jnp.matmul(x[q_range], w_q)
  before = decode_state.shifted(x)
  k = local_keys(self, x, weights, before)
  mask_fn = local_mask(self, causal=self._causal, masked=self._masked)
  chunks = {}
  if q_len > self._chunk_len:  # Trax's: only at the start of a context.
    chunks = dict(
      q_chunk_len=self._chunk_len,
      kv_chunk_len=self._chunk_len,
      n_chunks_before=self._n_chunks_before,
      n_chunks_after=self._n_chunks_after,
    )
  o, _ = ea.attend(
    q, k, self._values(x, weights, before),
    mask_fn=mask_fn, q_info=q_range,
    kv_info=jnp.arange(k.shape[-2], dtype=jnp.int32),
    dropout=self._attention_dropout, rng=attend_rng, **chunks,
  )  # fmt: skip
  out = jnp.matmul(o, w_o)
  if q_len == 1:
    out = out[:1]
  return ea.apply_broadcasted_dropout(out, self._output_dropout, output_rng)


def local_keys(self, x, weights, x_before=None):
  """A local layer's keys of the rows `x`: its queries' (as Trax makes
  shared ones) or its own, smeared with their predecessors' `x_before`
  where the layer smears them (`smeared.SmearedLocalSelfAttention`)."""
  if self._share_qk:
    return ea.length_normalized(jnp.matmul(x, self.weight(weights, 'q')))
  k = jnp.matmul(x, self.weight(weights, 'k'))
  if self._smeared:
    k = k + jnp.matmul(x_before, self.weight(weights, 's'))
  return k


def local_mask(self, causal: bool, masked: bool):
  """`attend`'s mask for a local layer's predict step: Trax's, within the
  window training used (`window_mask`)."""
  return functools.partial(
    window_mask,
    chunk_len=int(self._chunk_len),
    n_chunks_before=int(self._n_chunks_before),
    causal=causal,
    exclude_self=self._share_qk,
    masked=masked,
  )
