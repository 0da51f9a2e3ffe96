"""The predict-mode state of an attention layer, by name.

Trax keeps an attention layer's predict state as `(mem_end, mem,
per_head)` (`Memory` here): the position, the memory of inputs, and each
head's own entries stacked `[batch * n_heads, ...]`. An LSH layer's
per-head entries are Trax's `(buckets, buckets_idx, hash_rng)` and, where
the layer keeps a bucket index (`decode_index.create_state`), the index
and the key cache after them: `LSHState`.

Trax's own code maps over the state with `nested_map_multiarg`, which
gives back plain tuples, and a jitted step must get back the structure it
was given (or it is compiled again): so the state is kept as plain
tuples, every reader takes it through `LSHState.of` / `Memory.of` and
names its fields, and every writer gives back `.plain()`. Nothing unpacks
the tuple by position.

`BlockRead` is how the chat decoder passes a block's arguments (how many
of its tokens are real, and whether it starts an empty context) to the
layers that read it: as their state argument for that call, wrapped around
their own state (`wrap_readers`), so the arguments travel with the call
and no layer is told anything between calls.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import numpy as jnp


class LSHState(NamedTuple):
  """An indexed LSH layer's per-head predict state (each `[batch * n_heads,
  ...]` in the layer's state, one head's in Trax's per-head loop)."""

  buckets: Any  # `[n_hashes * mem]` each position's bucket in each round.
  buckets_idx: Any  # Positions hashed so far (Trax's).
  hash_rng: Any  # Trax's hashing key.
  ring: Any  # `[n_hashes, n_buckets, n_keep]` each bucket's last positions.
  counts: Any  # `[n_hashes, n_buckets]` positions each bucket holds.
  rotations: Any  # The hashing rotations, drawn once (`decode_index`).
  keys: Any  # `[mem, width]` each position's `_key_parts`.

  @classmethod
  def of(cls, state) -> LSHState:
    return cls(*state)

  def plain(self) -> tuple:
    """As the state keeps it."""
    return tuple(self)

  def trax(self) -> tuple:
    """The part Trax's own predict step reads and returns."""
    return (self.buckets, self.buckets_idx, self.hash_rng)

  def with_trax(self, trax_state) -> LSHState:
    """This state with the part Trax's step returned (`trax`'s order)."""
    buckets, buckets_idx, hash_rng = trax_state
    return self._replace(
      buckets=buckets, buckets_idx=buckets_idx, hash_rng=hash_rng
    )


class Memory(NamedTuple):
  """Trax's predict-mode state of an attention layer."""

  mem_end: Any  # The next position (tokens in the memory).
  mem: Any  # `(inputs,)`: `[batch, mem, d_model]` the inputs so far.
  heads: Any  # The per-head entries (`LSHState` or Trax's, or `()`).

  @classmethod
  def of(cls, state) -> Memory:
    return cls(*state)

  def plain(self) -> tuple:
    """As the state keeps it."""
    return (self.mem_end, self.mem, tuple(self.heads))


class Appended(NamedTuple):
  """What Trax's `_use_predict_mem` returns: a call's tokens written into
  the memory."""

  inputs: Any  # The memory with the new tokens (what the heads read).
  heads: Any  # The per-head state entries.
  q_start: Any  # The first new token's position.
  mem: Any  # The new memory.
  mem_end: Any  # The new position.


@jax.tree_util.register_pytree_node_class
class BlockRead:
  """A block of the chat decoder, given to a layer that reads it.

  A pytree whose `start` is static (Trax traces a layer's state through
  its gradient wrapper: a plain field would arrive as a tracer)."""

  def __init__(self, n, start: bool, state):
    self.n = n  # How many of the block's tokens are real (a traced int).
    self.start = start  # It starts an empty context (read as Trax reads one).
    self.state = state  # The layer's own state.

  def tree_flatten(self):
    return (self.n, self.state), self.start

  @classmethod
  def tree_unflatten(cls, start, children):
    n, state = children
    return cls(n, start, state)


def unwrap(state):
  """A layer's own state, whether or not a block call wraps it."""
  return state.state if isinstance(state, BlockRead) else state


def wrap_readers(layer, state, readers, n, start: bool):
  """`layer`'s state tree with the state of each layer whose `id` is in
  `readers` wrapped in a `BlockRead` of `n` real tokens. Only the paths to
  the readers are rebuilt: a combinator that holds one keeps its state as
  the tuple of its sublayers' (Trax's Serial, Branch, the reversible
  halves); any other (a `Scan` over the feed-forward chunks keeps more)
  is left as it is."""
  if id(layer) in readers:
    return BlockRead(n, start, state)
  subs = layer.sublayers or ()
  if not any(_holds(sub, readers) for sub in subs):
    return state
  if not isinstance(state, (tuple, list)) or len(state) != len(subs):
    raise ValueError(
      f'{type(layer).__name__} holds a layer that reads blocks but keeps '
      "its state otherwise than as the tuple of its sublayers' states"
    )
  return tuple(
    wrap_readers(sub, sub_state, readers, n, start)
    for sub, sub_state in zip(subs, state)
  )


def _holds(layer, readers) -> bool:
  """Whether `layer` is, or holds at any depth, one of `readers`."""
  if id(layer) in readers:
    return True
  return any(_holds(sub, readers) for sub in layer.sublayers or ())


def each_head(fn, per_example, per_head, per_both):
  """`fn(example's, head's, both's)` over every example and head of a
  layer's call: `[batch, n_heads, ...]`."""
  per_example_fn = jax.vmap(fn, in_axes=(None, 0, 0))
  return jax.vmap(per_example_fn, in_axes=(0, None, 0))(
    per_example, per_head, per_both
  )


def by_example(a, batch: int, heads: int):
  """`[batch * heads, ...]` per-head state entries as `[batch, heads, ...]`."""
  return jnp.reshape(a, (batch, heads) + a.shape[1:])


def flat(a):
  """`[batch, heads, ...]` as the state keeps it, `[batch * heads, ...]`."""
  return jnp.reshape(a, (a.shape[0] * a.shape[1],) + a.shape[2:])


def shifted(x, first=None):
  """Each row's predecessor (along the rows, axis -2): `first` (`[..., 1,
  d]`; zeros when None: nothing came before) then all rows of `x` but the
  last."""
  if first is None:
    first = jnp.zeros_like(x[..., :1, :])
  return jnp.concatenate([first, x[..., :-1, :]], axis=-2)


def rows_before(mem_inputs, x, start):
  """The predecessors of the rows `x` (`[..., n, d]`) that stand in a
  layer's memory of inputs (`[..., mem, d]`) from `start` (or are about
  to be written there): the memory's row before `start` (zeros at 0),
  then `x`'s own."""
  return shifted(x, memory_rows_before(mem_inputs, start, 1, x.dtype))


def memory_rows_before(mem_inputs, start, k: int, dtype):
  """The `k` rows of a layer's memory of inputs (`[..., mem, d]`) before
  position `start` (`[..., k, d]`, in `dtype`), zeros where before
  position 0."""
  at = start - k + jnp.arange(k)
  rows = jnp.take(mem_inputs, jnp.maximum(at, 0), axis=-2)
  return jnp.where((at >= 0)[:, None], rows, 0).astype(dtype)


def window_sums(mem_inputs, x, start, k: int, inclusive: bool):
  """Each row of `x`'s (`[..., n, d]`, at positions `start`...) sum of the
  `k` rows before it (`inclusive`: the `k` rows ending with itself),
  divided by `sqrt(k)`: the rows of the layer's memory of inputs
  (`mem_inputs`, `[..., mem, d]`) before `start`, zeros before position 0,
  then `x`'s own (None: nothing stands before `x`). A sum of `k` shifted
  copies, not a running sum: the same additions in the same order at any
  position, so a chat's block or token gets what training computed."""
  n = x.shape[-2]
  if mem_inputs is None:
    before = jnp.zeros(x.shape[:-2] + (k, x.shape[-1]), x.dtype)
  else:
    before = memory_rows_before(mem_inputs, start, k, x.dtype)
  rows = jnp.concatenate([before, x], axis=-2)  # Row t of `x` at t + k.
  first = 1 if inclusive else 0
  total = rows[..., first : first + n, :]
  for j in range(first + 1, first + k):
    total = total + rows[..., j : j + n, :]
  return total / jnp.sqrt(jnp.asarray(k, x.dtype))
