"""The training console: one live progress line, the time estimate."""

from __future__ import annotations

import collections
import sys
import time

import numpy as np

from src.model import losses, preflight
from src.training import distributed


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  if seconds >= 2 * 86400:
    return f'{seconds / 86400:.0f} days'
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f'{h}h{m:02d}m' if h else (f'{m}m{s:02d}s' if m else f'{s}s')


class Progress:
  """One live status line: step/total, loss, perplexity, lr, tokens/s, ETA.

  On a terminal the line is redrawn in place; otherwise a line is printed
  every `interval` seconds. The loss shown is the mean of the last
  `average` steps (not one noisy step). Step times exclude the first two
  steps of the session (they include compilation), so the ETA is not
  thrown off.
  """

  def __init__(
    self,
    total: int,
    start: int,
    stream=None,
    interval: float = 10.0,
    average: int = 10,
    prefix: str = '',
  ):
    self.total, self.start = total, start
    self.prefix = prefix  # Names the process in a multi-process run.
    # Device values, read only when shown (no per-step wait).
    self.recent = collections.deque(maxlen=max(1, average))
    self.stream = stream or sys.stdout
    self.tty = self.stream.isatty()
    self.interval = 0.5 if self.tty else interval
    self.last_print = 0.0
    self.timed_steps, self.timed_seconds, self.timed_tokens = 0, 0.0, 0.0
    self.last_time = None
    self.live = False

  def step_done(self, step: int, loss, lr: float, tokens: float):
    now = time.time()
    if self.last_time is not None and step - self.start > 2:
      self.timed_steps += 1
      self.timed_seconds += now - self.last_time
      self.timed_tokens += tokens
    self.last_time = now
    self.recent.append(loss)
    if now - self.last_print < self.interval and step < self.total:
      return
    self.last_print = now
    loss = self.running_loss()
    ppl = losses.perplexity(loss)
    parts = [
      f'step {step}/{self.total}',
      f'loss {loss:.3f}',
      f'ppl {ppl:.1f}',
      f'lr {lr:.2e}',
    ]
    if self.timed_steps:
      per_step = self.timed_seconds / self.timed_steps
      parts.append(f'{self.timed_tokens / self.timed_seconds:.0f} tok/s')
      parts.append(f'ETA {format_duration(per_step * (self.total - step))}')
    else:
      parts.append('compiling' if step - self.start <= 2 else '')
    self._write(' | '.join(p for p in parts if p))

  def running_loss(self) -> float:
    """Mean loss of the last `average` steps."""
    return float(np.mean([np.mean(np.asarray(v)) for v in self.recent]))

  def _write(self, line: str):
    line = self.prefix + line
    if self.tty:
      self.stream.write('\r\033[K' + line)
      self.live = True
    else:
      self.stream.write(line + '\n')
    self.stream.flush()

  def message(self, line: str):
    """Prints a line that stays (eval results, checkpoints, notes)."""
    if self.live:
      self.stream.write('\r\033[K')
      self.live = False
    self.stream.write(self.prefix + line + '\n')
    self.stream.flush()


def devices_text(cluster: distributed.Cluster) -> str:
  if cluster.count == 1:
    return f'{cluster.devices} device(s)'
  return (
    f'{cluster.devices} devices in {cluster.count} processes '
    f'({cluster.local_devices} in this one)'
  )


def time_lines(step_seconds: float, start: int, total: int) -> list[str]:
  """The time pre-flight's log lines for steps `start + 1..total`."""
  remaining = max(total - start, 0) * step_seconds
  lines = [
    f'time estimate: about {step_seconds:.3g} s a step on this device, '
    f'{format_duration(remaining)} for steps {start + 1}..{total}'
  ]
  if remaining > preflight.DAY:
    lines.append(
      f'note: that is more than {int(remaining // preflight.DAY)} day(s). '
      'For a quick run on a CPU use the small model: --gin gin/tiny.gin '
      '(see the README quick start)'
    )
  return lines
