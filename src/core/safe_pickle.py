"""Unpickling that cannot run code: only the types a Trax checkpoint holds.

A pickle can run arbitrary code when loaded, so we never unpickle with the
stock loader: `SafeUnpickler` accepts only the handful of types a Trax
checkpoint contains (NumPy and JAX arrays, dtypes, `ShapeDtype`, plain
containers) and refuses anything else with a `UserError`.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import zlib

from src.core import files
from src.core.errors import UserError

_ALLOWED = {
  ('numpy', 'ndarray'),
  ('numpy', 'dtype'),
  ('numpy.core.multiarray', '_reconstruct'),
  ('numpy.core.multiarray', 'scalar'),
  ('numpy._core.multiarray', '_reconstruct'),
  ('numpy._core.multiarray', 'scalar'),
  ('jax._src.array', '_reconstruct_array'),
  ('trax.shapes', 'ShapeDtype'),
  ('collections', 'defaultdict'),
  ('collections', 'OrderedDict'),
  ('builtins', 'list'),
  ('builtins', 'dict'),
  ('builtins', 'tuple'),
  ('builtins', 'set'),
  ('builtins', 'frozenset'),
  ('builtins', 'float'),
  ('builtins', 'int'),
  ('builtins', 'complex'),
}


# A checkpoint's metadata pickle holds small arrays only (the weights and
# optimizer slots are separate NumPy files): larger ones are refused before
# they are allocated, as is a pickle that decompresses to more than this.
MAX_ARRAY_ELEMENTS = 1 << 24
MAX_PICKLE_BYTES = 256 * 1024 * 1024
MAX_ARRAYS = 100_000  # Weight arrays a model may have.


def _elements(shape) -> int:
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  n = 1
  for d in shape:
    if not isinstance(d, int) or d < 0:
      raise pickle.UnpicklingError(f'array shape {shape!r} is not a shape')
    n *= d
  return n


def _bounded(shape):
  if _elements(shape) > MAX_ARRAY_ELEMENTS:
    raise pickle.UnpicklingError(
      f'an array of {_elements(shape):,} elements, more than a checkpoint holds'
    )


class _NdarrayName:
  """What `numpy.ndarray` resolves to: allocation bounded by the shape."""

  def __new__(cls, shape, *args, **kwargs):
    import numpy as np

    _bounded(shape)
    return np.ndarray(shape, *args, **kwargs)


def _bounded_reconstruct(real):
  def reconstruct(subtype, shape, dtype):
    import numpy as np

    _bounded(shape)
    return real(
      np.ndarray if subtype is _NdarrayName else subtype, shape, dtype
    )

  return reconstruct


class SafeUnpickler(pickle.Unpickler):
  """Unpickles only the types a Trax checkpoint is made of."""

  def find_class(self, module, name):
    if (module, name) == ('numpy', 'ndarray'):
      return _NdarrayName
    if name == '_reconstruct' and (module, name) in _ALLOWED:
      return _bounded_reconstruct(super().find_class(module, name))
    if (module, name) in _ALLOWED or (
      module == 'numpy.dtypes' and name.endswith('DType')
    ):
      return super().find_class(module, name)
    raise pickle.UnpicklingError(
      f'checkpoint refers to {module}.{name}, which a Trax checkpoint '
      'never contains'
    )


def safe_load(data: bytes, path: str = 'checkpoint'):
  """Unpickles `data` with `SafeUnpickler`; errors become `UserError`."""
  try:
    return SafeUnpickler(io.BytesIO(data)).load()
  except (
    pickle.UnpicklingError,
    EOFError,
    AttributeError,
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    OverflowError,
    MemoryError,
    RecursionError,
  ) as e:
    raise UserError(
      f'{path}: not a readable Trax checkpoint ({e}); delete '
      'it to start over, or restore it from a backup'
    ) from None


def read_pickle(path: str, gzipped: bool = True):
  """The object in a checkpoint pickle: a regular file, decompressed to at
  most MAX_PICKLE_BYTES, unpickled with `SafeUnpickler`."""
  if not gzipped:
    return safe_load(files.read_regular(path, MAX_PICKLE_BYTES), path)
  with files.open_regular(path, MAX_PICKLE_BYTES) as raw:
    try:
      with gzip.GzipFile(fileobj=raw) as f:
        data = f.read(MAX_PICKLE_BYTES + 1)
    except (OSError, EOFError, zlib.error) as e:
      raise UserError(
        f'{path}: damaged ({e}); delete it to start over, or '
        'restore it from a backup'
      ) from None
  if len(data) > MAX_PICKLE_BYTES:
    raise UserError(
      f'{path}: decompresses to more than {MAX_PICKLE_BYTES >> 20} MB, '
      'more than a checkpoint holds; the file is damaged or not a '
      'checkpoint: delete it to start over, or restore it from a backup'
    )
  return safe_load(data, path)


def read_npy_stream(path: str, compressed_size: int, max_bytes: int) -> list:
  """The arrays of a gzipped stream of .npy records (Trax's weights file),
  each header checked before its data is read: no object arrays, and at
  most `max_bytes` in all (a small file cannot claim a huge array)."""
  import numpy as np
  from numpy.lib import format as npy

  out, total = [], 0
  with files.open_regular(path, compressed_size) as raw:
    with gzip.GzipFile(fileobj=raw) as f:
      while True:
        try:
          version = npy.read_magic(f)
        except ValueError:  # The end of the stream.
          break
        if version == (1, 0):
          shape, fortran, dtype = npy.read_array_header_1_0(f)
        else:
          shape, fortran, dtype = npy.read_array_header_2_0(f)
        if dtype.hasobject:
          raise ValueError('an array of Python objects')
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        total += nbytes
        if total > max_bytes or len(out) >= MAX_ARRAYS:
          raise ValueError(
            f'more than the {max_bytes / 2**20:.0f} MB of weights the '
            'model needs'
          )
        data = f.read(nbytes)
        if len(data) != nbytes:
          raise ValueError('truncated')
        array = np.frombuffer(data, dtype).reshape(
          shape, order='F' if fortran else 'C'
        )
        out.append(array)
  return out


def is_int(value) -> bool:
  """A whole number as JSON or a pickle holds one (not a bool)."""
  import numpy as np

  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_meta(meta, path: str):
  """`meta` if it has the shape of a Trax checkpoint's metadata (the keys
  Trax's `Loop` reads, of the types it reads them as), else a UserError."""
  problem = None
  if not isinstance(meta, dict):
    problem = f'it holds a {type(meta).__name__}, not a dict'
  elif not is_int(meta.get('step')) or meta['step'] < 0:
    problem = f'its step is {meta.get("step")!r}'
  elif not is_int(meta.get('flat_weights')):
    problem = 'it has no flat_weights setting'
  elif not isinstance(meta.get('history', {}), dict):
    problem = 'its history is not a dict'
  elif not (
    is_int(meta.get('slots_per_task', 0))
    or isinstance(meta.get('slots_per_task'), (list, tuple))
  ):
    problem = 'its slots_per_task is neither a number nor a list'
  elif not isinstance(meta.get('flat_state', ()), (list, tuple)):
    problem = 'its flat_state is not a list'
  if problem:
    raise UserError(
      f'{path}: not a Trax checkpoint ({problem}); delete the model.* '
      'files to start over, or copy the folder again'
    )
  return meta


def memory_available() -> int:
  import psutil

  return int(psutil.virtual_memory().available)


def read_weights_file(path: str, max_bytes: int | None = None) -> list:
  """The arrays of a checkpoint's weights or optimizer-slots file (see
  `read_npy_stream`), at most `max_bytes` (default: the memory this machine
  has available); a damaged file is a UserError."""
  try:
    return read_npy_stream(
      path, os.path.getsize(path), max_bytes or memory_available()
    )
  except (OSError, EOFError, ValueError, zlib.error) as e:
    raise UserError(
      f'{path}: damaged or not the weights of this model ({e}); delete '
      'the model.* files to start over, or copy the folder again'
    ) from None


def np_from_file(file_path, compresslevel):
  """Trax's `np_from_file` (weights and optimizer slots of a checkpoint),
  through `read_weights_file`."""
  del compresslevel
  if not os.path.lexists(file_path):
    raise FileNotFoundError(file_path)
  return read_weights_file(file_path)
