"""Unpickling that cannot run code: only the types a Trax checkpoint holds.

A pickle can run arbitrary code when loaded, so we never unpickle with the
stock loader: `SafeUnpickler` accepts only the handful of types a Trax
checkpoint contains (NumPy and JAX arrays, dtypes, `ShapeDtype`, plain
containers) and refuses anything else with a `UserError`.
"""

from __future__ import annotations

import gzip
import io
import pickle
import zlib

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
  from src.core import files

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
