"""A block of new tokens read after a predict-mode memory in one call.

The chat decoder (`src.inference.decoding.Decoder`) reads a conversation,
and each follow-up message after a kept one, as blocks of a fixed number of
tokens at any position. Each token of a block attends to exactly what it
would attend to if it were fed alone: the same LSH candidates (bucket
index and window, `decode_cache.select_indexed`), read from the key cache,
and the same local window; only the arithmetic is shared, all of the
block's tokens at once. Training reads a window differently (buckets sorted
over the window); Trax's predict mode could read a block only at position 0
and then only that way.

A block's last tokens may be padding (a message rarely fills one): the
decoder says how many are real (`reading`, set while the block function is
traced); only those move the layer's position and enter the bucket index.
What the padding wrote past them is overwritten by what comes next, and no
read looks there (causal masks; `select_indexed` reads no bucket from the
query's position on). The decoder never lets a block run past the memory.
"""

from __future__ import annotations

import contextlib
import functools

import jax
from jax import numpy as jnp
from trax import fastmath
from trax.layers.research import efficient_attention as ea

from src.model import decode_cache, lsh_hash

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


@contextlib.contextmanager
def reading(layers, n=None, start: bool = False):
  """While a block function is traced: `layers` (attention and position
  layers) take `n` (a traced int) of the block's tokens as real; `start`:
  the block starts an empty context and is read as Trax reads one there
  (as training reads a window: buckets sorted over the block)."""
  for layer in layers:
    layer._block_valid, layer._block_start = n, start
  try:
    yield
  finally:
    for layer in layers:
      layer._block_valid, layer._block_start = None, False


def valid(layer, length: int):
  """The real tokens of a block of `length` (see `reading`)."""
  n = getattr(layer, '_block_valid', None)
  return length if n is None else n


def wants_block(self, inputs, update_state, compute_output, output_grad):
  """Whether a predict-mode attention call is a block of a chat decoder
  (`decode_cache.never_roll`): several new tokens, forward only."""
  one = not isinstance(inputs, (tuple, list))
  return (
    one
    and inputs.shape[-2] > 1
    and self._never_rolls
    and not getattr(self, '_block_start', False)
    and update_state
    and compute_output
    and output_grad is None
  )


def append(mem, x, mem_end):
  """The layer's memory of inputs (Trax's: a tuple of one `[batch, mem,
  d]`) with the block `x` written from `mem_end`."""
  (inputs,) = mem
  return (
    jax.lax.dynamic_update_slice_in_dim(
      inputs, x.astype(inputs.dtype), mem_end, axis=1
    ),
  )


def _per_head(fn, per_example, per_head, per_both):
  """`fn` over every example and head (as `decode_cache._each_head`)."""
  per_example_fn = jax.vmap(fn, in_axes=(None, 0, 0))
  return jax.vmap(per_example_fn, in_axes=(0, None, 0))(
    per_example, per_head, per_both
  )


def lsh_block(self, x, weights, state, rng):
  """A block of tokens through a whole LSH layer with a bucket index and a
  key cache (`decode_cache.create_state`).

  Args:
    x: `[batch, length, d_model]` the block's inputs.
    state: `(mem_end, mem, (buckets, buckets_idx, hash_rng, ring, counts,
      rotations, keys))`, the per-head entries stacked `[batch * n_heads,
      ...]`.

  Returns:
    `(out [batch, length, d_model], new_state)`.
  """
  mem_end, mem, per_head = state
  batch, length = x.shape[:2]
  heads, n_hashes = self._n_heads, self._n_hashes
  n = valid(self, length)
  q_start = mem_end
  buckets, buckets_idx, hash_rng, ring, counts, turns, keys = per_head
  mem_len = keys.shape[1]
  n_keep = min(decode_cache.keep_count(self), mem_len)
  positions = q_start + jnp.arange(length, dtype=jnp.int32)

  def by_example(a):
    return jnp.reshape(a, (batch, heads) + a.shape[1:])

  def flat(a):
    return jnp.reshape(a, (batch * heads,) + a.shape[2:])

  def project(x_b, w_h, turns_h):
    q = jnp.matmul(x_b, w_h[0])
    hashed = lsh_hash.hash_rounds(q, turns_h, self._n_buckets)
    qb = jnp.transpose(jnp.reshape(hashed, (n_hashes, length)))
    return q, qb, self._key_parts(x_b, w_h)

  q, qb, parts = _per_head(project, x, weights, by_example(turns))
  # Each token's own entries first (a later token of the block reads
  # them; `select_indexed` reads no bucket from the token's position on).
  keys = decode_cache.write_keys(keys, flat(parts), q_start)
  buckets = jnp.reshape(buckets, (batch * heads, n_hashes, mem_len))
  buckets = jax.lax.dynamic_update_slice(
    buckets,
    jnp.transpose(flat(qb), (0, 2, 1)).astype(buckets.dtype),
    (0, 0, q_start),
  )
  own = decode_cache.own_buckets(self, flat(qb))  # [heads, length, rounds]
  # The rings as they were before the block: its own tokens are in every
  # query's window (length < 2 n_keep), and what the block would have
  # pushed out of a ring had n_keep newer positions of its bucket.
  h = jnp.arange(batch * heads)[:, None, None]
  lists = ring[h, jnp.arange(n_hashes)[None, None, :], own]

  def select(buckets_h, qb_i, lists_i, at):
    return decode_cache.select_indexed(buckets_h, qb_i, lists_i, at, n_keep)

  def head(x_b, w_h, per):
    q_h, qb_h, lists_h, buckets_h, keys_h = per
    kv = jax.vmap(select, in_axes=(None, 0, 0, 0))(
      buckets_h, qb_h, lists_h, positions
    )
    return attend_block(self, x_b, q_h, positions, kv, keys_h[kv], w_h)

  per = (q, qb, by_example(lists), by_example(buckets), by_example(keys))
  out = _per_head(head, x, weights, per)
  out = jnp.sum(out, axis=1).astype(x.dtype)  # Over heads.

  def write(i, index):
    return decode_cache.write_index(*index, own[:, i], q_start + i)

  ring, counts = jax.lax.fori_loop(0, n, write, (ring, counts))
  buckets = jnp.reshape(buckets, (batch * heads, n_hashes * mem_len))
  buckets_idx = jnp.full_like(buckets_idx, q_start + n)
  per_head = (buckets, buckets_idx, hash_rng, ring, counts, turns, keys)
  return out, (mem_end + n, append(mem, x, mem_end), per_head)


def attend_block(self, x_rows, q, positions, kv, parts, weights):
  """`decode_cache.attend_parts` for all of a block's tokens at once, one
  head: each query (`q`, `[length, d_qk]`, at `positions`) over its own
  candidates `kv` (`[length, n]`), whose keys and values are `parts`
  (`[length, n, width]`): `[length, d_model]`. (Dropout is off outside
  training.)"""
  dots = self._block_scores(q, parts, x_rows, weights)
  dots = ea.mask_self_attention(
    dots, positions[:, None], kv, causal=True, exclude_self=True, masked=True
  )
  dots = jnp.exp(dots - fastmath.logsumexp(dots, axis=-1, keepdims=True))
  d = self._d_qk
  o = jnp.sum(dots[..., None] * parts[..., d : d + self._d_v], 1)
  return jnp.matmul(o, weights[2])


def local_window(self, x, q_start, length: int, weights, rng):
  """One head of a chunked local attention layer: the `length` positions
  of the memory `x` (`[mem, d]`) from `q_start`, each over the window
  training gave it (`window_mask`), read from one fixed-size slice:
  `[length, d_model]`."""
  attend_rng, output_rng = fastmath.random.split(rng)
  if self._share_qk:
    w_q, w_v, w_o = weights
  else:
    w_q, w_k, w_v, w_o = weights
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
  if self._share_qk:
    k = ea.length_normalized(jnp.matmul(window, w_q))
  else:
    k = jnp.matmul(window, w_k)
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
    jnp.matmul(window, w_v),
    mask_fn=mask_fn,
    q_info=at,
    kv_info=(start + jnp.arange(size)).astype(jnp.int32),
    dropout=self._attention_dropout,
    rng=attend_rng,
  )
  out = jnp.matmul(o, w_o)[:length]
  return ea.apply_broadcasted_dropout(out, self._output_dropout, output_rng)


def local_block(self, x, weights, state, rng):
  """A block of tokens through a chunked local attention layer, each token
  over the window `local_window` gives it: `(out [batch, length,
  d_model], new_state)`."""
  mem_end, mem, per_head = state
  length = x.shape[1]
  n = valid(self, length)
  mem = append(mem, x, mem_end)

  def head(x_b, w_h, _):
    return local_window(self, x_b, mem_end, length, w_h, rng)

  none = jnp.zeros((x.shape[0], self._n_heads))
  out = _per_head(head, mem[0], weights, none)
  out = jnp.sum(out, axis=1).astype(x.dtype)  # Over heads.
  return out, (mem_end + n, mem, per_head)
