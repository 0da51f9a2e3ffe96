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
   that JAX needs. We hide accelerators from TensorFlow (JAX keeps them),
   when TensorFlow is loaded (fix 10).
10. ``tensorflow_on_demand``: `import trax` imports TensorFlow (0.72 GB
   resident, ~5 s) for its TF-NumPy backend, its tf.data inputs, Keras
   export and TensorBoard writer, though training, evaluation and chat use
   none of them: TensorFlow alone was a fifth of the peak memory of a 32k
   training run. Before Trax is imported, `tensorflow` (and its
   `compat.v2`), `tensorflow_datasets`, `tensorflow_text` and the Trax
   modules that touch TensorFlow at import (`trax.fastmath.tf`,
   `trax.jaxboard`, `trax.trax2keras`) are stand-ins that import the real
   module the first time an attribute they were not given is used. Given:
   `tf.io.gfile` for local paths (others load TensorFlow's), `tf.random
   .set_seed` (nothing to seed before TensorFlow exists), `tf.TensorShape`
   and `tf.DType` for isinstance checks (no TensorFlow object exists yet),
   and a `jaxboard.SummaryWriter` that writes scalars and text with
   TensorBoard's own event writer. Nothing is lost: anything else loads
   TensorFlow and works as before.
11. ``all_reduce_one_local_device``: Trax's trainer takes its single-device
   path (a plain `jit`, no gradient all-reduce) whenever *this process* has
   one device. With one device per process, the usual layout of a GPU
   cluster or of two CPU machines, every process would train its own model
   and nothing would tell. Where more processes than one share a run, a
   single local device gets Trax's multi-device path instead: a `pmap` over
   one local device whose `psum` spans the devices of every process.
"""

from __future__ import annotations

import collections.abc
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import sys
import time
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

  _install_tensorflow_stand_ins()
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


_TRAX_ACCELERATE_UPDATE_FN = []  # Trax's own, kept by fix 11.


def accelerate_update_fn_compat(
  forward_and_backward_fn, optimizer, n_devices, accelerate=True, adasum=False
):
  """Trax's `_accelerate_update_fn`, all-reducing with one local device when
  several processes share the run (fix 11)."""
  import jax
  from jax import numpy as jnp
  from trax.optimizers import trainer

  own = _TRAX_ACCELERATE_UPDATE_FN[0]
  if n_devices != 1 or not accelerate or jax.process_count() == 1:
    return own(
      forward_and_backward_fn, optimizer, n_devices, accelerate, adasum
    )

  def update(weights_and_slots, step, opt_params, batch, state, rng):
    weights, slots = weights_and_slots
    (loss, state), gradients = forward_and_backward_fn(
      batch, weights, state, rng
    )
    gradients = trainer._average_multidevice_gradients(gradients, adasum)
    weights, slots, stats = optimizer.tree_update(
      step, gradients, weights, slots, opt_params, store_slots=False
    )
    stats['loss'] = loss
    return (weights, slots), state, stats

  pmapped = jax.pmap(update, axis_name='batch', donate_argnums=(0,))

  def one_device_update(weights_and_slots, step, opt_params, batch, state, rng):
    def add(tree):
      return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), tree)

    out = pmapped(
      add(weights_and_slots),
      jnp.reshape(jnp.asarray(step, jnp.int32), (1,)),
      add(opt_params),
      add(batch),
      add(state),
      add(rng),
    )
    return jax.tree_util.tree_map(lambda x: x[0], out)

  return one_device_update


def _patch_trainer_all_reduce():
  from trax.optimizers import trainer

  if not _TRAX_ACCELERATE_UPDATE_FN:
    _TRAX_ACCELERATE_UPDATE_FN.append(trainer._accelerate_update_fn)
  trainer._accelerate_update_fn = accelerate_update_fn_compat


def _hide_accelerators_from_tensorflow(tf):
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
  _patch_fast_assert_shape()
  _patch_fastmath()
  _patch_jax_aliases()
  _patch_trees_and_placement()
  _patch_trainer_all_reduce()
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
      'tensorflow_on_demand',
      'all_reduce_one_local_device',
    ]
  )


# ---- fix 10: TensorFlow on demand


class _OnDemand(types.ModuleType):
  """Stands in for a module until an attribute it was not given is used.

  Then the real module is imported (it replaces this one in `sys.modules`),
  its attributes are copied here, so references taken earlier keep working,
  and the attribute is returned.
  """

  def __init__(self, name: str, file: str | None, **preset):
    super().__init__(name)
    self.__file__ = file
    self.__dict__.update(preset)

  def __getattr__(self, attr: str):
    spec = self.__spec__
    if attr == '__path__' and spec and spec.submodule_search_locations is None:
      # `from module import name` asks whether the module is a package.
      raise AttributeError(attr)
    return getattr(load_on_demand(self.__name__), attr)


def load_on_demand(name: str) -> types.ModuleType:
  """Imports the real module behind an `_OnDemand` stand-in (fix 10).

  TensorFlow's own stand-ins are replaced first, whichever module is asked
  for: every other stand-in is built on TensorFlow, and TensorFlow's imports
  must see only real modules. `JADE_TRACE_TF=1` prints where a load starts.
  """
  if name not in _STAND_INS:
    return importlib.import_module(name)
  if os.environ.get('JADE_TRACE_TF'):
    import traceback

    traceback.print_stack(limit=12, file=sys.stdout)
  from src import quiet

  names = [n for n in _STAND_INS if n.split('.')[0] == 'tensorflow']
  names += [name] if name not in names else []
  for n in names:
    sys.modules.pop(n, None)
  with quiet.native_stderr_muted():
    for n in names:  # In `_STAND_INS` order: a package before its modules.
      real = importlib.import_module(n)
      if n == 'tensorflow':
        _hide_accelerators_from_tensorflow(real)
      _STAND_INS.pop(n).__dict__.update(real.__dict__)
  return sys.modules[name]


def tensorflow_loaded() -> bool:
  """Whether TensorFlow itself (not its stand-in) has been imported."""
  return 'tensorflow.python' in sys.modules


def _is_local(path) -> bool:
  return '://' not in str(path)


def _real_gfile():
  return load_on_demand('tensorflow').io.gfile


class _LocalGFileType:
  """`tf.io.gfile` for local paths, without TensorFlow (fix 10).

  Paths with a scheme (`gs://...`), and the functions not defined here, go to
  TensorFlow's own gfile, loaded then.
  """

  def __getattr__(self, name):
    return getattr(_real_gfile(), name)

  @staticmethod
  def GFile(path, mode='r'):  # noqa: N802 (TensorFlow's name)
    if _is_local(path):
      return open(path, mode)  # noqa: SIM115 (the caller closes it)
    return _real_gfile().GFile(path, mode)

  @staticmethod
  def exists(path):
    return (
      os.path.exists(path) if _is_local(path) else _real_gfile().exists(path)
    )

  @staticmethod
  def isdir(path):
    return os.path.isdir(path) if _is_local(path) else _real_gfile().isdir(path)

  @staticmethod
  def makedirs(path):
    if _is_local(path):
      return os.makedirs(path, exist_ok=True)
    return _real_gfile().makedirs(path)

  @staticmethod
  def listdir(path):
    return os.listdir(path) if _is_local(path) else _real_gfile().listdir(path)

  @staticmethod
  def glob(pattern):
    if _is_local(pattern):
      import glob

      return glob.glob(pattern)
    return _real_gfile().glob(pattern)

  @staticmethod
  def remove(path):
    return os.remove(path) if _is_local(path) else _real_gfile().remove(path)

  @staticmethod
  def rename(src, dst, overwrite=False):
    if not (_is_local(src) and _is_local(dst)):
      return _real_gfile().rename(src, dst, overwrite=overwrite)
    if not overwrite and os.path.exists(dst):
      raise FileExistsError(dst)
    return os.replace(src, dst)


_LocalGFile = _LocalGFileType()


def _set_seed_if_loaded(seed):
  """`tf.random.set_seed`; TensorFlow not yet loaded has nothing to seed."""
  if tensorflow_loaded():
    load_on_demand('tensorflow').random.set_seed(seed)


class _NoTensorFlowType:
  """A TensorFlow type before TensorFlow is loaded: nothing is one."""


def _tensorflow_stand_ins() -> list[_OnDemand]:
  """`tensorflow` and `tensorflow.compat.v2` (which Trax imports as `tf`)."""
  spec = importlib.util.find_spec('tensorflow')
  root = os.path.dirname(spec.origin)
  tf_like = {
    'io': types.SimpleNamespace(gfile=_LocalGFile),
    'random': types.SimpleNamespace(set_seed=_set_seed_if_loaded),
    'TensorShape': _NoTensorFlowType,
    'DType': _NoTensorFlowType,
  }
  v2 = _stand_in('tensorflow.compat.v2', root, 'compat', 'v2', **tf_like)
  compat = _stand_in('tensorflow.compat', root, 'compat', v2=v2)
  tf = _OnDemand('tensorflow', spec.origin, __spec__=spec, compat=compat)
  tf.__dict__.update(tf_like)
  return [tf, compat, v2]


def _stand_in(name, root, *parts, **preset) -> _OnDemand:
  """A stand-in for the package `root/parts` (or the module `root/parts.py`)."""
  path = os.path.join(root, *parts)
  if os.path.isdir(path):
    file = os.path.join(path, '__init__.py')
    spec = importlib.util.spec_from_file_location(
      name, file, submodule_search_locations=[path]
    )
  else:
    file = path + '.py'
    spec = importlib.util.spec_from_file_location(name, file)
  return _OnDemand(name, file, __spec__=spec, **preset)


class _BackendOnDemand(collections.abc.Mapping):
  """Trax's TensorFlow-NumPy backend table, imported when first used."""

  def _table(self):
    return load_on_demand('trax.fastmath.tf').TF_BACKEND

  def __getitem__(self, key):
    return self._table()[key]

  def __iter__(self):
    return iter(self._table())

  def __len__(self):
    return len(self._table())


class SummaryWriter:
  """Trax's `jaxboard.SummaryWriter`, writing event files without TensorFlow.

  Scalars and text (what training logs) are built here with TensorBoard's
  own protos and event writer; Trax's other summary kinds (images, plots)
  run Trax's code, which loads TensorFlow then.
  """

  def __init__(self, log_dir, enable=True):
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    _LocalGFile.makedirs(log_dir)
    self._event_writer = EventFileWriter(log_dir, 10, 120, '')
    self._step = 0
    self._closed = False
    self._enabled = enable

  def add_summary(self, summary, step):
    if not self._enabled:
      return
    from tensorboard.compat.proto import event_pb2, summary_pb2

    if not isinstance(summary, summary_pb2.Summary):  # One of TensorFlow's.
      summary = summary_pb2.Summary.FromString(summary.SerializeToString())
    event = event_pb2.Event(summary=summary, wall_time=time.time())
    if step is not None:
      event.step = int(step)
    self._event_writer.add_event(event)

  def _at(self, step):
    if step is None:
      return self._step
    self._step = step
    return step

  def scalar(self, tag, value, step=None):
    from tensorboard.compat.proto import summary_pb2

    value = summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
    self.add_summary(summary_pb2.Summary(value=[value]), self._at(step))

  def text(self, tag, textdata, step=None):
    import numpy as np
    from tensorboard.compat.proto import (
      summary_pb2,
      tensor_pb2,
      tensor_shape_pb2,
      types_pb2,
    )

    data = np.array(textdata if not isinstance(textdata, bytes) else [textdata])
    shape = data.shape or (1,)
    tensor = tensor_pb2.TensorProto(
      dtype=types_pb2.DT_STRING,
      string_val=[
        t if isinstance(t, bytes) else str(t).encode('utf-8')
        for t in data.reshape(-1)
      ],
      tensor_shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in shape]
      ),
    )
    metadata = summary_pb2.SummaryMetadata(
      plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='text')
    )
    value = summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)
    self.add_summary(summary_pb2.Summary(value=[value]), self._at(step))

  def flush(self):
    if self._enabled:
      self._event_writer.flush()

  def close(self):
    if not self._closed:
      self._event_writer.close()
      self._closed = True

  def __del__(self):
    with contextlib.suppress(Exception):
      self.close()

  def __getattr__(self, name):
    # image, images, plot, audio, histogram: Trax's methods, which build
    # TensorFlow protos and hand them to add_summary above.
    method = getattr(load_on_demand('trax.jaxboard').SummaryWriter, name)
    return method.__get__(self)


def markdownify_operative_config_str(string: str) -> str:
  """Gin's operative config as Markdown, as Trax's `jaxboard` formats it."""

  def line_md(line):
    if not line.startswith('#'):
      return '    ' + line
    line = line[2:]
    if line.startswith('===='):
      return ''
    if line.startswith('None'):
      return '    # None.'
    if line.endswith(':'):
      return '#### ' + line
    return line

  return '\n'.join(line_md(line) for line in string.splitlines())


_STAND_INS: dict[str, _OnDemand] = {}


def _on_call(module: str, name: str):
  """A function that imports `module` when called and calls its `name`."""

  def call(*args, **kwargs):
    return getattr(load_on_demand(module), name)(*args, **kwargs)

  call.__name__ = call.__qualname__ = name
  return call


def _install_tensorflow_stand_ins():
  """Puts the stand-ins of fix 10 in `sys.modules`, before Trax is imported."""
  if 'tensorflow' in sys.modules:
    return  # Already imported by someone else: nothing left to save.
  stand_ins = _tensorflow_stand_ins()
  for name in ('tensorflow_datasets', 'tensorflow_text'):
    spec = importlib.util.find_spec(name)
    stand_ins.append(_OnDemand(name, spec.origin, __spec__=spec))
  trax_dir = importlib.util.find_spec('trax').submodule_search_locations[0]
  stand_ins.append(
    _stand_in(
      'trax.fastmath.tf',
      trax_dir,
      'fastmath',
      'tf',
      TF_BACKEND=_BackendOnDemand(),
    )
  )
  stand_ins.append(
    _stand_in(
      'trax.jaxboard',
      trax_dir,
      'jaxboard',
      SummaryWriter=SummaryWriter,
      markdownify_operative_config_str=markdownify_operative_config_str,
    )
  )
  stand_ins.append(
    _stand_in(
      'trax.trax2keras',
      trax_dir,
      'trax2keras',
      AsKeras=_on_call('trax.trax2keras', 'AsKeras'),
    )
  )
  for module in stand_ins:
    _STAND_INS[module.__name__] = module
    sys.modules[module.__name__] = module
