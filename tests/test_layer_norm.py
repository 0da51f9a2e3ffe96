"""The normalization kernels (`src.model.layer_norm`): Trax's `LayerNorm`
values and gradients, the same weights in the model, and Trax's own
formula where the kernel does not run; the LSH layer's normalized keys."""

import jax
import numpy as np
import pytest
import trax
from jax import numpy as jnp
from trax.layers import normalization
from trax.layers.research import efficient_attention as ea

from src.model import ginconf, kernels, layer_norm, reformer
from tests.conftest import TINY_GIN

needs_kernels = pytest.mark.skipif(
  not kernels.available(), reason='the CPU kernels cannot be built here'
)


def _values(shape, seed, scale=1.0, shift=0.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * scale + shift, jnp.float32)


def _trax_layer(center=True):
  layer = normalization.LayerNorm(center=center)
  return lambda x, w: layer.pure_fn(x, w, (), None)[0]


def _ours(center=True):
  layer = layer_norm.LayerNorm(center=center)
  return lambda x, w: layer.pure_fn(x, w, (), None)[0]


def _loss_and_grads(norm, x, weights, g):
  return jax.jit(
    jax.value_and_grad(lambda x, w: jnp.sum(norm(x, w) * g), argnums=(0, 1))
  )(x, weights)


@needs_kernels
@pytest.mark.parametrize('shape', [(2, 700, 64), (1, 1024, 256)])
def test_values_and_gradients_are_traxs(shape):
  """Rows far from centered and scaled (mean 3, std 5), weights not at
  their start: the output, the input's gradient and the weights' (summed
  over 1,400 and 1,024 rows) within float rounding of Trax's layer, by
  the kernel (its call in what XLA compiles), the same bits run twice."""
  d = shape[-1]
  x = _values(shape, 0, scale=5.0, shift=3.0)
  weights = (_values((d,), 1, shift=1.0), _values((d,), 2))
  g = _values(shape, 3)
  hlo = jax.jit(_ours()).lower(x, weights).as_text()
  assert 'jade_layer_norm' in hlo
  grad_hlo = (
    jax.jit(jax.grad(lambda x, w: jnp.sum(_ours()(x, w) * g), argnums=(0, 1)))
    .lower(x, weights)
    .as_text()
  )
  assert 'jade_layer_norm_backward' in grad_hlo
  np.testing.assert_allclose(
    np.asarray(_ours()(x, weights)),
    np.asarray(_trax_layer()(x, weights)),
    rtol=1e-5,
    atol=2e-5,
  )
  (v1, (dx1, dw1)), (v2, (dx2, dw2)) = (
    _loss_and_grads(_ours(), x, weights, g),
    _loss_and_grads(_trax_layer(), x, weights, g),
  )
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(dx1), np.asarray(dx2), atol=2e-5)
  for a, b in zip(dw1, dw2):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-4
    )
  again = _loss_and_grads(_ours(), x, weights, g)[1]
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves((dx1, dw1))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_kernels
def test_under_vmap_and_rematerialization():
  """Inside `vmap` (a call per entry) and `jax.checkpoint` (Trax's
  feed-forward chunks): the same values and gradients as Trax's."""
  x = _values((3, 1024, 32), 4, scale=2.0)
  weights = (_values((32,), 5), _values((32,), 6))

  def loss(norm):
    body = jax.checkpoint(jax.vmap(norm, in_axes=(0, None)))
    return jax.grad(lambda x, w: jnp.sum(jnp.sin(body(x, w))), argnums=(0, 1))

  ours, theirs = loss(_ours())(x, weights), loss(_trax_layer())(x, weights)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4
    )


def test_where_the_kernel_does_not_run_it_is_traxs_formula(monkeypatch):
  """Below `MIN_ROWS` (a chat's token), RMS normalization, a width not a
  multiple of 8, or `JADE_NORM_KERNEL=off`: no call of ours, and Trax's
  layer's values bit for bit."""
  cases = [
    ((1, 5, 64), True),
    ((2048, 64), False),
    ((2048, 12), True),
  ]
  monkeypatch.setenv('JADE_NORM_KERNEL', 'off')
  cases.append(((2048, 64), True))
  for shape, center in cases:
    d = shape[-1]
    x = _values(shape, 7, scale=3.0)
    weights = (_values((d,), 8), _values((d,), 9))
    assert 'jade_' not in jax.jit(_ours(center)).lower(x, weights).as_text()
    np.testing.assert_array_equal(
      np.asarray(jax.jit(_ours(center))(x, weights)),
      np.asarray(jax.jit(_trax_layer(center))(x, weights)),
    )


def test_the_model_has_ours_with_traxs_weights():
  """The model (tiny.gin) has `layer_norm.LayerNorm` wherever Trax's model has
  Trax's (each block's two branches and before the output: 2 per layer
  plus 1), with the same settings, and the weights' shapes are Trax's:
  a checkpoint of either model loads into the other."""
  ginconf.parse(TINY_GIN)
  ours = ginconf.model(40, 'train')
  theirs = trax.models.ReformerLM(vocab_size=40, mode='train')

  def norms(model):
    return [
      x
      for x in reformer.all_layers(model)
      if isinstance(x, normalization.LayerNorm)
    ]

  assert len(norms(ours)) == len(norms(theirs)) > 2
  assert all(type(x) is layer_norm.LayerNorm for x in norms(ours))
  assert [(x._center, x._epsilon) for x in norms(ours)] == [
    (x._center, x._epsilon) for x in norms(theirs)
  ]
  signature = trax.shapes.ShapeDtype((1, 512), jnp.int32)
  ours.init(signature)
  theirs.init(signature)
  shapes = jax.tree.map(lambda w: getattr(w, 'shape', None), ours.weights)
  assert shapes == jax.tree.map(
    lambda w: getattr(w, 'shape', None), theirs.weights
  )


@needs_kernels
def test_unit_rows_are_traxs_normalized_keys():
  """The LSH layer's shared keys (`length_normalized(q) / sqrt(d)`) under
  `vmap` over heads, forward and gradient, by the kernel; Trax's formula
  below `MIN_ROWS`."""
  x = _values((4, 1024, 64), 10, scale=3.0, shift=0.5)
  g = _values((4, 1024, 64), 11)

  def trax_keys(x):
    return ea.length_normalized(x) / jnp.sqrt(jnp.asarray(64.0))

  def ours(x):
    return jax.vmap(lambda r: layer_norm.unit_rows(r, 1 / 8))(x)

  assert 'jade_unit_rows' in jax.jit(ours).lower(x).as_text()
  np.testing.assert_allclose(
    np.asarray(jax.jit(ours)(x)), np.asarray(trax_keys(x)), atol=1e-6
  )
  grads = [
    jax.jit(lambda x, g, f=f: jax.vjp(f, x)[1](g)[0])(x, g)
    for f in (ours, trax_keys)
  ]
  np.testing.assert_allclose(
    np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-5, atol=1e-6
  )
  few = x[:, :5]
  assert 'jade_' not in jax.jit(ours).lower(few).as_text()
  np.testing.assert_allclose(
    np.asarray(ours(few)), np.asarray(trax_keys(few)), atol=1e-7
  )
