"""The output layer that also scores tokens through the token embedding
(`output_layer.tied`).

Trax's output layer is a `Dense`: token `t` gets `h . w_t + b_t`, with a
column `w_t` of its own, which a token seen a few times in training
barely learns. What a layer copies from an earlier position is that
token's embedding vector (carried by the attention's values), so the
copy of a rare token reaches the output as a vector its column has
hardly met: a model that found the word stated earlier still names its
first, rare piece 11 times in 37 (BENCHMARKS.md, "The long-conversation
walkthrough, four runs"). A tied output layer adds a term read through
the embedding itself:

  logits_t = h . w_t + b_t + (h C) . e_t

with `C` (`[features, d_model]`) a learned map that starts at zero (the
model starts as Trax's, and learns what of `h` to read as an embedding).
`C` is one map for every token, so what it learns on common tokens
scores a copied rare token through that token's own embedding vector.
Since it starts at zero, a trained model's output layer can grow into
this one at `--init-from` (`src.training.finetune.grown_output`).

With `output_layer.tied = 'only'` the layer has no column of a token's
own: `logits_t = (h C) . e_t + b_t`. The own columns learn which tokens
training answers hold and hold the others down where an answer goes,
over a copy the map had found: after its second run the long-conversation
model named a word no practice answer held 37 times in 60, and 54 with
'only' (BENCHMARKS.md "An output read through the embedding alone").
With no column to grow beside, `C` starts drawn, and a `Dense` output is
never grown into this form.

The matrix reaches the output layer the way Trax passes values, on the
stack: `TiedEmbedding` puts it under the embedded tokens, every layer
between leaves it there, and `TiedOutput` (the model's last layer) reads
both. The gradient of both uses sums into the matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from trax import layers as tl
from trax.layers import initializers as init


class TiedEmbedding(tl.Embedding):
  """Trax's `Embedding`, which also passes its matrix on, under the
  embedded tokens (two outputs)."""

  def __init__(self, vocab_size: int, d_feature: int):
    super().__init__(vocab_size, d_feature)
    self._n_out = 2

  def forward(self, x):
    return super().forward(x), self.weights


class TiedOutput(tl.Layer):
  """`(h, matrix)` -> logits `h @ kernel(matrix) + bias`; weights
  `(kernel, bias, copy)`, the first two drawn as Trax's `Dense` draws
  them, `copy` (`C`, `[features, d_model]`) zeros. With `own=False`
  (`output_layer.tied = 'only'`) tokens are scored through the embedding
  alone, `(h C) . e_t + b_t`: weights `(bias, copy)`, `copy` drawn as a
  `Dense` kernel (there is no column of a token's own for `C` to grow
  beside)."""

  # A fine-tune may grow a trained model's Trax output layer (a `Dense`)
  # into this one: its kernel and bias, then its last `GROWN_WEIGHTS`
  # (`copy`) at zero (`src.training.finetune.grown_output`).
  GROWN_WEIGHTS = 1

  def __init__(self, vocab_size: int, own: bool = True):
    super().__init__(n_in=2, n_out=1, name=f'TiedOutput_{vocab_size}')
    self._vocab_size = vocab_size
    self._own = own

  def forward(self, inputs):
    # `h C` first: a reply token's logits then cost `features x d_model +
    # d_model x vocab` products, not the merged kernel's
    # `features x d_model x vocab` (`loss_operands`, for training,
    # which scores many rows with one kernel where a token has its own).
    h, matrix = inputs
    *kernel, bias, copy = self.weights
    through = jnp.matmul(h @ copy, matrix.T)
    if kernel:  # Summed in the order it always was.
      return jnp.matmul(h, kernel[0]) + through + bias
    return through + bias

  def loss_operands(self, h, matrix):
    """What training's loss scores, `(rows, kernel, bias)`, the logits
    being `rows @ kernel + bias`, many rows at once. With a column of
    each token's own, the rows are `h` and the kernel the own one plus
    `copy` against the embedding's matrix (`[vocab, d_model]`): `[features,
    vocab]`. Through the embedding alone (`own=False`) the rows are `h C`
    and the kernel the matrix itself, `[d_model, vocab]`: the same
    logits in fewer products, `features x d_model + 3 d_model x vocab` a
    row with the gradients where the merged kernel takes `3 features x
    vocab` (the walkthrough's loss 1.5-2.0x faster: BENCHMARKS.md "The
    loss read through the embedding in its own width")."""
    *kernel, bias, copy = self.weights
    if not kernel:
      return h @ copy, matrix.T, bias
    return h, kernel[0] + copy @ matrix.T, bias

  def init_weights_and_state(self, input_signature):
    features = input_signature[0].shape[-1]
    d_model = input_signature[1].shape[-1]
    rng_kernel, rng_bias = jax.random.split(self.rng)
    bias = init.RandomNormalInitializer(1e-6)((self._vocab_size,), rng_bias)
    glorot = init.GlorotUniformInitializer()
    if not self._own:
      self.weights = (bias, glorot((features, d_model), rng_kernel))
      return
    kernel = glorot((features, self._vocab_size), rng_kernel)
    copy = jnp.zeros((features, d_model), np.float32)
    self.weights = (kernel, bias, copy)
