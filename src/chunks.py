"""Cuts the token stream into padded `max_len` chunks and batches them.

Every step takes `batch_size` distinct chunks (batch = devices x per-device
batch); Trax's Loop gives device `d` rows `d*per_device:(d+1)*per_device`,
so each device trains on a different chunk. An epoch is one seeded
permutation of all chunks, cut into `n_chunks // batch_size` full batches;
the few left over differ from epoch to epoch. Each chunk is padded to
`max_len` with a seeded random split of the padding between left and right;
padding has weight 0. Batches are a pure function of (seed, step), so a
resumed run continues with the data it would have seen.
"""

from __future__ import annotations

import numpy as np

from src.errors import UserError
from src.tokenizer import PAD_ID, ROLE_AI, ROLE_AI_CONTEXT


class TokenView:
  """Spans of a token stream (and its roles), read as one stream.

  The training and held-out parts of a corpus are each a list of runs of
  whole conversations; the stream is usually memory-mapped, so only the
  chunks a batch needs are ever read.
  """

  def __init__(self, tokens, roles=None, spans=None):
    """Args:
    tokens: `[n]` ids (any integer dtype, e.g. a uint16 memmap).
    roles: `[n]` uint8 roles (`tokenizer.ROLE_*`); None means all user.
    spans: `[k, 2]` int64 `[start, end)` ranges; None means all of it.
    """
    self.tokens, self.roles = tokens, roles
    if spans is None:
      spans = np.asarray([[0, len(tokens)]], np.int64)
    self.spans = np.asarray(spans, np.int64).reshape(-1, 2)
    lengths = self.spans[:, 1] - self.spans[:, 0]
    self.offsets = np.concatenate([[0], np.cumsum(lengths)])

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def take(self, a: int, b: int):
    """Positions `[a, b)` of the view.

    Returns:
      `([m] int32 ids, [m] uint8 roles)`, m = min(b, len) - a.
    """
    b = min(b, len(self))
    i = int(np.searchsorted(self.offsets, a, 'right')) - 1
    ranges = []
    while a < b:
      start = int(self.spans[i, 0] + a - self.offsets[i])
      stop = int(min(self.spans[i, 1], self.spans[i, 0] + b - self.offsets[i]))
      ranges.append((start, stop))
      a += stop - start
      i += 1
    ids = [np.asarray(self.tokens[x:y], np.int32) for x, y in ranges]
    ids = np.concatenate(ids) if ids else np.zeros([0], np.int32)
    if self.roles is None:
      return ids, np.zeros(ids.shape, np.uint8)
    roles = [np.asarray(self.roles[x:y]) for x, y in ranges]
    return ids, np.concatenate(roles) if roles else np.zeros([0], np.uint8)


def _runs(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray):
  """`[k, 2]` spans of the maximal runs of conversations where mask is set."""
  edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
  first, last = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
  return np.stack([starts[first], ends[last]], axis=1)


def split_conversations(
  conversation_ends: np.ndarray, fraction: float, seed: int
):
  """Holds out whole conversations, drawn at random, for evaluation.

  Args:
    conversation_ends: `[n]` int64 end offset of each conversation.
    fraction: Share of tokens to hold out, at least (0: none).
    seed: Chooses the conversations.

  Returns:
    `(train_spans, eval_spans, n_held)`: `[k, 2]` spans for `TokenView`;
    `eval_spans` is None (evaluate on the training data) when nothing is
    held out: fraction 0 or a single conversation.
  """
  if not 0 <= fraction < 1:
    raise UserError(
      f'eval-fraction {fraction} must be at least 0 and below 1 (e.g. 0.05)'
    )
  ends = np.asarray(conversation_ends, np.int64)
  starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
  everything = np.asarray([[0, ends[-1] if len(ends) else 0]], np.int64)
  if fraction == 0 or len(ends) < 2:
    return everything, None, 0
  order = np.random.default_rng([seed, 7]).permutation(len(ends))
  lengths = (ends - starts)[order]
  k = int(np.searchsorted(np.cumsum(lengths), fraction * ends[-1])) + 1
  k = min(k, len(ends) - 1)
  held = np.zeros([len(ends)], bool)
  held[order[:k]] = True
  return _runs(~held, starts, ends), _runs(held, starts, ends), k


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


def pad_chunk(
  tokens: np.ndarray,
  max_len: int,
  rng: np.random.Generator,
  token_weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Pads `tokens` to `max_len`, a random share of the padding on the left.

  Args:
    tokens: `[n] int32`, n <= max_len.
    max_len: The padded length.
    rng: Draws the left share of the padding.
    token_weights: `[n]` loss weights of the tokens (default all 1).

  Returns:
    `([max_len] int32 ids, [max_len] float32 weights)`; padding weighs 0.
  """
  n = len(tokens)
  left = int(rng.integers(0, max_len - n + 1))
  ids = np.full([max_len], PAD_ID, np.int32)
  ids[left : left + n] = tokens
  weights = np.zeros([max_len], np.float32)
  weights[left : left + n] = 1.0 if token_weights is None else token_weights
  return ids, weights


class ChunkBatches:
  """Batches of padded chunks for every training step.

  Attributes:
    n_chunks: Chunks in the stream (the last one may be short).
    steps_per_epoch: Full batches per epoch.
  """

  def __init__(
    self,
    tokens,
    max_len: int,
    batch_size: int,
    seed: int,
    ai_only: bool = False,
  ):
    """Args: `tokens` is a `TokenView` or a `[n]` stream; `ai_only` puts
    the loss on AI turns only (see `loss_weights`)."""
    view = tokens if isinstance(tokens, TokenView) else TokenView(tokens)
    if len(view) == 0:
      raise UserError('no tokens to train on; add conversations to the data')
    self.view = view
    self.ai_only = ai_only
    self.max_len = max_len
    self.batch_size = batch_size
    self.seed = seed
    self.n_chunks = -(-len(view) // max_len)
    self.steps_per_epoch = max(1, self.n_chunks // batch_size)

  def chunk(self, index: int):
    """`([m] int32 ids, [m] float32 loss weights)` of chunk `index`.

    Chunks are cut at fixed offsets; every marker is one token, so a chunk
    never starts inside a marker.
    """
    ids, roles = self.view.take(
      index * self.max_len, (index + 1) * self.max_len
    )
    return ids, loss_weights(roles, self.ai_only)

  def _order(self, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(self.n_chunks)
    if self.n_chunks < self.batch_size:  # Too little data: repeat chunks.
      order = np.resize(order, self.batch_size)
    return order

  def chunk_ids(self, step: int) -> np.ndarray:
    """Indices of the chunks in the batch of `step` (0-based)."""
    epoch, k = divmod(step, self.steps_per_epoch)
    return self._order(epoch)[k * self.batch_size : (k + 1) * self.batch_size]

  def batch(self, step: int):
    """The batch of `step` (0-based).

    Returns:
      `(inputs, targets, weights)`: `[batch, max_len]` int32, int32,
      float32. Inputs equal targets: the model shifts its inputs right.
    """
    epoch = step // self.steps_per_epoch
    ids, weights = [], []
    for index in self.chunk_ids(step):
      rng = np.random.default_rng([self.seed, epoch, int(index), 1])
      tokens, token_weights = self.chunk(int(index))
      i, w = pad_chunk(tokens, self.max_len, rng, token_weights)
      ids.append(i)
      weights.append(w)
    ids = np.stack(ids)
    return ids, ids, np.stack(weights)

  def iterate(self, start_step: int = 0):
    step = start_step
    while True:
      yield self.batch(step)
      step += 1


def batch_size_for(devices: int, batch_size: int) -> int:
  """The global batch: `batch_size`, or one chunk per device if it is 0."""
  if batch_size == 0:
    return devices
  if batch_size < 0 or batch_size % devices:
    raise UserError(
      f'batch-size {batch_size} does not split evenly across {devices} '
      f'device(s); use a multiple of {devices} (e.g. {devices} or '
      f'{2 * devices}), or 0 for one chunk per device'
    )
  return batch_size
