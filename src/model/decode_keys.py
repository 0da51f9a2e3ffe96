"""The key cache of a predict-mode LSH layer, and attention over it.

Each position's keys and values (and directed key), as the layer's
`_key_parts` makes them, are kept in its predict state (`[mem, width]`,
`decode_state.LSHState.keys`), so a new token's candidates are read, not
projected again. `attend_parts` is Trax's one-token attention over given
candidates; `indexed_token` takes them from the bucket index
(`decode_select.select_indexed`) and the key cache.
"""

from __future__ import annotations

import functools

import jax
from jax import numpy as jnp
from trax import fastmath
from trax.layers.research import efficient_attention as ea

from src.model import decode_select


def write_keys(keys, parts, q_start):
  """The key cache `keys` (`[..., mem, width]`) with `parts` (`[...,
  n, width]`, new positions' `_key_parts`) written from `q_start` on, in
  place."""
  at = (0,) * (keys.ndim - 2) + (q_start, 0)
  return jax.lax.dynamic_update_slice(keys, parts.astype(keys.dtype), at)


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
  if self._far_keys:  # Of the far candidates, the best (`read_far`).
    causal = mask_fn

    def mask_fn(dots, q_info, kv_info):
      return best_far(self, causal(dots, q_info, kv_info), q_info, kv_info)

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
  out = jnp.matmul(o, self.weight(weights, 'o'))[:1]
  return ea.apply_broadcasted_dropout(out, self._output_dropout, output_rng)


# The key-cache prefixes a block of a layer that `reads_memory` reads (as
# shares of its memory): the shortest that holds every position its
# queries may rank, so a short conversation does not pay for the whole
# cache (32 tokens over a 32k cache: ~32 ms a block, whatever the
# position). A one-token step reads the whole cache: under a switch its
# key cache was copied, 3-4x the step's time (BENCHMARKS.md, "The
# lookup's temperature at chat time, where the walkthrough's step goes,
# and a long chat read today").
PREFIX_SHARES = (16, 4, 1)


def attend_filled(self, x_rows, q, positions, buckets, qb, n_keep, keys, w):
  """`attend_memory` over the candidates `decode_select.keep_mask` marks,
  read from the shortest prefix of the memory (`PREFIX_SHARES`) holding
  every position up to the last query's + 1 (all the ranking reads:
  positions after it are never kept). The same positions and scores as
  over the whole cache; only the sums' rounding may differ, and a block
  at the same positions always takes the same prefix.

  Args:
    x_rows, q, positions: a block's inputs, queries (`[length, d_qk]`)
      and positions (`[length]`, consecutive).
    buckets: `[n_hashes, mem]` each memory position's buckets.
    qb: `[length, n_hashes]` the queries' buckets.
    n_keep: candidates a token keeps (at most `mem`).
    keys: `[mem, width]` the key cache. w: one head's weights.
  """
  mem = keys.shape[0]
  sizes = sorted({max(1, mem // share) for share in PREFIX_SHARES})

  def over(size):
    def read(_):
      keep = jax.vmap(decode_select.keep_mask, in_axes=(None, 0, 0, None))(
        buckets[:, :size], qb, positions, n_keep
      )
      return attend_memory(self, x_rows, q, positions, keep, keys[:size], w)

    return read

  need = positions[-1] + 2  # The last query ranks up to its next position.
  index = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < need)
  return jax.lax.switch(index, [over(size) for size in sizes], None)


def attend_memory(self, x_rows, q, positions, keep, keys, weights):
  """Attention of a block's queries (`q`, `[length, d_qk]`, at
  `positions`; inputs `x_rows`) over the whole key cache `keys` (`[mem,
  width]`), each reading the positions `keep` marks (`[length, mem]`),
  one head, as `decode_block.attend_block` over gathered candidates:
  `[length, d_model]`. A wide layer's tokens read this way
  (`decode_select.reads_memory`)."""
  mem = keys.shape[0]
  # Not kept: a position after every query (the causal mask hides it).
  kv = jnp.where(keep, jnp.arange(mem, dtype=jnp.int32), mem)
  dots = self._memory_scores(q, keys, x_rows, weights)
  dots = ea.mask_self_attention(
    dots, positions[:, None], kv, causal=True, exclude_self=True, masked=True
  )
  if self._far_keys:  # Of the far keys kept, the best (`read_far`).
    dots = best_far(self, dots, positions[:, None], kv)
  dots = jnp.exp(dots - fastmath.logsumexp(dots, axis=-1, keepdims=True))
  d = self._d_qk
  o = jnp.matmul(dots, keys)[:, d : d + self._d_v]  # Whole width: no copy.
  return jnp.matmul(o, self.weight(weights, 'o'))


def best_far(self, dots, q_at, kv_at):
  """`dots` (`[..., length, n]`, masked scores of queries at positions
  `q_at` over keys at `kv_at`, both broadcast to `dots`) with the keys
  more than the layer's `_far_from` positions before their query masked
  as Trax masks (-1e9), all but its `_far_keys` that score best (ties at
  the last score all kept; a chat's `read_far`). The last best score is
  found by a pass of a maximum a key (XLA's CPU top-k is a sort: ~10x a
  read of 27k keys)."""
  far = kv_at < q_at - self._far_from
  scores = jnp.where(far, dots, -jnp.inf)

  def below(_, top):
    return jnp.max(jnp.where(scores < top, scores, -jnp.inf), -1, keepdims=True)

  top = jnp.full(dots.shape[:-1] + (1,), jnp.inf, dots.dtype)
  nth = jax.lax.fori_loop(0, self._far_keys, below, top)
  return jnp.where(far & (scores < nth), dots - 1e9, dots)


def attend_selected(self, x, q, q_start, kv_indices, weights, rng):
  """`attend_parts` for a memory without a key cache: the candidates'
  keys and values projected from the memory `x` (`[mem, d]`)."""
  x_q = self.query_rows(x, x[q_start + jnp.arange(1, dtype=jnp.int32)], q_start)
  parts = self._key_parts(
    x[kv_indices], weights, self.selected_context(x, kv_indices)
  )
  return attend_parts(self, x_q, q, q_start, kv_indices, parts, weights, rng)


def indexed_token(
  self, x_q, *, q_start, weights, q, qb, buckets, lists, keys, rng
):
  """One head's attention of the newest token through the bucket index
  (the token already written into it, `write_index`) and the key cache
  (its own entry written, `write_keys`).

  Args:
    x_q: `[1, d]` the token's input.
    q, qb: the token's query and buckets (`decode_select.query_buckets`).
    buckets: `[n_hashes * mem]` each position's buckets (read only
      before `q_start`).
    lists: `[n_hashes, n_keep]` the rings of the token's buckets.
    keys: `[mem, width]` the key cache.

  Returns:
    `[1, d_v]`: Trax's one-token step over the positions its sort keeps
    (a layer that `reads_memory` reads them from the whole key cache,
    the others masked: the same result, to rounding).
  """
  mem = keys.shape[0]
  all_buckets = jnp.reshape(buckets, (self._n_hashes, mem))
  n_keep = min(decode_select.keep_count(self), mem)
  if decode_select.reads_memory(self, mem):  # The same positions, masked.
    keep = decode_select.keep_mask(all_buckets, qb, q_start, n_keep)
    at = jnp.reshape(q_start, (1,)).astype(jnp.int32)
    return attend_memory(self, x_q, q[:1], at, keep[None], keys, weights)
  kv_indices = decode_select.select_indexed(
    all_buckets, qb, lists, q_start, n_keep
  )
  parts = keys[kv_indices]
  return attend_parts(self, x_q, q, q_start, kv_indices, parts, weights, rng)
