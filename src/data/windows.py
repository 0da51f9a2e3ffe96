"""Cuts the token stream into padded `max_len` windows and batches them.

Training windows move (the default, `windows = 'moving'`): every epoch

1. re-packs the conversations into a stream in a new random order (each
   conversation whole, its tokens in order; one longer than a window is
   split across consecutive windows);
2. starts the window grid at a random phase: the first window holds up to
   `max_len` fewer tokens, as if the stream began before position 0;
3. gives every window a random length between `max_len` and
   `max_len * (1 - pad_fraction)` tokens; the rest is padding (weight 0),
   split at random between the left and the right end;
4. shuffles the windows and deals them out `batch_size` per step. Trax's
   Loop gives device `d` rows `d*per_device:(d+1)*per_device`, so each
   device trains on a different window; the few windows left over after
   the last full batch differ from epoch to epoch.

A fine-tune run may name replay data (e.g. the pretraining corpus): each
epoch then packs the data with a new random draw of whole replay
conversations, `replay_share` of the epoch's tokens, so the model keeps
practising what it knew while it learns the new chats.

So a piece of text is seen at a different position of the context every
epoch, and the model cannot key on absolute position (the axial position
embeddings would let it). `windows = 'fixed'` keeps the grid of earlier
versions (the stream in file order, cut every `max_len` tokens, padding
only in the last window) for comparison.

Nothing is copied: an epoch's packing is a permuted `[n_conversations, 2]`
index of spans over the memory-mapped token cache. Batches are a pure
function of (seed, step), so a resumed run continues with exactly the data
it would have seen.
"""

from __future__ import annotations

import bisect

import numpy as np

from src.config import jsonconfig
from src.core.errors import UserError
from src.data.tokenizer import PAD_ID, ROLE_AI, ROLE_AI_CONTEXT

# Measured on the quick start (BENCHMARKS.md, "Training windows").
PAD_FRACTION = jsonconfig.TRAIN_KEYS['pad-fraction'][0]
REPLAY_SHARE = jsonconfig.TRAIN_KEYS['replay-share'][0]
WINDOWS = jsonconfig.WINDOWS


class TokenView:
  """Spans of one or more token streams (and their roles), read as one
  stream.

  The training and held-out parts of a corpus are each a list of whole
  conversations; the streams are usually memory-mapped, so only the
  windows a batch needs are ever read. A view `joined` with another (the
  replay data of a fine-tune run) reads each span from its own stream.
  """

  def __init__(self, tokens, roles=None, spans=None):
    """Args:
    tokens: `[n]` ids (any integer dtype, e.g. a uint16 memmap).
    roles: `[n]` uint8 roles (`tokenizer.ROLE_*`); None means all user.
    spans: `[k, 2]` int64 `[start, end)` ranges, one per conversation;
      None means all of it as one span.
    """
    if spans is None:
      spans = np.asarray([[0, len(tokens)]], np.int64)
    spans = np.asarray(spans, np.int64).reshape(-1, 2)
    self._set([(tokens, roles)], spans, np.zeros([len(spans)], np.int64))

  def _set(self, streams, spans, source):
    self.streams = streams  # [(tokens, roles)], one per stream.
    self.spans = spans  # [k, 2] int64 [start, end) in its stream.
    self.source = source  # [k] int64: the stream of each span.
    lengths = self.spans[:, 1] - self.spans[:, 0]
    self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

  def _view(self, streams, spans, source) -> TokenView:
    view = TokenView.__new__(TokenView)
    view._set(streams, spans, source)
    return view

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def reordered(self, order: np.ndarray) -> TokenView:
    """The same spans in `order` (`[k]` permutation or any `[m]` index);
    no token is copied."""
    return self._view(self.streams, self.spans[order], self.source[order])

  def joined(self, other: TokenView) -> TokenView:
    """This view's spans, then `other`'s (from their own streams)."""
    return self._view(
      self.streams + other.streams,
      np.concatenate([self.spans, other.spans]),
      np.concatenate([self.source, other.source + len(self.streams)]),
    )

  def _read(self, source: int, index):
    tokens, roles = self.streams[source]
    ids = np.asarray(tokens[index], np.int32)
    if roles is None:
      return ids, np.zeros(ids.shape, np.uint8)
    return ids, np.asarray(roles[index], np.uint8)

  def take(self, a: int, b: int):
    """Positions `[a, b)` of the view.

    Returns:
      `([m] int32 ids, [m] uint8 roles)`, m = min(b, len) - max(a, 0).
    """
    a, b = max(a, 0), min(b, len(self))
    if b <= a:
      return np.zeros([0], np.int32), np.zeros([0], np.uint8)
    first = int(np.searchsorted(self.offsets, a, 'right')) - 1
    last = int(np.searchsorted(self.offsets, b - 1, 'right')) - 1
    if first == last:  # One span: a plain slice of its stream.
      x = int(self.spans[first, 0] + a - self.offsets[first])
      return self._read(int(self.source[first]), slice(x, x + b - a))
    # Gather across spans, vectorized (per stream).
    pos = np.arange(a, b, dtype=np.int64)
    span = np.searchsorted(self.offsets[first : last + 2], pos, 'right')
    span += first - 1
    index = self.spans[span, 0] + pos - self.offsets[span]
    source = self.source[span]
    if (source == source[0]).all():
      return self._read(int(source[0]), index)
    ids, roles = np.zeros([b - a], np.int32), np.zeros([b - a], np.uint8)
    for k in np.unique(source):
      here = source == k
      ids[here], roles[here] = self._read(int(k), index[here])
    return ids, roles


def conversation_spans(conversation_ends: np.ndarray) -> np.ndarray:
  """`[n, 2]` int64 `[start, end)` of each conversation from its end."""
  ends = np.asarray(conversation_ends, np.int64)
  starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
  return np.stack([starts, ends], axis=1)


def split_conversations(
  conversation_ends: np.ndarray, fraction: float, seed: int
):
  """Holds out whole conversations, drawn at random, for evaluation.

  Args:
    conversation_ends: `[n]` int64 end offset of each conversation.
    fraction: Share of tokens to hold out, at least (0: none).
    seed: Chooses the conversations.

  Returns:
    `(train_spans, eval_spans, n_held)`: `[k, 2]` spans, one per
    conversation, for `TokenView`; `eval_spans` is None (evaluate on the
    training data) when nothing is held out: fraction 0 or a single
    conversation.
  """
  if not 0 <= fraction < 1:
    raise UserError(
      f'eval-fraction {fraction} must be at least 0 and below 1 (e.g. 0.05)'
    )
  spans = conversation_spans(conversation_ends)
  if fraction == 0 or len(spans) < 2:
    return spans, None, 0
  total = spans[-1, 1]
  order = np.random.default_rng([seed, 7]).permutation(len(spans))
  lengths = (spans[:, 1] - spans[:, 0])[order]
  k = int(np.searchsorted(np.cumsum(lengths), fraction * total)) + 1
  k = min(k, len(spans) - 1)
  held = np.zeros([len(spans)], bool)
  held[order[:k]] = True
  return spans[~held], spans[held], k


def loss_weights(roles: np.ndarray, ai_only: bool) -> np.ndarray:
  """Loss weight of each token from its role.

  Every token is trained on except the text and end marker of `|noloss|`
  AI turns; with `ai_only`, only the text and end marker of the other AI
  turns are (user text, start markers and EOS are context). The start
  marker always belongs to the context side: the chat session writes it.

  Returns:
    `[n] float32`.
  """
  if ai_only:
    return (roles == ROLE_AI).astype(np.float32)
  return (roles != ROLE_AI_CONTEXT).astype(np.float32)


def pad_window(
  tokens: np.ndarray,
  max_len: int,
  left: int,
  token_weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Pads `tokens` to `max_len` with `left` pad ids before them.

  Args:
    tokens: `[n] int32`, n <= max_len.
    max_len: The padded length.
    left: Padding before the tokens, 0 <= left <= max_len - n.
    token_weights: `[n]` loss weights of the tokens (default all 1).

  Returns:
    `([max_len] int32 ids, [max_len] float32 weights)`; padding weighs 0.
  """
  n = len(tokens)
  ids = np.full([max_len], PAD_ID, np.int32)
  ids[left : left + n] = tokens
  weights = np.zeros([max_len], np.float32)
  weights[left : left + n] = 1.0 if token_weights is None else token_weights
  return ids, weights


class Window:
  """One training window: `length` tokens of `view` from `start`, placed
  after `left` pad ids in a row of `max_len`; a spliced window reads the
  `(start, length)` segments of `before` first (conversations' first and
  last tokens: see `splice`)."""

  __slots__ = ('view', 'start', 'length', 'left', 'before')

  def __init__(self, view: TokenView, start: int, length: int, left: int):
    self.view, self.start, self.length, self.left = view, start, length, left
    self.before = ()

  def take(self, shift: int = 0):
    """`([m] int32 ids, [m] uint8 roles)` of the window moved by `shift`
    tokens along its epoch's stream (0: as trained; `before` stays)."""
    a = self.start + shift
    ids, roles = self.view.take(a, a + self.length)
    if not self.before:
      return ids, roles
    parts = [self.view.take(s, s + n) for s, n in self.before]
    return (
      np.concatenate([p[0] for p in parts] + [ids]),
      np.concatenate([p[1] for p in parts] + [roles]),
    )


MAX_REPLAY_PASSES = 100  # Times an epoch may read a small replay over.
SPLICE_PIECES = (1, 2, 4)  # Conversations a spliced window holds (drawn).
SPLICE_LEAST = 64  # Tokens of one conversation in it, at least.


def splice(window: Window, rng, offsets: np.ndarray) -> Window:
  """`window` made of conversations' starts and ends: 1, 2 or 4 pieces
  (drawn), each a long conversation's first `h` tokens and then its last
  ones (`h` a quarter to three quarters of the piece), the first piece
  from the window's own conversation, the others drawn at random. What
  was said first and what is said last then share one short window, at
  distances from a few tokens (in reach of the local attention, where
  copying is learned first) to the window, so a model trained on short
  windows learns to reach back to the start of a long conversation.
  The window is kept as it is when its conversation is not longer than
  it.

  Args:
    window: A grid window of an epoch's stream.
    rng: A NumPy Generator (the window's own).
    offsets: `[k + 1]` the stream's conversation offsets.
  """
  length = window.length
  k = int(np.searchsorted(offsets, window.start + length // 2, 'right')) - 1
  if offsets[k + 1] - offsets[k] <= length or length < 2 * SPLICE_LEAST:
    return window
  n = int(rng.choice(SPLICE_PIECES))
  n = max(1, min(n, length // SPLICE_LEAST))
  sizes = np.full([n], length // n)
  sizes[-1] += length - sizes.sum()
  long = _longer(window.view, int(sizes[0]))
  chosen = [k] + [int(long[rng.integers(len(long))]) for _ in range(n - 1)]
  segments = []
  for size, c in zip(sizes, chosen):
    h = int(rng.integers(size // 4, 3 * size // 4 + 1))
    end = int(offsets[c + 1])
    segments += [(int(offsets[c]), h), (end - (size - h), int(size - h))]
  out = Window(window.view, *segments[-1], window.left)
  out.before = tuple(segments[:-1])
  return out


def _longer(view: TokenView, size: int) -> np.ndarray:
  """Indices of `view`'s conversations longer than `size` tokens (by
  length); the sorted lengths are kept on the view (one per epoch), so a
  spliced window costs O(log conversations), not O(conversations)."""
  cache = getattr(view, '_by_length', None)
  if cache is None:
    lengths = np.diff(view.offsets)
    order = np.argsort(lengths, kind='stable')
    cache = view._by_length = (order, lengths[order])
  order, ordered = cache
  return order[np.searchsorted(ordered, size, 'right') :]


def _check_options(windows, pad_fraction, part, batch_size, replay, share):
  """Refuses `WindowBatches` options out of range, with the fix."""
  if windows not in WINDOWS:
    raise UserError(
      f'windows {windows!r} is not one of {", ".join(WINDOWS)}; use '
      '"moving" (the default)'
    )
  if not 0 <= pad_fraction < 1:
    raise UserError(
      f'pad-fraction {pad_fraction} must be at least 0 and below 1 '
      f'(e.g. {PAD_FRACTION})'
    )
  if part is not None and (not 0 <= part[0] < part[1] or batch_size % part[1]):
    raise UserError(
      f'a batch of {batch_size} windows does not split into {part[1]} '
      'equal parts (one per process); use a batch-size that is a '
      f'multiple of the number of devices'
    )
  if replay is not None and not 0 < share < 1:
    raise UserError(
      f'replay-share {share} must be above 0 and below 1 (e.g. {REPLAY_SHARE})'
    )
  if replay is not None and len(replay) == 0:
    raise UserError('no tokens in the replay data; add conversations to it')


def _replay_draw(data: int, replay, share: float) -> tuple[int, int]:
  """`(tokens, passes)`: the replay tokens an epoch of `data` tokens
  draws at `share`, and the passes over `replay` that takes (1 when it
  holds them, or there is none)."""
  if replay is None:
    return 0, 1
  tokens = max(1, round(data * share / (1 - share)))
  passes = -(-tokens // max(len(replay), 1))
  if passes > MAX_REPLAY_PASSES:
    raise UserError(
      f'replay-share {share}: an epoch would read the replay data '
      f'({len(replay)} tokens) {passes} times over; give more replay data '
      'or a lower replay-share'
    )
  return tokens, passes


class WindowBatches:
  """Batches of padded windows for every training step (see the module).

  Attributes:
    n_chunks: Windows of a full `max_len` grid over the stream (the least
      any epoch has).
    steps_per_epoch: Full batches in the first epoch (later epochs may
      have a few more or fewer).
  """

  def __init__(
    self,
    tokens,
    max_len: int,
    batch_size: int,
    seed: int,
    ai_only: bool = False,
    pad_fraction: float = PAD_FRACTION,
    windows: str = 'moving',
    part: tuple[int, int] | None = None,
    replay: TokenView | None = None,
    replay_share: float = REPLAY_SHARE,
    splice: float = 0.0,
  ):
    """Args:
    tokens: A `TokenView` (one span per conversation: the units that are
      re-packed) or a `[n]` stream (one unit).
    max_len: Window length (the model's context).
    batch_size: Windows per step, all devices together.
    seed: Chooses packing, phase, lengths, order and padding split.
    ai_only: Loss on AI turns only (see `loss_weights`).
    pad_fraction: A moving window holds between `max_len * (1 -
      pad_fraction)` and `max_len` tokens; 0 fills every window but the
      epoch's first and last.
    windows: 'moving' (a new cut every epoch) or 'fixed' (one grid).
    part: `(i, n)`: batches hold only part i of n of each step's windows
      (process i of a multi-process run; `batch_size` is the whole step's
      and must split into n). None: all of them.
    replay: Conversations mixed into every epoch (a fine-tune run's
      replay data): each epoch packs the data with a new random draw of
      whole replay conversations, about `replay_share` of its tokens.
    replay_share: Share of each epoch's tokens drawn from `replay`.
    splice: Share of the windows (drawn at random) that hold their
      conversation's start and end instead (`splice`), where it is
      longer than the window; 0: none.
    """
    view = tokens if isinstance(tokens, TokenView) else TokenView(tokens)
    if len(view) == 0:
      raise UserError('no tokens to train on; add conversations to the data')
    _check_options(
      windows, pad_fraction, part, batch_size, replay, replay_share
    )
    self.part = part
    self.view = view
    self.replay = replay
    self.replay_tokens, self.replay_passes = _replay_draw(
      len(view), replay, replay_share
    )
    self._drawn = None  # (epoch, view with its replay draw), cached.
    self.ai_only = ai_only
    self.max_len = max_len
    self.batch_size = batch_size
    self.seed = seed
    self.moving = windows == 'moving'
    self.splice = splice
    self.max_pad = min(int(pad_fraction * max_len), max_len - 1)
    self.n_chunks = -(-len(view) // max_len)
    self._first_steps = [0]  # First step of each epoch computed so far.
    self._layout = None  # (epoch, view, starts, lengths, order), cached.
    self.steps_per_epoch = self._steps_in(0)

  # ---- one epoch's windows

  def epoch_view(self, epoch: int) -> TokenView:
    """The conversations of `epoch`, before packing: the data, then (with
    replay) whole replay conversations drawn at random for this epoch
    until they hold `replay_tokens` tokens."""
    if self.replay is None:
      return self.view
    if self._drawn is not None and self._drawn[0] == epoch:
      return self._drawn[1]
    spans = self.replay.spans
    rng = np.random.default_rng([self.seed, epoch, 14])
    # A replay smaller than its share is drawn again (a new order each
    # pass), so the share holds; each conversation at most once a pass.
    order = np.concatenate(
      [rng.permutation(len(spans)) for _ in range(self.replay_passes)]
    )
    lengths = np.cumsum((spans[:, 1] - spans[:, 0])[order])
    k = int(np.searchsorted(lengths, self.replay_tokens)) + 1
    view = self.view.joined(self.replay.reordered(order[:k]))
    self._drawn = (epoch, view)
    return view

  def grid(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the windows of `epoch` lie in its packed stream.

    Returns:
      `([w] int64 starts, [w] int64 lengths)`, in stream order; together
      they cover every position of the stream exactly once.
    """
    n = len(self.epoch_view(epoch))
    if not self.moving:
      starts = np.arange(0, n, self.max_len, dtype=np.int64)
      return starts, np.minimum(self.max_len, n - starts)
    rng = np.random.default_rng([self.seed, epoch, 11])
    phase = int(rng.integers(0, self.max_len))
    count = -(-(n + phase) // (self.max_len - self.max_pad)) + 1
    sizes = self.max_len - rng.integers(0, self.max_pad + 1, size=count)
    ends = np.cumsum(sizes) - phase
    starts = ends - sizes
    keep = (ends > 0) & (starts < n)
    starts = np.maximum(starts[keep], 0)
    return starts, np.minimum(ends[keep], n) - starts

  def _steps_in(self, epoch: int) -> int:
    return max(1, len(self.grid(epoch)[0]) // self.batch_size)

  def locate(self, step: int) -> tuple[int, int]:
    """`(epoch, batch index in that epoch)` of `step` (0-based)."""
    if not self.moving and self.replay is None:  # The same every epoch.
      return divmod(step, self.steps_per_epoch)
    firsts = self._first_steps
    while firsts[-1] <= step:
      firsts.append(firsts[-1] + self._steps_in(len(firsts) - 1))
    epoch = bisect.bisect_right(firsts, step) - 1
    return epoch, step - firsts[epoch]

  def layout(self, epoch: int):
    """`(view, starts, lengths, order)` of `epoch`: its packed stream, its
    grid and the window order that batches are dealt from."""
    if self._layout is not None and self._layout[0] == epoch:
      return self._layout[1:]
    view = self.epoch_view(epoch)
    if self.moving and len(view.spans) > 1:
      rng = np.random.default_rng([self.seed, epoch, 12])
      view = view.reordered(rng.permutation(len(view.spans)))
    starts, lengths = self.grid(epoch)
    order = np.random.default_rng([self.seed, epoch, 13]).permutation(
      len(starts)
    )
    if len(order) < self.batch_size:  # Too little data: repeat windows.
      order = np.resize(order, self.batch_size)
    self._layout = (epoch, view, starts, lengths, order)
    return self._layout[1:]

  def epoch_end(self, epochs: int) -> int:
    """The number of steps in the first `epochs` epochs."""
    if not self.moving and self.replay is None:
      return epochs * self.steps_per_epoch
    firsts = self._first_steps
    while len(firsts) <= epochs:
      firsts.append(firsts[-1] + self._steps_in(len(firsts) - 1))
    return firsts[epochs]

  # ---- batches

  def window_ids(self, step: int) -> np.ndarray:
    """Indices (into the epoch's grid) of the windows of `step` (of this
    part's share of them, see `part`)."""
    epoch, k = self.locate(step)
    ids = self.layout(epoch)[3][k * self.batch_size : (k + 1) * self.batch_size]
    if self.part is not None:
      i, n = self.part
      share = self.batch_size // n
      ids = ids[i * share : (i + 1) * share]
    return ids

  def windows(self, step: int) -> list[Window]:
    """The windows of `step`, one per batch row (`batch_size` of them, or
    this part's share)."""
    epoch, _ = self.locate(step)
    view, starts, lengths, _ = self.layout(epoch)
    out = []
    for index in self.window_ids(step):
      length = int(lengths[index])
      rng = np.random.default_rng([self.seed, epoch, int(index), 1])
      left = int(rng.integers(0, self.max_len - length + 1))
      window = Window(view, int(starts[index]), length, left)
      if self.splice and rng.random() < self.splice:
        window = splice(window, rng, view.offsets)
      out.append(window)
    return out

  def rows(self, windows: list[Window], shift: int = 0):
    """`(ids, weights)`: `[len(windows), max_len]` int32 and float32 rows
    of `windows` (moved by `shift` tokens; see `Window.take`)."""
    ids, weights = [], []
    for w in windows:
      tokens, roles = w.take(shift)
      i, wt = pad_window(
        tokens, self.max_len, w.left, loss_weights(roles, self.ai_only)
      )
      ids.append(i)
      weights.append(wt)
    return np.stack(ids), np.stack(weights)

  def batch(self, step: int):
    """The batch of `step` (0-based).

    Returns:
      `(inputs, targets, weights)`: `[batch, max_len]` int32, int32,
      float32. Inputs equal targets: the model shifts its inputs right.
    """
    ids, weights = self.rows(self.windows(step))
    return ids, ids, weights

  def iterate(self, start_step: int = 0):
    step = start_step
    while True:
      yield self.batch(step)
      step += 1


def batch_size_for(devices: int, batch_size: int) -> int:
  """The global batch: `batch_size`, or one window per device if it is 0."""
  if batch_size == 0:
    return devices
  if batch_size < 0 or batch_size % devices:
    raise UserError(
      f'batch-size {batch_size} does not split evenly across {devices} '
      f'device(s); use a multiple of {devices} (e.g. {devices} or '
      f'{2 * devices}), or 0 for one window per device'
    )
  return batch_size
