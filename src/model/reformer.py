"""The model, optimizer and learning-rate schedule, as plain functions.

Nothing here knows about gin: `src.model.ginconf` registers these functions (and
Trax's own `ReformerLM`, `LSHSelfAttention`, optimizers) as configurables
and parses the gin files. `mode` and `vocab_size` always come from code.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import trax
from trax import layers as tl
from trax.layers.research import efficient_attention as ea

from src.config import safegin
from src.core.errors import UserError
from src.model import positions as axial

DECAYS = ('rsqrt', 'cosine', 'linear', 'constant')


def lr_schedule(
  total_steps: int,
  peak: float = 1e-3,
  warmup_steps: int = 1000,
  decay: str = 'rsqrt',
  final_fraction: float = 0.1,
) -> Callable[[int], float]:
  """Linear warmup to `peak`, then a decay.

  Args:
    total_steps: Steps of the whole run (the `steps` run setting).
    peak: Learning rate at the end of warmup.
    warmup_steps: Steps of linear warmup from 0.
    decay: 'rsqrt' (peak * sqrt(warmup / step)), 'cosine' or 'linear' (to
      `final_fraction * peak` at `total_steps`), or 'constant'.
    final_fraction: Where cosine and linear decay end, relative to peak.

  Returns:
    A function step -> learning rate.
  """
  if decay not in DECAYS:
    raise UserError(
      f'lr_schedule.decay = {decay!r} is not one of {DECAYS}; '
      'fix it in the gin file'
    )
  warmup_steps = max(0, int(warmup_steps))

  def schedule(step: int) -> float:
    step = int(step)
    if warmup_steps and step < warmup_steps:
      return peak * (step + 1) / warmup_steps
    if decay == 'constant':
      return peak
    if decay == 'rsqrt':
      return peak * math.sqrt(max(warmup_steps, 1) / max(step, 1))
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if decay == 'linear':
      shape = 1.0 - progress
    else:
      shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (final_fraction + (1.0 - final_fraction) * shape)

  return schedule


def optimizer(kind=trax.optimizers.Adam, learning_rate: float | None = None):
  """The optimizer: `kind` is a Trax optimizer class, its settings in gin.

  Args:
    learning_rate: Where to start; the training loop sets the rate from
      `lr_schedule` at every step. Passing the schedule's peak keeps the
      class's own default (Adam: 1e-4, never used) out of the saved gin
      text, where it read as the run's rate.
  """
  if learning_rate is None:
    return kind()
  return kind(learning_rate=learning_rate)


def positions(axial_init_scale: float = 1.0) -> float:
  """How the axial position embeddings start (gin: positions).

  Args:
    axial_init_scale: Their standard deviation at initialization, relative
      to the token embeddings' (Trax draws those with std 1/sqrt(d_model)).
      1.0: position and token start at the same scale. Trax's own start,
      std 1.0, is `sqrt(d_model)` here (11 at d_model 128, 23 at 512): the
      position then swamps the token in every layer's input, and a model
      learns little from content (BENCHMARKS.md, "The position swamps the
      token"). Only a run from scratch uses it: resumed and fine-tuned runs
      load their weights.

  Returns:
    The scale.
  """
  if not axial_init_scale > 0:
    raise UserError(
      f'positions.axial_init_scale = {axial_init_scale!r} must be above 0; '
      "fix it in the gin file (1.0: the token embeddings' scale)"
    )
  return float(axial_init_scale)


def residual(
  zero_feed_forward: bool = True, zero_attention: bool = False
) -> tuple[bool, bool]:
  """How each reversible block's two branches start (gin: residual).

  Args:
    zero_feed_forward: Each block's feed-forward output layer starts at
      zero, so at first a block adds only its attention and the next
      block's attention reads the embedding plus that, not an untrained
      feed-forward of it. Trax starts it random: the copy task's word
      three tokens back was then learned at step ~1750 (LSH first) instead
      of 500, and a held-out list was repeated exactly 29 times of 30
      instead of 30 (BENCHMARKS.md, "Blocks that start quiet").
    zero_attention: Each attention output projection starts at zero too,
      so every block starts as the identity (SkipInit). Measured: the copy
      task at step 250, but lists repeated 8 times of 30: not the default.

  Only a run from scratch uses them: resumed and fine-tuned runs load
  their weights.

  Returns:
    `(zero_attention, zero_feed_forward)`.
  """
  return bool(zero_attention), bool(zero_feed_forward)


def _zeros(shape, rng):
  """A Trax initializer: zeros."""
  del rng
  return jnp.zeros(shape, jnp.float32)


def branch_outputs(lm) -> tuple[list, list]:
  """The layers whose output ends each block's two branches: the attention
  layers and the feed-forwards' last `Dense` (Trax's feed-forward is
  `LayerNorm, Dense, Dropout, activation, Dense, Dropout`)."""
  attention = [
    node
    for node in all_layers(lm)
    if isinstance(node, (ea.SelfAttention, ea.LSHSelfAttention))
  ]
  dense = []
  for node in all_layers(lm):
    subs = list(getattr(node, 'sublayers', ()) or ())
    if subs and type(subs[0]).__name__ == 'LayerNorm':
      found = [s for s in subs if type(s).__name__ == 'Dense']
      dense += found[1:2] if len(found) == 2 else []
  return attention, dense


def reformer_lm(
  vocab_size: int,
  mode: str,
  axial_init_scale: float | None = None,
  zero_outputs: tuple[bool, bool] = (False, False),
  offset: str = 'zero',
):
  """`trax.models.ReformerLM` with the gin-bound settings.

  `axial_init_scale` (see `positions`): where given, the axial position
  embeddings are drawn with std `axial_init_scale / sqrt(d_model)` when
  the model is initialized; None keeps Trax's initializer (std 1.0), which
  only matters for a model that is then initialized, not loaded.
  The attention layers are the classes `ReformerLM.attention_type` names
  (`src.model.attention`). `zero_outputs` (see `residual`): whether each
  block's attention output projections, and its feed-forward output
  layers, start at zero when the model is initialized. Its axial
  positions are
  `positions.AxialPositions` (any window of the grid); `offset` is where a
  training window starts on it ('zero' or 'random').
  """
  lm = trax.models.ReformerLM(vocab_size=vocab_size, mode=mode)
  if any(zero_outputs):
    attention, dense = branch_outputs(lm)
    if not attention or len(attention) != len(dense):
      raise UserError(
        f'residual: found {len(attention)} attention and {len(dense)} '
        'feed-forward outputs, one of each per block wanted; it needs '
        "LSHSelfAttention or SelfAttention blocks with Trax's feed-forward; "
        'set residual.zero_feed_forward = False and '
        'residual.zero_attention = False in the gin file'
      )
    for layer in attention if zero_outputs[0] else ():
      if not hasattr(layer, '_zero_output'):
        raise UserError(
          f'residual.zero_attention needs the attention classes of '
          f"src/model/attention.py, not Trax's {type(layer).__name__}; "
          'name them in ReformerLM.attention_type'
        )
      layer._zero_output = True
    for layer in dense if zero_outputs[1] else ():
      layer._kernel_initializer = _zeros
  for layer in all_layers(lm):
    if isinstance(layer, tl.AxialPositionalEncoding):
      layer.__class__ = axial.AxialPositions
      layer._offset = offset
      if axial_init_scale is not None:
        d_model = sum(layer._d_embs)
        std = axial_init_scale / math.sqrt(d_model)
        layer._kernel_initializer = tl.RandomNormalInitializer(std)
  return lm


def all_layers(layer) -> list:
  """`layer` and every layer inside it, depth first."""
  found = [layer]
  for sub in getattr(layer, 'sublayers', ()) or ():
    found += all_layers(sub)
  return found


def _defaults(fn) -> dict:
  """Keyword defaults of a function, or of a class's `__init__`."""
  fn = fn.__init__ if inspect.isclass(fn) else getattr(fn, '__wrapped__', fn)
  return {
    k: p.default
    for k, p in inspect.signature(fn).parameters.items()
    if p.default is not inspect.Parameter.empty
  }


def attention_kinds(model: dict, where: str) -> list:
  """The attention classes of `ReformerLM.attention_type`, as a list.

  Trax cycles a list through the decoder blocks (block i gets entry
  `i % len`), so `n_layers` must be a multiple of its length.
  """
  kinds = model['attention_type']
  if not isinstance(kinds, (list, tuple)):
    return [kinds]
  kinds = list(kinds)
  if not kinds or int(model['n_layers']) % len(kinds):
    raise UserError(
      f'{where}: ReformerLM.n_layers {model["n_layers"]} must be a multiple '
      f'of the {len(kinds)} entries of ReformerLM.attention_type (Trax '
      'cycles the list through the blocks)'
    )
  return kinds


def check_local(model: dict, local: dict | None, where: str):
  """A mixed model's `SelfAttention` blocks must be local (chunked).

  Unchunked, they would hold the whole context's scores, which the
  32k model cannot afford, and the mix would no longer be a Reformer.
  """
  chunk = (local or {}).get('chunk_len')
  if not chunk:
    raise UserError(
      f'{where}: ReformerLM.attention_type mixes attention kinds, so bind '
      '"SelfAttention.chunk_len" (e.g. 64): the SelfAttention blocks are '
      'the local ones, attending within their chunk and the one before'
    )
  if int(model['max_len']) % int(chunk):
    raise UserError(
      f'{where}: max_len {model["max_len"]} must be a multiple of '
      f'SelfAttention.chunk_len {chunk}'
    )
  if local.get('n_chunks_after'):
    raise UserError(
      f'{where}: SelfAttention.n_chunks_after must be 0 in a causal '
      'language model (it would look ahead)'
    )


# ---- Types and ranges of the model settings --------------------------------
#
# A model.gin may come from someone else: every setting is checked for its
# type and range before anything is built, so a bad value is one line, not
# a traceback or an allocation that takes the machine's memory.

_INT, _FRACTION, _PROBABILITY, _BOOL = 'int', 'fraction', 'probability', 'bool'
MAX_LEN = 1 << 20  # Tokens of context.
_MODEL_RANGES = {
  'd_model': (_INT, 1, 16384),
  'd_ff': (_INT, 1, 65536),
  'd_attention_key': (_INT, 1, 4096),
  'd_attention_value': (_INT, 1, 4096),
  'n_layers': (_INT, 1, 128),
  'n_heads': (_INT, 1, 256),
  'max_len': (_INT, 1, MAX_LEN),
  'dropout': (_FRACTION, 0, 1),
  'pos_start_from_zero_prob': (_PROBABILITY, 0, 1),
  'pos_max_offset_to_add': (_INT, 0, MAX_LEN),
  'ff_use_sru': (_INT, 0, 64),
  'ff_chunk_size': (_INT, 0, MAX_LEN),
  'ff_sparsity': (_INT, 0, 65536),
  'attention_chunk_size': (_INT, 0, MAX_LEN),
}
_ATTENTION_RANGES = {
  'chunk_len': (_INT, 1, MAX_LEN),
  'n_chunks_before': (_INT, 0, 64),
  'n_chunks_after': (_INT, 0, 64),
  'n_hashes': (_INT, 1, 64),
  'predict_mem_len': (_INT, 1, MAX_LEN),
  'predict_drop_len': (_INT, 1, MAX_LEN),
  'attention_dropout': (_FRACTION, 0, 1),
  'output_dropout': (_FRACTION, 0, 1),
  'max_length_for_buckets': (_INT, 1, MAX_LEN),
  'n_parallel_heads': (_INT, 1, 256),
  'causal': (_BOOL, 0, 1),
  'masked': (_BOOL, 0, 1),
  'bias': (_BOOL, 0, 1),
  'use_python_loop': (_BOOL, 0, 1),
  'use_reference_code': (_BOOL, 0, 1),
}
_ATTENTION_CLASSES = {
  'LSHSelfAttention',
  'SelfAttention',
  'LocalSelfAttention',
  'FastLSHSelfAttention',
  'DirectedLSHSelfAttention',
}


def _bad(where: str, name: str, value, want: str):
  shown = '@' + value.__name__ if callable(value) else repr(value)
  shown = shown if len(shown) <= 40 else shown[:37] + '...'
  return UserError(f'{where}: {name} = {shown} must be {want}')


def _check_value(where: str, name: str, value, rule):
  kind, low, high = rule
  if value is None:
    return
  if kind == _BOOL:
    if not isinstance(value, bool):
      raise _bad(where, name, value, 'True or False')
    return
  if kind == _INT:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or not low <= value <= high:
      raise _bad(where, name, value, f'a whole number from {low} to {high}')
    return
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if kind == _PROBABILITY:
    if not ok or not low <= value <= high:
      raise _bad(where, name, value, f'a number from {low} to {high}')
    return
  if not ok or not low <= value < high:
    raise _bad(where, name, value, f'a number from {low} to below {high}')


def _ints(where, name, value, low, high, length=(1, 8)):
  if isinstance(value, (list, tuple)) and not value:
    return  # An empty tuple: no axial positions.
  if not isinstance(value, (list, tuple)) or not (
    length[0] <= len(value) <= length[1]
  ):
    raise _bad(
      where, name, value, f'a tuple of {length[0]}-{length[1]} numbers'
    )
  for v in value:
    _check_value(where, name, v, (_INT, low, high))


def _class_name(value) -> str | None:
  """The name of a class or function a setting references (`@Name`)."""
  return getattr(value, '__name__', None) if callable(value) else None


def check_types(model: dict, attention: dict[str, dict], where: str):
  """Every model setting has its type and range, before anything is built.

  Args:
    model: ReformerLM keyword settings (defaults filled in).
    attention: Settings of each attention class used, by class name.
    where: The gin file, for messages.
  """
  for key, rule in _MODEL_RANGES.items():
    _check_value(where, f'ReformerLM.{key}', model.get(key), rule)
  kinds = model.get('attention_type')
  kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
  if not 1 <= len(kinds) <= 16 or any(
    _class_name(k) not in _ATTENTION_CLASSES for k in kinds
  ):
    raise _bad(
      where,
      'ReformerLM.attention_type',
      model.get('attention_type'),
      '@LocalSelfAttention, @DirectedLSHSelfAttention or a list of them',
    )
  if _class_name(model.get('ff_activation')) not in safegin.ACTIVATIONS:
    raise _bad(
      where,
      'ReformerLM.ff_activation',
      model.get('ff_activation'),
      f'one of {", ".join("@" + a for a in sorted(safegin.ACTIVATIONS))}',
    )
  if model.get('pos_type') not in (None, 'axial', 'fixed-base', 'infinite'):
    raise _bad(where, 'ReformerLM.pos_type', model.get('pos_type'), "'axial'")
  for key in ('pos_axial_shape', 'pos_d_axial_embs'):
    if model.get(key) is not None:
      _ints(where, f'ReformerLM.{key}', model[key], 1, MAX_LEN)
  for cls, settings in attention.items():
    for key, rule in _ATTENTION_RANGES.items():
      _check_value(where, f'{cls}.{key}', settings.get(key), rule)
    mixed = len({_class_name(k) for k in kinds}) > 1  # See check_local.
    if (
      not mixed
      and settings.get('chunk_len') is None
      and (settings.get('n_chunks_before') or settings.get('n_chunks_after'))
    ):
      raise UserError(
        f'{where}: {cls}.chunk_len is None (full attention) but '
        f'{cls}.n_chunks_before is {settings.get("n_chunks_before")}; add '
        f'"{cls}.n_chunks_before = 0" (chunks before mean local attention)'
      )
    buckets = settings.get('n_buckets')
    if buckets is not None:
      if isinstance(buckets, (list, tuple)):
        _ints(where, f'{cls}.n_buckets', buckets, 2, 1 << 16, (1, 4))
      else:
        _check_value(where, f'{cls}.n_buckets', buckets, (_INT, 2, 1 << 16))


def check_settings(model: dict, attention: dict, attention_type, where: str):
  """Rejects settings that Trax would silently get wrong.

  Args:
    model: ReformerLM keyword settings (defaults filled in).
    attention: Settings of the attention layer (defaults filled in).
    attention_type: The attention layer class.
    where: The gin file, for messages.
  """
  for key in ('vocab_size', 'mode'):
    if key in model.get('_bound', ()):
      what = (
        'comes from the tokenizer'
        if key == 'vocab_size'
        else 'is chosen by the scripts (train/eval/predict)'
      )
      raise UserError(f'{where}: remove "ReformerLM.{key}": it {what}')
  max_len, d_model = model['max_len'], model['d_model']
  axial = tuple(model.get('pos_axial_shape') or ())
  if axial and model.get('pos_type') != 'axial':
    raise UserError(
      f'{where}: ReformerLM.pos_axial_shape is set but '
      "ReformerLM.pos_type is not 'axial', so Trax would "
      'ignore it; add "ReformerLM.pos_type = \'axial\'"'
    )
  if model.get('pos_type') == 'axial':
    if not axial or int(np.prod(axial)) != max_len:
      raise UserError(
        f'{where}: ReformerLM.pos_axial_shape {axial} must '
        f'multiply to max_len {max_len}'
      )
    embs = tuple(model.get('pos_d_axial_embs') or ())
    if len(embs) != len(axial) or sum(embs) != d_model:
      raise UserError(
        f'{where}: ReformerLM.pos_d_axial_embs {embs} must have '
        f'{len(axial)} entries summing to d_model {d_model}'
      )
  name = getattr(attention_type, '__name__', str(attention_type))
  if 'LSH' in name:
    chunk_len, n_buckets = attention['chunk_len'], attention['n_buckets']
    if n_buckets is None:
      raise UserError(
        f'{where}: set "LSHSelfAttention.n_buckets" (e.g. '
        f'{max(2, max_len // chunk_len)}); left unset, '
        'Trax hashes the one-token predict step into a different number '
        'of buckets than training used'
      )
    for n in n_buckets if isinstance(n_buckets, (list, tuple)) else [n_buckets]:
      if n < 2 or n % 2:
        raise UserError(
          f'{where}: LSHSelfAttention.n_buckets {n_buckets} '
          'must be even (or a list of even factors)'
        )
    if max_len % chunk_len:
      raise UserError(
        f'{where}: max_len {max_len} must be a multiple of '
        f'LSHSelfAttention.chunk_len {chunk_len}'
      )
  return name


def count_params(layer) -> int:
  """Number of weights in an initialized Trax layer."""
  leaves = [
    w for w in trax.fastmath.tree_flatten(layer.weights) if hasattr(w, 'size')
  ]
  return int(sum(w.size for w in leaves))


def init_model(
  vocab_size: int,
  mode: str,
  max_len: int,
  batch: int = 1,
):
  """Builds and initializes a model for a `[batch, max_len]` int32 input."""
  model = reformer_lm(vocab_size, mode)
  length = 1 if mode == 'predict' else max_len
  model.init(trax.shapes.ShapeDtype((batch, length), np.int32))
  return model


def lsh_layers(layer) -> list:
  """Every LSH attention layer inside `layer`."""
  return [
    node
    for node in all_layers(layer)
    if isinstance(node, (ea.LSHSelfAttention, ea.PureLSHSelfAttention))
  ]


def local_layers(layer) -> list:
  """Every chunked (local) `SelfAttention` layer inside `layer`."""
  return [
    node
    for node in all_layers(layer)
    if isinstance(node, ea.SelfAttention) and node._chunk_len
  ]


def loss_layer():
  """Cross-entropy on logits (ReformerLM outputs logits, not log-probs)."""
  return tl.WeightedCategoryCrossEntropy()


def output_loss(chunk_size: int = 512) -> int:
  """How training computes the output layer and loss (gin: output_loss).

  Args:
    chunk_size: Positions (over batch x length) whose logits exist at once;
      0 computes all `[batch, length, vocab]` logits as Trax does.

  Returns:
    The chunk size.
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
  chunk's logits exist at a time, in the forward and (recomputed) in the
  backward pass: memory is `chunk_size x vocab`, not `length x vocab`.

  Args:
    x: `[batch, length, d]` float activations.
    kernel: `[d, vocab]`; bias: `[vocab]`.
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
  shape = targets.shape
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

  @jax.checkpoint
  def piece(xc, tc, wc, kernel, bias):
    logits = xc @ kernel + bias
    lse = jax.nn.logsumexp(logits, axis=-1)
    true = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
    loss = jnp.sum(wc * (lse - true))
    if not (with_accuracy or with_hits):
      return loss, jnp.zeros([], jnp.float32), jnp.zeros([0], jnp.float32)
    hits = (jnp.argmax(logits, axis=-1) == tc).astype(jnp.float32)
    hits = jax.lax.stop_gradient(jnp.sum(wc * hits))
    return loss, hits, (lse - true) if with_accuracy else jnp.zeros([0])

  def body(totals, inputs):
    loss, hits, each = piece(*inputs, kernel, bias)
    return (totals[0] + loss, totals[1] + hits), each

  zero = jnp.zeros([], jnp.float32)
  (loss, hits), each = jax.lax.scan(
    body,
    (zero, zero),
    (x.reshape(-1, c, d), t.reshape(-1, c), w.reshape(-1, c)),
  )
  total = jnp.sum(w)
  if with_accuracy:
    per_token = each.reshape(-1)[:n].reshape(shape)
    sums = range_sums(per_token, weights.astype(jnp.float32), ranges)
    return (loss / total, hits / total, *sums)
  if with_hits:
    return loss / total, hits, jax.lax.stop_gradient(total)
  return loss / total


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
  predict models are unchanged.
  """

  def __init__(self, head, dense_index: int | None):
    """Args: `head` is a Dense, or a Serial with one Dense at `dense_index`
    (Trax wraps it in shape checks)."""
    super().__init__(n_in=1, n_out=3, name='OutputWeights')
    self._wrapped = head
    self._index = dense_index

  def forward(self, x):
    weights = self.weights
    kernel, bias = weights if self._index is None else weights[self._index]
    return x, kernel, bias


def _dense_position(head):
  """None if `head` is a Dense; the index of the only weighted sublayer if
  it is a Dense inside weightless layers; else raises ValueError."""
  if type(head).__name__ == 'Dense':
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
    x, kernel, bias, targets, weights = inputs
    out = chunked_cross_entropy(
      x,
      kernel,
      bias,
      targets,
      weights,
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
  (same layers, same weights, nothing initialized again), so
  `weights[0]` has the model's structure as Trax's Loop expects. None when
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


__all__ = [
  'lr_schedule',
  'optimizer',
  'positions',
  'reformer_lm',
  'all_layers',
  'check_settings',
  'count_params',
  'init_model',
  'lsh_layers',
  'loss_layer',
  'output_loss',
  'chunked_cross_entropy',
  'OutputWeights',
  'ChunkedOutput',
  'chunked_model',
  'metric_layers',
  'metric_names',
  'Accumulate',
  'position_ranges',
  'range_name',
  'range_sums',
  'range_losses',
  'RangeSum',
  '_defaults',
]
