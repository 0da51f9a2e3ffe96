"""The output layer fused on AMX tiles (`src.model.output_layer`, the CPU
kernel `output_layer.cc`): the same loss, hits and gradients as XLA's
bfloat16 products, only where the step's products read bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from src.model import kernels, losses, output_layer, precision

AMX = pytest.mark.skipif(
  not (jax.default_backend() == 'cpu' and kernels.amx()),
  reason='the kernel runs on AMX tiles only',
)


def _problem(vocab, d, seed=3):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(2, 75, d)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(d, vocab)) * 0.3, jnp.float32)
  bias = jnp.asarray(rng.normal(size=(vocab,)) * 0.1, jnp.float32)
  targets = rng.integers(0, vocab, (2, 75))
  targets[0, :3] = vocab - 1  # The last piece, next to the padded rows.
  weights = rng.integers(0, 3, (2, 75)).astype(np.float32)
  return x, kernel, bias, jnp.asarray(targets, jnp.int32), jnp.asarray(weights)


def _step(targets, weights, chunk):
  """A fresh `(loss, hits), grads` function of (x, kernel, bias), traced
  with bfloat16 products (a new function each call: JAX caches a trace
  by the function, and the kernel's switch is read when tracing)."""

  def loss(x, kernel, bias):
    mean, hits, _ = losses.chunked_cross_entropy(
      x, kernel, bias, targets, weights, chunk, with_hits=True
    )
    return mean, hits

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  return jax.jit(precision.with_products(grad, 'bfloat16'))


def _uses_kernel(fn, *args) -> bool:
  return 'jade_output_chunk' in fn.lower(*args).as_text()


@AMX
@pytest.mark.parametrize('vocab,d,chunk', [(70, 32, 32), (131, 64, 64)])
def test_the_kernel_equals_xlas_bfloat16_products(monkeypatch, vocab, d, chunk):
  """Loss, hits and every gradient equal XLA's bfloat16 path within float
  rounding (a vocabulary not a multiple of 32, rows padded to a whole
  chunk, weights of 0, 1 and 2); both differ from float32's."""
  monkeypatch.setattr(output_layer, 'MIN_VOCAB', 1)
  x, kernel, bias, targets, weights = _problem(vocab, d)
  monkeypatch.setenv('JADE_OUTPUT_KERNEL', 'off')
  xla_step = _step(targets, weights, chunk)
  assert not _uses_kernel(xla_step, x, kernel, bias)
  (want, want_hits), want_grads = xla_step(x, kernel, bias)
  monkeypatch.setenv('JADE_OUTPUT_KERNEL', 'on')
  fused = _step(targets, weights, chunk)
  assert _uses_kernel(fused, x, kernel, bias)
  (got, hits), grads = fused(x, kernel, bias)
  assert float(hits) == float(want_hits) > 0
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # The kernel's exponential is not XLA's (~1 ulp): now and then a gradient
  # value rounds to the neighbouring bfloat16 (2^-8 of it) in one path.
  for g, w in zip(grads, want_grads):
    assert g.shape == w.shape and g.dtype == jnp.float32
    np.testing.assert_allclose(
      g, w, rtol=0, atol=1e-4 * float(jnp.abs(w).max())
    )

  def plain(x, kernel, bias):
    return losses.chunked_cross_entropy(
      x, kernel, bias, targets, weights, chunk
    )

  float32 = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))
  loss32, grads32 = float32(x, kernel, bias)
  assert not np.array_equal(grads[1], grads32[1])
  np.testing.assert_allclose(got, loss32, rtol=2e-3)


@AMX
def test_only_bfloat16_products_and_large_vocabularies_use_it(monkeypatch):
  """float32 products, a vocabulary under `MIN_VOCAB`, a chunk that is not
  a multiple of 32 and `JADE_OUTPUT_KERNEL=off` keep XLA's path; a float32
  trace of a function traced before with bfloat16 products does too."""
  x, kernel, bias, targets, weights = _problem(70, 32)
  monkeypatch.setattr(output_layer, 'MIN_VOCAB', 71)
  assert not _uses_kernel(_step(targets, weights, 32), x, kernel, bias)
  monkeypatch.setattr(output_layer, 'MIN_VOCAB', 1)
  assert not _uses_kernel(_step(targets, weights, 48), x, kernel, bias)
  monkeypatch.setenv('JADE_OUTPUT_KERNEL', 'off')
  assert not _uses_kernel(_step(targets, weights, 32), x, kernel, bias)
  monkeypatch.setenv('JADE_OUTPUT_KERNEL', 'on')

  def loss(x, kernel, bias):
    return losses.chunked_cross_entropy(x, kernel, bias, targets, weights, 32)

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  rewritten = jax.jit(precision.with_products(grad, 'bfloat16'))
  assert _uses_kernel(rewritten, x, kernel, bias)
  assert not _uses_kernel(jax.jit(grad), x, kernel, bias)
