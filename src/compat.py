"""Fixes that let Trax 1.4.1 (the last release, 2021) run on today's JAX.

Every incompatibility we found between Trax 1.4.1 and the pinned JAX /
TensorFlow lives here and nowhere else. `apply()` runs once, when the `src`
package is imported, before any model is built. Each fix is documented below
with the symptom it removes and is pinned by a test in `tests/test_compat.py`
that fails without it. Nothing in site-packages is edited.

Fixes:

1. ``fast_trax_import``: `trax.layers.assert_shape` calls `inspect.stack()`
   for every decorated layer at import time and for every `AssertShape` layer
   built. `inspect.stack()` resolves the source file of every frame on the
   stack, and for the frozen `importlib` frames of an import that means a scan
   of all of `sys.modules` (thousands of modules once TensorFlow is loaded):
   about 1 s per call, ~20 s of a 25 s `import trax`. It only needs the
   caller's file and line, which we read straight off the frame.
2. ``cond_keyword_form``: Trax calls `fastmath.cond(pred=, true_operand=,
   true_fun=, false_operand=, false_fun=)`; JAX removed that keyword form of
   `lax.cond`, so LSH attention in `mode='predict'` raises a TypeError. We
   translate it to the positional form.
3. ``stop_gradient_static``: LSH attention calls
   `fastmath.stop_gradient(seqlen)` on a Python int. Today's JAX turns that
   into a traced array, so a static slice length becomes a tracer and
   predict-mode decoding fails. Stopping the gradient of a Python number is a
   no-op, so we return the number unchanged.
4. ``host_count_alias``: `jax.host_count()` (used by `trax.supervised
   .training` and `trax.data`) is a deprecated alias of `jax.process_count()`
   that warns on every call and is slated for removal.
5. ``device_put_replicated``: Trax's multi-device path replicates weights
   with `jax.device_put_replicated`, deprecated in JAX 0.10 (it warns, and
   raises under `-W error`). We replicate with `jax.device_put` onto a
   sharding over the local devices, which is what JAX recommends.
7. ``on_cpu_uncommitted``: Trax keeps optimizer slots "on CPU" with
   `jax.device_put(x, cpu)`, which commits them to one device. The old
   `jax.pmap` moved such inputs to its devices; today's `pmap` (a
   `jit(shard_map)`) rejects them ("Sharding passed to jit does not match"),
   so training on several devices fails at the first step. Host NumPy
   arrays are equally on the CPU and uncommitted, so we return those.
8. ``tree_unflatten_arrays``: `fastmath.tree_unflatten` tests `tree in
   copy_from_tree`, which compares a JAX array with `()`; JAX now raises
   TypeError on that comparison, so resuming from a checkpoint (optimizer
   slots) fails. We compare containers only.
9. ``tensorflow_off_accelerators``: Trax imports TensorFlow for its data
   utilities; on a GPU machine TensorFlow would reserve most of the GPU memory
   that JAX needs. We hide accelerators from TensorFlow (JAX keeps them).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import sys
import types

APPLIED: list[str] = []


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
  from src import quiet

  with _cheap_stack_during_import(), quiet.native_stderr_muted():
    # gym (a Trax RL dependency we never use) prints a deprecation notice
    # to stderr on import; it is not actionable for our users.
    with contextlib.redirect_stderr(io.StringIO()):
      import gym  # noqa: F401
    import trax
  return trax


def _patch_fast_assert_shape():
  # `trax.layers.assert_shape` is also the name of a function there, so
  # fetch the module itself.
  module = importlib.import_module('trax.layers.assert_shape')
  module.inspect = fast_inspect_module()


def cond_compat(*args, **kwargs):
  """`lax.cond` that also accepts Trax's removed keyword form (fix 2)."""
  from jax import lax

  if 'true_fun' not in kwargs:
    return lax.cond(*args, **kwargs)
  pred = kwargs.pop('pred') if 'pred' in kwargs else args[0]
  true_fun, false_fun = kwargs.pop('true_fun'), kwargs.pop('false_fun')
  true_op, false_op = kwargs.pop('true_operand'), kwargs.pop('false_operand')
  if kwargs:
    raise TypeError(f'cond_compat: unexpected arguments {sorted(kwargs)}')
  if true_op is false_op:
    return lax.cond(pred, true_fun, false_fun, true_op)
  return lax.cond(
    pred,
    lambda ops: true_fun(ops[0]),
    lambda ops: false_fun(ops[1]),
    (true_op, false_op),
  )


def stop_gradient_compat(x):
  """`lax.stop_gradient` that leaves Python numbers static (fix 3)."""
  from jax import lax

  if isinstance(x, (bool, int, float)):
    return x
  return lax.stop_gradient(x)


def device_put_replicated_compat(x, devices):
  """Replicates `x` onto `devices` with a leading device axis (fix 5).

  Returns:
    An array of shape `[len(devices), *x.shape]` sharded so that device `i`
    holds slice `i`, as `jax.device_put_replicated` did.
  """
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  x = np.asarray(x) if not isinstance(x, jax.Array) else x
  mesh = Mesh(np.array(devices), ('devices',))
  sharding = NamedSharding(mesh, PartitionSpec('devices'))
  stacked = jax.numpy.broadcast_to(x, (len(devices),) + tuple(x.shape))
  return jax.device_put(stacked, sharding)


def _patch_fastmath():
  from trax.fastmath import jax as fastmath_jax

  fastmath_jax.JAX_BACKEND['cond'] = cond_compat
  fastmath_jax.JAX_BACKEND['stop_gradient'] = stop_gradient_compat


def on_cpu_compat(x):
  """Moves `x` to host memory without committing it to a device (fix 7)."""
  import jax
  import numpy as np

  return jax.tree_util.tree_map(np.asarray, x)


def _in_copy_from_tree(tree, copy_from_tree) -> bool:
  for item in copy_from_tree:
    if tree is item:
      return True
    if isinstance(item, (list, tuple, dict)) and type(tree) is type(item):
      if tree == item:
        return True
  return False


def tree_unflatten_compat(flat, tree, copy_from_tree=None):
  """`fastmath.tree_unflatten` that never compares arrays (fix 8).

  Same contract as Trax's version: returns `(new_tree, rest_of_flat)`, the
  tree with the structure of `tree` and leaves from `flat`.
  """
  if copy_from_tree is not None and _in_copy_from_tree(tree, copy_from_tree):
    return tree, flat
  if isinstance(tree, (list, tuple)):
    new_tree, rest = [], flat
    for t in tree:
      new_t, rest = tree_unflatten_compat(rest, t, copy_from_tree)
      new_tree.append(new_t)
    return (tuple(new_tree) if isinstance(tree, tuple) else new_tree), rest
  if isinstance(tree, dict):
    new_tree, rest = {}, flat
    for k in tree:
      new_v, rest = tree_unflatten_compat(rest, tree[k], copy_from_tree)
      new_tree[k] = new_v
    return new_tree, rest
  return flat[0], flat[1:]


def _patch_trees_and_placement():
  import trax
  from trax import fastmath
  from trax.fastmath import numpy as fastmath_numpy
  from trax.layers import acceleration

  fastmath_numpy.tree_unflatten = tree_unflatten_compat
  fastmath.tree_unflatten = tree_unflatten_compat
  acceleration.on_cpu = on_cpu_compat
  trax.layers.on_cpu = on_cpu_compat


def _patch_jax_aliases():
  import jax

  jax.host_count = jax.process_count
  from trax.layers import acceleration

  acceleration.jax = _JaxForAcceleration('jax')


class _JaxForAcceleration(types.ModuleType):
  """`jax` as `trax.layers.acceleration` sees it, with fix 5 in place."""

  device_put_replicated = staticmethod(device_put_replicated_compat)

  def __getattr__(self, name):
    import jax

    return getattr(jax, name)


def _hide_accelerators_from_tensorflow():
  import tensorflow as tf

  try:
    tf.config.set_visible_devices([], 'GPU')
    tf.config.set_visible_devices([], 'TPU')
  except (RuntimeError, ValueError):
    pass  # Already initialised or no such device type: nothing to hide.


def apply():
  """Applies every fix once; later calls do nothing."""
  if APPLIED:
    return
  import_trax()
  _hide_accelerators_from_tensorflow()
  _patch_fast_assert_shape()
  _patch_fastmath()
  _patch_jax_aliases()
  _patch_trees_and_placement()
  APPLIED.extend(
    [
      'fast_trax_import',
      'cond_keyword_form',
      'stop_gradient_static',
      'host_count_alias',
      'device_put_replicated',
      'on_cpu_uncommitted',
      'tree_unflatten_arrays',
      'tensorflow_off_accelerators',
    ]
  )
