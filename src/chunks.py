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
from src.tokenizer import PAD_ID


def split_eval(
  stream: np.ndarray, fraction: float, boundary_ids
) -> tuple[np.ndarray, np.ndarray]:
  """Holds out the end of the stream, cut just after a turn boundary.

  Args:
    stream: `[n] int32` token stream.
    fraction: Share of tokens to hold out (0 means evaluate on train data).
    boundary_ids: Ids after which a cut may fall (AI end marker, EOS).

  Returns:
    `(train, eval)` streams, cut after the last boundary before the target
    share. If the stream is too short to split, both are the whole stream.
  """
  if not 0 <= fraction < 1:
    raise UserError(
      f'eval-fraction {fraction} must be at least 0 and below 1 (e.g. 0.05)'
    )
  n = len(stream)
  target = int(round(n * (1 - fraction)))
  if fraction == 0 or target >= n or target == 0:
    return stream, stream
  # The last boundary at or before the target, so at least `fraction` is
  # held out and the held-out part starts with a whole turn.
  before = np.flatnonzero(np.isin(stream[:target], list(boundary_ids)))
  cut = int(before[-1]) + 1 if len(before) else target
  return stream[:cut], stream[cut:]


def ai_loss_mask(
  stream: np.ndarray, ai_start_id: int, ai_end_id: int
) -> np.ndarray:
  """1 for the tokens of AI turns (text and end marker), 0 elsewhere.

  The start marker itself gets 0: the chat session writes it, the model
  never has to predict it. Markers are single ids that user text cannot
  contain (the parser refuses it), so a running count of open AI turns
  finds the turns.

  Returns:
    `[n] float32`.
  """
  is_start = (stream == ai_start_id).astype(np.int32)
  is_end = (stream == ai_end_id).astype(np.int32)
  open_turns = np.cumsum(is_start) - np.cumsum(is_end)
  return ((open_turns + is_end - is_start) > 0).astype(np.float32)


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
    stream: np.ndarray,
    max_len: int,
    batch_size: int,
    seed: int,
    token_weights: np.ndarray | None = None,
  ):
    """Args: as named; `token_weights` is `[n]`, aligned with `stream`
    (e.g. `ai_loss_mask`), multiplied into the padding mask."""
    if len(stream) == 0:
      raise UserError('no tokens to train on; add conversations to the data')
    self.stream = np.asarray(stream, np.int32)
    self.token_weights = token_weights
    self.max_len = max_len
    self.batch_size = batch_size
    self.seed = seed
    self.n_chunks = -(-len(stream) // max_len)
    self.steps_per_epoch = max(1, self.n_chunks // batch_size)

  def chunk(self, index: int) -> np.ndarray:
    return self.stream[index * self.max_len : (index + 1) * self.max_len]

  def chunk_weights(self, index: int) -> np.ndarray | None:
    if self.token_weights is None:
      return None
    return self.token_weights[index * self.max_len : (index + 1) * self.max_len]

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
      i, w = pad_chunk(
        self.chunk(int(index)), self.max_len, rng, self.chunk_weights(index)
      )
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
