"""Cross-entropy over an output layer, one chunk of rows at a time, with
its gradients made in the forward pass: a plain output layer
(`dense_chunk`) and a shortlist one (`shortlist_chunk`; the layer is
`src.model.shortlist`), and the shortlist layer's log-probabilities
(`shortlist_log_probs`).

A shortlist output layer (adaptive softmax, Grave et al. 2017, with one
tail cluster) scores the `size` most used pieces (the lowest ids: the
tokenizer's unigram model numbers its pieces by score) and one more
class, "a rarer piece", from all the features; a rarer piece's
probability is that class's times its own among the rarer pieces, scored
from a narrow projection of the features (`width`):

  log p(t) = head_t                         t < size
  log p(t) = head_size + tail_(t - size)    t >= size

with `head = log_softmax(h Kh + bh)`, `tail = log_softmax((h P) Kt + bt)`.
Every row still gets every piece's probability (a chat samples from
all), but the rarer pieces cost `width` products a row, not `features`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_chunk(chunk, kernels, bias):
  """One chunk's loss sum, hit rows and gradients, the logits laid out
  `[vocab, rows]` (XLA's CPU code reduces over the leading axis ~4x
  faster than over the last one).

  `chunk` is `(rows as [c, d], the same as [d, c], targets, weights)`;
  `kernels` the output kernel as `[vocab, d]` and `[d, vocab]`: every
  product reads its operands in the plain layout (`[m, k] x [k, n]`):
  XLA's CPU backend hands a product with a transposed operand to Eigen,
  which has no bfloat16 product, and a plain one to YNNPACK where its
  products are on (`src.runtime.xla`): with `precision.products =
  'bfloat16'` (`src.model.precision`) they read bfloat16 and sum in
  float32.

  Returns `((loss sum, hit rows, d loss/d kernel as [vocab, d], d loss/d
  bias), d loss/d rows as [d, c])`. The hit rows (`[c]`, 1.0 or 0.0,
  unweighted) are the rows whose target logit is the largest.
  """
  xc, xt, tc, wc = chunk
  k_vd, k_dv = kernels
  f32 = jnp.float32
  logits = jnp.dot(k_vd, xt, preferred_element_type=f32) + bias[:, None]
  top = jnp.max(logits, axis=0)
  e = jnp.exp(logits - top)
  total = jnp.sum(e, axis=0)
  true = jnp.take_along_axis(logits, tc[None, :], axis=0)[0]
  loss = jnp.sum(wc * (top + jnp.log(total) - true))
  hits = (true >= top).astype(f32)
  target = jnp.arange(logits.shape[0])[:, None] == tc[None, :]
  g = (e * (1.0 / total) - target.astype(f32)) * wc[None, :]
  dk = jnp.dot(g, xc, preferred_element_type=f32)
  dx = jnp.dot(k_dv, g, preferred_element_type=f32)
  return (loss, hits, dk, jnp.sum(g, axis=1)), dx


def shortlist_chunk(chunk, kernels, biases):
  """`dense_chunk` for a shortlist output layer: the head's softmax over
  the shortlist and the "rarer piece" class (every row), then the
  tail's over the rarer pieces from the narrow projection `z = h P`
  (the rows whose target is one; the others weigh 0).

  `kernels` are `((Kh as [size + 1, d], as [d, size + 1]), (P as [w,
  d], as [d, w]), (Kt as [tail, w], as [w, tail]))`; `biases` `(bh,
  bt)`. Returns `((loss sum, hit rows, (dKh, dP, dKt) each laid out as
  its first form, (dbh, dbt)), d loss/d rows as [d, c])`. A hit row's
  target is the piece that the most likely head class and, for a rarer
  piece, the most likely tail piece name (the tree's own argmax).
  """
  xc, xt, tc, wc = chunk
  head, (p_wd, p_dw), tail = kernels
  size = head[0].shape[0] - 1
  f32 = jnp.float32
  short = tc < size
  first = jnp.where(short, tc, size)
  (loss, hits, dkh, dbh), dx = dense_chunk((xc, xt, first, wc), head, biases[0])
  zt = jnp.dot(p_wd, xt, preferred_element_type=f32)
  rest = jnp.where(short, 0, tc - size)
  rest_w = jnp.where(short, 0.0, wc)
  (tail_loss, tail_hits, dkt, dbt), dz = dense_chunk(
    (zt.T, zt, rest, rest_w), tail, biases[1]
  )
  dp = jnp.dot(dz, xc, preferred_element_type=f32)
  dx = dx + jnp.dot(p_dw, dz, preferred_element_type=f32)
  hits = jnp.where(short, hits, hits * tail_hits)
  return (loss + tail_loss, hits, (dkh, dp, dkt), (dbh, dbt)), dx


def shortlist_log_probs(h, kernels, biases):
  """Every piece's log-probability under a shortlist output layer:
  `h` `[..., features]` -> `[..., vocab]`. `kernels` are `(Kh [d, size +
  1], P [d, w], Kt [w, tail])`, `biases` `(bh, bt)`."""
  kh, p, kt = kernels
  size = kh.shape[-1] - 1
  head = jax.nn.log_softmax(jnp.matmul(h, kh) + biases[0], axis=-1)
  tail = jax.nn.log_softmax(jnp.matmul(h @ p, kt) + biases[1], axis=-1)
  return jnp.concatenate([head[..., :size], tail + head[..., size:]], axis=-1)
