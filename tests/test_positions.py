"""Axial positions for any window of the grid (src/model/positions.py)."""

import jax
import numpy as np
from trax import layers as tl
from trax import shapes

from src.model import positions


def _layer(mode, offset='zero'):
  layer = positions.AxialPositions(
    shape=(8, 16), d_embs=(4, 4), dropout=0.0, mode=mode, offset=offset
  )
  layer.init(shapes.ShapeDtype((2, 128, 8), np.float32), rng=jax.random.key(0))
  return layer


def test_a_full_window_is_traxs_and_a_short_one_its_first_rows():
  layer = _layer('eval')
  zeros = np.zeros((2, 128, 8), np.float32)
  table = np.asarray(layer(zeros))
  trax_ = np.asarray(tl.AxialPositionalEncoding.forward(layer, zeros))
  np.testing.assert_array_equal(table, trax_)
  short = np.asarray(layer(np.zeros((2, 48, 8), np.float32)))
  np.testing.assert_array_equal(short, table[:, :48])


def test_random_offsets_place_each_training_window_on_the_grid():
  """In training with offset 'random', each example's window is a run of
  consecutive grid positions starting anywhere; evaluation starts at 0."""
  table = np.asarray(_layer('eval')(np.zeros((1, 128, 8), np.float32)))[0]
  layer = _layer('train', 'random')
  starts = set()
  for seed in range(6):
    layer.rng = jax.random.key(seed)
    out = np.asarray(layer(np.zeros((2, 32, 8), np.float32)))
    for row in out:
      start = int(np.flatnonzero((table == row[0]).all(-1))[0])
      np.testing.assert_array_equal(row, table[start : start + 32])
      starts.add(start)
  assert len(starts) > 6 and max(starts) > 32


def test_a_windows_gradient_is_the_full_tables():
  """The rows a window reads are taken from each axis by coordinate, the
  `[max_len, d_model]` table never built: the same values and gradients as
  taking them from that table."""
  layer = _layer('train', 'random')
  layer.rng = jax.random.key(3)
  x = np.random.default_rng(0).normal(size=(2, 40, 8)).astype(np.float32)
  starts = jax.random.randint(layer.rng, (2,), 0, 128 - 40 + 1)
  at = starts[:, None] + np.arange(40)[None, :]

  def by_table(weights):
    table = jax.numpy.concatenate(
      [
        jax.numpy.broadcast_to(w, (1, 8, 16, w.shape[-1])).reshape(128, -1)
        for w in weights
      ],
      -1,
    )
    return jax.numpy.sum((x + table[at]) ** 2)

  def by_layer(weights):
    out, _ = layer.pure_fn(x, weights, layer.state, layer.rng)
    return jax.numpy.sum(out**2)

  weights = layer.weights
  np.testing.assert_allclose(by_layer(weights), by_table(weights), rtol=1e-6)
  for got, want in zip(
    jax.grad(by_layer)(weights), jax.grad(by_table)(weights), strict=True
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
