"""Unpickling that cannot run code: only the types a Trax checkpoint holds.

A pickle can run arbitrary code when loaded, so we never unpickle with the
stock loader: `SafeUnpickler` accepts only the handful of types a Trax
checkpoint contains (NumPy and JAX arrays, dtypes, `ShapeDtype`, plain
containers) and refuses anything else with a `UserError`.
"""

from __future__ import annotations

import contextlib
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
  """Elements of an array `shape` (Python ints: no overflow), checked to
  be non-negative ints, at most 2**62 in all."""
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  n = 1
  for d in shape:
    if not isinstance(d, int) or isinstance(d, bool) or d < 0:
      raise pickle.UnpicklingError(f'array shape {shape!r:.60} is not a shape')
    n *= d
    if n > 1 << 62:
      raise pickle.UnpicklingError(f'array shape {shape!r:.60} is too big')
  return n


def _bounded(shape) -> int:
  """The elements of `shape`, at most MAX_ARRAY_ELEMENTS."""
  n = _elements(shape)
  if n > MAX_ARRAY_ELEMENTS:
    raise pickle.UnpicklingError(
      f'an array of {n:,} elements, more than a checkpoint holds'
    )
  return n


# The unpicklers loading now (innermost last): what they build is
# charged to their budget.
_LOADING: list = []


def _charge(shape, dtype) -> None:
  import numpy as np

  n = _bounded(shape)
  if _LOADING:
    _LOADING[-1].spend(n * np.dtype(dtype).itemsize)


class _NdarrayName:
  """What `numpy.ndarray` resolves to: allocation bounded by the shape and
  charged to the pickle's budget."""

  def __new__(cls, shape, dtype=float, *args, **kwargs):
    import numpy as np

    _charge(shape, dtype)
    return np.ndarray(shape, dtype, *args, **kwargs)


def _bounded_reconstruct(real):
  def reconstruct(subtype, shape, dtype):
    import numpy as np

    _charge(shape, dtype)
    return real(
      np.ndarray if subtype is _NdarrayName else subtype, shape, dtype
    )

  return reconstruct


class SafeUnpickler(pickle._Unpickler):
  """Unpickles only the types a Trax checkpoint is made of, and builds at
  most as many bytes of arrays as the pickle holds (`budget`): an array
  rebuilt by `__setstate__` is checked (shape, dtype, byte count) before
  NumPy makes it, so one shared buffer cannot become many arrays. (The
  pure-Python unpickler: its BUILD step can be checked; a checkpoint's
  pickle is small.)"""

  dispatch = dict(pickle._Unpickler.dispatch)

  def __init__(self, file, budget: int = MAX_PICKLE_BYTES):
    super().__init__(file)
    self.budget = budget

  def spend(self, nbytes: int):
    self.budget -= nbytes
    if self.budget < 0:
      raise pickle.UnpicklingError(
        'its arrays add up to more bytes than the pickle holds'
      )

  def load_build(self):
    import numpy as np

    inst, state = self.stack[-2], self.stack[-1]
    if isinstance(inst, np.ndarray):
      self.spend(_setstate_bytes(state))
    super().load_build()

  dispatch[pickle.BUILD[0]] = load_build

  def load(self):
    _LOADING.append(self)
    try:
      return super().load()
    finally:
      _LOADING.remove(self)

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


def _setstate_bytes(state) -> int:
  """The bytes `ndarray.__setstate__(state)` would make, checked: a shape
  of non-negative ints within the element limit, a plain little-endian
  dtype, and raw data of exactly that size."""
  import numpy as np

  if not (isinstance(state, tuple) and len(state) in (4, 5)):
    raise pickle.UnpicklingError('an array state that is not a tuple')
  shape, dtype, data = state[-4], state[-3], state[-1]
  if not isinstance(shape, tuple) or len(shape) > 32:
    raise pickle.UnpicklingError('an array shape that is not a tuple')
  n = _bounded(shape)
  if not isinstance(dtype, np.dtype) or dtype.hasobject or dtype.names:
    raise pickle.UnpicklingError('an array of objects or records')
  if dtype.byteorder == '>':
    raise pickle.UnpicklingError('a big-endian array')
  nbytes = n * dtype.itemsize
  if not isinstance(data, (bytes, bytearray)) or len(data) != nbytes:
    raise pickle.UnpicklingError('array data of the wrong size')
  return nbytes


def safe_load(data: bytes, path: str = 'checkpoint'):
  """Unpickles `data` with `SafeUnpickler` (at most `len(data)` bytes of
  arrays); errors become `UserError`."""
  try:
    return SafeUnpickler(io.BytesIO(data), budget=len(data)).load()
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
        pieces, size = [], 0
        while size <= MAX_PICKLE_BYTES and (piece := f.read(1 << 24)):
          pieces.append(piece)
          size += len(piece)
        data = b''.join(pieces)
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


# What a weights or slots file holds: floats (bfloat16 is saved as uint16),
# integers (random keys) and booleans, of at most 8 bytes.
_NPY_KINDS = 'fiub'


def _npy_dtype(dtype):
  """`dtype` of an .npy header if a weights file may hold it, as the
  native little-endian dtype its data is converted to; else ValueError."""
  if dtype.hasobject or dtype.names or dtype.subdtype is not None:
    raise ValueError(f'an array of {dtype} (objects or records)')
  if dtype.kind not in _NPY_KINDS or dtype.itemsize > 8:
    raise ValueError(f'an array of {dtype}, which no weights file holds')
  return dtype.newbyteorder('<')


def read_npy_stream(path: str, compressed_size: int, max_bytes: int) -> list:
  """The arrays of a gzipped stream of .npy records (Trax's weights file),
  each header checked before its data is read: a shape of non-negative
  ints (sizes in Python ints), numbers of at most 8 bytes (big-endian ones
  converted), at most `max_bytes` in all (a small file cannot claim a huge
  array), the data read in pieces (a header that claims more than the
  stream holds fails at its end, having allocated only what was there)."""
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
        native = _npy_dtype(dtype)
        try:
          nbytes = _elements(shape) * dtype.itemsize
        except pickle.UnpicklingError as e:
          raise ValueError(str(e)) from None
        total += nbytes
        if total > max_bytes or len(out) >= MAX_ARRAYS:
          raise ValueError(
            f'more than the {max_bytes / 2**20:.0f} MB of weights the '
            'model needs'
          )
        data = bytearray()
        while len(data) < nbytes:
          piece = f.read(min(nbytes - len(data), 1 << 24))
          if not piece:
            raise ValueError('truncated')
          data += piece
        array = np.frombuffer(data, dtype).reshape(
          shape, order='F' if fortran else 'C'
        )
        out.append(array.astype(native) if native != dtype else array)
  return out


_WEIGHTS_LIMIT: list[int] = []


@contextlib.contextmanager
def weights_limit(max_bytes: int):
  """Within the block, a weights or slots file read without a bound of its
  own (Trax's resume, through `np_from_file`) may hold at most `max_bytes`
  (what the run's model needs), not all the memory there is."""
  _WEIGHTS_LIMIT.append(int(max_bytes))
  try:
    yield
  finally:
    _WEIGHTS_LIMIT.pop()


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
    limit = max_bytes or (
      _WEIGHTS_LIMIT[-1] if _WEIGHTS_LIMIT else memory_available()
    )
    return read_npy_stream(path, os.path.getsize(path), limit)
  except (OSError, EOFError, ValueError, zlib.error, OverflowError) as e:
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
