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


class SafeUnpickler(pickle.Unpickler):
  """Unpickles only the types a Trax checkpoint is made of."""

  def find_class(self, module, name):
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
  ) as e:
    raise UserError(
      f'{path}: not a readable Trax checkpoint ({e}); delete '
      'it to start over, or restore it from a backup'
    ) from None


def read_pickle(path: str, gzipped: bool = True):
  with open(path, 'rb') as f:
    data = f.read()
  if gzipped:
    try:
      data = gzip.decompress(data)
    except (OSError, EOFError) as e:
      raise UserError(
        f'{path}: damaged ({e}); delete it to start over, or '
        'restore it from a backup'
      ) from None
  return safe_load(data, path)
