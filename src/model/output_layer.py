"""The output layer and its cross-entropy over a step's rows, chunk by
chunk, fused on AMX tiles by the CPU kernel `output_layer.cc`, where the
step's products read bfloat16 (`precision.products = 'bfloat16'`, or
'auto' on such a CPU) and the CPU has AMX (`src.model.kernels.amx()`).

`applies(x, kernel, c)` says whether it runs; `loss_and_grads(x, kernel,
bias, t, w, c)` is then `src.model.losses._fused_loss`'s forward pass:
`((loss sum, weighted hits), (d/dx, d/dkernel, d/dbias))` for rows `x`
`[n, d]` (n a multiple of `c`), a plain output layer's kernel `[d,
vocab]` and bias `[vocab]`, targets and weights `[n]`.

XLA ran each chunk as three products (YNNPACK's, on AMX) and four
element-wise passes over the `[vocab, c]` logits, each through memory;
the kernel keeps a block of vocabulary rows in cache, makes its logits
twice (a fourth product instead of the passes) and feeds the gradient's
block to both gradient products at once, on operands packed as whole
tiles; the kernel is packed once a step (`jade_output_pack`). The same
sums as XLA's bfloat16 products within float rounding (tests compare;
the gradient is rounded to bfloat16 as XLA rounds it). Vocabularies
below `MIN_VOCAB` keep XLA's path (the walkthroughs' 1,000 pieces among
them: their numbers stay as measured); `JADE_OUTPUT_KERNEL=off` keeps it
everywhere, to compare or to rule the kernel out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from src.model import kernels, precision
from src.runtime import switches

# Vocabulary from which the kernel runs (BENCHMARKS.md "The output layer
# fused on AMX tiles").
MIN_VOCAB = 4096
_TILE = 32  # The kernel's chunk rows and features: multiples of this.


def applies(x, kernel, c: int) -> bool:
  """Whether `loss_and_grads` runs for rows `x`, this output layer's
  kernel (`[d, vocab]`; a shortlist layer's tuple never) and chunks of `c`
  rows."""
  if isinstance(kernel, tuple) or not precision.tracing_bfloat16():
    return False
  d, v = kernel.shape
  return (
    v >= MIN_VOCAB
    and d % _TILE == 0
    and c % _TILE == 0
    and kernel.dtype == x.dtype == jnp.float32
    and not switches.off('JADE_OUTPUT_KERNEL')
    and jax.default_backend() == 'cpu'
    and kernels.amx()
  )


def _padded(v: int) -> int:
  return -(-v // _TILE) * _TILE


def pack(kernel_vd):
  """The kernel `[vocab, d]` rounded to bfloat16 and packed as both
  products' tiles (uint32 words, opaque)."""
  v, d = kernel_vd.shape
  out = jax.ShapeDtypeStruct((_padded(v) * d,), jnp.uint32)
  return jax.ffi.ffi_call('jade_output_pack', out)(kernel_vd)


class Chunk(NamedTuple):
  """What `chunk` returns."""

  losses: jax.Array  # [c]: each row's weighted loss.
  hits: jax.Array  # [c]: 1 where the target's logit is the largest.
  dbias: jax.Array  # [v]
  drows_t: jax.Array  # [d, c]: the rows' gradient, transposed.
  dkernel: jax.Array  # [vp, d]: the kernel's gradient so far, with this one.


def chunk(packed, xc, bias, tc, wc, dk) -> Chunk:
  """One chunk of rows `xc` `[c, d]` (see `Chunk`); `dk` the kernel's
  gradient of the chunks before (`[vp, d]`, vp the vocabulary up to a
  multiple of 32), updated in place."""
  c, d = xc.shape
  f32 = jnp.float32
  outputs = (
    jax.ShapeDtypeStruct((c,), f32),
    jax.ShapeDtypeStruct((c,), f32),
    jax.ShapeDtypeStruct(bias.shape, f32),
    jax.ShapeDtypeStruct((d, c), f32),
    jax.ShapeDtypeStruct(dk.shape, f32),
  )
  call = jax.ffi.ffi_call(
    'jade_output_chunk',
    outputs,
    vmap_method='sequential',
    input_output_aliases={5: 4},
  )
  return Chunk(*call(packed, xc, bias, tc.astype(jnp.int32), wc, dk))


def loss_and_grads(x, kernel, bias, t, w, c: int):
  """`((loss sum, weighted hits), (dx [n, d], dkernel [d, v], dbias [v]))`
  (see the module)."""
  n, d = x.shape
  v = kernel.shape[1]
  packed = pack(kernel.T)
  bias = bias.astype(jnp.float32)

  def body(carry, rows):
    loss, hits, db, dk = carry
    xc, tc, wc = rows
    out = chunk(packed, xc, bias, tc, wc, dk)
    loss = loss + jnp.sum(out.losses)
    hits = hits + jnp.sum(wc * out.hits)
    return (loss, hits, db + out.dbias, out.dkernel), out.drows_t

  zero = jnp.zeros([], jnp.float32)
  start = (zero, zero, jnp.zeros_like(bias), jnp.zeros((_padded(v), d)))
  chunks = (x.reshape(-1, c, d), t.reshape(-1, c), w.reshape(-1, c))
  (loss, hits, db, dk), dxt = jax.lax.scan(body, start, chunks)
  dx = dxt.transpose(0, 2, 1).reshape(n, d)
  return (loss, hits), (dx, dk[:v].T, db)
