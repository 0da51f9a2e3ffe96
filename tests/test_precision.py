"""`precision.products = 'bfloat16'`: the step's products read bfloat16
and sum in float32 (`src.model.precision`), everywhere in the step and
nowhere else."""

import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from src.core.errors import UserError
from src.model import ginconf, kernels, losses, precision
from src.runtime import xla

from .conftest import MICRO, TINY_GIN, micro_args, run_script, train_settings

TYPE = r'tensor<(?:[^>]*x)?([a-z]+\d+)>'  # A tensor's element type.


def dots(fn, *args):
  """The lowered products of `jit(fn)`: `[(input types, output type)]`,
  each type the element type's name ('f32', 'bf16', 'i32')."""
  text = jax.jit(fn).lower(*args).as_text()
  found = []
  for line in re.findall(r'stablehlo.dot_general[^\n]*', text):
    ins, out = line.rsplit(': (', 1)[1].split(') -> ')
    kinds = re.findall(TYPE, ins)
    found.append((tuple(kinds), re.findall(TYPE, out)[0]))
  return found


def test_every_nested_float32_product_reads_bfloat16():
  """Products in scans, loops, conditionals and rematerialized code, and
  their gradients, read bfloat16 and sum in float32; integer and bfloat16
  products stay as they are; the result is float32's within bfloat16's
  rounding, not bit-equal."""
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32)
  x = jnp.asarray(rng.normal(size=(4, 3, 32)), jnp.float32)
  n = jnp.asarray(rng.integers(0, 5, (3, 3)), jnp.int32)

  def f(w, x):
    def step(c, xi):
      return jnp.tanh(c @ w) + xi, (c @ w).sum()

    c, ys = jax.lax.scan(step, x[0], x)
    c = jax.checkpoint(lambda a: jnp.sin(a @ w.T))(c)
    c = jax.lax.cond(c.sum() > 0, lambda a: a @ w, lambda a: a * 2.0, c)
    c = jax.lax.fori_loop(0, 2, lambda i, a: jnp.cos(a @ w), c)
    kept = (n @ n).sum() + (w.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16))
    return (c**2).sum() + ys.sum() + kept.astype(jnp.float32).sum()

  grad = jax.value_and_grad(f)
  rewritten = precision.bfloat16_products(grad)
  before, after = dots(grad, w, x), dots(rewritten, w, x)
  assert len(after) == len(before) >= 12
  low = (('bf16', 'bf16'), 'f32')
  for was, now in zip(sorted(before), sorted(after)):
    if was == (('f32', 'f32'), 'f32'):
      assert now == low
    else:  # The integer product and the bfloat16 one, as they were.
      assert now == was
  assert after.count(low) == before.count((('f32', 'f32'), 'f32')) >= 10
  (want, g_want), (got, g_got) = jax.jit(grad)(w, x), jax.jit(rewritten)(w, x)
  assert got.dtype == g_got.dtype == jnp.float32
  assert float(got) != float(want)
  np.testing.assert_allclose(got, want, rtol=2e-2)
  err = np.linalg.norm(g_got - g_want) / np.linalg.norm(g_want)
  assert 0 < err < 3e-2


def test_the_chunked_loss_reads_bfloat16_and_evaluation_float32():
  """The output layer and loss: the three products per chunk (logits, both
  gradients) read bfloat16; loss and gradients within bfloat16 rounding;
  `with_products('float32')` is the function itself."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 40, 32)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(32, 70)) * 0.2, jnp.float32)
  bias = jnp.asarray(rng.normal(size=(70,)) * 0.1, jnp.float32)
  targets = jnp.asarray(rng.integers(0, 70, (2, 40)), jnp.int32)
  weights = jnp.asarray(rng.integers(0, 2, (2, 40)), jnp.float32)

  def loss(x, kernel, bias):
    return losses.chunked_cross_entropy(x, kernel, bias, targets, weights, 16)

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  assert precision.with_products(grad, 'float32') is grad
  rewritten = precision.with_products(grad, 'bfloat16')
  assert dots(rewritten, x, kernel, bias) == [(('bf16', 'bf16'), 'f32')] * 3
  want, grads_want = jax.jit(grad)(x, kernel, bias)
  got, grads = jax.jit(rewritten)(x, kernel, bias)
  assert float(got) != float(want)
  np.testing.assert_allclose(got, want, rtol=2e-3)
  for g, gw in zip(grads, grads_want):
    assert g.dtype == jnp.float32 and not np.array_equal(g, gw)
    np.testing.assert_allclose(g, gw, atol=1e-2 * float(jnp.abs(gw).max()))


def _bits(x):
  return np.asarray(x).view(np.uint16)


def test_the_kernels_round_as_xla_does():
  """The CPU kernels' float32 -> bfloat16 (plain, and transposed in one
  pass) is XLA's convert bit for bit: ties to even, NaN, infinities,
  signed zeros, subnormals, shapes that are not whole tiles."""
  assert kernels.ready(), 'the kernels did not build here'
  rng = np.random.default_rng(5)
  x = rng.normal(size=(3, 70, 130)).astype(np.float32)
  one = np.float32(1.0).view(np.uint32)
  special = np.array(
    [one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001], np.uint32
  ).view(np.float32)  # Ties to even either way, and either side of a tie.
  x.flat[:10] = [*special, np.nan, np.inf, -np.inf, -0.0, 1e-40, 3e38]
  x = jnp.asarray(x)
  cast = jax.jit(precision._cast)(x)
  assert cast.dtype == jnp.bfloat16
  assert np.array_equal(_bits(cast), _bits(x.astype(jnp.bfloat16)))
  flipped = jax.jit(precision._cast_transpose)(x)
  want = jnp.swapaxes(x, 1, 2).astype(jnp.bfloat16)
  assert flipped.shape == (3, 130, 70)
  assert np.array_equal(_bits(flipped), _bits(want))


def test_a_products_layout_is_one_ynnpack_runs():
  """A product whose left operand is contracted on its first dimensions
  (a weight's gradient, x^T g) reads the kernels' transposed copy, and a
  transpose of a product is computed as the swapped product, not left to
  XLA (which would fold it back into a layout YNNPACK does not take); the
  values are the plain bfloat16 products'."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(2, 48, 40)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(2, 48, 24)), jnp.float32)

  def f(x, g):
    gradient = jnp.einsum('btd,bte->de', x, g)  # x^T g: contracted first.
    batched = jnp.einsum('btd,bte->bed', x, g)  # A transposed product.
    return gradient, jnp.swapaxes(batched, 1, 2)

  rewritten = jax.jit(precision.bfloat16_products(f))
  text = rewritten.lower(x, g).as_text()
  assert text.count('jade_cast_transpose_bf16') >= 2
  with mock.patch.object(kernels, 'available', lambda: False):
    plain = jax.jit(precision.bfloat16_products(f))
    assert 'jade_cast' not in plain.lower(x, g).as_text()
    want = plain(x, g)
  for got, w in zip(rewritten(x, g), want):
    assert got.shape == w.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def test_settings_are_checked():
  assert precision.precision() == 'float32'
  assert precision.precision('bfloat16') == 'bfloat16'
  with pytest.raises(UserError, match='precision.products'):
    precision.precision('float16')
  ginconf.parse(TINY_GIN, ("precision.products = 'bfloat16'",))
  assert ginconf.precision() == 'bfloat16'
  ginconf.parse(TINY_GIN)
  assert ginconf.precision() == 'float32'
  # 'auto': bfloat16 only on a CPU with bfloat16 dot instructions,
  # YNNPACK's products on and the kernels built.
  for native, ynn, built, want in (
    (True, True, True, 'bfloat16'),
    (True, False, True, 'float32'),
    (False, True, True, 'float32'),
    (True, True, False, 'float32'),
  ):
    with (
      mock.patch.object(xla, 'cpu_bf16_dot', return_value=native),
      mock.patch.object(xla, 'ynn_products', return_value=ynn),
      mock.patch.object(kernels, 'ready', return_value=built),
    ):
      assert precision.precision('auto') == want


def test_train_py_turns_on_what_bfloat16_products_need(tmp_path):
  """train.py reads the gin's `precision.products` before JAX starts: asked
  for bfloat16 (or 'auto') on a CPU with bfloat16 dot instructions, it
  turns YNNPACK's products on itself and trains in bfloat16 (its model line
  says so); on a CPU without them, 'bfloat16' is one line naming 'auto',
  and 'auto' trains in float32."""
  native = xla.cpu_bf16_dot()
  for kind in ('bfloat16', 'auto'):
    args = [*micro_args(str(tmp_path / kind), 2)]
    args += ['--bind', f"precision.products = '{kind}'"]
    r = run_script(args, {'XLA_FLAGS': ''})
    if kind == 'bfloat16' and not native:
      assert r.returncode == 2  # A UserError's exit (src/apps/cli.py).
      last = r.stderr.strip().splitlines()[-1]
      assert "'auto'" in last and 'Traceback' not in r.stderr
      continue
    assert r.returncode == 0, r.stderr[-2000:]
    assert ('bfloat16 products' in r.stdout) == native


def test_a_run_trains_with_bfloat16_products(tmp_path):
  """train(): the step's update reads bfloat16 in every product of the
  model and loss (no float32 product left), it trains (the loss falls),
  and the run refuses bfloat16 on a CPU without YNNPACK's products."""
  from src.training import trainer

  binds = (*MICRO, "precision.products = 'bfloat16'")
  settings = train_settings(tmp_path / 'off', steps=2)
  off = {'XLA_FLAGS': '--xla_cpu_experimental_ynn_fusion_type='}
  with mock.patch.dict(os.environ, off):
    with pytest.raises(UserError, match='precision.products'):
      trainer.train(settings, gin_bindings=binds, log=lambda line: None)
  lines = []
  settings = train_settings(tmp_path / 'run', steps=8, **{'eval-every': 8})
  with mock.patch.dict(os.environ, {'XLA_FLAGS': xla.YNN_PRODUCTS}):
    loop = trainer.train(settings, gin_bindings=binds, log=lines.append)
  # The model's and the loss's products, forward and backward; the update
  # around them (the optimizer, the weights' and gradients' norms) is
  # float32's.
  step = loop._trainer_per_task[0]
  model = step._accelerated_model_with_loss
  batch = loop._tasks[0].next_batch()
  key = jax.random.PRNGKey(0)
  found = dots(
    step._forward_and_backward_fn, batch, model.weights, model.state, key
  )
  assert len(found) > 20
  assert {kinds for kinds in found if 'i32' not in kinds[0]} == {
    (('bf16', 'bf16'), 'f32')
  }
  history = loop.history.get('train', 'metrics/loss')
  assert history[-1][1] < history[0][1]


def test_bfloat16_products_run_in_ynnpacks_individual_products(tmp_path):
  """With YNNPACK's individual products the micro model trains: every
  product reaches YNNPACK in its layout (the kernels' casts). Without the
  kernels (no compiler), XLA's CPU backend fails some bfloat16 products
  as the step runs: one line with the fixes, not a traceback. With
  YNNPACK's fused products the run trains on 8 devices."""
  binds = ['--bind', "precision.products = 'bfloat16'"]
  individual = {'XLA_FLAGS': xla.YNN_PRODUCTS}
  r = run_script([*micro_args(str(tmp_path / 'a'), 2), *binds], individual)
  assert r.returncode == 0, r.stderr[-2000:]
  without = {**individual, 'JADE_COMPILE_CACHE': 'off', 'PATH': str(tmp_path)}
  r = run_script([*micro_args(str(tmp_path / 'c'), 2), *binds], without)
  assert 'Traceback' not in r.stderr
  if r.returncode:  # jaxlib 0.10.2 fails it; a later one may run it.
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith('error: ') and 'precision.products' in last
    assert '--xla_cpu_experimental_ynn_fusion_type=dot' in last
  # YNNPACK's fused products run it, on 8 devices too (Trax's pmap'd step
  # calls the rewritten function).
  flags = '--xla_cpu_experimental_ynn_fusion_type=dot'
  fused = {'XLA_FLAGS': f'{flags} --xla_force_host_platform_device_count=8'}
  args = [*micro_args(str(tmp_path / 'b'), 2), '--batch-size', '8', *binds]
  r = run_script(args, fused)
  assert r.returncode == 0, r.stderr[-2000:]
  assert '8 device(s)' in r.stdout + r.stderr
