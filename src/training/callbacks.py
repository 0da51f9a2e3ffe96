"""What a training run does around its steps, one class per job.

`JadeLoop` (src.training.loop) trains, evaluates and checkpoints; it calls
these at fixed points:

- `FiniteCheck.after_step` / `check`: the loss and gradient norm of each
  step are finite (checked one step late, so no step waits for the device,
  and always before a checkpoint is written).
- `RunningScalars.after_step`: every `log_every` steps, the running loss,
  perplexity, learning rate, tokens/s and accuracy to TensorBoard
  (`running/...` in the train events).
- `SampleReplies.after_eval`: greedy replies to the sample prompts with the
  weights just evaluated, to the console and TensorBoard's text tab.
- `FullContext.after_eval`: a model trained on windows shorter than its
  context reads long held-out conversations at its whole context every
  few evaluations (the loss by position, to the console and TensorBoard).

Trax's own `TrainingStepCallback`s are called inside the step, without its
loss and before the evaluation, so they cannot do these jobs; these have
the same shape (an object per job, called by the loop) with what they need.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from src.core import rundir
from src.data import windows
from src.model import losses
from src.training import samples
from src.training.progress import Progress


class Diverged(Exception):
  """The loss, gradients or weights stopped being finite at `step`."""

  def __init__(self, step: int, what: str, saved_bad: bool = False):
    super().__init__(step, what)
    self.step, self.what, self.saved_bad = step, what, saved_bad


class FiniteCheck:
  """Raises `Diverged` when a step's loss or gradient norm is not finite."""

  def __init__(self):
    self._unchecked = None  # (step, loss, gradient norm)

  def after_step(self, step: int, loss, grad_norm):
    """Checks the step before (its values are ready by now: checking this
    one here would make every step wait for the device), then keeps this
    one for the next call."""
    self.check()
    self._unchecked = (step, loss, grad_norm)

  def check(self):
    """Checks the last unchecked step (before any checkpoint of it)."""
    if self._unchecked is None:
      return
    step, loss, grad_norm = self._unchecked
    self._unchecked = None
    for name, value in (('loss', loss), ('gradient norm', grad_norm)):
      if not np.isfinite(np.asarray(value)).all():
        raise Diverged(
          step, f'the {name} is {float(np.mean(value))}', saved_bad=True
        )


class RunningScalars:
  """Running training scalars every `log_every` steps (the loss is the
  progress line's running mean over them)."""

  def __init__(self, progress: Progress, log_every: int, output_dir, chief):
    self._progress = progress
    self._log_every = log_every
    self._dir = output_dir if chief else None  # Only the chief writes.
    self._tokens = 0.0  # Loss tokens since the last write.
    self._hits = None  # Device [hits, total] since the last write.
    self._start = time.time()
    self._writer = None

  def after_step(self, step: int, lr: float, tokens: float, counts):
    """Adds a step's loss tokens and `counts` (the chunked loss's device
    `[hits, total]`, or None); writes every `log_every` steps."""
    self._tokens += tokens
    if counts is not None:  # Added on the device: no wait here.
      self._hits = counts if self._hits is None else self._hits + counts
    if step % self._log_every == 0:
      self._write(step, lr)

  def _write(self, step: int, lr: float):
    tokens, self._tokens = self._tokens, 0.0
    counts, self._hits = self._hits, None
    now, start = time.time(), self._start
    self._start = now
    if self._dir is None:
      return
    if self._writer is None:
      from trax import jaxboard

      self._writer = jaxboard.SummaryWriter(
        os.path.join(self._dir, rundir.TRAIN_EVENTS)
      )
    loss = self._progress.running_loss()
    values = {
      'loss': loss,
      'perplexity': losses.perplexity(loss),
      'learning_rate': lr,
      'tokens_per_second': tokens / max(now - start, 1e-9),
    }
    if counts is not None:  # The chunked loss counts right guesses.
      hits, total = (float(v) for v in np.asarray(counts))
      values['accuracy'] = hits / max(total, 1e-9)
    for name, value in values.items():
      self._writer.scalar(f'running/{name}', value, step=step)
    self._writer.flush()

  def close(self):
    if self._writer is not None:
      self._writer.close()
      self._writer = None


class SampleReplies:
  """The model answers the sample prompts after each evaluation."""

  def __init__(self, replies: samples.SampleReplies, progress: Progress):
    self._replies = replies
    self._progress = progress

  def after_eval(self, step: int, weights, writer):
    """Greedy replies with `weights`, to the console and to `writer`'s
    text tab (None: console only)."""
    replies = self._replies(weights)
    for prompt, reply in replies:
      self._progress.message(f'step {step}: sample {prompt!r} -> {reply!r}')
    if writer is not None:
      writer.text('samples', samples.markdown(step, replies), step=step)
      writer.flush()


class FullContext:
  """Long held-out conversations read at the model's whole context.

  A model trained on windows shorter than its context is evaluated by
  position only up to the window; this reads the longest held-out
  conversations (those longer than the window, at most `most`) from their
  start, up to the context, every `every` evaluations and at the last
  step, and writes the loss by position (`full context/loss at 8k-32k`,
  ...) to TensorBoard's eval run and the console: the far context
  learning, or not.
  """

  def __init__(self, rows, fused, ranges, when, progress: Progress):
    self._rows, self._fused = rows, fused
    self._every, self._last = when  # Every so many evaluations; last step.
    self._names = losses.metric_names(ranges)
    self._progress = progress
    self._evals = 0
    self._jitted = None

  @classmethod
  def build(cls, view, window: int, max_len: int, ai_only: bool, **kw):
    """None where nothing is to read: no held-out conversation longer than
    the window, a window of the whole context, or a model whose output is
    not chunked (`output_loss.chunk_size` 0). `kw`: `model` (makes an
    eval model of its own, initialized at the context's length when first
    due; called only where there is something to read), `chunk`,
    `progress`, `last` (the run's last step), and optionally `every` (4)
    and `most` (2)."""
    if view is None or window >= max_len:
      return None
    lengths = np.diff(view.offsets)
    order = np.argsort(-lengths, kind='stable')
    longest = order[lengths[order] > window]
    if not len(longest):
      return None
    ranges = losses.position_ranges(max_len)
    fused = losses.chunked_model(kw['model'](), kw['chunk'], True, ranges)
    if fused is None:
      return None
    ids, weights = [], []
    for k in longest[: kw.get('most', 2)]:
      start = int(view.offsets[k])
      tokens, roles = view.take(start, start + min(int(lengths[k]), max_len))
      i, w = windows.pad_window(
        tokens, max_len, 0, windows.loss_weights(roles, ai_only)
      )
      ids.append(i)
      weights.append(w)
    rows = (np.stack(ids), np.stack(weights))
    when = (kw.get('every', 4), kw['last'])
    return cls(rows, fused, ranges, when, kw['progress'])

  def after_eval(self, step: int, weights, writer):
    """Reads the conversations with `weights` (the eval model's) when due."""
    self._evals += 1
    if not (step >= self._last or self._evals % self._every == 0):
      return
    ids, w = self._rows
    if self._jitted is None:  # Its own state, for the context's length.
      from trax import shapes

      self._fused.init(shapes.signature((ids, ids, w)))
      self._jitted = jax.jit(self._fused.pure_fn)
    values, _ = self._jitted(
      (ids, ids, w),
      (weights, losses.loss_part(self._fused.weights)),
      self._fused.state,
      jax.random.PRNGKey(step),
    )
    values = losses.range_losses(
      dict(zip(self._names, (float(v) for v in values)))
    )
    shown = ' | '.join(f'{k} {v:.4g}' for k, v in values.items())
    self._progress.message(
      f'step {step}: full context ({len(ids)} held-out conversations from '
      f'their start, {int(w.sum())} tokens) {shown}'
    )
    if writer is not None:
      for key, value in values.items():
        writer.scalar(f'full context/{key}', value, step=step)
      writer.flush()
