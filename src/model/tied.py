"""The output layer that also scores tokens through the token embedding
(`output_layer.tied`).

Trax's output layer is a `Dense`: token `t` gets `h . w_t + b_t`, with a
column `w_t` of its own, which a token seen a few times in training
barely learns. What a layer copies from an earlier position is that
token's embedding vector (carried by the attention's values), so a
column per token is also what copying needs, token by token. A tied
output layer adds a term read through the embedding itself:

  logits_t = h . w_t + b_t + g * (mean of the halves of h) . e_t

with `g` a learned scalar that starts at 0 (the model starts as Trax's,
and learns how much to use it). The copy of any token then scores that
token through one map, whether or not the token was often a target.

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
  `(kernel, bias, gate)`, the first two drawn as Trax's `Dense` draws
  them, the gate 0."""

  def __init__(self, vocab_size: int):
    super().__init__(n_in=2, n_out=1, name=f'TiedOutput_{vocab_size}')
    self._vocab_size = vocab_size

  def forward(self, inputs):
    h, matrix = inputs
    return jnp.matmul(h, self.kernel(matrix)) + self.weights[1]

  def kernel(self, matrix):
    """`[features, vocab]`: the own kernel plus the gate times the
    embedding's matrix, read by each half (the halves concatenated: each
    half's rows get half of it, so their mean meets the embedding)."""
    kernel, _, gate = self.weights
    halves = kernel.shape[0] // matrix.shape[1]
    tied = jnp.concatenate([matrix.T] * halves, axis=0) / halves
    return kernel + gate * tied

  def init_weights_and_state(self, input_signature):
    features = input_signature[0].shape[-1]
    rng_kernel, rng_bias = jax.random.split(self.rng)
    kernel = init.GlorotUniformInitializer()(
      (features, self._vocab_size), rng_kernel
    )
    bias = init.RandomNormalInitializer(1e-6)((self._vocab_size,), rng_bias)
    self.weights = (kernel, bias, jnp.zeros((), np.float32))
