"""A chat's new tokens over a wide LSH layer's whole key cache, fused for
the CPU (`memory_attention.cc`): `decode_keys.attend_memory` where every
position up to a query is kept, with the chat's far keys.

A layer that `decode_select.reads_memory` with as many candidates as its
memory (the walkthrough's LSH layer at 8 chat hash rounds) reads every
key up to each query. XLA computes that as passes over the whole cache:
the scores' product with every column of each key, the masks, a maximum
pass a far key kept (`decode_keys.best_far`), the log-sum-exp, the
exponentials and the values' product with every column again, each the
size of all of a block's scores; a follow-up's first reply token at ~23k
tokens took ~2x its time at ~3.8k (BENCHMARKS.md "A wide layer that keeps
every key reads them unranked"). The kernel reads each key's score
columns once, only the keys up to the last query, keeps each query's far
cut while it scores, and reads the values of the near keys and of the
few far keys kept: the same attention (the same keys kept, to the
rounding of the scores' sums).

`JADE_MEMORY_KERNEL=off` (or `JADE_KERNELS=off`, or no compiler) keeps
XLA's passes; the kernel runs only on XLA's CPU backend, in float32.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import numpy as jnp

from src.model import decode_select, decode_state, kernels
from src.runtime import switches

TARGET = 'jade_memory_attention'
MAX_FAR_KEYS = 256  # The kernel's bound (`kMaxFarKeys`).


def switched_off() -> bool:
  """`JADE_MEMORY_KERNEL=off`: XLA's passes, to compare or rule it out."""
  return switches.off('JADE_MEMORY_KERNEL')


def applies(self, keys) -> bool:
  """Whether a layer whose key cache is `keys` (`[batch * heads, mem,
  width]`, the state's) reads it through the kernel here: a wide layer
  that keeps every key up to its queries (`decode_select.keep_count` at
  least its memory: `keep_mask` unranked), in float32."""
  mem = keys.shape[1]
  return (
    decode_select.keep_count(self) >= mem
    and decode_select.reads_memory(self, mem)
    and keys.dtype == jnp.float32
    and 0 <= self._far_keys <= MAX_FAR_KEYS
    and not switched_off()
    and kernels.available()
  )


def attend(self, x_q, weights, q, parts, keys, positions):
  """All of a layer's heads (and examples) over its whole key cache, the
  kernel's way (`decode_keys.attend_memory` with every key up to each
  query kept), the new keys written into the cache by the call.

  Args:
    x_q: `[batch, length, d]` the queries' inputs (`query_rows`).
    q: `[batch, heads, length, d_qk]` their queries.
    parts: `[batch, heads, length, width]` their `_key_parts`.
    keys: `[batch * heads, mem, width]` the key cache (the state's).
    positions: `[length]` the queries' positions (consecutive).

  Returns:
    `(out [batch, length, d_model]` summed over heads, `keys)`: the cache
    with `parts` written from the first position, as
    `decode_keys.write_keys` writes them, in place: the call takes the
    state's cache and returns it (aliased). A read of a cache written
    apart, which the state then returned, made XLA write it twice, each
    into a copy of the whole cache (4 copies of the 32k cache a token,
    3x the step's time).
  """
  batch, heads, length = q.shape[:3]

  def row(x_b, w_h, q_h):
    r = self._memory_row(q_h, x_b, w_h)
    return r / jnp.sqrt(jnp.asarray(self._d_qk, r.dtype))

  rows = decode_state.flat(decode_state.each_head(row, x_q, weights, q))
  o, keys = jax.ffi.ffi_call(
    TARGET,
    (
      jax.ShapeDtypeStruct((batch * heads, length, self._d_v), jnp.float32),
      jax.ShapeDtypeStruct(keys.shape, keys.dtype),
    ),
    input_output_aliases={1: 1},
  )(
    rows.astype(jnp.float32),
    keys,
    decode_state.flat(parts).astype(jnp.float32),
    jnp.broadcast_to(positions.astype(jnp.int32), (batch * heads, length)),
    v_at=np.int64(self._d_qk),
    dv=np.int64(self._d_v),
    far_from=np.int64(self._far_from if self._far_keys else 0),
    far_keys=np.int64(self._far_keys),
  )

  def project(_, w_h, o_h):
    return jnp.matmul(o_h, self.weight(w_h, 'o'))

  o = decode_state.by_example(o, batch, heads)
  out = decode_state.each_head(project, x_q, weights, o)
  return jnp.sum(out, axis=1), keys
