"""The one signal handler: signals become a flag that is checked between
steps, never an exception inside one.

Training arms SIGTERM (a preemptible VM being taken away) and SIGINT
(Ctrl-C): the current step finishes, then the run saves and stops; a second
Ctrl-C stops at once, without saving. The chat arms SIGINT while a reply is
generated: the reply loop checks the flag between tokens, since raising
inside the jitted step would lose the donated model state.
"""

from __future__ import annotations

import contextlib
import signal


class StopSignals:
  """Records the last armed signal that arrived (`signum`, `stop`)."""

  def __init__(self, signals=('SIGTERM', 'SIGINT'), second_sigint_raises=True):
    self.names = tuple(signals)
    self.second_sigint_raises = second_sigint_raises
    self.signum: int | None = None

  @property
  def stop(self) -> bool:
    return self.signum is not None

  def _handler(self, signum, frame):
    del frame
    if (
      self.second_sigint_raises
      and self.signum is not None
      and signum == signal.SIGINT
    ):
      raise KeyboardInterrupt
    self.signum = signum

  @contextlib.contextmanager
  def armed(self):
    """Handles the signals inside the block (where this thread and the
    platform allow); the previous handlers come back after it."""
    self.signum = None
    previous = {}
    for name in self.names:
      sig = getattr(signal, name, None)
      if sig is None or signal.getsignal(sig) is None:
        continue  # No such signal here, or a handler not set from Python.
      try:
        previous[sig] = signal.signal(sig, self._handler)
      except ValueError:  # Not the main thread: leave signals alone.
        pass
    try:
      yield self
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
