"""How a predict-mode LSH layer takes a call: the one place that chooses.

`route` chooses among the paths below, for every call of an attention
layer of `src.model.attention` (`_Ours.forward_and_or_backward`); its
text is the map. The pieces live by concern: which positions a token
attends to (`decode_select`), the bucket index and its upkeep
(`decode_index`), the key cache and attention over it (`decode_keys`),
blocks of tokens at any position (`decode_block`), and the state's
fields by name (`decode_state`).

The chat decoder (`src.inference.decoding.Decoder`) marks its layers
(`never_roll`: their memory never rolls, it drops whole turns and re-reads
them first), so tokens are appended in place and an LSH layer keeps a
bucket index, its hashing rotations and a key cache in its predict state
(`decode_index.create_state`). A token of such a layer costs O(n_keep),
not O(memory), and the outputs are Trax's bit for bit (pinned by
tests/test_attention.py); a wide layer, whose candidates are a large
share of its memory (`decode_select.reads_memory`), reads them as a mask
over the whole key cache instead, Trax's outputs to rounding.
"""

from __future__ import annotations

from jax import numpy as jnp
from trax import fastmath

from src.model import (
  decode_index,
  decode_keys,
  decode_select,
  decode_state,
  memory_attention,
)
from src.model.decode_state import Appended, BlockRead, LSHState, Memory

# The paths of `route`.
BLOCK = 'block'
START = 'start'
TOKEN = 'token'
TRAX = 'trax'


def never_roll(layer):
  """Marks a predict-mode attention layer whose memory never rolls (see
  the module's text); Trax's own classes keep their ways."""
  mark = getattr(layer, 'never_roll', None)
  if mark is not None:
    mark()


def route(layer, inputs, state, *, forward_only: bool) -> str:
  """Which path a call of a predict-mode attention `layer` takes.

  - BLOCK: a block of the chat decoder at any position (`state` is a
    `BlockRead`, not a start) on a layer that reads blocks
    (`layer._reads_blocks()`): `decode_block`, each token attending to what
    it would attend to alone, all at once.
  - START: a block that starts an empty context: Trax's step, read as
    Trax reads a context's start (as training reads a window) with the
    memory filled from position 0 (`start_mem`); an LSH layer with an
    index then rebuilds it from what it read (`incremental_forward`).
  - TOKEN: one token of the chat decoder through an LSH layer that keeps
    an index: all heads at once, the few state entries it changes written
    in place (`indexed_layer_step`).
  - TRAX: anything else (training, evaluation, gradients, Trax's own
    predict mode): Trax's path, whose per-head step for LSH is
    `incremental_forward` (one token: `one_token_step`, the sort's
    positions found in one pass over a memory that may roll) and for a
    local layer `attention.LocalSelfAttention`'s window.
  """
  if not forward_only or not layer._never_rolls:
    return TRAX
  if isinstance(state, BlockRead):
    if state.start:
      return START
    return BLOCK if layer._reads_blocks() else TRAX
  one = not isinstance(inputs, (tuple, list)) and inputs.shape[-2] == 1
  if one and layer._reads_tokens():
    return TOKEN
  return TRAX


def use_predict_mem(self, inputs, state, trax_mem):
  """Appends one token to the memory without Trax's in-graph roll
  (`trax_mem`: Trax's `_use_predict_mem` of the layer).

  Trax drops the oldest `predict_drop_len` positions inside the step when
  the memory is full, through a `cond` whose result XLA must copy: every
  token then copies each layer's whole memory (3 of the 13 ms of a token at
  an 8192-token memory). A layer marked by `never_roll` appends in place
  instead; several tokens at once are a start block (`route`: the other
  blocks never come here).
  """
  if not self._never_rolls:
    return trax_mem(inputs, state)
  if inputs[0].shape[-2] > 1:
    return start_mem(self, inputs, state)
  memory = Memory.of(state)

  def append(buf, new):
    return buf.at[:, memory.mem_end].set(new[:, 0])

  inputs = fastmath.nested_map_multiarg(append, memory.mem, inputs)
  return inputs, memory.heads, memory.mem_end, inputs, memory.mem_end + 1


def start_mem(self, inputs, state):
  """Trax's `_use_predict_mem` for a block that starts a context: the
  memory is the block, zeros after it.

  Trax takes this branch only for a block longer than `predict_drop_len`;
  a shorter one it appends at a traced start, which its chunked local
  attention cannot read (it asserts the start is 0): a 1k-4k-token
  re-read of a gin/reformer_32k.gin model (drop length 4096) failed. As
  Trax's, it turns the output to NaN if the memory was not empty, so a
  misuse cannot pass silently.
  """
  memory = Memory.of(state)
  mem_len = self._predict_mem_len
  seqlen = inputs[0].shape[-2]

  def filled(inp):
    pad = jnp.zeros(
      inp.shape[:1] + (mem_len - seqlen,) + inp.shape[2:], inp.dtype
    )
    return jnp.concatenate([inp, pad], axis=1) if seqlen < mem_len else inp

  mem, _ = fastmath.tree_unflatten(
    [filled(inp) for inp in fastmath.tree_leaves(inputs)], memory.mem
  )

  def nan_unless_start(x):
    if x.dtype != jnp.float32:
      return x
    empty = jnp.equal(memory.mem_end, jnp.array(0, memory.mem_end.dtype))
    return fastmath.cond(
      pred=empty,
      true_operand=x,
      true_fun=lambda x: x,
      false_operand=x,
      false_fun=lambda x: x * jnp.nan,
    )

  inputs = fastmath.nested_map(nan_unless_start, inputs)
  return inputs, memory.heads, 0, mem, jnp.minimum(seqlen, mem_len)


def incremental_forward(
  self, trax_step, x, *, q_start, q_len, weights, state, rng, update_state
):
  """LSH's per-head predict step for `x` (`[mem, d]`, one head; `route`'s
  START and TRAX paths): one token through `one_token_step`, anything else
  through Trax's (`trax_step`), after which a layer with an index rebuilds
  it from what it read (and, if its memory never rolls, fills its key
  cache)."""
  step = dict(q_start=q_start, weights=weights, rng=rng)
  one = q_len == 1 and self._n_chunks_after == 0 and update_state
  if not decode_index.indexed(self):
    if one:
      return one_token_step(self, x, state=state, **step)
    return trax_step(
      x, q_len=q_len, state=state, update_state=update_state, **step
    )
  full = LSHState.of(state)
  if one:  # A memory that may roll: its index is not used.
    out, trax_state = one_token_step(self, x, state=full.trax(), **step)
    return out, full.with_trax(trax_state).plain()
  out, trax_state = trax_step(
    x, q_len=q_len, state=full.trax(), update_state=update_state, **step
  )
  new = full.with_trax(trax_state)
  buckets = jnp.reshape(new.buckets, (self._n_hashes, -1))
  ring, counts = decode_index.rebuilt_index(
    buckets, new.buckets_idx, *full.ring.shape[1:]
  )
  keys = full.keys
  if self._never_rolls:  # Its keys: `x` holds the block from position 0.
    rows = x[:q_len]
    parts = self._key_parts(rows, weights, self.key_context(None, rows, 0))
    keys = decode_keys.write_keys(keys, parts, 0)
  return out, new._replace(ring=ring, counts=counts, keys=keys).plain()


def one_token_step(self, x, *, q_start, weights, state, rng):
  """LSH attention of the newest token over the memory `x` (`[mem, d]`),
  one head, in Trax's per-head loop, for a memory that may roll: the
  positions Trax's sort keeps, found with `select_kv` in one pass.

  Returns:
    `(out [1, d_v], new_state)` as Trax's one-token path (its state
    `(buckets, buckets_idx, hash_rng)`).
  """
  buckets, buckets_idx, hash_rng = state
  new_idx = jnp.array(q_start + 1, dtype=buckets_idx.dtype)
  buckets = decode_index.roll_buckets(self, buckets, buckets_idx, q_start)
  w_q = self.weight(weights, 'q')
  q, qb = decode_select.query_buckets(self, x, q_start, w_q, hash_rng)
  all_buckets = fastmath.dynamic_update_slice_in_dim(
    jnp.reshape(buckets, (self._n_hashes, -1)), qb[:, None], q_start, axis=1
  )
  n_keep = min(decode_select.keep_count(self), x.shape[0])
  is_valid_target = jnp.any(all_buckets == qb[:, None], axis=0)
  kv_indices = decode_select.select_kv(is_valid_target, q_start, n_keep)
  out = decode_keys.attend_selected(
    self, x, q, q_start, kv_indices, weights, rng
  )
  return out, (jnp.reshape(all_buckets, (-1,)), new_idx, hash_rng)


def _token_queries(self, x, weights, appended, rotations):
  """Each head's query, buckets and `_key_parts` of a new token `x`
  (`[batch, 1, d_model]`, in the memory already: `appended`), hashed with
  its `rotations` (`[batch, heads, ...]`)."""

  def query(rows, w_h, turns_h):  # The row as a memory of one position.
    x_b, before = rows
    w_q = self.weight(w_h, 'q')
    q, qb = decode_select.query_buckets(self, x_b, 0, w_q, None, turns_h)
    return q, qb, self._key_parts(x_b, w_h, before)

  # Its predecessor: the memory's row before it.
  before = self.key_context(appended.inputs[0], x, appended.q_start)
  return decode_state.each_head(query, (x, before), weights, rotations)


def _indexed_heads(self, x_q, weights, per, q_start, rng):
  """Every head's `decode_keys.indexed_token` of a new token (`per`: its
  query, buckets, ring lists and the key cache, by head), summed over
  heads: `[batch, 1, d_model]`."""

  def attend(x_b, w_h, per_head):
    return decode_keys.indexed_token(
      self, x_b, q_start=q_start, weights=w_h, rng=rng, **per_head
    )

  return jnp.sum(decode_state.each_head(attend, x_q, weights, per), axis=1)


def indexed_layer_step(self, x, weights, state, rng):
  """One new token through a whole LSH layer (all examples and heads),
  for a memory that never rolls and keeps a bucket index (`route`'s
  TOKEN).

  Trax's per-head loop gathers each head's state, returns a whole new one
  (the `[n_hashes * mem]` buckets, the index) and scatters it back: every
  token copied those arrays, a cost that grew with the memory. Here the
  few entries a token changes are written into the (donated) state in
  place (`write_index`, `write_buckets`, `write_keys`) and each head only
  reads (`decode_keys.indexed_token`). The output is Trax's: all heads at
  once, summed over heads (by the fused kernel where every key up to the
  token is kept, `memory_attention`, which also writes its key).

  Args:
    x: `[batch, 1, d_model]` the new token's input.
    state: a `Memory` whose heads are an `LSHState`, each entry stacked
      `[batch * n_heads, ...]`.

  Returns:
    `(out [batch, 1, d_model], new_state)`.
  """
  appended = Appended(*self._use_predict_mem((x,), state))
  q_start = appended.q_start
  s = LSHState.of(appended.heads)
  batch, heads = x.shape[0], self._n_heads

  def example(a):  # `[batch * heads, ...]` as `[batch, heads, ...]`.
    return decode_state.by_example(a, batch, heads)

  q, qb, parts = _token_queries(
    self, x, weights, appended, example(s.rotations)
  )
  own = decode_state.flat(decode_index.own_buckets(self, qb))
  ring, counts = decode_index.write_index(s.ring, s.counts, own, q_start)
  x_q = self.query_rows(appended.inputs[0], x, q_start)
  if memory_attention.applies(self, s.keys):
    at = jnp.reshape(q_start, (1,)).astype(jnp.int32)
    out, keys = memory_attention.attend(
      self, x_q, weights, q[:, :, :1], parts, s.keys, at
    )  # The query's first row (Trax's step duplicates it).
  else:
    keys = decode_keys.write_keys(s.keys, decode_state.flat(parts), q_start)
    lists = example(decode_index.bucket_lists(ring, own))
    per = dict(q=q, qb=qb, buckets=example(s.buckets), lists=lists,
               keys=example(keys))  # fmt: skip
    out = _indexed_heads(self, x_q, weights, per, q_start, rng)
  out = out.astype(x.dtype)
  new = s._replace(
    buckets=decode_index.write_buckets(
      s.buckets, decode_state.flat(qb), q_start
    ),
    buckets_idx=jnp.full_like(s.buckets_idx, q_start + 1),
    ring=ring,
    counts=counts,
    keys=keys,
  )
  return out, Memory(appended.mem_end, appended.mem, new).plain()
