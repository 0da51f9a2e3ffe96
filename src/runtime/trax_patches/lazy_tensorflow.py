"""TensorFlow loaded only when something uses it (fixes 9 and 10).

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
   TensorFlow and works as before. Where TensorFlow is not installed at all
   (a GPU box with JAX's CUDA wheels alone), training, evaluation and chat
   run the same, and what needs it raises one line that says to install it.
"""

from __future__ import annotations

import collections.abc
import contextlib
import importlib
import importlib.util
import os
import sys
import time
import types

from src.core import files


def _hide_accelerators_from_tensorflow(tf):
  try:
    tf.config.set_visible_devices([], 'GPU')
    tf.config.set_visible_devices([], 'TPU')
  except (RuntimeError, ValueError):
    pass  # Already initialised or no such device type: nothing to hide.


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
  from src.runtime import quiet

  names = [n for n in _STAND_INS if n.split('.')[0] == 'tensorflow']
  names += [name] if name not in names else []
  for n in names:
    sys.modules.pop(n, None)
  with quiet.native_stderr_muted():
    for n in names:  # In `_STAND_INS` order: a package before its modules.
      try:
        real = importlib.import_module(n)
      except ModuleNotFoundError as e:
        if e.name is None or e.name.split('.')[0] != n.split('.')[0]:
          raise
        raise ModuleNotFoundError(
          f'{n} is not installed and this needs it (training, evaluation '
          'and chat do not): pip install -r requirements.txt',
          name=e.name,
        ) from None
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
      if any(c in mode for c in 'wax+'):
        # Trax writes checkpoints to a fixed name (`<file>._tmp_`): a link
        # planted there is replaced, never written through.
        return files.open_for_write(path, mode)
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


def _installed(name: str):
  """The module's import spec, or None where it is not installed: training,
  evaluation and chat run without TensorFlow (a GPU box with only JAX's
  CUDA wheels, say); what needs it says so when first used."""
  try:
    return importlib.util.find_spec(name)
  except (ImportError, ValueError):
    return None


def _tensorflow_stand_ins() -> list[_OnDemand]:
  """`tensorflow` and `tensorflow.compat.v2` (which Trax imports as `tf`)."""
  spec = _installed('tensorflow')
  origin = spec.origin if spec else None
  root = os.path.dirname(origin) if origin else os.path.join(os.sep, 'no-tf')
  tf_like = {
    'io': types.SimpleNamespace(gfile=_LocalGFile),
    'random': types.SimpleNamespace(set_seed=_set_seed_if_loaded),
    'TensorShape': _NoTensorFlowType,
    'DType': _NoTensorFlowType,
  }
  v2 = _stand_in('tensorflow.compat.v2', root, 'compat', 'v2', **tf_like)
  compat = _stand_in('tensorflow.compat', root, 'compat', v2=v2)
  tf = _OnDemand('tensorflow', origin, __spec__=spec, compat=compat)
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


def install():
  """Puts the stand-ins of fix 10 in `sys.modules`, before Trax is imported."""
  if 'tensorflow' in sys.modules:
    return  # Already imported by someone else: nothing left to save.
  stand_ins = _tensorflow_stand_ins()
  for name in ('tensorflow_datasets', 'tensorflow_text'):
    spec = _installed(name)
    stand_ins.append(_OnDemand(name, spec and spec.origin, __spec__=spec))
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
