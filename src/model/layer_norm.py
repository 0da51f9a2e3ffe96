"""Trax's `LayerNorm`, and the LSH layer's normalized keys, their forwards
and gradients by the CPU kernel `layer_norm.cc` where it runs.

`LayerNorm` is Trax's (`trax.layers.normalization.LayerNorm`: the same
weights, `(scale, bias)`, the same start, the same values within float
rounding) whose `forward` runs the kernel. `reformer.reformer_lm`
puts one wherever Trax's model has Trax's (each block's attention and
feed-forward branch, and before the output layer), so a checkpoint of
either loads into the other. `unit_rows` is Trax's `length_normalized`
times a scale: `chunk_attention.attend`'s shared keys.

XLA's CPU backend runs a reduction over a row of more than 32 values as
`reduce-window` loops on one thread: at 32k positions and d_model 256 a
layer norm took 6.9 ms forward and 20.4 ms forward and backward, ~0.22 s
of a ~6.5 s step for the benchmark's eight; one 32k attention branch's
forward and backward took ~40 ms less with the kernel, a feed-forward
branch ~10 ms less (BENCHMARKS.md "Layer norms and the LSH keys as
kernels"). The kernel reads a row once a pass, on XLA's threads.

The kernels run for float32 rows whose width is a multiple of 8 (the
layer norm's centered), at least `MIN_ROWS` rows a call, on XLA's CPU
backend with the kernels built (`src.model.kernels`); Trax's own formula
everywhere else (a chat's token, RMS normalization, `JADE_KERNELS=off`,
or `JADE_NORM_KERNEL=off` for these two alone).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import numpy as jnp
from trax.layers import normalization
from trax.layers.research import efficient_attention as ea

from src.model import kernels
from src.runtime import switches

# Rows a call normalizes from which the kernel runs (below, XLA's loops
# are as fast, and a chat's one token keeps Trax's formula).
MIN_ROWS = 1024
BLOCK_ROWS = 128  # Rows a task of the kernel (`kBlockRows` in layer_norm.cc).


def rows_fusable(x) -> bool:
  """Whether the kernels take `x`'s rows (`unit_rows` runs its kernel
  then): float32, a width a multiple of 8, `MIN_ROWS` of them or more,
  the kernels here and switched on."""
  d = x.shape[-1] if x.ndim else 0
  return (
    x.dtype == jnp.float32
    and d > 0
    and d % 8 == 0
    and x.size // d >= MIN_ROWS
    and not switches.off('JADE_NORM_KERNEL')
    and kernels.available()
  )


def _fusable(x, scale, bias, center: bool) -> bool:
  d = x.shape[-1] if x.ndim else 0
  return (
    center
    and scale.dtype == jnp.float32
    and bias.dtype == jnp.float32
    and scale.shape == (d,)
    and bias.shape == (d,)
    and rows_fusable(x)
  )


def _forward_call(rows, scale, bias, epsilon: float):
  out = jax.ShapeDtypeStruct(rows.shape, jnp.float32)
  call = jax.ffi.ffi_call('jade_layer_norm', out, vmap_method='sequential')
  return call(rows, scale, bias, eps=np.float32(epsilon))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm(rows, scale, bias, epsilon: float):
  return _forward_call(rows, scale, bias, epsilon)


def _norm_forward(rows, scale, bias, epsilon: float):
  return _forward_call(rows, scale, bias, epsilon), (rows, scale)


def _norm_backward(epsilon: float, saved, g):
  rows, scale = saved
  n, d = rows.shape
  blocks = -(-n // BLOCK_ROWS)
  outs = (
    jax.ShapeDtypeStruct(rows.shape, jnp.float32),
    jax.ShapeDtypeStruct((blocks, 2, d), jnp.float32),
  )
  call = jax.ffi.ffi_call(
    'jade_layer_norm_backward', outs, vmap_method='sequential'
  )
  dx, sums = call(rows, scale, g, eps=np.float32(epsilon))
  totals = jnp.sum(sums, axis=0)  # The blocks' sums, in order.
  return dx, totals[0], totals[1]


_norm.defvjp(_norm_forward, _norm_backward)


def unit_rows(x, scale: float, epsilon: float = 1e-6):
  """Trax's `length_normalized(x, epsilon) * scale` (`x` `[..., d]`, each
  row to a root mean square of `scale`): the LSH layer's keys, by the
  kernel where it runs (its forward squared, summed and divided the
  rows in three passes over the heads' `[4, 32768, 64]` queries, its
  gradient in three more, ~2% of the benchmark's step)."""
  if not rows_fusable(x):
    return ea.length_normalized(x, epsilon) * jnp.asarray(scale, x.dtype)
  return _unit(x, float(scale), float(epsilon))


def _unit_call(x, scale: float, epsilon: float):
  out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
  call = jax.ffi.ffi_call('jade_unit_rows', out, vmap_method='broadcast_all')
  return call(x, eps=np.float32(epsilon), scale=np.float32(scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _unit(x, scale: float, epsilon: float):
  return _unit_call(x, scale, epsilon)


def _unit_forward(x, scale: float, epsilon: float):
  return _unit_call(x, scale, epsilon), x


def _unit_backward(scale: float, epsilon: float, x, g):
  out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
  call = jax.ffi.ffi_call(
    'jade_unit_rows_backward', out, vmap_method='broadcast_all'
  )
  return (call(x, g, eps=np.float32(epsilon), scale=np.float32(scale)),)


_unit.defvjp(_unit_forward, _unit_backward)


class LayerNorm(normalization.LayerNorm):
  """Trax's `LayerNorm` (the same weights and start), by the kernel where
  it runs and by Trax's own `forward` elsewhere."""

  def forward(self, x):
    scale, bias = self.weights
    if not _fusable(x, scale, bias, self._center):
      return super().forward(x)
    rows = jnp.reshape(x, (-1, x.shape[-1]))
    out = _norm(rows, scale, bias, float(self._epsilon))
    return jnp.reshape(out, x.shape)

  @classmethod
  def like(cls, layer: normalization.LayerNorm) -> LayerNorm:
    """One with `layer`'s settings (a model not initialized yet)."""
    return cls(center=layer._center, epsilon=layer._epsilon)
