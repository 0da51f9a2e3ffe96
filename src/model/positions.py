"""Axial position embeddings that read any window of their grid.

Trax's `AxialPositionalEncoding` adds the embeddings of positions
`0..max_len-1` and so needs inputs of exactly `max_len` tokens (outside
predict mode). `AxialPositions` is the same layer (same weights, same
result at full length) that also reads shorter inputs, and in training can
place each window at a random offset of the grid (`offset='random'`): a
model trained on short windows then trains every row of the grid, so the
positions it meets far into a long context are not the untrained ones it
started with (BENCHMARKS.md, "The 32k context, used").

`reformer.reformer_lm` puts this class where Trax's axial layer was
(`like`).
"""

from __future__ import annotations

import math

import jax
from jax import numpy as jnp
from trax import fastmath
from trax import layers as tl

from src.model.decode_state import BlockRead

OFFSETS = ('zero', 'random')


class AxialPositions(tl.AxialPositionalEncoding):
  """Trax's axial positions, for any window of the grid.

  `offset` ('zero' or 'random'; set by `reformer_lm`): where a training
  window starts on the grid. Evaluation and sampling always start at 0.
  """

  def __init__(self, *args, offset: str = 'zero', **kwargs):
    super().__init__(*args, **kwargs)
    if offset not in OFFSETS:
      raise ValueError(f'offset {offset!r}: one of {OFFSETS}')
    self._offset = offset

  @classmethod
  def like(cls, layer, offset: str = 'zero', kernel_initializer=None):
    """This class built with the settings of Trax's `AxialPositionalEncoding`
    `layer` (as `ReformerLM` built it), its training windows starting at
    `offset` (one of OFFSETS), its embeddings drawn by `kernel_initializer`
    (None: `layer`'s)."""
    return cls(
      shape=layer._shape,
      d_embs=layer._d_embs,
      kernel_initializer=kernel_initializer or layer._kernel_initializer,
      dropout=layer._dropout,
      dropout_broadcast_dims=layer._dropout_broadcast_dims,
      mode=layer._mode,
      offset=offset,
    )

  def _rows(self, at):
    """`[*at.shape, d_model]`: the embeddings of positions `at` (integers),
    each axis's row taken by its coordinate: the `[max_len, d_model]` table
    is never built (at 32k that was a 16 MB broadcast and concatenation a
    step, and its gradient a reduction of that size)."""
    parts = []
    for axis, ax_emb in enumerate(self.weights):
      size = self._shape[axis]
      stride = math.prod(self._shape[axis + 1 :])
      table = jnp.reshape(ax_emb, (size, ax_emb.shape[-1]))
      parts.append(jnp.take(table, (at // stride) % size, axis=0))
    return jnp.concatenate(parts, -1)

  def forward(self, inputs):
    """`inputs + ` the embeddings of their positions.

    Predict mode: each new token's row is looked up by its coordinates
    (Trax builds the whole table every token and slices rows out). A window
    of the full grid length starting at 0 takes Trax's own path.
    """
    length = inputs.shape[1]
    if self._mode == 'predict':
      # One token, or a block of a chat decoder (a `BlockRead`: its real
      # tokens move the position): each row looked up alone.
      position, real = self.state, length
      if isinstance(position, BlockRead):
        position, real = position.state, position.n
      self.state = position + real
      rows = self._rows(position + jnp.arange(length))
      return inputs + rows[None].astype(inputs.dtype)
    grid = math.prod(self._shape)
    if length >= grid:
      return super().forward(inputs)
    random = self._mode == 'train' and self._offset == 'random'
    if random:
      starts = jax.random.randint(
        self.rng, (inputs.shape[0],), 0, grid - length + 1
      )
      emb = self._rows(starts[:, None] + jnp.arange(length)[None, :])
    else:
      emb = self._rows(jnp.arange(length))[None]
    if self._dropout:
      keep = fastmath.random.bernoulli(self.rng, 1.0 - self._dropout, emb.shape)
      emb = emb * keep.astype(emb.dtype) / (1.0 - self._dropout)
    return inputs + emb.astype(inputs.dtype)
