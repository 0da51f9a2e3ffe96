"""The learning-rate schedule and the optimizer, as plain functions
(registered with gin by `src.model.ginconf`: `lr_schedule`, `optimizer`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import trax

from src.core.errors import UserError

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
