"""Fast, quiet `import trax` (fix 1).

1. ``fast_trax_import``: `trax.layers.assert_shape` calls `inspect.stack()`
   for every decorated layer at import time and for every `AssertShape` layer
   built. `inspect.stack()` resolves the source file of every frame on the
   stack, and for the frozen `importlib` frames of an import that means a scan
   of all of `sys.modules` (thousands of modules once TensorFlow is loaded):
   about 1 s per call, ~20 s of a 25 s `import trax`. It only needs the
   caller's file and line, which we read straight off the frame.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import sys
import types


def _fast_stack(context: int = 1) -> list[inspect.FrameInfo]:
  """Like `inspect.stack()` but without reading source files or modules."""
  del context
  frame = sys._getframe(1)
  out = []
  while frame is not None:
    code = frame.f_code
    out.append(
      inspect.FrameInfo(
        frame, code.co_filename, frame.f_lineno, code.co_name, None, None
      )
    )
    frame = frame.f_back
  return out


def _fast_getframeinfo(frame, context: int = 1) -> inspect.Traceback:
  """Like `inspect.getframeinfo()` for the fields Trax reads (file, line)."""
  del context
  if hasattr(frame, 'f_code'):
    return inspect.Traceback(
      frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, None, None
    )
  return inspect.getframeinfo(frame)


def fast_inspect_module() -> types.ModuleType:
  """Returns a stand-in for `inspect` whose stack helpers are cheap."""
  shim = types.ModuleType('inspect_fast')
  shim.__dict__.update(inspect.__dict__)
  shim.stack = _fast_stack
  shim.getframeinfo = _fast_getframeinfo
  return shim


@contextlib.contextmanager
def _cheap_stack_during_import():
  real_stack, real_getframeinfo = inspect.stack, inspect.getframeinfo
  inspect.stack, inspect.getframeinfo = _fast_stack, _fast_getframeinfo
  try:
    yield
  finally:
    inspect.stack, inspect.getframeinfo = real_stack, real_getframeinfo


def import_trax():
  """Imports Trax quickly and quietly (fix 1; gym's notice is dropped)."""
  if 'trax' in sys.modules:
    return sys.modules['trax']
  from src.runtime import quiet

  with _cheap_stack_during_import(), quiet.native_stderr_muted():
    # gym (a Trax RL dependency we never use) prints a deprecation notice
    # to stderr on import; it is not actionable for our users.
    with contextlib.redirect_stderr(io.StringIO()):
      import gym  # noqa: F401
    import trax
  return trax


def install():
  """`trax.layers.assert_shape` reads frames without `inspect.stack`."""
  # `trax.layers.assert_shape` is also the name of a function there, so
  # fetch the module itself.
  module = importlib.import_module('trax.layers.assert_shape')
  module.inspect = fast_inspect_module()
