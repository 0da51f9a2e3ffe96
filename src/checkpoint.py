"""The one checkpoint reader, used by training (resume) and every other reader.

Trax checkpoints are `model.pkl.gz` (a pickle: step, state, history, input
signature) beside `model.weights.npy.gz` and `model.opt_slots0.npy.gz`
(NumPy arrays, read without pickle). A pickle can run arbitrary code when
loaded, so we never unpickle with the stock loader: `SafeUnpickler` accepts
only the handful of types a Trax checkpoint contains (NumPy and JAX arrays,
dtypes, `ShapeDtype`, plain containers) and refuses anything else with a
`UserError`. `install()` routes Trax's own loader through it.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle

from src.errors import UserError

CHECKPOINT = 'model.pkl.gz'
WEIGHTS = 'model.weights.npy.gz'

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


def read_meta(model_dir: str) -> dict | None:
  """The checkpoint's metadata (step, history, ...), or None if absent."""
  path = os.path.join(model_dir, CHECKPOINT)
  if not os.path.exists(path):
    return None
  return read_pickle(path)


def latest_step(model_dir: str) -> int:
  """The step of the saved checkpoint; 0 if there is none."""
  meta = read_meta(model_dir)
  return int(meta['step']) if meta else 0


def _trax_unpickle_from_file(file_path, gzip=False):  # noqa: A002 (Trax API)
  return read_pickle(file_path, gzipped=gzip)


def _no_data_counters(output_dir, host_id=None):
  del output_dir, host_id


def install():
  """Makes Trax's `Loop` read pickles only through this module.

  Checkpoint pickles go through `SafeUnpickler`. Trax's data counters
  (`data_counters<host>.pkl`, a plain pickle loaded with the stock loader
  whenever a Loop starts in an out-dir) are neither read nor written: Jade
  V8's batches are a pure function of (seed, step), so they hold nothing a
  run needs, and a planted one must never be unpickled.
  """
  from trax.data import inputs
  from trax.supervised import training

  training.unpickle_from_file = _trax_unpickle_from_file
  inputs.load_data_counters = _no_data_counters
  inputs.save_data_counters = _no_data_counters


def load_weights(model_dir: str, layer, input_signature):
  """Initializes `layer` and loads the checkpoint's weights into it.

  The weights file holds plain NumPy arrays (read without pickle); the
  metadata comes through `SafeUnpickler`. Works for any mode of the model
  that was trained (train, eval, predict share the weights' structure).

  Args:
    model_dir: The run folder.
    layer: An uninitialized Trax layer of the trained architecture.
    input_signature: `ShapeDtype` of the layer's input.

  Returns:
    The checkpoint's step.
  """
  import jax
  import numpy as np
  from trax import layers as tl

  meta = read_meta(model_dir)
  if meta is None:
    raise UserError(
      f'{os.path.join(model_dir, CHECKPOINT)}: missing; train a model '
      f'into {model_dir!r} first (python train.py --out-dir {model_dir})'
    )
  path = os.path.join(model_dir, WEIGHTS)
  if not os.path.exists(path):
    raise UserError(f'{path}: missing; the checkpoint is incomplete')
  try:
    flat = tl.np_from_file(path, compresslevel=meta['flat_weights'])
  except (OSError, EOFError, ValueError) as e:
    raise UserError(f'{path}: damaged ({e})') from None
  flat = [
    np.asarray(jax.lax.bitcast_convert_type(w, jax.numpy.bfloat16))
    if w.dtype == np.uint16
    else w
    for w in flat
  ]
  # The state (LSH hash seeds) is drawn at init: seed it so that scoring
  # and sampling are reproducible from run to run.
  layer.rng = jax.random.PRNGKey(0)
  layer.init(input_signature)
  sig = layer.weights_and_state_signature(input_signature)
  expected = len(tl.flatten_weights_and_state(layer.weights, layer.state)[0])
  if len(flat) != expected:
    raise UserError(
      f'{path}: has {len(flat)} weight arrays, the model in {model_dir} '
      f'needs {expected}; the checkpoint and its model.gin do not match'
    )
  weights, _ = tl.unflatten_weights_and_state(flat, (), sig, weights_only=True)
  layer.weights = jax.tree_util.tree_map(jax.numpy.asarray, weights)
  return int(meta['step'])
