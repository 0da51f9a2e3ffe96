"""The loss, the chunked output layer and the metrics of training and
evaluation (loss and accuracy, also by position in the context)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from trax import layers as tl

from src.core.errors import UserError
from src.model import output_layer, shortlist, softmax, tied


def loss_layer():
  """Cross-entropy on logits (ReformerLM outputs logits, not log-probs)."""
  return tl.WeightedCategoryCrossEntropy()


def output_loss(chunk_size: int = 512) -> int:
  """How training computes the output layer and loss (gin: output_loss).

  Args:
    chunk_size: Positions (over batch x length) whose logits exist at once;
      0 computes all `[batch, length, vocab]` logits as Trax does.

  Returns:
    The chunk size. (The products' type is `precision.products`.)
  """
  if chunk_size < 0:
    raise UserError(
      f'output_loss.chunk_size = {chunk_size} must be 0 (off) or positive; '
      'fix it in the gin file'
    )
  return int(chunk_size)


def position_ranges(max_len: int) -> list[tuple[int, int]]:
  """Ranges of context positions for loss by position: the last quarter,
  the sixteenth before it, ...: for 32k, 0-512, 512-2k, 2k-8k, 8k-32k."""
  cuts = sorted({0, max_len, *(max(1, max_len // f) for f in (64, 16, 4))})
  return list(zip(cuts[:-1], cuts[1:]))


def range_name(start: int, end: int) -> str:
  def short(n):
    return f'{n // 1024}k' if n >= 1024 and n % 1024 == 0 else str(n)

  return f'{short(start)}-{short(end)}'


def range_sums(losses, weights, ranges) -> list:
  """`[sum of weighted loss, sum of weights]` per position range.

  Args:
    losses, weights: `[batch, length]` per-token loss and loss weight.
    ranges: `(start, end)` position ranges.
  """
  pos = jnp.arange(losses.shape[-1])
  sums = []
  for start, end in ranges:
    mask = ((pos >= start) & (pos < end)).astype(jnp.float32)[None, :] * weights
    sums += [jnp.sum(mask * losses), jnp.sum(mask)]
  return sums


def _chunked_rows(x, targets, weights, chunk_size: int):
  """`x`, targets and weights as rows (`[n, d]`, `[n]`, `[n]`), padded
  with weight-0 rows to a multiple of the chunk; and the chunk size."""
  d = x.shape[-1]
  x = x.reshape(-1, d)
  t = targets.reshape(-1).astype(jnp.int32)
  w = weights.reshape(-1).astype(jnp.float32)
  n = x.shape[0]
  c = max(1, min(chunk_size, n))
  pad = (-n) % c
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
    t = jnp.pad(t, (0, pad))
    w = jnp.pad(w, (0, pad))
  return x, t, w, c


def _scores(xc, kernel, bias):
  """Rows' logits (or, from a shortlist output layer, log-probabilities,
  which serve as logits)."""
  if isinstance(kernel, tuple):
    return softmax.shortlist_log_probs(xc, kernel, bias)
  return xc @ kernel + bias


def _chunk_metrics(xc, tc, wc, kernel, bias):
  """Evaluation: one chunk's `(loss sum, weighted hits, per-token
  losses)`; a hit is the first most likely token being the target, as
  `WeightedCategoryAccuracy` counts it."""
  logits = _scores(xc, kernel, bias)
  lse = jax.nn.logsumexp(logits, axis=-1)
  true = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
  hits = (jnp.argmax(logits, axis=-1) == tc).astype(jnp.float32)
  return jnp.sum(wc * (lse - true)), jnp.sum(wc * hits), lse - true


def _fused_loss(x, kernel, bias, t, w, c):
  """`(loss sum, hits)` over rows `x` (`[n, d]`, n a multiple of `c`),
  with the gradient made in the forward pass, chunk by chunk
  (`src.model.softmax`): three products per chunk (logits, then both
  gradients) where recomputing the logits in the backward pass takes
  four, and the backward pass only scales what the forward pass kept
  (`dx`, `[n, d]`, the size of `x`). `kernel` and `bias` are a plain
  output layer's arrays, or a shortlist one's tuples (`_scores`)."""
  d = x.shape[-1]
  many = isinstance(kernel, tuple)

  def forward(x, kernel, bias, t, w):
    if output_layer.applies(x, kernel, c):  # bfloat16 products on AMX.
      return output_layer.loss_and_grads(x, kernel, bias, t, w, c)

    def body(carry, chunk):
      if many:
        (loss, hit_rows, dk, db), dx = softmax.shortlist_chunk(
          chunk, layouts, bias
        )
      else:
        (loss, hit_rows, dk, db), dx = softmax.dense_chunk(
          chunk, layouts[0], bias
        )
        dk = (dk,)
      sums = (loss, jnp.sum(chunk[3] * hit_rows), dk, db)
      return jax.tree.map(jnp.add, carry, sums), dx

    # Both layouts of each kernel and of the rows, once a step.
    kernels = kernel if many else (kernel,)
    layouts = tuple((k.T, k) for k in kernels)
    rows = x.reshape(-1, c, d)
    chunks = (rows, rows.transpose(0, 2, 1), t.reshape(-1, c), w.reshape(-1, c))
    zero = jnp.zeros([], jnp.float32)
    dk = tuple(jnp.zeros(k.shape[::-1]) for k in kernels)
    start = (zero, zero, dk, jax.tree.map(jnp.zeros_like, bias))
    (loss, hits, dk, db), dx = jax.lax.scan(body, start, chunks)
    dk = tuple(g.T for g in dk)
    dx = dx.transpose(0, 2, 1).reshape(x.shape)
    return (loss, hits), (dx, dk if many else dk[0], db)

  @jax.custom_vjp
  def loss_and_hits(x, kernel, bias, t, w):
    return forward(x, kernel, bias, t, w)[0]

  dtypes = jax.tree.map(lambda a: a.dtype, (x, kernel, bias))

  def backward(grads, cotangents):
    scale = cotangents[0]  # The hits have no gradient; nor have t and w.
    scaled = jax.tree.map(lambda g, t: (scale * g).astype(t), grads, dtypes)
    return (*scaled, None, None)

  loss_and_hits.defvjp(forward, backward)
  loss, hits = loss_and_hits(x, kernel, bias, t, w)
  return loss, jax.lax.stop_gradient(hits)


def chunked_cross_entropy(
  x,
  kernel,
  bias,
  targets,
  weights,
  chunk_size,
  with_accuracy=False,
  ranges=(),
  with_hits=False,
):
  """Weighted cross-entropy of `x @ kernel + bias`, `chunk_size` rows at a time.

  Equals `WeightedCategoryCrossEntropy` on the full logits, but only one
  chunk's logits exist at a time: memory is `chunk_size x vocab`, not
  `length x vocab`. In training the gradient is made with the loss
  (`_fused_loss`); evaluation computes the loss and its metrics only.

  Args:
    x: `[batch, length, d]` float activations.
    kernel: `[d, vocab]`; bias: `[vocab]`. Or a shortlist output
      layer's `(Kh, P, Kt)` and `(bh, bt)` (`src.model.softmax`).
    targets: `[batch, length]` int32.
    weights: `[batch, length]` float32 loss weights.
    chunk_size: Rows per chunk.
    with_accuracy: Also return the weighted accuracy (evaluation).
    ranges: With `with_accuracy`, also `range_sums` for these position
      ranges.
    with_hits: Also return the weighted count of right guesses and the
      weight total (training: the running accuracy), without gradient.

  Returns:
    The weighted mean loss, a float32 scalar; with `with_accuracy`, the
    pair (loss, accuracy) as `WeightedCategoryAccuracy` computes it,
    followed by the `range_sums`; with `with_hits`, (loss, hits, total).
  """
  shape, d, n = targets.shape, x.shape[-1], targets.size
  x, t, w, c = _chunked_rows(x, targets, weights, chunk_size)
  total = jnp.sum(w)
  if not with_accuracy:
    loss, hits = _fused_loss(x, kernel, bias, t, w, c)
    if with_hits:
      return loss / total, hits, jax.lax.stop_gradient(total)
    return loss / total

  def body(totals, inputs):
    loss, hits, each = _chunk_metrics(*inputs, kernel, bias)
    return (totals[0] + loss, totals[1] + hits), each

  zero = jnp.zeros([], jnp.float32)
  (loss, hits), each = jax.lax.scan(
    body,
    (zero, zero),
    (x.reshape(-1, c, d), t.reshape(-1, c), w.reshape(-1, c)),
  )
  per_token = each.reshape(-1)[:n].reshape(shape)
  sums = range_sums(per_token, weights.astype(jnp.float32), ranges)
  return (loss / total, hits / total, *sums)


class _Wraps(tl.Layer):
  """A layer whose weights and state are another layer's (`_wrapped`),
  read and written through, so a model built with it has exactly the
  wrapped layer's weight structure."""

  @property
  def weights(self):
    return self._wrapped.weights

  @weights.setter
  def weights(self, weights):
    self._wrapped.weights = weights

  @property
  def state(self):
    return self._wrapped.state

  @state.setter
  def state(self, state):
    self._wrapped.state = state

  def init_weights_and_state(self, input_signature):
    self._wrapped.init(input_signature)


class OutputWeights(_Wraps):
  """Stands in for the model's output layer (its `Dense`) in training.

  Passes the activations on together with the Dense layer's kernel and
  bias, so `ChunkedOutput` can apply them chunk by chunk. Its weights *are*
  the output layer's (read and written through), so the training model has
  exactly the model's weight structure: checkpoints and the eval and
  predict models are unchanged. A tied output layer (`tied.TiedOutput`)
  also reads the embedding's matrix from the stack and says what rows
  and kernel the loss scores (`loss_operands`); a shortlist one
  (`shortlist.ShortlistOutput`) passes its kernels and biases as tuples.
  """

  def __init__(self, head, dense_index: int | None):
    """Args: `head` is a Dense or a `TiedOutput`, or a Serial with one
    Dense at `dense_index` (Trax wraps it in shape checks)."""
    n_in = 2 if isinstance(head, tied.TiedOutput) else 1
    super().__init__(n_in=n_in, n_out=3, name='OutputWeights')
    self._wrapped = head
    self._index = dense_index

  def forward(self, x):
    if isinstance(self._wrapped, tied.TiedOutput):
      return self._wrapped.loss_operands(*x)  # (h, the embedding's matrix)
    if isinstance(self._wrapped, shortlist.ShortlistOutput):
      return self._wrapped.loss_operands(x)
    weights = self.weights
    kernel, bias = weights if self._index is None else weights[self._index]
    return x, kernel, bias


def _dense_position(head):
  """None if `head` is a Dense (or a tied or shortlist output layer); the
  index of the only weighted sublayer if it is a Dense inside weightless
  layers; else raises ValueError."""
  if type(head).__name__ == 'Dense' or isinstance(
    head, (tied.TiedOutput, shortlist.ShortlistOutput)
  ):
    return None
  names = [type(layer).__name__ for layer in head.sublayers]
  if names.count('Dense') == 1 and all(
    n in ('Dense', 'AssertShape') for n in names
  ):
    return names.index('Dense')
  raise ValueError(f'not a Dense output layer: {names}')


class ChunkedOutput(tl.Layer):
  """`(activations, kernel, bias, targets, weights)` -> the weighted mean
  loss (training) or (loss, accuracy, position range sums...) (evaluation),
  via `chunked_cross_entropy`.

  In training its state is `(hits, total)` of the last call: the weighted
  count of positions whose most likely token was the target, and the
  weight total (float32 scalars). The loop reads them for the running
  accuracy; they are not part of the model's state or checkpoints.
  """

  def __init__(self, chunk_size: int, with_accuracy: bool = False, ranges=()):
    n_out = 2 + 2 * len(ranges) if with_accuracy else 1
    super().__init__(n_in=5, n_out=n_out, name='ChunkedOutput')
    self._chunk_size = chunk_size
    self._with_accuracy = with_accuracy
    self._ranges = tuple(ranges) if with_accuracy else ()
    if not with_accuracy:
      # Set here, not in `init_weights_and_state`: the trainer reads the
      # state of a layer it never initializes, and the first step must see
      # the structure every later step sees, or the whole training step is
      # traced and compiled a second time.
      self.state = hit_counts_zero()

  def forward(self, inputs):
    # (x, kernel, bias, targets, weights), in `chunked_cross_entropy`'s order.
    out = chunked_cross_entropy(
      *inputs,
      self._chunk_size,
      with_accuracy=self._with_accuracy,
      ranges=self._ranges,
      with_hits=not self._with_accuracy,
    )
    if self._with_accuracy:
      return out
    loss, hits, total = out
    self.state = (hits, total)
    return loss


def loss_part(fused):
  """What `chunked_model`'s second layer (`ChunkedOutput`) holds of a
  `fused` tree (its weights, or its state)."""
  _, loss = fused
  return loss


def hit_counts_zero():
  """`ChunkedOutput`'s training state before any step: (hits, total)."""
  return (jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))


def hit_counts(model_with_loss_state):
  """`(hits, total)` of the last training step, summed over devices (from
  the trainer's model-with-loss state), or None when the loss is not the
  chunked one (no counts there). Device values: nothing waits."""
  try:
    hits, total = model_with_loss_state[1]
  except (TypeError, ValueError, IndexError):
    return None
  return jnp.stack([jnp.sum(hits), jnp.sum(total)])


def chunked_model(
  model, chunk_size: int, with_accuracy: bool = False, ranges=()
):
  """`Serial(model', ChunkedOutput)`: training (loss) or evaluation (loss,
  accuracy) without the full `[batch, length, vocab]` logits; or None.

  `model'` is `model` with its output `Dense` replaced by `OutputWeights`
  (same layers, same weights, nothing initialized again), so its first
  weights have the model's structure, as Trax's Loop expects. None when
  `chunk_size` is 0 or the model does not end in a plain Dense layer.
  """
  if not chunk_size:
    return None
  *body, head = model.sublayers
  try:
    index = _dense_position(head)
  except ValueError:
    return None
  return tl.Serial(
    tl.Serial(*body, OutputWeights(head, index)),
    ChunkedOutput(chunk_size, with_accuracy, ranges),
  )


class Accumulate(_Wraps):
  """Gradient accumulation: a training loss over `k` micro-batches.

  Wraps the model-with-loss (`(inputs, targets, weights)` -> mean loss).
  The batch is cut into `k` equal micro-batches along its first axis; a
  `lax.scan` runs them one after another, each rematerialized in the
  backward pass (`jax.checkpoint`), so only one micro-batch's activations
  are alive at a time. The loss is their mean weighted by loss tokens (the
  whole batch's token-weighted mean), so its gradient is the matching
  mean of the micro-batch gradients: one optimizer step over `k`
  micro-batches equals one over the whole batch. Its weights and state
  are the wrapped layer's (read and written through): checkpoints are
  unchanged.
  """

  def __init__(self, inner, k: int):
    super().__init__(n_in=inner.n_in, n_out=1, name=f'Accumulate{k}')
    self._wrapped, self._k = inner, int(k)

  def forward(self, inputs):
    k = self._k
    for x in inputs:
      if x.shape[0] % k:
        raise UserError(
          f'a batch of {x.shape[0]} per device does not split into '
          f'accumulate-steps = {k} micro-batches'
        )
    micro = [x.reshape((k, x.shape[0] // k) + x.shape[1:]) for x in inputs]
    weights, rngs = self._wrapped.weights, jax.random.split(self.rng, k)

    @jax.checkpoint
    def one(weights, state, batch, rng):
      return self._wrapped.pure_fn(tuple(batch), weights, state, rng)

    def body(carry, xs):
      total, state = carry
      *batch, rng = xs
      loss, new = one(weights, state, batch, rng)
      # The chunked loss's hit counts add up over the micro-batches.
      state = _add_hit_counts(state, new) if counts else new
      # Each micro-batch's mean loss weighted by its loss tokens: the
      # result is the whole batch's token-weighted mean.
      return (total + loss * jnp.sum(batch[-1]), state), None

    zero = jnp.zeros([], jnp.float32)
    state = self._wrapped.state
    counts = isinstance(self._wrapped.sublayers[-1], ChunkedOutput)
    if counts:
      state = (state[0], hit_counts_zero())
    (total, state), _ = jax.lax.scan(body, (zero, state), (*micro, rngs))
    self.state = state
    return total / jnp.sum(inputs[-1])


def _add_hit_counts(before, after):
  """`after` with its `ChunkedOutput` counts added to `before`'s."""
  return (after[0], tuple(a + b for a, b in zip(before[1], after[1])))


class RangeSum(tl.Layer):
  """Evaluation metric `(logits, targets, weights)` -> one of `range_sums`
  (`what`: 'loss' or 'count') for positions `start..end-1`."""

  def __init__(self, start: int, end: int, what: str):
    super().__init__(n_in=3, n_out=1, name=f'RangeSum_{what}')
    self._range, self._what = (start, end), what

  def forward(self, inputs):
    logits, targets, weights = inputs
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    loss, count = range_sums(nll, weights.astype(jnp.float32), [self._range])
    return loss if self._what == 'loss' else count


RANGE_LOSS, RANGE_COUNT = 'range loss ', 'range count '


def metric_names(ranges=()) -> list[str]:
  """Names of the evaluation metrics; the range sums are turned into
  `loss at START-END` by the training loop."""
  names = ['loss', 'accuracy']
  for start, end in ranges:
    name = range_name(start, end)
    names += [RANGE_LOSS + name, RANGE_COUNT + name]
  return names


def metric_layers(ranges=()):
  layers = [tl.WeightedCategoryCrossEntropy(), tl.WeightedCategoryAccuracy()]
  for start, end in ranges:
    layers += [RangeSum(start, end, 'loss'), RangeSum(start, end, 'count')]
  return layers


def perplexity(loss: float) -> float:
  """exp(loss), clamped at exp(50) so a diverging run shows a number."""
  return math.exp(min(float(loss), 50.0))


def range_losses(values: dict) -> dict:
  """Evaluation values with each range's (loss sum, count) pair turned
  into `loss at START-END` (the token-weighted mean; left out when no token
  of the range had a loss weight)."""
  out = {}
  for key, value in values.items():
    if key.startswith(RANGE_COUNT):
      continue
    if key.startswith(RANGE_LOSS):
      name = key[len(RANGE_LOSS) :]
      count = float(values[RANGE_COUNT + name])
      if count > 0:
        out[f'loss at {name}'] = float(value) / count
      continue
    out[key] = value
  return out
