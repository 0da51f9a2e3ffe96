"""The type training's matrix products read (gin: `precision.products`).

`precision(products='bfloat16')` makes every float32 x float32 matrix
product of a training step (the forward's and the gradient's: projections,
feed-forwards, the output layer and its loss) read its two inputs rounded
to bfloat16 and sum in float32, as a TPU's default precision does. Nothing
else changes: the weights, the optimizer, every sum outside the products,
the softmax and the loss stay float32, and evaluation and chat read float32.
Where the CPU has bfloat16 dot instructions (AVX512-BF16, AMX) the products
run ~1.6x faster; on the CPU they need XLA's YNNPACK products
(`src.runtime.xla.ynn_products`).

`bfloat16_products(fn)` is the rewrite: it traces `fn` to a jaxpr and
evaluates it again with each such `dot_general` replaced, inside every
nested jaxpr (jit calls, loops, conditionals, rematerialization), so it
reaches the products of Trax's layers and of their gradients without
touching a layer. Products already in another type and integer products
are left as they are. The attention kernel's products
(`src.model.chunk_attention`) read bfloat16 inputs too, where the kernels
were built for a CPU with AVX512-BF16 (float32 elsewhere).

On XLA's CPU backend the rewrite also gives each product the layout
YNNPACK runs: YNNPACK takes a left operand only when its contracted
dimensions are its last, and XLA's own dot cannot run bfloat16. A
weight's gradient (x^T g) reads a copy of x rounded and transposed in one
pass by the CPU kernel (`src.model.kernels`, `bf16_cast.cc`); a transpose
of a product is computed as the swapped product; and small left operands
(weights) are rounded by the kernel, an opaque call, so that XLA cannot
fold a transpose of its own into them. Without the kernels (no compiler)
XLA rounds every product's inputs, and on some models with YNNPACK's
individual products XLA's CPU backend then fails (`explained`).
"""

from __future__ import annotations

import collections
import contextvars
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.tree_util import tree_structure

from src.core.errors import UserError
from src.model import chunk_attention, kernels
from src.runtime import xla

PRODUCTS = ('float32', 'bfloat16', 'auto')
_F32 = jnp.dtype('float32')
_BF16 = jnp.dtype('bfloat16')
# Left operands of at most this many values are rounded by the CPU kernel
# (weights; every operand of a small model): XLA cannot fold a transpose of
# its own into them. Larger ones (activations at long windows) are rounded
# by XLA, which fuses the rounding into the operation that makes them:
# rounding those by the kernel too cost 0.7-0.8 s of a ~6 s step
# (BENCHMARKS.md "bfloat16 products in YNNPACK's layout").
KERNEL_CAST_MAX = 1 << 20
# Set while `bfloat16_products` traces its function (`tracing_bfloat16`).
_TRACING = contextvars.ContextVar('jade_bfloat16_products', default=False)


def precision(products: str = 'float32') -> str:
  """Training's matrix products (gin: precision).

  Args:
    products: 'float32'; 'bfloat16': every float32 product of a training
      step reads its inputs rounded to bfloat16 and sums in float32;
      weights, optimizer, softmax and loss stay float32, and evaluation and
      chat compute in float32. On a CPU it needs bfloat16 instructions
      (AVX512-BF16, AMX) and XLA's YNNPACK products, which train.py turns
      on when the gin asks (`src.runtime.xla`). 'auto': 'bfloat16' on a
      CPU with bfloat16 dot instructions, YNNPACK's products on and the
      project's CPU kernels built (without them some products fail),
      'float32' anywhere else (a CPU without them, where bfloat16 would be
      slower; a GPU or TPU, where XLA picks its own).

  Returns:
    The products' input type: 'float32' or 'bfloat16'.
  """
  if products not in PRODUCTS:
    raise UserError(
      f"precision.products = {products!r}: write 'float32', 'bfloat16' or "
      "'auto' in the gin file"
    )
  if products == 'auto':
    native = jax.default_backend() == 'cpu' and xla.cpu_bf16_dot()
    ready = xla.ynn_products() and kernels.ready()
    return 'bfloat16' if native and ready else 'float32'
  return products


def with_products(fn, products: str):
  """`fn` itself for 'float32'; `bfloat16_products(fn)` for 'bfloat16'."""
  return fn if products == 'float32' else bfloat16_products(fn)


def explained(error: Exception) -> UserError | None:
  """One line for XLA's CPU backend failing a bfloat16 product at run time
  (with YNNPACK's individual products, a product XLA hands to its own dot
  instead: "Unsupported element type for DotThunk::Execute: BF16 x BF16 =
  F32"); None for any other error."""
  text = str(error)
  if 'DotThunk' not in text or 'BF16' not in text:
    return None
  return UserError(
    "precision.products = 'bfloat16': XLA's CPU backend cannot run one of "
    "this model's bfloat16 products with YNNPACK's individual products "
    '(a product in a layout YNNPACK does not take; JADE_VERBOSE=1 says if '
    f"the project's CPU kernels are missing); run with XLA_FLAGS={xla.YNN_FLAG}"
    "=dot (slower on some models), or set precision.products = 'float32'"
  )


def bfloat16_products(fn):
  """`fn` with every float32 x float32 `dot_general` reading bfloat16
  inputs and summing in float32 (see the module's docstring)."""

  @functools.wraps(fn)
  def rewritten(*args):
    # JAX's trace caches key on its configuration, not on `_TRACING`: the
    # matmul precision (no other effect on the CPU, whose float32 products
    # this rewrites anyway) keeps a trace made here from being reused
    # where `fn` runs in float32, and the other way round.
    token = _TRACING.set(True)
    try:
      with jax.default_matmul_precision('bfloat16'):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    finally:
      _TRACING.reset(token)
    leaves = jax.tree_util.tree_leaves(args)
    outs = _evaluate(closed.jaxpr, closed.consts, leaves)
    return jax.tree_util.tree_unflatten(tree_structure(shapes), outs)

  return rewritten


def tracing_bfloat16() -> bool:
  """Whether the function being traced now is one `bfloat16_products`
  rewrites: a layer may then compute its products in bfloat16 itself,
  summed in float32 (the output layer on AMX: `src.model.output_layer`)."""
  return _TRACING.get()


def _is_float32_product(eqn) -> bool:
  if eqn.primitive is not jax.lax.dot_general_p:
    return False
  wanted = eqn.params.get('preferred_element_type')
  inputs = all(v.aval.dtype == _F32 for v in eqn.invars)
  return inputs and wanted in (None, _F32)


class _Product(NamedTuple):
  """A rewritten product not computed yet: what reads it decides its
  orientation (a transpose that swaps its two operands' dimensions is
  computed as the swapped product, in the layout YNNPACK runs)."""

  lhs: jax.Array
  rhs: jax.Array
  dimension_numbers: tuple

  def value(self):
    return _bfloat16_dot(self.lhs, self.rhs, self.dimension_numbers)

  def transposed(self, permutation):
    """The product transposed by `permutation`, if that swaps the two
    operands' free dimensions (batch dimensions first): computed as the
    swapped product; None for any other permutation."""
    (lc, rc), (lb, rb) = self.dimension_numbers
    nb = len(lb)
    nl = self.lhs.ndim - nb - len(lc)
    nr = self.rhs.ndim - nb - len(rc)
    swap = (*range(nb), *range(nb + nl, nb + nl + nr), *range(nb, nb + nl))
    if tuple(permutation) != swap or not kernels.available():
      return None
    return _Product(self.rhs, self.lhs, ((rc, lc), (rb, lb)))


def _bfloat16_dot(lhs, rhs, dimension_numbers):
  """`dot_general` of bfloat16-rounded inputs, summed in float32; a left
  operand whose contracted dimensions come before its free ones is
  rounded and transposed by the CPU kernel first (`src.model.kernels`):
  XLA folds any transpose of its own back into the product, which
  YNNPACK then does not take."""
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
  nb, nc = len(lb), len(lc)
  free = lhs.ndim - nb - nc
  kernel = kernels.available()
  column_major = (
    kernel
    and nc > 0
    and lb == tuple(range(nb))
    and lc == tuple(range(nb, nb + nc))
    and free > 0
    and rc == tuple(range(rc[0], rc[0] + nc))
  )
  if not column_major:
    if kernel and lhs.size <= KERNEL_CAST_MAX:
      lhs = _cast(lhs)
    return jax.lax.dot_general(
      lhs.astype(_BF16), rhs.astype(_BF16), dimension_numbers,
      preferred_element_type=_F32,
    )  # fmt: skip
  shape, k = lhs.shape, math.prod(lhs.shape[nb : nb + nc])
  batch, rows = shape[:nb], shape[nb + nc :]
  flat = lhs.reshape(math.prod(batch), k, math.prod(rows))
  lhs = _cast_transpose(flat).reshape(*batch, *rows, k)
  r = rhs.shape
  rhs = rhs.reshape(*r[: rc[0]], k, *r[rc[0] + nc :]).astype(_BF16)
  rb = tuple(d if d < rc[0] else d - (nc - 1) for d in rb)
  numbers = (((nb + free,), (rc[0],)), (tuple(range(nb)), rb))
  return jax.lax.dot_general(lhs, rhs, numbers, preferred_element_type=_F32)


def _cast(x):
  """`x` rounded to bfloat16 by the CPU kernel (an opaque call)."""
  out = jax.ShapeDtypeStruct(x.shape, _BF16)
  return jax.ffi.ffi_call('jade_cast_bf16', out, vmap_method='sequential')(x)


def _cast_transpose(x):
  """`[b, k, m]` float32 to `[b, m, k]` bfloat16 by the CPU kernel."""
  b, k, m = x.shape
  out = jax.ShapeDtypeStruct((b, m, k), _BF16)
  return jax.ffi.ffi_call(
    'jade_cast_transpose_bf16', out, vmap_method='sequential'
  )(x)


def _evaluate(jaxpr, consts, args) -> list:
  """Evaluates `jaxpr` (with `consts`, on `args`), rewriting products."""
  env = {}

  def read(v):
    if isinstance(v, jax_core.Literal):
      return v.val
    if isinstance(found := env[v], _Product):
      env[v] = found = found.value()
    return found

  names = [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars)
  uses = collections.Counter(v for v in names if isinstance(v, jax_core.Var))
  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    if _is_float32_product(eqn):
      lhs, rhs = map(read, eqn.invars)
      outs = [_Product(lhs, rhs, eqn.params['dimension_numbers'])]
    elif (swapped := _swapped(eqn, env, uses)) is not None:
      outs = [swapped]
    else:
      inputs = [read(v) for v in eqn.invars]
      params = {k: _rewrite_param(v) for k, v in eqn.params.items()}
      params = chunk_attention.with_bfloat16_products(params) or params
      bind_params = eqn.primitive.get_bind_params(params)
      with eqn.ctx.manager:
        out = eqn.primitive.bind(*inputs, **bind_params)
      outs = out if eqn.primitive.multiple_results else [out]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _swapped(eqn, env, uses) -> _Product | None:
  """A transpose that is the only reader of a product not computed yet,
  as the swapped product (`_Product.transposed`); None otherwise."""
  if eqn.primitive is not jax.lax.transpose_p:
    return None
  (operand,) = eqn.invars
  if not isinstance(operand, jax_core.Var) or uses[operand] != 1:
    return None
  pending = env.get(operand)
  if not isinstance(pending, _Product):
    return None
  return pending.transposed(eqn.params['permutation'])


def _rewrite_param(value):
  """A nested jaxpr (closed or open, or a tuple of them) rewritten the same
  way; any other parameter as it is."""
  if isinstance(value, jax_core.ClosedJaxpr):
    return _rewrite_closed(value)
  if isinstance(value, jax_core.Jaxpr):
    if value.constvars:
      return value
    closed = _rewrite_closed(jax_core.ClosedJaxpr(value, ()))
    return value if closed.consts else closed.jaxpr
  if (
    isinstance(value, tuple)
    and value
    and all(isinstance(v, jax_core.ClosedJaxpr) for v in value)
  ):
    return tuple(_rewrite_closed(v) for v in value)
  return value


def _rewrite_closed(closed):
  if not _has_product(closed.jaxpr):
    return closed
  return jax.make_jaxpr(lambda *a: _evaluate(closed.jaxpr, closed.consts, a))(
    *closed.in_avals
  )


def _has_product(jaxpr) -> bool:
  """Whether `jaxpr` holds a float32 product, in a nested jaxpr too."""
  return any(
    _is_float32_product(eqn)
    or chunk_attention.with_bfloat16_products(eqn.params) is not None
    or any(map(_has_product, jax_core.jaxprs_in_params(eqn.params)))
    for eqn in jaxpr.eqns
  )
