"""Trax's `Loop` logs to absl only, never to stdout.

Trax's Loop prints its own step lines and blank separators to stdout; our
`JadeLoop` prints a progress line and one line per evaluation instead. Trax
still logs everything through absl (see JADE_VERBOSE in `src.runtime.quiet`).
"""

from __future__ import annotations

_TRAX_LOG = []  # Trax's own `_log`, kept by `install`.


def _log_without_stdout(s, stdout=True):
  del stdout
  _TRAX_LOG[0](s, stdout=False)


def _patch(training):
  if not _TRAX_LOG:
    _TRAX_LOG.append(training._log)
  training._log = _log_without_stdout


def install():
  """As soon as Trax's training loop is imported."""
  from src.runtime.trax_patches import import_speed

  import_speed.patch_on_import({'trax.supervised.training': [_patch]})
