"""Jade V8's attention layers: Trax's, as classes with our changes.

Trax keeps every attention as a class with override points
(`trax/layers/research/efficient_attention.py`); `ReformerLM` takes the
classes from `ReformerLM.attention_type`, and gin/*.gin name these:

- `LocalSelfAttention`: Trax's `SelfAttention` whose predict mode keeps
  the window it was trained with (a chunked layer attends within its chunk
  and the `n_chunks_before` before it, while chatting too).
- `FastLSHSelfAttention`: Trax's `LSHSelfAttention`, the same outputs,
  buckets and gradients (pinned by tests/test_attention.py), faster: the
  buckets' argmax is a scan over the rotations (`lsh_hash`), the hash sort
  sorts its keys alone (`lsh_forward`), and a token of the chat decoder
  goes through the bucket index of `decode_cache`.
- `DirectedLSHSelfAttention`: that, with a directed term in the score
  (`|q_i| cos(q_i, q_j) + a_i . b_j / sqrt(d)`, two more projections per
  head): LSH that can find the different thing it needs, not only what
  resembles its query (BENCHMARKS.md, "Why LSH did not learn").

The smeared classes (keys and values that see the positions before) are
`src.model.smeared`'s, subclasses of these; `key_context` and
`query_rows` are what they widen. In training and evaluation each
attends through `chunk_attention.attend` (Trax's `attend`, fused into
one CPU kernel where it applies). Each reads its settings from Trax's gin
names (`SelfAttention.chunk_len`, ...), as a subclass of the registered
class; starts with its output projections at zero where asked
(`start_at_zero`); and its chat-decoder calls take the path
`decode_cache.route` chooses.
"""

from __future__ import annotations

import functools

import jax
from jax import numpy as jnp
from trax import fastmath
from trax import layers as tl
from trax.layers.research import efficient_attention as ea

from src.model import (
  chunk_attention,
  decode_block,
  decode_cache,
  decode_index,
  decode_state,
  gather_rows,
  heads,
  lsh_hash,
)
from src.model.decode_state import shifted, unwrap


def settings_name(cls) -> str:
  """The Trax class whose gin bindings `cls` reads (`LSHSelfAttention`
  for ours), or the class's own name."""
  for c in cls.__mro__:
    if c.__module__.startswith('trax.'):
      return c.__name__
  return cls.__name__


def weight_roles(layer) -> tuple[str, ...]:
  """The roles of an attention head's weights, in Trax's order: `q`
  (queries; also the keys where they are shared), `k` (keys, only where
  not shared), `v`, `o` (the output projection), then what a class adds
  (`a`, `b`: the directed score's). The one place that knows the order:
  every reader asks `layer.weight(weights, role)`."""
  shared = ('q', 'v', 'o') if layer._share_qk else ('q', 'k', 'v', 'o')
  return shared + tuple(getattr(layer, 'EXTRA_ROLES', ()))


def zero_output(layer, weights):
  """One head's `weights` with the output projection `w_o` zero where the
  layer starts at zero (`start_at_zero`): the head then adds nothing
  until it has learned to."""
  if not layer._zero_output:
    return weights
  return tuple(
    jnp.zeros_like(w) if role == 'o' else w
    for role, w in zip(weight_roles(layer), weights)
  )


def directed_qk(q, k_unit, a, b):
  """Queries and keys for `attend` (which divides keys by the square root
  of their width) whose dot product is Trax's shared score `|q| cos`
  plus a directed one, `a . b / sqrt(d)`.

  Args:
    q: `[n, d]` shared queries. k_unit: `[m, d]` their keys as Trax makes
      them (`length_normalized`: length sqrt(d)). a: `[n, d]`. b: `[m, d]`.
  """
  scale = jnp.sqrt(jnp.asarray(2.0, q.dtype))
  return jnp.concatenate([q, a], -1), scale * jnp.concatenate([k_unit, b], -1)


class _Ours:
  """What each of our attention classes adds to Trax's: the output
  projections may start at zero (`start_at_zero`, called by
  `model.reformer_lm`), weights are read by role (`weight`), and a chat
  decoder's calls take the paths `decode_cache.route` chooses."""

  _zero_output = False
  _never_rolls = False
  _smeared = False  # Keys and values see the position before (`Smeared...`).
  _keeps_activations = False  # See `keep_activations`.

  def start_at_zero(self):
    """The output projections start at zero when the layer is initialized."""
    self._zero_output = True

  def keep_activations(self):
    """No custom backward (which runs the forward again): JAX
    differentiates it (a kept block of `reversible.KeptSerial`)."""
    self._keeps_activations = True

  @property
  def has_backward(self):
    return super().has_backward and not self._keeps_activations

  def never_roll(self):
    """The chat decoder's layer: its memory never rolls (see
    `decode_cache`)."""
    self._never_rolls = True

  def weight(self, weights, role: str):
    """One head's weight of `role` (see `weight_roles`)."""
    return weights[weight_roles(self).index(role)]

  def key_context(self, mem, x, start):
    """What the keys of the rows `x` (at positions `start`...) read of the
    positions before them (`_key_parts`' `x_before`): the row before each
    (from the memory of inputs `mem`; None: nothing stands before `x`). A
    class whose keys read more widens it (`smeared.ContextLSHSelfAttention`)."""
    if mem is None:
      return shifted(x)
    return decode_state.rows_before(mem, x, start)

  def selected_context(self, x, kv_indices):
    """`key_context` of the memory rows `kv_indices` of `x` (`[mem, d]`,
    one head; a memory that may roll, where index 0 has nothing before)."""
    return jnp.where(
      (kv_indices > 0)[:, None], x[jnp.maximum(kv_indices - 1, 0)], 0
    )

  def query_rows(self, mem, x, start):
    """What the queries of the rows `x` read (`x_q` of `_cached_qkv`,
    `_block_scores`, `_memory_row`): the rows themselves here."""
    del mem, start
    return x

  def _values(self, x, weights, x_before):
    """One head's values of the rows `x`: `x w_v`, plus their
    predecessors' `x_before w_u` where the layer smears them."""
    v = jnp.matmul(x, self.weight(weights, 'v'))
    if self._smeared:
      v = v + jnp.matmul(x_before, self.weight(weights, 'u'))
    return v

  def create_weights_unbatched(self, input_signature, rng):
    weights = super().create_weights_unbatched(input_signature, rng)
    return zero_output(self, weights)

  def heads_at_once(self) -> bool:
    """Whether `forward_unbatched` can stop before the output projection
    (`project_output=False`), so that `heads` projects all heads at once."""
    return False

  def _use_predict_mem(self, inputs, state):
    return decode_cache.use_predict_mem(
      self, inputs, state, super()._use_predict_mem
    )

  def forward_and_or_backward(self, inputs, weights, state, rng, **kwargs):
    """Trax's, except where `decode_cache.route` chooses a chat decoder's
    path: a block (`_read_block`) or an indexed token
    (`decode_cache.indexed_layer_step`)."""
    forward_only = (
      kwargs.get('update_state', True)
      and kwargs.get('compute_output', True)
      and kwargs.get('output_grad') is None
    )
    path = decode_cache.route(self, inputs, state, forward_only=forward_only)
    if path == decode_cache.BLOCK:
      out, new = self._read_block(inputs, weights, state.state, rng, state.n)
      return out, new, None, None
    if path == decode_cache.TOKEN:
      out, new = decode_cache.indexed_layer_step(
        self, inputs, weights, state, rng
      )
      return out, new, None, None
    if heads.applies(self, inputs):
      return heads.forward_and_or_backward(
        self, inputs, weights, unwrap(state), rng, **kwargs
      )
    return super().forward_and_or_backward(
      inputs, weights, unwrap(state), rng, **kwargs
    )

  def _reads_blocks(self) -> bool:
    """Whether `_read_block` can read this layer's blocks."""
    return False

  def _reads_tokens(self) -> bool:
    """Whether the chat decoder's tokens take `route`'s TOKEN path."""
    return False


class LocalSelfAttention(_Ours, tl.SelfAttention):
  """Trax's `SelfAttention`; chunked, a local attention whose predict
  step sees only what training saw.

  Trax's chunked `SelfAttention` attends within a chunk and the
  `n_chunks_before` before it in training, but while chatting to the whole
  memory, thousands of tokens it never learned to weigh. Here the predict
  step keeps the training window (`local_one_token_step`; longer feeds
  `decode_block.windowed_step`). Unchunked (full) attention is Trax's.
  """

  def heads_at_once(self) -> bool:
    return not (self._bias or self._share_qk)

  def forward_unbatched(
    self, x, mask=None, *, weights, state, rng, project_output=True, **kw
  ):
    """Trax 1.4.1's `SelfAttention.forward_unbatched` (own keys, no bias;
    smeared where the class smears) through `chunk_attention.attend`; the
    head's output before its projection where `project_output` is False
    (`heads`)."""
    if not self.heads_at_once():
      return super().forward_unbatched(
        x, mask, weights=weights, state=state, rng=rng, **kw
      )
    attend_rng, output_rng = fastmath.random.split(rng)
    q = jnp.matmul(x, self.weight(weights, 'q'))
    before = shifted(x)
    k = decode_block.local_keys(self, x, weights, before)
    v = self._values(x, weights, before)
    info = jnp.arange(q.shape[-2], dtype=jnp.int32)
    kv_info = info
    if self._masked:  # `mask` is True on valid tokens.
      kv_info = info * jnp.where(mask, 1, -1).astype(jnp.int32)
    mask_fn = functools.partial(
      ea.mask_self_attention,
      causal=self._causal,
      exclude_self=False,
      masked=self._masked,
    )
    o, _ = chunk_attention.attend(
      q, k, v, q_chunk_len=self._chunk_len, kv_chunk_len=self._chunk_len,
      n_chunks_before=self._n_chunks_before,
      n_chunks_after=self._n_chunks_after, mask_fn=mask_fn, q_info=info,
      kv_info=kv_info, dropout=self._attention_dropout, rng=attend_rng,
    )  # fmt: skip
    out = heads.project_one(self, o, weights, output_rng, project_output)
    return out, state

  def _incremental_forward_unbatched(self, x, mask=None, **kwargs):
    if not self._chunk_len:
      return super()._incremental_forward_unbatched(x, mask, **kwargs)
    if kwargs['q_len'] == 1 and mask is None and not self._bias:
      out = local_one_token_step(
        self,
        x,
        q_start=kwargs['q_start'],
        weights=kwargs['weights'],
        rng=kwargs['rng'],
      )
      return out, kwargs['state']
    return decode_block.windowed_step(self, x, **kwargs), kwargs['state']

  def _reads_blocks(self) -> bool:
    return bool(self._chunk_len) and not self._bias

  def _read_block(self, x, weights, state, rng, n):
    return decode_block.local_block(self, x, weights, state, rng, n)


class FastLSHSelfAttention(_Ours, tl.LSHSelfAttention):
  """Trax's `LSHSelfAttention`, the same computation, faster (see the
  module's text): scanned hashing, a key-only sort, the decode cache."""

  _far_keys = 0  # The chat's far keys (`read_far`; 0: all).
  _far_from = 0

  def read_far(self, keys: int, beyond: int):
    """The chat decoder's layer reads, of the keys more than `beyond`
    positions before a query, only the `keys` that score best among those
    it reads (`chat.far_keys`; `decode_keys.best_far`), through the whole
    key cache or its gathered candidates alike. A start block is read as
    trained."""
    self._far_keys, self._far_from = int(keys), int(beyond)

  def create_state_unbatched(self, input_signature, rng):
    state = super().create_state_unbatched(input_signature, rng)
    return decode_index.create_state(self, state, rng)

  def hash_vectors(self, vecs, rng, mask=None):
    """Trax's buckets, through `lsh_hash.bucket_ids` (factorized bucket
    counts and masks go to Trax's)."""
    if not isinstance(self._n_buckets, int) or mask is not None:
      return super().hash_vectors(vecs, rng, mask)
    turns = lsh_hash.draw_rotations(
      rng, vecs.shape[-1], self._n_hashes, self._n_buckets
    )
    # Buckets are integers: no gradient flows through them (Trax stops it
    # after), and none need be traced through the scan.
    vecs = jax.lax.stop_gradient(vecs)
    return lsh_hash.hash_rounds(vecs, turns, self._n_buckets)

  def _key_width(self) -> int:
    """Floats a position keeps in the decode cache (`_key_parts`)."""
    return self._d_qk + self._d_v

  def _key_parts(self, x_k, weights, x_before):
    """What a predict step reads of the positions `x_k` (`[n, d]`; each
    one's preceding position's input in `x_before`, read where smeared),
    their keys and values side by side (`[n, _key_width]`): Trax's shared
    keys (`length_normalized`) and values."""
    k = ea.length_normalized(jnp.matmul(x_k, self.weight(weights, 'q')))
    v = self._values(x_k, weights, x_before)
    return jnp.concatenate([k, v], -1)

  def _cached_qkv(self, q, parts, x_q, weights):
    """Queries, keys and values of a predict step's `attend`, from the
    query `q`, the candidates' `parts` (`_key_parts`) and the query's
    input `x_q`: Trax's shared ones."""
    del x_q, weights
    d = self._d_qk
    return q, parts[..., :d], parts[..., d : d + self._d_v]

  def _block_scores(self, q, parts, x_q, weights):
    """`attend`'s scores of each of a block's queries (`q`, `[length,
    d_qk]`; inputs `x_q`) over its own candidates (`parts`, `[length, n,
    width]`), without building the concatenated keys: `[length, n]`."""
    del x_q, weights
    d = self._d_qk
    dots = jnp.sum(q[:, None, :] * parts[..., :d], -1)  # XLA fuses it.
    return dots / jnp.sqrt(jnp.asarray(d, dots.dtype))

  def _memory_scores(self, q, keys, x_q, weights):
    """`_block_scores` over the whole key cache (`keys`, `[mem, width]`),
    shared by all of a block's queries: `[length, mem]`, one product with
    the cache's whole width (`_memory_row`: a product with a slice of it
    copied the slice, 4x the time at 32k)."""
    row = self._memory_row(q, x_q, weights)
    dots = jnp.matmul(row, jnp.transpose(keys))
    return dots / jnp.sqrt(jnp.asarray(self._d_qk, dots.dtype))

  def _memory_row(self, q, x_q, weights):
    """The queries laid out as `_key_parts` lays out a key (`[length,
    _key_width]`): each part's query, zeros against the values."""
    del x_q, weights
    return jnp.concatenate([q, jnp.zeros(q.shape[:-1] + (self._d_v,))], -1)

  def heads_at_once(self) -> bool:
    return True

  def forward_unbatched(self, x, mask=None, *, weights, **kwargs):
    return lsh_forward(self, x, mask, weights=weights, **kwargs)

  def _incremental_forward_unbatched(self, x, **kwargs):
    trax_step = super()._incremental_forward_unbatched
    return decode_cache.incremental_forward(self, trax_step, x, **kwargs)

  def _reads_blocks(self) -> bool:
    return decode_index.indexed(self)

  def _reads_tokens(self) -> bool:
    return decode_index.indexed(self)

  def _read_block(self, x, weights, state, rng, n):
    return decode_block.lsh_block(self, x, weights, state, rng, n)


class DirectedLSHSelfAttention(FastLSHSelfAttention):
  """LSH attention whose in-bucket score has a directed term.

  LSH shares queries and keys: a score is `|q_i| cos(q_i, q_j)`, so a head
  finds what resembles its query, never a different thing it needs ("the
  word after Repeat"; BENCHMARKS.md, "Why LSH did not learn"). This layer
  hashes, sorts and chunks exactly as Trax does (the buckets still group
  similar positions, and are learned through the shared term), and scores
  a pair in view with `|q_i| cos(q_i, q_j) + a_i . b_j / sqrt(d)`,
  `a = x w_a`, `b = x w_b`: a query and a key projection of its own.
  """

  EXTRA_ROLES = ('a', 'b')  # After Trax's weights (`weight_roles`).

  def create_weights_unbatched(self, input_signature, rng):
    """Trax's weights of one head, plus `w_a` and `w_b`."""
    weights = super().create_weights_unbatched(input_signature, rng)
    if isinstance(input_signature, (tuple, list)):
      input_signature = input_signature[0]
    shape = (input_signature.shape[-1], self._d_qk)
    rng_a, rng_b = fastmath.random.split(fastmath.random.split(rng, 5)[4])
    w_a = self._kernel_initializer(shape, rng_a)
    w_b = self._kernel_initializer(shape, rng_b)
    return (*weights, w_a, w_b)

  def _key_width(self) -> int:
    return super()._key_width() + self._d_qk  # And `b`.

  def _key_parts(self, x_k, weights, x_before):
    parts = super()._key_parts(x_k, weights, x_before)
    b = self._directed_keys(x_k, weights, x_before)
    return jnp.concatenate([parts, b], -1)

  def _directed_keys(self, x, weights, x_before):
    """`b = x w_b`: the directed score's keys of the rows `x` (a smeared
    class adds its predecessors' `x_before w_s`)."""
    del x_before
    return jnp.matmul(x, self.weight(weights, 'b'))

  def _cached_qkv(self, q, parts, x_q, weights):
    q, k_unit, v = super()._cached_qkv(q, parts, x_q, weights)
    b = parts[..., self._d_qk + self._d_v :]
    a = self._directed_queries(x_q, weights)
    q, k = directed_qk(q, k_unit, a, b)
    return q, k, v

  def _block_scores(self, q, parts, x_q, weights):
    # `directed_qk`'s keys are scaled by sqrt(2) and `attend` divides by
    # sqrt(2 d): the score is (q . k + a . b) / sqrt(d).
    d = self._d_qk
    a = self._directed_queries(x_q, weights)
    dots = jnp.sum(q[:, None, :] * parts[..., :d], -1)
    dots += jnp.sum(a[:, None, :] * parts[..., d + self._d_v :], -1)
    return dots / jnp.sqrt(jnp.asarray(d, dots.dtype))

  def _memory_row(self, q, x_q, weights):
    a = self._directed_queries(x_q, weights)  # Against `b`.
    return jnp.concatenate([super()._memory_row(q, x_q, weights), a], -1)

  def _directed_queries(self, x_q, weights):
    """`a = x w_a`: the directed score's queries of the rows `x_q`
    (`query_rows`)."""
    return jnp.matmul(x_q, self.weight(weights, 'a'))

  def forward_unbatched(self, x, mask=None, *, weights, **kwargs):
    a = self._directed_queries(self.query_rows(None, x, 0), weights)
    b = self._directed_keys(x, weights, self.key_context(None, x, 0))

    def directed_attend(q, k=None, v=None, **kw):
      at = kw['q_info']  # The positions of `q`'s rows, as sorted.
      q, k = directed_qk(q, ea.length_normalized(q), a[at], b[at])
      kw['kv_chunk_len'] = kw['q_chunk_len']
      if kw.get('kv_info') is None:
        kw['kv_info'] = at
      return chunk_attention.attend(q, k, v, **kw)

    return lsh_forward(
      self, x, mask, weights=weights, attend=directed_attend, **kwargs
    )


def _buckets(self, q, x, mask, state, update_state):
  """The buckets of `q` (`[n_hashes * length]`, hashed afresh or read
  from `state`) and the new state, as Trax's LSH forward makes them."""
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
  return buckets, state


def _sort_order(buckets, seqlen: int, n_hashes: int):
  """`(sticker, undo_sort)`: the positions in bucket order (each hash
  round's block of `seqlen` in turn) and the permutation back; the keys
  sorted alone (see `lsh_forward`)."""
  ticker = jnp.arange(n_hashes * seqlen, dtype=jnp.int32)
  buckets_and_t = seqlen * buckets + (ticker % seqlen)
  buckets_and_t = jax.lax.stop_gradient(buckets_and_t)

  # Hash-based sort ("s" at the start of variable names means "sorted").
  sbuckets_and_t = jax.lax.sort(buckets_and_t)
  sticker = (ticker // seqlen) * seqlen + sbuckets_and_t % seqlen
  undo_sort = jnp.zeros_like(ticker).at[sticker].set(ticker)
  sticker = jax.lax.stop_gradient(sticker)
  undo_sort = jax.lax.stop_gradient(undo_sort)
  return sticker, undo_sort


def _unsorted(so, slogits, undo_sort, sticker, n_hashes: int, seqlen: int):
  """The attention outputs back in position order, the hash rounds'
  outputs weighted by their share of the probability mass (Trax's)."""
  # Trax undoes the logits' sort with another sort; a gather is the same
  # permutation.
  o = gather_rows.permute_rows(so, undo_sort, sticker)
  logits = gather_rows.permute_rows(slogits, undo_sort, sticker)

  if n_hashes > 1:
    o = jnp.reshape(o, (n_hashes, seqlen, o.shape[-1]))
    logits = jnp.reshape(logits, (n_hashes, seqlen, 1))
    probs = jnp.exp(logits - fastmath.logsumexp(logits, axis=0, keepdims=True))
    o = jnp.sum(o * probs, axis=0)
  return o


def _kv_info(mask, st):
  """Trax's key positions for a masked layer: negative where the sorted
  position is padding (`mask` is True on valid tokens)."""
  smask = jnp.take(mask, st, axis=0)
  ones_like_mask = jnp.ones_like(smask, dtype=jnp.int32)
  return st * jnp.where(smask, ones_like_mask, -ones_like_mask)


def lsh_forward(
  self, x, mask=None, *, weights, state, rng, update_state, attend=None,
  project_output=True,
):  # fmt: skip
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
  directed score); `project_output` as `heads.project_one`'s.
  """
  attend = attend or chunk_attention.attend
  attend_rng, output_rng = fastmath.random.split(rng)
  q = jnp.matmul(x, self.weight(weights, 'q'))
  v = self._values(x, weights, self.key_context(None, x, 0))

  buckets, state = _buckets(self, q, x, mask, state, update_state)
  seqlen = x.shape[0]

  sticker, undo_sort = _sort_order(buckets, seqlen, self._n_hashes)

  st = sticker % seqlen
  sq = gather_rows.take_rows(q, st)
  sv = gather_rows.take_rows(v, st)

  mask_fn = functools.partial(
    ea.mask_self_attention,
    causal=self._causal,
    exclude_self=True,
    masked=self._masked,
  )
  kv_info = _kv_info(mask, st) if self._masked else None

  so, slogits = attend(
    sq,
    k=None,
    v=sv,
    q_chunk_len=self._chunk_len,
    n_chunks_before=self._n_chunks_before,
    n_chunks_after=self._n_chunks_after,
    mask_fn=mask_fn,
    q_info=st,
    kv_info=kv_info,
    dropout=self._attention_dropout,
    rng=attend_rng,
  )

  o = _unsorted(so, slogits, undo_sort, sticker, self._n_hashes, seqlen)
  out = heads.project_one(self, o, weights, output_rng, project_output)
  return out, state


def local_one_token_step(self, x, *, q_start, weights, rng):
  """Local attention of the newest token over its window of the memory.

  Reads only the `chunk_len * (1 + n_chunks_before)` positions that can
  be in the token's training window (a fixed-size slice of the memory
  `x`, `[mem, d]`, `decode_block.local_window`), so a token costs the
  same at any position; Trax's step projects the whole memory's keys for
  every token.

  Returns:
    `[1, d_v]`, as Trax's one-token path with `window_mask`.
  """
  return decode_block.local_window(self, x, q_start, 1, weights, rng)
