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

Trax's own `TrainingStepCallback`s are called inside the step, without its
loss and before the evaluation, so they cannot do these jobs; these have
the same shape (an object per job, called by the loop) with what they need.
"""

from __future__ import annotations

import os
import time

import numpy as np

from src.core import rundir
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
