"""Keeps the console for what the user can act on.

TensorFlow, absl, JAX and gym log start-up chatter (CUDA probing, plugin
registration, deprecation notices) that says nothing about the user's run.
`silence_libraries()` must run before TensorFlow is imported; set
`JADE_VERBOSE=1` to see everything again.
"""

import logging
import os
import sys
import warnings


def verbose() -> bool:
  return os.environ.get('JADE_VERBOSE', '') not in ('', '0')


def note(text: str):
  """`note: TEXT` on stderr, only with `JADE_VERBOSE=1`: why an optional
  speed-up (a cache, a kernel) is not used."""
  if verbose():
    print(f'note: {text}', file=sys.stderr)


def silence_libraries():
  """Sets the environment so TensorFlow/XLA C++ logging stays quiet."""
  if verbose():
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  os.environ.setdefault('GRPC_VERBOSITY', 'ERROR')
  os.environ.setdefault('GLOG_minloglevel', '3')
  warnings.filterwarnings('ignore', category=DeprecationWarning)
  warnings.filterwarnings('ignore', category=FutureWarning)
  warnings.filterwarnings('ignore', module='gym')
  warnings.filterwarnings('ignore', module='tensorflow')


def silence_loggers():
  """Quiets Python loggers after the libraries are imported."""
  if verbose():
    return
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.ERROR)
  for name in ('tensorflow', 'jax', 'absl', 'jax._src.xla_bridge'):
    logging.getLogger(name).setLevel(logging.ERROR)


class native_stderr_muted:
  """Context manager that drops what C++ code writes to fd 2 meanwhile.

  TensorFlow's native start-up logs ("Could not find cuda drivers ...")
  are written before any log level applies. Python exceptions are
  unaffected: they propagate and are printed after the fd is restored.
  """

  def __enter__(self):
    self._saved = None
    if verbose():
      return self
    import sys

    sys.stderr.flush()
    self._saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    return self

  def __exit__(self, *exc):
    if self._saved is not None:
      os.dup2(self._saved, 2)
      os.close(self._saved)
    return False
