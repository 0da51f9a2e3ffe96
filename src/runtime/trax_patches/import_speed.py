"""Fast, quiet `import trax` (fix 1).

1. ``fast_trax_import``: `trax.layers.assert_shape` calls `inspect.stack()`
   for every decorated layer at import time and for every `AssertShape` layer
   built. `inspect.stack()` resolves the source file of every frame on the
   stack, and for the frozen `importlib` frames of an import that means a scan
   of all of `sys.modules` (thousands of modules once TensorFlow is loaded):
   about 1 s per call, ~20 s of a 25 s `import trax`. It only needs the
   caller's file and line, which we read straight off the frame.

   For the chat and the server (`bootstrap(light=True)`), `trax/__init__.py`
   is not run: it imports Trax's data pipeline, training loop and Keras
   export (~0.3 s of a 2 s start), which a process that only decodes never
   uses. The `trax` package is made from its spec and imports a submodule
   the first time an attribute names it (`trax.data`, `trax.supervised`,
   ...), as `import trax.x` does anyway; the fixes to modules not yet
   imported are applied as each is imported (`patch_on_import`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
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


def import_trax(light: bool = False):
  """Imports Trax quickly and quietly (fix 1; gym's notice is dropped);
  `light`: only the modules a model needs (see the module's text)."""
  if 'trax' in sys.modules:
    return sys.modules['trax']
  from src.runtime import quiet

  with _cheap_stack_during_import(), quiet.native_stderr_muted():
    if light:
      return _import_trax_light()
    # gym (a Trax RL dependency we never use) prints a deprecation notice
    # to stderr on import; it is not actionable for our users.
    with contextlib.redirect_stderr(io.StringIO()):
      import gym  # noqa: F401
    import trax
  return trax


# Names `trax/__init__.py` binds that are not its submodules' own names.
_TOP_NAMES = {
  'lr': ('trax.supervised.lr_schedules', None),
  'AsKeras': ('trax.trax2keras', 'AsKeras'),
}
# What a model and its decoder use (ginconf registers the optimizers).
_LIGHT_MODULES = (
  'trax.fastmath',
  'trax.layers',
  'trax.shapes',
  'trax.models',
  'trax.optimizers',
)


def _import_trax_light():
  spec = importlib.util.find_spec('trax')
  trax = importlib.util.module_from_spec(spec)

  def attribute(name):
    """A submodule not imported yet, or a name `__init__` would bind."""
    if name.startswith('__'):
      raise AttributeError(name)
    module, inside = _TOP_NAMES.get(name, (f'trax.{name}', None))
    try:
      found = importlib.import_module(module)
    except ModuleNotFoundError:
      raise AttributeError(f"module 'trax' has no attribute {name!r}") from None
    return found if inside is None else getattr(found, inside)

  trax.__getattr__ = attribute
  sys.modules['trax'] = trax
  for name in _LIGHT_MODULES:
    importlib.import_module(name)
  return trax


class _PatchingLoader(importlib.abc.Loader):
  """A module's own loader, then `patches` applied to the module."""

  def __init__(self, loader, patches):
    self._loader = loader
    self._patches = patches

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    self._loader.exec_module(module)
    for patch in self._patches:
      patch(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
  """Finds the modules named in `patches` as Python would, with a loader
  that applies their patches right after the module runs (before anyone
  can use it)."""

  def __init__(self, patches):
    self.patches = patches

  def find_spec(self, name, path, target=None):
    if name not in self.patches:
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path, target)
    if spec is not None and spec.loader is not None:
      spec.loader = _PatchingLoader(spec.loader, self.patches[name])
    return spec


_LATER = _PatchOnImport({})  # The one finder: every module's patches.


def patch_on_import(patches: dict) -> None:
  """Applies `patches` (`{module name: [patch(module)]}`) to each module
  now if it is imported, else as soon as it is."""
  for name, found in patches.items():
    if name in sys.modules:
      for patch in found:
        patch(sys.modules[name])
    else:
      _LATER.patches.setdefault(name, []).extend(found)
  if _LATER.patches and _LATER not in sys.meta_path:
    sys.meta_path.insert(0, _LATER)


def install():
  """`trax.layers.assert_shape` reads frames without `inspect.stack`."""
  # `trax.layers.assert_shape` is also the name of a function there, so
  # fetch the module itself.
  module = importlib.import_module('trax.layers.assert_shape')
  module.inspect = fast_inspect_module()
