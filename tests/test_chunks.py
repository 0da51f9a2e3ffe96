"""Chunking: exact shapes, padding masks, random split, distinct chunks."""

import numpy as np
import pytest

from src import chunks
from src.errors import UserError


def test_shapes_padding_and_weights_with_odd_max_len():
  stream = np.arange(3, 3 + 23, dtype=np.int32)  # 23 tokens, max_len 7.
  b = chunks.ChunkBatches(stream, max_len=7, batch_size=2, seed=0)
  assert b.n_chunks == 4 and b.steps_per_epoch == 2
  inputs, targets, weights = b.batch(0)
  assert inputs.shape == targets.shape == weights.shape == (2, 7)
  assert inputs.dtype == np.int32 and weights.dtype == np.float32
  np.testing.assert_array_equal(inputs, targets)
  seen = []
  for step in range(2):  # One epoch covers all four chunks.
    ids, _, w = b.batch(step)
    for row, wrow in zip(ids, w):
      real = row[wrow == 1]
      assert np.all(row[wrow == 0] == 0)
      # Real tokens are contiguous: padding only at the two ends.
      nz = np.flatnonzero(wrow)
      assert nz[-1] - nz[0] + 1 == len(nz)
      seen.append(tuple(real))
  assert sorted(seen) == sorted(
    tuple(stream[i : i + 7]) for i in range(0, 23, 7)
  )


def test_padding_split_is_random_and_seeded():
  stream = np.ones(2, np.int32)  # One 2-token chunk, 30 padding positions.
  lefts = set()
  for seed in range(20):
    b = chunks.ChunkBatches(stream, max_len=32, batch_size=1, seed=seed)
    lefts.add(int(np.flatnonzero(b.batch(0)[2][0])[0]))
  assert len(lefts) > 5  # Not always left, not always right.
  b = chunks.ChunkBatches(stream, 32, 1, seed=3)
  np.testing.assert_array_equal(b.batch(5)[0], b.batch(5)[0])


def test_each_device_row_gets_a_different_chunk_every_step():
  stream = np.arange(1, 1 + 64 * 40, dtype=np.int32)
  b = chunks.ChunkBatches(stream, max_len=64, batch_size=8, seed=1)
  for step in range(20):
    ids = b.chunk_ids(step)
    assert len(set(ids.tolist())) == 8
  # Epochs are seeded permutations: every chunk once per epoch (5 steps).
  epoch = np.concatenate([b.chunk_ids(s) for s in range(5)])
  assert sorted(epoch.tolist()) == list(range(40))
  assert not np.array_equal(b.chunk_ids(0), b.chunk_ids(5))


def test_batch_size_must_divide_across_devices():
  assert chunks.batch_size_for(8, 0) == 8
  assert chunks.batch_size_for(8, 16) == 16
  with pytest.raises(
    UserError, match='batch-size 6 does not split evenly across 8 device'
  ):
    chunks.batch_size_for(8, 6)


def test_eval_split_cuts_after_a_turn_boundary():
  end = 9
  stream = np.array([5, 5, end, 6, 6, 6, end, 7, 7, end, 1], np.int32)
  train, held = chunks.split_eval(stream, 0.3, [end, 1])
  assert len(train) + len(held) == len(stream)
  assert train[-1] == end
  np.testing.assert_array_equal(held, [7, 7, end, 1])
  same_a, same_b = chunks.split_eval(stream, 0.0, [end])
  assert same_a is same_b
  with pytest.raises(UserError, match='eval-fraction'):
    chunks.split_eval(stream, 1.5, [end])


def test_ai_only_loss_weights_are_exact():
  start, end, eos = 3, 4, 1
  #         user  user start  ai  ai  end  eos  start ai end
  stream = np.array([7, 8, start, 9, 10, end, eos, start, 11, end], np.int32)
  mask = chunks.ai_loss_mask(stream, start, end)
  np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1, 0, 0, 1, 1])
  b = chunks.ChunkBatches(
    stream, max_len=12, batch_size=1, seed=0, token_weights=mask
  )
  ids, _, weights = b.batch(0)
  left = int(np.flatnonzero(ids[0])[0])
  expected = np.zeros(12, np.float32)
  expected[left : left + 10] = mask
  np.testing.assert_array_equal(weights[0], expected)
  # Off by default: every real token weighs 1.
  plain = chunks.ChunkBatches(stream, 12, 1, seed=0).batch(0)[2][0]
  np.testing.assert_array_equal(plain, (ids[0] != 0).astype(np.float32))
