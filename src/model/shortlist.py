"""The output layer of a large vocabulary (`output_layer.shortlist`): the
most used pieces scored from all the features, the rarer ones through a
narrow projection of them (the arithmetic: `src.model.softmax`).

At a vocabulary of thousands of pieces Trax's output layer does most of
a step's work (`2 d_model x vocab` products a row, three times with the
gradients). Pieces are used very unevenly: in chat text the most used
2,048 of a 32,000-piece vocabulary carry most tokens. This layer scores
those (and a class "a rarer piece") with all the features and the rest
through `width` of them, so at vocabulary 31,392, 512 features, a
shortlist of 2,048 and width 128 a row costs ~4.8M products, not ~16M.
Every piece still gets its probability: the layer's output is the
log-probabilities of the whole vocabulary, which serve as logits
everywhere a model's output is read (loss, scoring, sampling).

The shortlist is the lowest ids: the project's tokenizer is a unigram
sentencepiece model, which numbers its pieces by score after the chat
markers and control pieces, so the lowest ids are the most used.
"""

from __future__ import annotations

import jax
from trax import layers as tl
from trax.layers import initializers as init

from src.model import softmax

# A new run that asks for a vocabulary of `AUTO_FROM` pieces or more gets
# a shortlist of `AUTO_SIZE` unless its gin chose an output layer
# (`src.training.plan`): at 8,000 and 16,000 pieces its held-out loss was
# lower than Trax's layer's in every seed measured, its steps 1.1-1.8x as
# fast (BENCHMARKS.md "A shortlist output layer", "The shortlist by
# default").
AUTO_FROM = 8000
AUTO_SIZE = 2048


def auto_size(vocab_size: int) -> int:
  """The shortlist a new run at `vocab_size` pieces gets (0: Trax's
  layer)."""
  return AUTO_SIZE if vocab_size >= AUTO_FROM else 0


def applies(size: int, vocab_size: int) -> bool:
  """Whether a shortlist of `size` pieces leaves rarer ones in the
  vocabulary (0, or a vocabulary no larger, keeps Trax's layer)."""
  return 0 < size < vocab_size - 1


def tail_width(features: int, width: int) -> int:
  """The rarer pieces' features: `width`, or 0 for a quarter of
  `features`."""
  return width or max(1, features // 4)


def kernel_shapes(features: int, size: int, width: int, vocab_size: int):
  """The layer's kernels' shapes, `(Kh, P, Kt)`: the head over `features`
  (the shortlist and the "rarer piece" class), the projection to the
  tail's width (`tail_width`), the rarer pieces' over it. Each kernel's
  bias is as wide as its last axis."""
  w = tail_width(features, width)
  return (features, size + 1), (features, w), (w, vocab_size - size)


class ShortlistOutput(tl.Layer):
  """`h` `[..., features]` -> log-probabilities `[..., vocab]`; weights
  `(Kh [features, size + 1], bh, P [features, width], Kt [width, vocab -
  size], bt)`, kernels drawn as Trax's `Dense` draws its kernel (Glorot
  uniform), biases as its bias. A `width` of 0 is a quarter of the
  features."""

  def __init__(self, vocab_size: int, size: int, width: int):
    super().__init__(n_in=1, n_out=1, name=f'ShortlistOutput_{vocab_size}')
    self._vocab_size, self._size, self._width = vocab_size, size, width

  def forward(self, h):
    return softmax.shortlist_log_probs(h, *self.loss_operands(h)[1:])

  def loss_operands(self, h):
    """`(rows, (Kh, P, Kt), (bh, bt))`, as training's chunked loss reads
    them (`src.model.losses.OutputWeights`)."""
    w = self.weights  # (Kh, bh, P, Kt, bt)
    return h, (w[0], w[2], w[3]), (w[1], w[4])

  def init_weights_and_state(self, input_signature):
    head, projection, tail = kernel_shapes(
      input_signature.shape[-1], self._size, self._width, self._vocab_size
    )
    rngs = jax.random.split(self.rng, 5)
    glorot = init.GlorotUniformInitializer()
    small = init.RandomNormalInitializer(1e-6)
    self.weights = (
      glorot(head, rngs[0]),
      small(head[1:], rngs[1]),
      glorot(projection, rngs[2]),
      glorot(tail, rngs[3]),
      small(tail[1:], rngs[4]),
    )
