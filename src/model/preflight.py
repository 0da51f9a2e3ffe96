"""Memory pre-flight: will this run fit on a device? Checked before compiling.

An estimate per device, in bytes, from the gin settings, the vocabulary and
the per-device batch (float32 everywhere):

- weights `P` (counted from the settings, `count_weights`) are held as weights,
  gradients, a new copy during the update, plus the optimizer's slots
  (Adam: 2 per weight, Momentum: 1, SGD: 0, Adafactor: ~0.1);
- activations of one step. The layers are reversible, so activations do
  not grow with depth (but for the blocks that keep theirs,
  `reversible.kept_blocks`: each holds one layer's, its whole
  feed-forward's): the residual halves and their gradients
  (`~12 B L d_model`), one layer's LSH attention (the chunked scores and
  their gradients, `3 B H n_hashes L chunk (1 + before)`, plus the sorted
  queries/keys/values, `~8 B H n_hashes L d_head`) and feed-forward
  (`3 B L d_ff`, or one chunk of it);
- logits: training and evaluation compute them `output_loss.chunk_size`
  rows at a time (`3 chunk V`, plus the output kernel's gradient summed
  over the chunks and its transposed copy, `3 V 2 d_model` for Trax's
  layer, less through the embedding alone or with a shortlist:
  `loss_operands`, and the rows transposed, `B L 2 d_model`; all `4 B L V`
  when chunking is off);
- on CPU, the frameworks themselves (JAX, Trax, compiled programs: `BASELINE`;
  TensorFlow is not loaded, see
  `src.runtime.trax_patches.lazy_tensorflow`).

The two fitted constants (`BASELINE`, `ACTIVATION_FACTOR`) come from peak
RSS measured on CPU: 1k-16k tokens with a small model at vocab 300 within
2%, vocab 8000 at 8k 20% over, the benchmark model at 32k 26% over (it
errs on the safe side as contexts grow); tests/test_preflight.py checks
the estimate against measured peaks within 35%.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax

from src.core.errors import UserError
from src.model import chunk_attention, reformer, shortlist

F32 = 4
BASELINE = 0.9e9  # CPU: JAX, Trax, compiled programs, data pipeline.
ACTIVATION_FACTOR = 1.2  # XLA's temporaries beyond the tensors counted.
SLOTS = {'Adam': 2.0, 'Momentum': 1.0, 'SGD': 0.0, 'Adafactor': 0.1}


@dataclasses.dataclass
class Estimate:
  """Bytes per device, by part."""

  weights: float
  optimizer: float
  activations: float
  logits: float
  baseline: float

  @property
  def total(self) -> float:
    return (
      self.weights + self.optimizer + self.activations + self.logits
    ) + self.baseline

  def parts(self) -> str:
    parts = {
      'weights+grads': self.weights,
      'optimizer': self.optimizer,
      'activations': self.activations,
      'logits': self.logits,
      'frameworks': self.baseline,
    }
    ordered = sorted(parts.items(), key=lambda kv: -kv[1])
    return ', '.join(f'{k} {gb(v)}' for k, v in ordered if v)


def gb(n: float) -> str:
  return f'{n / 1e9:.1f} GB'


def count_weights(setup, vocab_size: int) -> int:
  """Weights of the configured ReformerLM, counted from the settings.

  Embedding, axial positions, per layer the LSH attention (shared
  query/key, value and output projections), feed-forward and layer norms,
  and the output layer (over the concatenated halves, `2 d_model`, or
  their mean, `d_model`: `output_layer.halves`; a tied one also has its
  copy map, features x `d_model`, and one tied 'only' has no kernel of
  its own: `output_layer.tied`; a shortlist one scores the rarer pieces
  through a narrow projection: `output_layer.shortlist`).
  Within 20% of Trax's count (tested); building the model to count
  exactly would cost seconds at every start.
  """
  m = setup.model
  d, d_ff, heads = m['d_model'], m['d_ff'], m['n_heads']
  dk, dv = m['d_attention_key'], m['d_attention_value']
  positions = m['max_len'] * d
  if m.get('pos_type') == 'axial' and m.get('pos_axial_shape'):
    positions = sum(
      n * e for n, e in zip(m['pos_axial_shape'], m['pos_d_axial_embs'])
    )
  attention = d * heads * dk + d * heads * dv + heads * dv * d + d
  feed_forward = 2 * d * d_ff + d_ff + d
  norms = 4 * d
  layers = m['n_layers'] * (attention + feed_forward + norms)
  kinds = setup.layer_attention or ()
  if getattr(setup, 'directed', False):  # w_a and w_b in each LSH layer.
    layers += sum('LSH' in k for k in kinds) * 2 * d * heads * dk
  if getattr(setup, 'local', None) is not None:  # Local blocks' own keys.
    layers += sum(k == 'SelfAttention' for k in kinds) * d * heads * dk
  # Trax's ReformerLM concatenates the two residual halves before its last
  # layer norm and output layer: both read 2 x d_model features (d_model
  # with output_layer.halves = 'mean').
  features = output_features(setup)
  tied = _output(setup).tied
  copy = features * d if tied else 0
  own = 0 if tied == 'only' else features * vocab_size
  output = 2 * features + own + vocab_size + copy
  if shortlist.applies(_output(setup).shortlist, vocab_size):
    head, projection, tail = _shortlist_shapes(setup, vocab_size)
    kernels = sum(r * c for r, c in (head, projection, tail))
    output = 2 * features + kernels + head[1] + tail[1]  # And two biases.
  return vocab_size * d + positions + layers + output


def output_features(setup) -> int:
  """What the output layer reads: `2 d_model` (the halves concatenated)
  or `d_model` (their mean)."""
  d = setup.model['d_model']
  return d if _output(setup).halves == 'mean' else 2 * d


def loss_operands(setup, vocab_size: int) -> tuple[int, int]:
  """`(width, kernel)`: the features a row of training's chunked loss
  holds and the floats of the kernels it scores them with (a copy each of
  their gradient and of their second layout). Trax's layer and a token's
  own column: the `features x vocab` kernel. Through the embedding alone
  (`tied = 'only'`): rows `d_model` wide against the embedding's matrix
  (`TiedOutput.loss_operands`). A shortlist: its head, its projection and
  the rarer pieces' kernel over the projection's width (the projected
  rows are made a chunk at a time: `softmax.shortlist_chunk`)."""
  features = output_features(setup)
  out = _output(setup)
  if shortlist.applies(out.shortlist, vocab_size):
    shapes = _shortlist_shapes(setup, vocab_size)
    return features, sum(r * c for r, c in shapes)
  if out.tied == 'only':
    d = setup.model['d_model']
    return d, features * d + d * vocab_size
  return features, features * vocab_size


def _shortlist_shapes(setup, vocab_size: int):
  """The setup's shortlist layer's kernels' shapes
  (`shortlist.kernel_shapes`)."""
  out = _output(setup)
  features = output_features(setup)
  return shortlist.kernel_shapes(features, out.shortlist, out.width, vocab_size)


def _output(setup) -> reformer.Output:
  """The setup's `reformer.Output` (its defaults, Trax's concatenation
  untied, where a setup made by hand has none)."""
  return getattr(setup, 'output', None) or reformer.Output()


def optimizer_name() -> str:
  from src.model import ginconf

  try:
    kind = ginconf.gin.query_parameter('jade.optimizer.kind')
    return str(kind).strip('@').split('.')[-1]
  except (ValueError, KeyError):
    return 'Adam'


def kept_blocks(setup) -> int:
  """How many blocks keep their activations in training (the parsed
  `reversible.kept_blocks`, checked; at most the model's blocks)."""
  from src.model import ginconf

  return min(ginconf.kept_blocks(), int(setup.model['n_layers']))


def estimate(
  setup,
  vocab_size: int,
  batch_per_device: int,
  loss_chunk: int,
  n_weights: int | None = None,
  optimizer: str = 'Adam',
  platform: str = 'cpu',
  length: int | None = None,
  kept: int = 0,
) -> Estimate:
  """The memory estimate for one device (see the module docstring);
  `length`: the training window (default the model's context); `kept`:
  blocks that keep their activations (`reversible.kept_blocks`)."""
  m, a = setup.model, setup.attention
  b, length = batch_per_device, length or setup.max_len
  d, d_ff, heads = m['d_model'], m['d_ff'], m['n_heads']
  d_head = max(m['d_attention_key'], m['d_attention_value'])
  chunk = a.get('chunk_len') or 64
  hashes = a.get('n_hashes') or 1
  before = a.get('n_chunks_before', 1) or 0
  if setup.attention_name not in ('LSHSelfAttention', 'PureLSHSelfAttention'):
    chunk, hashes, before = length, 1, 0  # Full attention: L x L scores.
  if n_weights is None:
    n_weights = count_weights(setup, vocab_size)
  slots = SLOTS.get(optimizer, 2.0)
  residual = 12 * b * length * d
  attention = 3 * b * heads * hashes * length * chunk * (1 + before)
  attention += 8 * b * heads * hashes * length * d_head
  ff_chunk = m.get('ff_chunk_size') or 0
  ff_rows = min(ff_chunk, b * length) if ff_chunk else b * length
  feed_forward = 3 * ff_rows * d_ff
  rows = b * length
  # A kept block holds its attention's and its feed-forward's activations
  # (every chunk's) until its backward pass: measured ~0.5-0.8 GB a block
  # of the 32k benchmark model, ~0.7 here.
  kept_held = kept * (attention + rows * d_ff)
  if loss_chunk:  # Training and evaluation both chunk their logits.
    # Training makes the output layer's gradient with its loss: a chunk's
    # logits, exponentials and gradient, the kernel's gradient summed, and
    # the kernel's and the rows' second layouts (one product each).
    rows_width, kernel = loss_operands(setup, vocab_size)
    logits = 3 * min(loss_chunk, rows) * vocab_size
    logits += 3 * kernel + rows * rows_width
  else:
    logits = 4 * rows * vocab_size
  return Estimate(
    weights=3 * n_weights * F32,
    optimizer=slots * n_weights * F32,
    activations=(residual + attention + feed_forward + kept_held)
    * F32
    * ACTIVATION_FACTOR,
    logits=logits * F32,
    baseline=BASELINE if platform == 'cpu' else 0.0,
  )


def device_limit() -> tuple[float, str]:
  """Memory one device can use: host RAM available on CPU, else the
  accelerator's own memory."""
  device = jax.local_devices()[0]
  if device.platform == 'cpu':
    import psutil

    n = jax.local_device_count()
    available = psutil.virtual_memory().available
    return available / n, f'{n} CPU device(s) share {gb(available)} free RAM'
  stats = device.memory_stats() or {}
  limit = stats.get('bytes_limit')
  if not limit:
    return float('inf'), f'{device.platform} (memory size unknown)'
  return float(limit), f'{device.device_kind} has {gb(limit)}'


def platform_name() -> str:
  """This process's devices' platform: 'cpu', 'gpu' or 'tpu'."""
  return jax.local_devices()[0].platform


def check(
  setup,
  vocab_size: int,
  batch_per_device: int,
  loss_chunk: int,
  length: int | None = None,
):
  """Raises a one-line UserError if the run will not fit; returns the
  estimate and the limit otherwise (`length`: the training window)."""
  platform = platform_name()
  est = estimate(
    setup,
    vocab_size,
    batch_per_device,
    loss_chunk,
    optimizer=optimizer_name(),
    platform=platform,
    length=length,
    kept=kept_blocks(setup),
  )
  limit, where = device_limit()
  if est.total > limit:
    advice = (
      'lower the per-device batch (batch-size), the training window '
      '(window), reversible.kept_blocks, ReformerLM.max_len with '
      'its pos_axial_shape, LSHSelfAttention.chunk_len or n_hashes, '
      'vocab-size or output_loss.chunk_size, or use a lighter optimizer '
      '(optimizer.kind)'
    )
    raise UserError(
      f'{setup.path}: this run needs about {gb(est.total)} per device '
      f'({est.parts()}) but {where}; {advice}'
    )
  return est, limit


def weight_file_bytes(setup, vocab_size: int) -> int:
  """Bytes of weight files the configured model may need: its weights as
  float32, with a margin for the count being an estimate (`count_weights`)
  and for headers. A larger weights file is refused before it is read."""
  return int(count_weights(setup, vocab_size) * F32 * 1.5) + (1 << 20)


def check_model(setup, vocab_size: int, what: str):
  """Refuses, before anything is allocated, a model to chat with or score
  whose weights (read, then set into the model: twice their size) and
  the running baseline do not fit this device. `what` names the folder."""
  n = count_weights(setup, vocab_size)
  need = 2 * 4 * n + predict_memory(setup) + BASELINE
  limit, where = device_limit()
  if need > limit:
    raise UserError(
      f'{what}: its model.gin describes {n:,} weights and a chat memory of '
      f'{gb(predict_memory(setup))}, about {gb(need)} to load, but '
      f'{where}; use a machine with more memory, or check that the folder '
      'is the model you meant'
    )


def predict_memory(setup) -> float:
  """Bytes of the attention memory decoding keeps: keys and values of
  `predict_mem_len` positions in every layer and head (float32)."""
  m = setup.model
  per_position = m['n_heads'] * (m['d_attention_key'] + m['d_attention_value'])
  total = 0.0
  for name in setup.layer_attention or ():
    settings = setup.attention if 'LSH' in name else (setup.local or {})
    mem = settings.get('predict_mem_len') or m['max_len']
    total += 4.0 * mem * per_position
  return total


# ---- Time ----------------------------------------------------------------
#
# Seconds per step from the step's floating-point operations and the rate
# this device multiplies float32 matrices at (measured at start, best of
# 10 products: ~0.1 s; best of 3 read 97-203 GFLOP/s on one machine within
# a day), each part divided by the share of that rate it reaches: the
# dense products (projections, feed-forwards, the output layer)
# `DENSE_EFFICIENCY`; the attention's score and value products computed
# by XLA (Trax's `attend`: small batched products, masks, the LSH sort and
# gathers) `ATTENTION_EFFICIENCY`, and those the fused CPU kernel takes
# (`chunk_attention.takes`) `FUSED_ATTENTION_EFFICIENCY`, counting only
# the key tiles it scores (`chunk_attention.live_share`: the causal mask
# lets it skip 20-48% of the walkthrough's); with bfloat16 products
# (`precision.products`) the rate is `BFLOAT16_SPEEDUP` times as high; each
# step adds `STEP_OVERHEAD` (Trax's loop, the optimizer's update, dispatch:
# a quarter of the quick start's 0.1 s step). Fitted on the long-
# conversation walkthrough's runs (steps timed by train.py's own loop: 16
# windows of 256 with chunks of 256, 4 of 1,024 with chunks of 512, one of
# 4,096 with chunks of 2,048; BENCHMARKS.md "Time pre-flight"): on a
# 2-core AVX-512 Zen 4 before the kernel skipped tiles the dense share
# was 0.46 and the kernel's 0.27 (0.90-1.13x of the measured steps in
# float32 and bfloat16); on a 2-core AVX2 Zen 4 with the skip, 0.63 and
# 0.26 (its dense products reach more of its smaller rate). 0.54 between
# them: within ~15% of either machine's dense time. The first fit (a
# 2-core AVX2 Zen 3, before the fused kernel, no overhead) had 0.46 and
# 0.14. The progress line's ETA replaces the estimate once steps are
# timed.

DENSE_EFFICIENCY = 0.54
ATTENTION_EFFICIENCY = 0.17
FUSED_ATTENTION_EFFICIENCY = 0.27
BFLOAT16_SPEEDUP = 1.3
STEP_OVERHEAD = 0.025  # Seconds a step beyond its products (loop, optimizer).
DAY = 86400.0


def step_flops(
  setup, vocab_size: int, batch_per_device: int, length: int | None = None
) -> float:
  """Floating-point operations of one training step on one device
  (forward + backward = 3 x forward) on windows of `length` tokens."""
  return sum(step_parts(setup, vocab_size, batch_per_device, length))


def step_parts(
  setup, vocab_size: int, batch_per_device: int, length: int | None = None
) -> tuple[float, float]:
  """`step_flops` as `(dense, attention)`: the products with weights, and
  the attention's scores and weighted values."""
  dense, by_xla, fused = _step_split(
    setup, vocab_size, batch_per_device, length
  )
  return dense, by_xla + fused


def _step_split(
  setup,
  vocab_size: int,
  batch_per_device: int,
  length: int | None,
  products: str = 'float32',
) -> tuple[float, float, float]:
  """A step's products: `(dense, attention by XLA, attention by the fused
  kernel)`, the kernel's in `products` (see `attention_parts`)."""
  length = length or setup.max_len
  tokens = batch_per_device * length
  weights = (
    count_weights(setup, vocab_size) - vocab_size * setup.model['d_model']
  )
  if _output(setup).tied == 'only':  # Its kernel is made, then multiplied.
    weights += output_features(setup) * vocab_size
  return (
    3.0 * tokens * 2.0 * weights,
    *attention_parts(setup, tokens, length, products),
  )


def attention_parts(
  setup, tokens: int, length: int, products: str = 'float32'
) -> tuple[float, float]:
  """A step's attention products over `tokens` tokens on windows of
  `length` (forward + backward) as `(by XLA, by the fused kernel)`: each
  block's call goes to the kernel where `chunk_attention.takes` says it
  will (its size, the CPU, the kernels built), the tiles it scores
  counted for its passes in `products` ('float32' or 'bfloat16')."""
  m, a = setup.model, setup.attention
  per_key = (
    3.0
    * tokens
    * m['n_heads']
    * 2
    * (m['d_attention_key'] + m['d_attention_value'])
  )
  parts = [0.0, 0.0]
  for name in setup.layer_attention or [setup.attention_name] * m['n_layers']:
    hashes, buckets = 1, 0  # A local layer's rows in position order.
    if 'LSH' in name:
      chunk, before = a.get('chunk_len') or 64, a.get('n_chunks_before') or 0
      hashes = a.get('n_hashes') or 1
      buckets = _buckets(a.get('n_buckets'), length, chunk)
    elif setup.local is not None:  # A local block of a mixed model.
      chunk, before = setup.local['chunk_len'], setup.local['n_chunks_before']
    else:  # Causal full attention: half the scores on average, by XLA.
      parts[0] += per_key * length / 2
      continue
    keys = chunk * (1 + before) * hashes  # Scores per query.
    if chunk_attention.takes(length * hashes, chunk, before):
      # The kernel skips the tiles of keys the causal mask zeroes.
      live = chunk_attention.live_share(
        length, chunk, before, hashes, buckets, products == 'bfloat16'
      )
      parts[1] += per_key * keys * live
    else:
      parts[0] += per_key * keys
  return parts[0], parts[1]


def _buckets(n_buckets, length: int, chunk: int) -> int:
  """Buckets a hash round of a window of `length` sorts into: the gin's
  number, or the product of a factorized list, or (unset) Trax's default
  of two per chunk."""
  if isinstance(n_buckets, (list, tuple)):
    return math.prod(n_buckets)
  return n_buckets or 2 * max(1, length // chunk)


def device_flops_per_second(
  m: int = 1024, k: int = 512, n: int = 2048, repeats: int = 10, dtype=None
) -> float:
  """Measured rate of a `[m, k] x [k, n]` matrix product on the first
  device (best of `repeats`), its inputs `dtype` (float32 unless given;
  sums in float32); bench/train_speed.py's matmul peaks are this at
  4096^3."""
  f32 = jax.numpy.float32
  x = jax.numpy.ones((m, k), dtype or f32)
  y = jax.numpy.ones((k, n), dtype or f32)
  f = jax.jit(lambda x, y: jax.numpy.matmul(x, y, preferred_element_type=f32))
  f(x, y).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(x, y).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * m * k * n / best


def step_seconds(
  setup,
  vocab_size: int,
  batch_per_device: int,
  length: int | None = None,
  products: str = 'float32',
) -> float:
  """Estimated seconds per training step on this device, its products in
  `products` ('float32' or 'bfloat16', as `precision` resolved them)."""
  dense, by_xla, fused = _step_split(
    setup, vocab_size, batch_per_device, length, products
  )
  rate = device_flops_per_second()
  if products == 'bfloat16':
    rate *= BFLOAT16_SPEEDUP
  products_seconds = (
    dense / DENSE_EFFICIENCY
    + by_xla / ATTENTION_EFFICIENCY
    + fused / FUSED_ATTENTION_EFFICIENCY
  ) / rate
  return products_seconds + STEP_OVERHEAD
