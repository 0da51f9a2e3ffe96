"""Chunking: exact shapes, padding masks, random split, distinct chunks."""

import numpy as np
import pytest

from src import chatformat, chunks
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


def test_eval_split_holds_out_whole_conversations():
  ends = np.array([10, 30, 35, 60, 100, 120], np.int64)
  train, held, k = chunks.split_conversations(ends, 0.2, seed=0)
  starts = np.concatenate([[0], ends[:-1]])
  bounds = set(starts) | set(ends)
  for span in np.concatenate([train, held]):
    assert span[0] in bounds and span[1] in bounds  # Whole conversations.
  covered = np.zeros(120, int)
  for a, b in np.concatenate([train, held]):
    covered[a:b] += 1
  np.testing.assert_array_equal(covered, 1)  # Disjoint and complete.
  held_tokens = int((held[:, 1] - held[:, 0]).sum())
  assert held_tokens >= 0.2 * 120 and k >= 1
  # The seed chooses; the same seed chooses the same.
  again = chunks.split_conversations(ends, 0.2, seed=0)[1]
  np.testing.assert_array_equal(again, held)
  # Nothing to hold out: fraction 0, or one conversation.
  assert chunks.split_conversations(ends, 0.0, 0)[1] is None
  assert chunks.split_conversations(ends[:1], 0.5, 0)[1] is None
  with pytest.raises(UserError, match='eval-fraction'):
    chunks.split_conversations(ends, 1.5, 0)


def test_token_view_reads_spans_as_one_stream():
  tokens = np.arange(100, dtype=np.uint16)
  roles = (np.arange(100) % 3).astype(np.uint8)
  view = chunks.TokenView(tokens, roles, [[10, 20], [50, 55], [90, 100]])
  assert len(view) == 25
  ids, r = view.take(8, 17)
  np.testing.assert_array_equal(ids, [18, 19, 50, 51, 52, 53, 54, 90, 91])
  np.testing.assert_array_equal(r, roles[ids])
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(view.take(15, 99)[0], range(90, 100))


def test_loss_weights_are_exact(trained_tokenizer):
  tok = trained_tokenizer
  convs = chatformat.parse_text(
    'hi there\n'
    '|aigenerationstart| hello |endofgeneration|\n'
    'who are you\n'
    '|noloss| |aigenerationstart| a bot |endofgeneration|\n',
    'x.txt',
  )
  ids, roles, lengths = tok.encode_with_roles(convs)
  np.testing.assert_array_equal(ids, tok.encode_conversations(convs))
  assert lengths.tolist() == [len(ids)]
  u1, a1 = tok.encode('hi there'), tok.encode('hello')
  u2, a2 = tok.encode('who are you'), tok.encode('a bot')
  s, e = tok.ai_start_id, tok.ai_end_id
  assert ids.tolist() == u1 + [s] + a1 + [e] + u2 + [s] + a2 + [e, 1]
  # Default: all tokens but the |noloss| turn's text and end marker.
  default = [1] * (len(u1) + 1 + len(a1) + 1 + len(u2) + 1)
  default += [0] * (len(a2) + 1) + [1]
  ai_only = [0] * (len(u1) + 1) + [1] * (len(a1) + 1)
  ai_only += [0] * (len(u2) + 1 + len(a2) + 1 + 1)
  np.testing.assert_array_equal(chunks.loss_weights(roles, False), default)
  np.testing.assert_array_equal(chunks.loss_weights(roles, True), ai_only)
  # Through a batch: padding weighs 0, the rest as above.
  view = chunks.TokenView(ids, roles)
  n = len(ids)
  for ai, expected in ((False, default), (True, ai_only)):
    b = chunks.ChunkBatches(
      view, max_len=n + 5, batch_size=1, seed=0, ai_only=ai
    )
    got_ids, _, weights = b.batch(0)
    left = int(np.flatnonzero(got_ids[0])[0])
    want = np.zeros(n + 5, np.float32)
    want[left : left + n] = expected
    np.testing.assert_array_equal(weights[0], want)
