"""Training windows: exact shapes, padding masks, random split, distinct
windows."""

import numpy as np
import pytest

from src.core.errors import UserError
from src.data import chatformat, windows


def _convs(lengths, first=3):
  """A stream of conversations whose tokens are all distinct, and its view."""
  ends = np.cumsum(lengths).astype(np.int64)
  stream = np.arange(first, first + ends[-1], dtype=np.int32)
  view = windows.TokenView(stream, None, windows.conversation_spans(ends))
  return stream, ends, view


def _real(ids, weights):
  """Each row's real tokens; checks padding is only at the two ends."""
  out = []
  for row, w in zip(ids, weights):
    nz = np.flatnonzero(w)
    assert np.all(row[w == 0] == 0)
    assert nz[-1] - nz[0] + 1 == len(nz)  # Contiguous.
    out.append(row[w > 0])
  return out


def _epoch_windows(b, epoch):
  """The real tokens of every window of an epoch, in stream order."""
  view, starts, lengths, _ = b.layout(epoch)
  return [view.take(int(a), int(a + n))[0] for a, n in zip(starts, lengths)]


def test_fixed_windows_shapes_padding_and_weights_with_odd_max_len():
  stream = np.arange(3, 3 + 23, dtype=np.int32)  # 23 tokens, max_len 7.
  b = windows.WindowBatches(stream, 7, 2, seed=0, windows='fixed')
  assert b.n_chunks == 4 and b.steps_per_epoch == 2
  inputs, targets, weights = b.batch(0)
  assert inputs.shape == targets.shape == weights.shape == (2, 7)
  assert inputs.dtype == np.int32 and weights.dtype == np.float32
  np.testing.assert_array_equal(inputs, targets)
  seen = []
  for step in range(2):  # One epoch covers all four windows.
    ids, _, w = b.batch(step)
    seen += [tuple(r) for r in _real(ids, w)]
  assert sorted(seen) == sorted(
    tuple(stream[i : i + 7]) for i in range(0, 23, 7)
  )


def test_moving_windows_change_offset_and_order_every_epoch():
  lengths = np.random.default_rng(0).integers(5, 40, size=60)
  stream, ends, view = _convs(lengths)
  b = windows.WindowBatches(view, 64, 2, seed=4, pad_fraction=0.2)
  offsets = []  # Where the first token of each conversation lands.
  for epoch in range(6):
    got = _epoch_windows(b, epoch)
    offsets.append(
      [
        next(int(i[0]) for i in (np.flatnonzero(w == t) for w in got) if i.size)
        for t in stream[np.concatenate([[0], ends[:3]])]
      ]
    )
    assert all(0 < len(w) <= 64 for w in got)
    # Every window after the first holds 64 * (1 - 0.2) tokens or more
    # (the last one: whatever is left).
    assert all(len(w) >= 52 for w in got[1:-1])
  # A conversation lands at a different place of its window each epoch.
  for k in range(4):
    assert len({o[k] for o in offsets}) >= 5
  starts0 = b.grid(0)[0]
  assert not np.array_equal(starts0, b.grid(1)[0])
  assert not np.all(starts0 % 64 == 0)


def test_every_conversation_whole_and_once_per_epoch():
  lengths = np.random.default_rng(1).integers(3, 150, size=80)  # Some > 64.
  stream, ends, view = _convs(lengths)
  starts = np.concatenate([[0], ends[:-1]])
  b = windows.WindowBatches(view, 64, 4, seed=2, pad_fraction=0.3)
  for epoch in range(4):
    packed = np.concatenate(_epoch_windows(b, epoch))
    # Every token exactly once.
    assert sorted(packed.tolist()) == stream.tolist()
    # Each conversation is contiguous and in its own order.
    where = np.empty(len(stream) + 3, np.int64)
    where[packed] = np.arange(len(packed))
    for a, e in zip(starts, ends):
      pos = where[stream[a:e]]
      np.testing.assert_array_equal(pos, np.arange(pos[0], pos[0] + e - a))
  order = [np.concatenate(_epoch_windows(b, e))[:50] for e in range(3)]
  assert not np.array_equal(order[0], order[1])


def test_padding_has_the_configured_share():
  stream, ends, view = _convs([50] * 400)
  for fraction in (0.0, 0.1, 0.4):
    b = windows.WindowBatches(view, 100, 8, seed=0, pad_fraction=fraction)
    ids, _, w = b.batch(3)
    inner = _epoch_windows(b, 0)[1:-1]
    real = np.array([len(x) for x in inner])
    assert real.max() <= 100 and real.min() >= 100 * (1 - fraction)
    if fraction:  # Uniform lengths: mean padding is half the maximum.
      mean_pad = 100 - real.mean()
      assert 0.35 * fraction * 100 < mean_pad < 0.65 * fraction * 100
    else:
      assert real.min() == 100


def test_padding_split_is_random_and_seeded():
  stream = np.ones(2, np.int32)  # One 2-token window, 30 padding positions.
  lefts = set()
  for seed in range(20):
    b = windows.WindowBatches(stream, max_len=32, batch_size=1, seed=seed)
    lefts.add(int(np.flatnonzero(b.batch(0)[2][0])[0]))
  assert len(lefts) > 5  # Not always left, not always right.
  b = windows.WindowBatches(stream, 32, 1, seed=3)
  np.testing.assert_array_equal(b.batch(5)[0], b.batch(5)[0])


def test_resume_at_any_step_reproduces_the_batches():
  lengths = np.random.default_rng(3).integers(3, 90, size=70)
  _, _, view = _convs(lengths)
  a = windows.WindowBatches(view, 32, 2, seed=9)
  first = [a.batch(s) for s in range(200)]  # Many epochs, in order.
  for step in (0, 1, 57, 130, 199, 75):  # Fresh objects, any order.
    b = windows.WindowBatches(view, 32, 2, seed=9)
    got = next(b.iterate(step))
    for x, y in zip(got, first[step]):
      np.testing.assert_array_equal(x, y)


def test_each_device_row_gets_a_different_window_every_step():
  lengths = np.random.default_rng(5).integers(3, 60, size=100)
  stream, _, view = _convs(lengths)
  b = windows.WindowBatches(view, 64, 8, seed=1)
  epoch_steps = []
  for step in range(40):
    ids, _, w = b.batch(step)
    rows = [tuple(r) for r in _real(ids, w)]
    assert len(set(rows)) == 8
    assert len(set(b.window_ids(step).tolist())) == 8
    epoch_steps.append(b.locate(step)[0])
  # The windows of one epoch's full batches are distinct windows.
  n0 = epoch_steps.count(0)
  used = np.concatenate([b.window_ids(s) for s in range(n0)])
  assert len(set(used.tolist())) == len(used) == n0 * 8
  assert not np.array_equal(b.window_ids(0), b.window_ids(n0))


def test_bad_window_settings_are_errors():
  stream = np.ones(10, np.int32)
  with pytest.raises(UserError, match='pad-fraction 1.0'):
    windows.WindowBatches(stream, 8, 1, 0, pad_fraction=1.0)
  with pytest.raises(UserError, match='windows .sliding. is not one of'):
    windows.WindowBatches(stream, 8, 1, 0, windows='sliding')


def test_batch_size_must_divide_across_devices():
  assert windows.batch_size_for(8, 0) == 8
  assert windows.batch_size_for(8, 16) == 16
  with pytest.raises(
    UserError, match='batch-size 6 does not split evenly across 8 device'
  ):
    windows.batch_size_for(8, 6)


def test_eval_split_holds_out_whole_conversations():
  ends = np.array([10, 30, 35, 60, 100, 120], np.int64)
  train, held, k = windows.split_conversations(ends, 0.2, seed=0)
  starts = np.concatenate([[0], ends[:-1]])
  whole = set(zip(starts.tolist(), ends.tolist()))
  for span in np.concatenate([train, held]):
    assert tuple(span.tolist()) in whole  # Whole conversations.
  covered = np.zeros(120, int)
  for a, b in np.concatenate([train, held]):
    covered[a:b] += 1
  np.testing.assert_array_equal(covered, 1)  # Disjoint and complete.
  held_tokens = int((held[:, 1] - held[:, 0]).sum())
  assert held_tokens >= 0.2 * 120 and k >= 1
  # The seed chooses; the same seed chooses the same.
  again = windows.split_conversations(ends, 0.2, seed=0)[1]
  np.testing.assert_array_equal(again, held)
  # Nothing to hold out: fraction 0, or one conversation.
  assert windows.split_conversations(ends, 0.0, 0)[1] is None
  assert windows.split_conversations(ends[:1], 0.5, 0)[1] is None
  with pytest.raises(UserError, match='eval-fraction'):
    windows.split_conversations(ends, 1.5, 0)


def test_token_view_reads_spans_as_one_stream():
  tokens = np.arange(100, dtype=np.uint16)
  roles = (np.arange(100) % 3).astype(np.uint8)
  view = windows.TokenView(tokens, roles, [[10, 20], [50, 55], [90, 100]])
  assert len(view) == 25
  ids, r = view.take(8, 17)
  np.testing.assert_array_equal(ids, [18, 19, 50, 51, 52, 53, 54, 90, 91])
  np.testing.assert_array_equal(r, roles[ids])
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(view.take(15, 99)[0], range(90, 100))
  np.testing.assert_array_equal(view.take(11, 14)[0], [51, 52, 53])
  back = view.reordered(np.array([2, 0, 1]))
  np.testing.assert_array_equal(back.take(8, 13)[0], [98, 99, 10, 11, 12])
  assert len(view.take(30, 40)[0]) == 0


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
  np.testing.assert_array_equal(windows.loss_weights(roles, False), default)
  np.testing.assert_array_equal(windows.loss_weights(roles, True), ai_only)
  # Through a batch: padding weighs 0, the rest as above.
  view = windows.TokenView(ids, roles)
  n = len(ids)
  for ai, expected in ((False, default), (True, ai_only)):
    b = windows.WindowBatches(
      view, n + 5, 1, seed=0, ai_only=ai, windows='fixed'
    )
    got_ids, _, weights = b.batch(0)
    left = int(np.flatnonzero(got_ids[0])[0])
    want = np.zeros(n + 5, np.float32)
    want[left : left + n] = expected
    np.testing.assert_array_equal(weights[0], want)


def _replayed(data_lengths, replay_lengths, share=0.5, **kw):
  """Data tokens 3.., replay tokens 10000.. (distinct), and their batches."""
  stream, _, view = _convs(data_lengths)
  r_stream, r_ends, r_view = _convs(replay_lengths, first=10000)
  b = windows.WindowBatches(
    view, 64, 4, 3, replay=r_view, replay_share=share, **kw
  )
  return stream, r_stream, r_ends, b


def test_token_view_joined_reads_each_span_from_its_own_stream():
  a = windows.TokenView(np.arange(100, 110), None, [[0, 3], [5, 10]])
  roles = np.full(10, 2, np.uint8)
  b = windows.TokenView(np.arange(200, 210), roles, [[2, 6]])
  j = a.joined(b).reordered(np.array([2, 0, 1]))
  assert len(j) == 12
  ids, r = j.take(0, 12)
  assert ids.tolist() == [
    202,
    203,
    204,
    205,
    100,
    101,
    102,
    105,
    106,
    107,
    108,
    109,
  ]
  assert r.tolist() == [2] * 4 + [0] * 8
  assert j.take(3, 6)[0].tolist() == [205, 100, 101]
  assert j.take(1, 3)[0].tolist() == [203, 204]  # Within one span.


def test_replay_mixes_a_new_draw_of_whole_conversations_every_epoch():
  stream, r_stream, r_ends, b = _replayed([40] * 20, [30] * 200, share=0.25)
  assert b.replay_tokens == round(800 * 0.25 / 0.75)
  r_starts = np.concatenate([[0], r_ends[:-1]]) + 10000
  drawn = []
  for epoch in range(3):
    packed = np.concatenate(_epoch_windows(b, epoch))
    data = packed[packed < 10000]
    assert sorted(data.tolist()) == stream.tolist()  # All data, once.
    replay = packed[packed >= 10000]
    # Whole replay conversations, about the share, none twice.
    assert len(set(replay.tolist())) == len(replay)
    assert b.replay_tokens <= len(replay) < b.replay_tokens + 30
    assert len(replay) % 30 == 0
    drawn.append(sorted(set(replay.tolist()) & set(r_starts.tolist())))
  assert drawn[0] != drawn[1] != drawn[2]  # A new draw every epoch.
  # Batches stay a pure function of the step (resume).
  again = _replayed([40] * 20, [30] * 200, share=0.25)[3]
  for step in (0, 5, 11):
    np.testing.assert_array_equal(again.batch(step)[0], b.batch(step)[0])


def test_epochs_end_where_the_windows_say():
  b = _replayed([40] * 20, [30] * 50)[3]
  ends = [b.epoch_end(e) for e in range(5)]
  assert ends[0] == 0 and all(x < y for x, y in zip(ends, ends[1:]))
  for e in range(4):
    assert b.locate(ends[e]) == (e, 0)
    assert b.locate(ends[e + 1] - 1)[0] == e
  stream = np.arange(3, 3 + 23, dtype=np.int32)
  fixed = windows.WindowBatches(stream, 7, 2, seed=0, windows='fixed')
  assert fixed.epoch_end(3) == 3 * fixed.steps_per_epoch


def test_bad_replay_settings_are_errors():
  _, _, view = _convs([10, 10])
  empty = windows.TokenView(np.zeros([0], np.int32))
  with pytest.raises(UserError, match='replay-share 1.0 must be above 0'):
    windows.WindowBatches(view, 8, 2, 0, replay=view, replay_share=1.0)
  with pytest.raises(UserError, match='no tokens in the replay data'):
    windows.WindowBatches(view, 8, 2, 0, replay=empty)


def test_spliced_windows_hold_conversations_starts_and_ends():
  # Conversations of 100 (shorter than a window: never spliced) and 1000;
  # token c * 10000 + i is token i of conversation c.
  lengths = np.array([100, 1000, 100, 1000, 1000, 100] * 4)
  stream = np.concatenate(
    [c * 10000 + np.arange(n) for c, n in enumerate(lengths)]
  )
  ends = np.cumsum(lengths)
  view = windows.TokenView(
    stream.astype(np.int32), None, windows.conversation_spans(ends)
  )
  b = windows.WindowBatches(view, 256, 4, seed=1, splice=1.0, pad_fraction=0)
  pieces = []
  for step in range(40):
    ids, _, weights = b.batch(step)
    for row in _real(ids, weights):
      runs = np.split(row, np.flatnonzero(np.diff(row) != 1) + 1)
      same = len(runs) > 1 and runs[0][0] // 10000 == runs[1][0] // 10000
      if not same or runs[0][0] % 10000 or runs[1][-1] % 10000 != 999:
        continue  # A plain window (across conversations).
      last = [c * 10000 + lengths[c] - 1 for c in range(len(lengths))]
      # Pairs of runs: a long conversation's first tokens, then its last.
      assert len(runs) % 2 == 0
      pieces.append(len(runs) // 2)
      size = len(row) // (len(runs) // 2)
      for head, tail in zip(runs[::2], runs[1::2]):
        c = head[0] // 10000
        # Longer than the piece (the first: than the window), start to end.
        assert lengths[c] > size and tail[0] // 10000 == c
        assert head[0] % 10000 == 0 and tail[-1] == last[c]
        assert size // 4 <= len(head) <= 3 * size // 4 + 1
  assert set(pieces) == {1, 2, 4} and len(pieces) > 80
  # None at 0 (the default): the batches are those of before.
  plain = windows.WindowBatches(view, 256, 4, seed=1, pad_fraction=0)
  again = windows.WindowBatches(view, 256, 4, seed=1, splice=0, pad_fraction=0)
  for step in (0, 5, 17):
    np.testing.assert_array_equal(plain.batch(step)[0], again.batch(step)[0])


def test_a_replay_smaller_than_its_share_is_drawn_again_so_the_share_holds():
  """A replay of 600 tokens at share 0.75 of 800 data tokens: 2,400
  tokens an epoch, four passes (before, every conversation once: 43%
  where 75% was asked, and the log said 75%)."""
  stream, r_stream, r_ends, b = _replayed([40] * 20, [30] * 20, share=0.75)
  assert b.replay_tokens == 2400 and b.replay_passes == 4
  for epoch in range(2):
    packed = np.concatenate(_epoch_windows(b, epoch))
    assert sorted(packed[packed < 10000].tolist()) == stream.tolist()
    replay = packed[packed >= 10000]
    assert 2400 <= len(replay) < 2430  # The share, in whole conversations.
    counts = np.bincount(replay - 10000)
    assert counts.max() <= 4 and counts.min() >= 3  # Each up to 4 passes.
  with pytest.raises(UserError, match='replay-share 0.999: an epoch would'):
    _replayed([40] * 20, [30] * 2, share=0.999)
