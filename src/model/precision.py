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
touching a layer. Products already in another type, integer products and
the attention kernel's own (`src.model.chunk_attention`, float32) are left
as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.tree_util import tree_structure

from src.core.errors import UserError
from src.runtime import xla

PRODUCTS = ('float32', 'bfloat16')
_F32 = jnp.dtype('float32')
_BF16 = jnp.dtype('bfloat16')


def precision(products: str = 'float32') -> str:
  """Training's matrix products (gin: precision).

  Args:
    products: 'float32', or 'bfloat16': every float32 product of a training
      step reads its inputs rounded to bfloat16 and sums in float32;
      weights, optimizer, softmax and loss stay float32, and evaluation and
      chat compute in float32. On a CPU it needs bfloat16 instructions
      (AVX512-BF16, AMX) and `XLA_FLAGS=` the flag
      `src.runtime.xla.YNN_PRODUCTS` names.

  Returns:
    The products' input type.
  """
  if products not in PRODUCTS:
    raise UserError(
      f"precision.products = {products!r}: write 'float32' or 'bfloat16' "
      'in the gin file'
    )
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
    f'(a product with transposed operands); run with XLA_FLAGS={xla.YNN_FLAG}'
    "=dot (slower on some models), or set precision.products = 'float32'"
  )


def bfloat16_products(fn):
  """`fn` with every float32 x float32 `dot_general` reading bfloat16
  inputs and summing in float32 (see the module's docstring)."""

  @functools.wraps(fn)
  def rewritten(*args):
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    leaves = jax.tree_util.tree_leaves(args)
    outs = _evaluate(closed.jaxpr, closed.consts, leaves)
    return jax.tree_util.tree_unflatten(tree_structure(shapes), outs)

  return rewritten


def _is_float32_product(eqn) -> bool:
  if eqn.primitive is not jax.lax.dot_general_p:
    return False
  wanted = eqn.params.get('preferred_element_type')
  inputs = all(v.aval.dtype == _F32 for v in eqn.invars)
  return inputs and wanted in (None, _F32)


def _product(eqn, lhs, rhs):
  params = eqn.params
  return jax.lax.dot_general(
    lhs.astype(_BF16),
    rhs.astype(_BF16),
    params['dimension_numbers'],
    precision=params.get('precision'),
    preferred_element_type=_F32,
  )


def _evaluate(jaxpr, consts, args) -> list:
  """Evaluates `jaxpr` (with `consts`, on `args`), rewriting products."""
  env = {}

  def read(v):
    return v.val if isinstance(v, jax_core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    inputs = [read(v) for v in eqn.invars]
    if _is_float32_product(eqn):
      outs = [_product(eqn, *inputs)]
    else:
      params = {k: _rewrite_param(v) for k, v in eqn.params.items()}
      bind_params = eqn.primitive.get_bind_params(params)
      with eqn.ctx.manager:
        out = eqn.primitive.bind(*inputs, **bind_params)
      outs = out if eqn.primitive.multiple_results else [out]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


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
    or any(map(_has_product, jax_core.jaxprs_in_params(eqn.params)))
    for eqn in jaxpr.eqns
  )
