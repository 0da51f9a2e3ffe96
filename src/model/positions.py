"""Axial position embeddings that read any window of their grid.

Trax's `AxialPositionalEncoding` adds the embeddings of positions
`0..max_len-1` and so needs inputs of exactly `max_len` tokens (outside
predict mode). `AxialPositions` is the same layer (same weights, same
result at full length) that also reads shorter inputs, and in training can
place each window at a random offset of the grid (`offset='random'`): a
model trained on short windows then trains every row of the grid, so the
positions it meets far into a long context are not the untrained ones it
started with (BENCHMARKS.md, "The 32k context, used").

`reformer.reformer_lm` gives Trax's axial layer this class (`adopt`).
"""

from __future__ import annotations

import math

import jax
from jax import numpy as jnp
from trax import fastmath
from trax import layers as tl

from src.model import decode_block

OFFSETS = ('zero', 'random')


class AxialPositions(tl.AxialPositionalEncoding):
  """Trax's axial positions, for any window of the grid.

  `offset` ('zero' or 'random'; set by `reformer_lm`): where a training
  window starts on the grid. Evaluation and sampling always start at 0.
  """

  _offset = 'zero'

  @staticmethod
  def adopt(layer, offset: str = 'zero'):
    """Makes Trax's `AxialPositionalEncoding` `layer` (built inside
    `ReformerLM`) this class, its training windows starting at `offset`
    (one of OFFSETS)."""
    if offset not in OFFSETS:
      raise ValueError(f'offset {offset!r}: one of {OFFSETS}')
    layer.__class__ = AxialPositions
    layer._offset = offset

  def _table(self):
    """`[max_len, d_model]`: every position's embedding."""
    parts = []
    for ax_emb in self.weights:
      full = jnp.broadcast_to(ax_emb, (1, *self._shape, ax_emb.shape[-1]))
      parts.append(jnp.reshape(full, (-1, ax_emb.shape[-1])))
    return jnp.concatenate(parts, -1)

  def _one_position(self, position):
    """`[1, d_model]`: the embedding of `position`, without the table."""
    parts = []
    for axis, ax_emb in enumerate(self.weights):
      size = self._shape[axis]
      stride = 1
      for later in self._shape[axis + 1 :]:
        stride *= later
      coord = (position // stride) % size
      table = jnp.reshape(ax_emb, (size, ax_emb.shape[-1]))
      parts.append(fastmath.dynamic_slice_in_dim(table, coord, 1, axis=0))
    return jnp.concatenate(parts, -1)

  def forward(self, inputs):
    """`inputs + ` the embeddings of their positions.

    Predict mode: each new token's row is looked up by its coordinates
    (Trax builds the whole table every token and slices rows out). A window
    of the full grid length starting at 0 takes Trax's own path.
    """
    length = inputs.shape[1]
    if self._mode == 'predict':
      # One token, or a block of a chat decoder (`decode_block.reading`:
      # its real tokens move the position): each row looked up alone.
      position = self.state
      self.state = position + decode_block.valid(self, length)
      at = position + jnp.arange(length)
      rows = jax.vmap(self._one_position)(at)[:, 0]
      return inputs + rows[None].astype(inputs.dtype)
    grid = math.prod(self._shape)
    if length >= grid:
      return super().forward(inputs)
    random = self._mode == 'train' and self._offset == 'random'
    table = self._table()
    if random:
      starts = jax.random.randint(
        self.rng, (inputs.shape[0],), 0, grid - length + 1
      )
      at = starts[:, None] + jnp.arange(length)[None, :]
      emb = jnp.take(table, at, axis=0)
    else:
      emb = table[None, :length]
    if self._dropout:
      keep = fastmath.random.bernoulli(self.rng, 1.0 - self._dropout, emb.shape)
      emb = emb * keep.astype(emb.dtype) / (1.0 - self._dropout)
    return inputs + emb.astype(inputs.dtype)
