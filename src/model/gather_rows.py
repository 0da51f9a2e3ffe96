"""Rows taken by index, as the LSH layer sorts into bucket order and back,
by the CPU kernel `gather_rows.cc` where it runs.

`take_rows(x, idx)` is `jnp.take(x, idx, axis=0)` (its gradient adds the
rows back where they came from: a scatter-add, since the hash rounds of
one position take its row more than once); `permute_rows(x, perm,
inverse)` is Trax's `permute_via_gather` (a permutation and its inverse:
the gradient is a gather too). XLA's CPU gather and scatter move a few
GB/s where the kernel copies whole rows: at 32k positions the LSH layer's
gathers and unsort took ~0.8 s of a ~10 s step on a Zen 3, ~0.7 s with
the kernel (each call's fresh output is page-faulted either way), and the
step ~0.5 s less (BENCHMARKS.md "The LSH hash and the row gathers as
kernels"). The same values: a copy is exact, and the scatter adds a
position's rows in the order they were taken (exactly XLA's sum for two
hash rounds; for more, within float rounding).

The kernel runs for float32 rows on XLA's CPU backend with the kernels
built (`src.model.kernels`) and calls of `MIN_ROWS` rows or more; XLA's
own gather everywhere else.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import numpy as jnp
from trax.layers.research import efficient_attention as ea

from src.model import kernels

# Rows a call takes from which the kernel runs (below, XLA's gather is as
# fast and a test's tiny model keeps its own path).
MIN_ROWS = 1024


def _fusable(x, idx) -> bool:
  return (
    x.dtype == jnp.float32
    and x.ndim >= 1
    and idx.ndim == 1
    and idx.shape[0] >= MIN_ROWS
    and kernels.available()
  )


def take_rows(x, idx):
  """`jnp.take(x, idx, axis=0)`: `x` `[n, ...]`, `idx` `[m]` int in `[0,
  n)` -> `[m, ...]`."""
  if not _fusable(x, idx):
    return jnp.take(x, idx, axis=0)
  rows = jnp.reshape(x, (x.shape[0], -1))
  out = _take(rows, idx.astype(jnp.int32), x.shape[0])
  return jnp.reshape(out, (idx.shape[0], *x.shape[1:]))


def permute_rows(x, perm, inverse):
  """Trax's `permute_via_gather(x, perm, inverse, axis=0)`: `x[perm]`,
  its gradient `g[inverse]` (`inverse` undoes `perm`)."""
  if not _fusable(x, perm):
    return ea.permute_via_gather(x, perm, inverse, axis=0)
  rows = jnp.reshape(x, (x.shape[0], -1))
  out = _permute(rows, perm.astype(jnp.int32), inverse.astype(jnp.int32))
  return jnp.reshape(out, x.shape)


def _gather(rows, idx):
  out = jax.ShapeDtypeStruct((idx.shape[0], rows.shape[1]), jnp.float32)
  call = jax.ffi.ffi_call('jade_gather_rows', out, vmap_method='broadcast_all')
  return call(rows, idx)


def _scatter_add(g, idx, n: int):
  out = jax.ShapeDtypeStruct((n, g.shape[1]), jnp.float32)
  call = jax.ffi.ffi_call(
    'jade_scatter_add_rows', out, vmap_method='broadcast_all'
  )
  return call(g, idx, n=np.int64(n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take(rows, idx, n: int):
  return _gather(rows, idx)


def _take_forward(rows, idx, n: int):
  return _gather(rows, idx), idx


def _take_backward(n: int, idx, g):
  return _scatter_add(g, idx, n), None


_take.defvjp(_take_forward, _take_backward)


@jax.custom_vjp
def _permute(rows, perm, inverse):
  return _gather(rows, perm)


def _permute_forward(rows, perm, inverse):
  return _gather(rows, perm), (perm, inverse)


def _permute_backward(saved, g):
  perm, inverse = saved
  return _permute(g, inverse, perm), None, None


_permute.defvjp(_permute_forward, _permute_backward)
