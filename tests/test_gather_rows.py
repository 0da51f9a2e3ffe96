"""The row gathers' kernel (`src.model.gather_rows`): the same values and
gradients as XLA's gather and Trax's `permute_via_gather`; and
`JADE_KERNELS=off`, which keeps it and the other kernels off."""

import functools

import jax
import numpy as np
import pytest
from jax import numpy as jnp
from trax.layers.research import efficient_attention as ea

from src.model import gather_rows, kernels

pytestmark = pytest.mark.skipif(
  not kernels.available(), reason='the CPU kernels cannot be built here'
)


def _rows(shape, seed=0):
  return jnp.asarray(
    np.random.default_rng(seed).standard_normal(shape), jnp.float32
  )


def test_take_rows_is_take_with_its_gradient_under_vmap():
  """Indices that repeat (two hash rounds of 1,500 positions) and rows of
  several features (`[n, 3, 5]`): the values are XLA's, and the gradient
  adds each position's rows up (exactly: the same order)."""
  n = 1500
  x = _rows((4, n, 3, 5))
  rng = np.random.default_rng(1)
  idx = jnp.asarray(
    np.stack(
      [
        np.concatenate([rng.permutation(n), rng.permutation(n)])
        for _ in range(4)
      ]
    ),
    jnp.int32,
  )
  assert idx.shape[1] >= gather_rows.MIN_ROWS
  weights = _rows((4, 2 * n, 3, 5), seed=2)

  def loss(take, x):
    return jnp.sum(jax.vmap(take)(x, idx) * weights)

  ours = jax.jit(jax.value_and_grad(lambda x: loss(gather_rows.take_rows, x)))
  xla = jax.value_and_grad(
    lambda x: loss(lambda a, i: jnp.take(a, i, axis=0), x)
  )
  np.testing.assert_array_equal(
    np.asarray(jax.vmap(gather_rows.take_rows)(x, idx)),
    np.asarray(jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(x, idx)),
  )
  (v1, g1), (v2, g2) = ours(x), xla(x)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
  np.testing.assert_allclose(
    np.asarray(g1), np.asarray(g2), rtol=1e-6, atol=1e-6
  )


def test_permute_rows_is_trax_permute_via_gather():
  """A permutation and its inverse, on `[n, d]` rows and on `[n]` values
  (the logits), forward and gradient, against Trax's."""
  n = 2048
  perm = jnp.asarray(np.random.default_rng(3).permutation(n), jnp.int32)
  inverse = jnp.zeros_like(perm).at[perm].set(jnp.arange(n, dtype=jnp.int32))
  for shape in ((n, 64), (n,)):
    x, w = _rows(shape, 4), _rows(shape, 5)

    def loss(permute, x, w=w):
      return jnp.sum(permute(x, perm, inverse) * w)

    ours = jax.grad(lambda x, loss=loss: loss(gather_rows.permute_rows, x))
    trax_ = jax.grad(
      lambda x, loss=loss: loss(
        lambda a, p, i: ea.permute_via_gather(a, p, i, axis=0), x
      )
    )
    np.testing.assert_array_equal(
      np.asarray(gather_rows.permute_rows(x, perm, inverse)),
      np.asarray(x)[np.asarray(perm)],
    )
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(trax_(x)))


def test_small_calls_keep_xlas_gather(monkeypatch):
  """Below `MIN_ROWS` XLA gathers (a test's tiny model); the kernel's
  rows are the same when it is made to run (other shapes: `make_jaxpr`
  keeps what it traced)."""
  x = _rows((10, 4))
  few = jnp.asarray([3, 3, 0, 9], jnp.int32)
  assert 'ffi_call' not in str(jax.make_jaxpr(gather_rows.take_rows)(x, few))
  monkeypatch.setattr(gather_rows, 'MIN_ROWS', 1)
  idx = jnp.asarray([3, 3, 0, 9, 1], jnp.int32)
  assert 'ffi_call' in str(jax.make_jaxpr(gather_rows.take_rows)(x, idx))
  np.testing.assert_array_equal(
    np.asarray(gather_rows.take_rows(x, idx)), np.asarray(x)[[3, 3, 0, 9, 1]]
  )


def test_jade_kernels_off_keeps_every_call_on_xla(monkeypatch):
  """`JADE_KERNELS=off`: the gathers, the hash and the fused attention
  compute as without a compiler (no call of ours in what XLA compiles),
  with the same values; unset, the same calls are the kernels'."""
  from src.model import chunk_attention, lsh_hash

  n = 2 * gather_rows.MIN_ROWS
  x, idx = _rows((n, 8)), jnp.arange(n, dtype=jnp.int32)[::-1]
  vecs, rotations = _rows((n, 16), seed=1), _rows((1, 4, 16), seed=2)
  q = _rows((n, 16), seed=3)
  mask = functools.partial(ea.mask_self_attention, causal=True)

  def calls():  # A new function each time: jit keeps what it traced.
    def all_three(x, idx, vecs, rotations, q):
      take = gather_rows.take_rows(x, idx)
      ids = lsh_hash.bucket_ids(vecs, rotations)
      out = chunk_attention.attend(
        q, None, q, q_chunk_len=256, n_chunks_before=1, mask_fn=mask
      )[0]
      return take, ids, out

    return jax.jit(all_three)

  args = (x, idx, vecs, rotations, q)
  monkeypatch.setattr(chunk_attention, 'MIN_SCORES', 0)
  ours = calls().lower(*args).as_text()
  found = calls()(*args)
  assert 'jade_gather_rows' in ours and 'jade_lsh_buckets' in ours
  assert 'jade_chunk_attention_forward' in ours
  monkeypatch.setenv('JADE_KERNELS', 'off')
  assert not kernels.ready() and not kernels.available()
  assert 'jade_' not in calls().lower(*args).as_text()
  for a, b in zip(found, calls()(*args)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
