"""The one reader of saved weights (checkpoints and exports), for every reader
(a run's checkpoint files and snapshots: `src.storage.snapshots`).

Trax checkpoints are `model.pkl.gz` (a pickle: step, state, history, input
signature) beside `model.weights.npy.gz` and `model.opt_slots0.npy.gz`
(NumPy arrays, read without pickle). A pickle can run arbitrary code when
loaded, so we never unpickle with the stock loader: `src.core.safe_pickle`
accepts only the handful of types a Trax checkpoint contains and refuses
anything else with a `UserError`; `src.runtime.trax_patches.checkpoint_io`
routes Trax's own loader through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys

from src.core import files, rundir, safe_pickle
from src.core.errors import UserError
from src.core.safe_pickle import (
  MAX_ARRAYS,
  is_int,
  read_weights_file,
)
from src.storage import snapshots

# ---- Weights-only exports (`python export.py`) ------------------
#
# An export is a folder with `model.safetensors` (the weights, flat, named
# `weights.00000`, ...), `export.json` (metadata and the SHA-256 of every
# file), `tokenizer.model`, `tokenizer.json`, `model.gin` and a README. It
# is read with `safetensors.numpy` (a JSON header and raw arrays: no pickle,
# no code) after its checksum is checked.

EXPORT_META = rundir.EXPORT_META
EXPORT_WEIGHTS = rundir.EXPORT_WEIGHTS
EXPORT_FORMAT = 'jade-v8-export'


def is_export(folder: str) -> bool:
  return os.path.isfile(os.path.join(folder, EXPORT_META))


def weight_key(i: int) -> str:
  return f'weights.{i:05d}'


def read_export_meta(folder: str) -> dict:
  """`export.json`, or a UserError naming what is wrong with it."""
  path = os.path.join(folder, EXPORT_META)
  meta = files.read_json(path)
  try:
    if not isinstance(meta, dict):
      raise TypeError('not a JSON object')
    if meta.get('format') != EXPORT_FORMAT:
      raise ValueError(f'format is {meta.get("format")!r}')
    if not is_int(meta.get('step')) or meta['step'] < 0:
      raise ValueError(f'step is {meta.get("step")!r}')
    n = meta.get('n_arrays')
    if not is_int(n) or not 0 < n <= MAX_ARRAYS:
      raise ValueError(f'n_arrays is {n!r}')
    snapshots.check_listing(meta.get('files'))
  except (ValueError, KeyError, TypeError) as e:
    raise UserError(
      f'{path}: damaged ({type(e).__name__}: {e}); it must be the JSON '
      'that python export.py wrote (download the model again)'
    ) from None
  return meta


# Bytes per element of the dtypes an export may hold.
_DTYPE_BYTES = {'F32': 4, 'F16': 2, 'F64': 8, 'I32': 4, 'I64': 8}
EXPORT_DTYPES = set(_DTYPE_BYTES)


def _safetensors_header(data: bytes, n: int) -> None:
  """Checks the header of an export's weights before they are parsed, by
  safetensors' own rules: `n` arrays, each with a dtype an export holds, a
  shape of non-negative integers and two integer offsets that match it;
  the arrays contiguous from the start, covering the data exactly."""
  import struct

  length = struct.unpack('<Q', data[:8])[0] if len(data) >= 8 else -1
  if not 2 <= length <= min(len(data) - 8, 64 * files.MB):
    raise ValueError('no safetensors header')
  header = files.parse_json(data[8 : 8 + length].decode('utf-8'), 'header')
  if not isinstance(header, dict):
    raise ValueError('the header is not an object')
  header.pop('__metadata__', None)
  if len(header) != n:
    raise ValueError(f'{len(header)} arrays, export.json says {n}')
  spans = []
  for name, entry in header.items():
    if not isinstance(entry, dict):
      raise ValueError(f'{name} is not an object')
    dtype, shape = entry.get('dtype'), entry.get('shape')
    offsets = entry.get('data_offsets')
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
      raise ValueError(f'{name} has dtype {dtype!r:.20}; an export holds F32')
    if not (
      isinstance(shape, list)
      and len(shape) <= 8
      and all(is_int(d) and 0 <= d < 1 << 40 for d in shape)
    ):
      raise ValueError(f'{name} has shape {str(shape)[:40]}')
    if not (
      isinstance(offsets, list)
      and len(offsets) == 2
      and all(is_int(o) for o in offsets)
      and 0 <= offsets[0] <= offsets[1]
    ):
      raise ValueError(f'{name} has data_offsets {str(offsets)[:40]}')
    elements = 1
    for d in shape:
      elements *= d
    if elements * _DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
      raise ValueError(f'{name}: its offsets do not match its shape')
    spans.append(tuple(offsets))
  end = 0
  for begin, stop in sorted(spans):
    if begin != end:
      raise ValueError('its arrays overlap or leave gaps')
    end = stop
  if 8 + length + end != len(data):
    raise ValueError('its arrays do not cover the file exactly')


# Files of an export the model does not need, with their largest size: a
# damaged one is left out with a note, and the model still loads.
OPTIONAL = {
  rundir.MODEL_CARD: files.MB,
  rundir.CURVES: 4 * files.MB,
  rundir.CURVES_PICTURE: 4 * files.MB,
}


def _check_optional(path: str, want: dict, most: int, contents: dict):
  """Checks a file the model does not need (see OPTIONAL) into `contents`;
  a damaged one is left out with one note."""
  if want['size'] > most:
    problem = f'{want["size"]} bytes, more than such a file holds'
  else:
    problem = snapshots.check_file(path, want, keep=contents)
  if problem:
    print(
      f'note: {path}: left out ({problem}); the model itself is fine',
      file=sys.stderr,
    )
    contents.pop(path, None)


def verify_export(
  folder: str,
  meta: dict | None = None,
  part: str = 'all',
  max_bytes: int | None = None,
) -> tuple[dict, dict]:
  """Checks the files `export.json` lists (size and SHA-256) before any is
  used: `part` 'all', 'rest' (all but the weights) or 'weights' (whose
  listed size must be at most `max_bytes`, default the memory available,
  before a byte of them is read). Returns the metadata and the checked
  files' bytes by path, to be parsed under `files.pinned` (the bytes
  hashed are the bytes read). `meta`: `export.json` already read."""
  meta = meta or read_export_meta(folder)
  listing = meta['files']
  for name in (EXPORT_WEIGHTS, rundir.TOKENIZER_MODEL, rundir.TOKENIZER_INFO):
    if name not in listing:
      raise UserError(
        f'{os.path.join(folder, EXPORT_META)}: does not list {name}; '
        'download the model again'
      )
  limit = safe_pickle.memory_available()
  others = sum(
    w['size']
    for n, w in listing.items()
    if n != EXPORT_WEIGHTS and n not in OPTIONAL
  )
  if others > min(limit, 256 * files.MB):
    raise UserError(
      f'{os.path.join(folder, EXPORT_META)}: lists {others / 2**20:.0f} MB '
      'of tokenizer, settings and card, more than an export holds; '
      'download the model again'
    )
  size, bound = listing[EXPORT_WEIGHTS]['size'], max_bytes or limit
  if part != 'rest' and size > bound:
    raise UserError(
      f'{os.path.join(folder, EXPORT_WEIGHTS)}: {size / 2**20:.0f} MB, more '
      f'than the {bound / 2**20:.0f} MB of weights its model.gin describes; '
      'the export is damaged or not this model: download it again'
    )
  contents: dict[str, bytes] = {}
  for name, want in listing.items():
    if part != 'all' and (name == EXPORT_WEIGHTS) != (part == 'weights'):
      continue
    path = os.path.join(folder, name)
    if name in OPTIONAL:
      _check_optional(path, want, OPTIONAL[name], contents)
      continue
    problem = snapshots.check_file(path, want, keep=contents)
    if problem:
      raise UserError(
        f'{path}: damaged or truncated ({problem}; export.json lists every '
        'file with its size and SHA-256); download the model again'
      )
  return meta, contents


def read_export(folder: str, max_bytes: int | None = None):
  """The flat weight arrays of an export and its metadata, every file
  checked first (`verify_export`), the weights parsed from the bytes
  that were checked."""
  meta, contents = verify_export(folder, max_bytes=max_bytes)
  with files.pinned(contents):
    return export_weights(folder, meta), meta


def export_weights(folder: str, meta: dict):
  """The weights of an export already checked, their size bounded too
  (`verify_export`; read under `files.pinned` with what it returned)."""
  from safetensors import SafetensorError
  from safetensors.numpy import load

  path = os.path.join(folder, EXPORT_WEIGHTS)
  size = meta['files'][EXPORT_WEIGHTS]['size']
  n = int(meta['n_arrays'])
  try:
    data = files.read_regular(path, size)
    _safetensors_header(data, n)
    arrays = load(data)
  except (SafetensorError, ValueError, OSError, UnicodeDecodeError) as e:
    raise UserError(
      f'{path}: not a weights file an export holds ({e}); download the '
      'model again'
    ) from None
  keys = [weight_key(i) for i in range(n)]
  if sorted(arrays) != keys:
    raise UserError(
      f'{path}: holds {len(arrays)} arrays, export.json says {n} named '
      'weights.00000...; the export is inconsistent'
    )
  return [arrays[k] for k in keys]


def read_weights(model_dir: str, max_bytes: int | None = None):
  """`(flat weight arrays, training step)` of a run folder (its latest
  intact checkpoint) or an export; nothing is unpickled but the run's
  checkpoint metadata, through `SafeUnpickler`. More than `max_bytes` of
  weights (see `preflight.weight_file_bytes`) is refused before it is
  read."""

  if is_export(model_dir):
    flat, meta = read_export(model_dir, max_bytes)
    return flat, int(meta['step'])
  checked = {}
  _, folder, problem = snapshots.verify(
    model_dir, (snapshots.CHECKPOINT, snapshots.WEIGHTS), checked
  )
  if folder is None:
    raise UserError(
      f'{os.path.join(model_dir, snapshots.CHECKPOINT)}: missing; train a '
      f'model into {model_dir!r} first (python train.py --out-dir '
      f'{model_dir})'
    )
  if problem:
    print(
      f'note: the checkpoint in {model_dir} is damaged ({problem}); using '
      f'the intact one in {folder}',
      file=sys.stderr,
    )
  with files.pinned(checked):
    return read_checkpoint_weights(folder, max_bytes)


def read_checkpoint_weights(folder: str, max_bytes: int | None = None):
  """`(flat weight arrays, step)` of the checkpoint in `folder`, a folder
  `verify` has already found intact."""
  import jax
  import numpy as np

  meta = snapshots.read_meta(folder)
  path = os.path.join(folder, snapshots.WEIGHTS)
  if not os.path.exists(path):
    raise UserError(f'{path}: missing; the checkpoint is incomplete')
  flat = read_weights_file(path, max_bytes)
  flat = [
    np.asarray(jax.lax.bitcast_convert_type(w, jax.numpy.bfloat16))
    if w.dtype == np.uint16
    else w
    for w in flat
  ]
  return flat, int(meta['step'])


def weights_digest(flat) -> str:
  """SHA-256 over the arrays' dtypes, shapes and bytes (names a model's
  weights independently of the file they came in)."""
  import numpy as np

  h = hashlib.sha256()
  for w in flat:
    w = np.ascontiguousarray(w)
    h.update(f'{w.dtype.str}{w.shape};'.encode())
    h.update(w.tobytes())
  return h.hexdigest()


def check_fit(where: str, flat, expected, fix: str) -> None:
  """The one weight-shape check: `flat` arrays against the `expected`
  ones (arrays or shape signatures), in order; `fix` ends the message."""
  import numpy as np

  if len(flat) != len(expected):
    raise UserError(
      f'{where}: has {len(flat)} weight arrays, its model.gin needs '
      f'{len(expected)}; {fix}'
    )
  for i, (w, e) in enumerate(zip(flat, expected)):
    if tuple(np.shape(w)) != tuple(e.shape):
      raise UserError(
        f'{where}: weight array {i} has shape {tuple(np.shape(w))}, the '
        f'model needs {tuple(e.shape)}; {fix}'
      )


def set_weights(model_dir: str, layer, input_signature, flat) -> None:
  """Initializes `layer` and sets the flat weights `flat` (read from
  `model_dir`, named in messages) into it."""
  import jax
  import numpy as np
  from trax import fastmath
  from trax import layers as tl

  # The state (LSH hash seeds) is drawn at init: seed it so that scoring
  # and sampling are reproducible from run to run. The weights Trax would
  # draw are replaced by `flat`: they are not drawn (`weights_not_drawn`).
  layer.rng = jax.random.PRNGKey(0)
  with weights_not_drawn(layer):
    layer.init(input_signature)
  expected = tl.flatten_weights_and_state(layer.weights, layer.state)[0]
  check_fit(
    model_dir,
    flat,
    expected,
    'the weights, model.gin and tokenizer do not match',
  )
  if not all(np.isfinite(w).all() for w in flat if w.dtype.kind not in 'iub'):
    raise UserError(
      f'{model_dir}: the weights contain NaN/inf (the training run '
      'diverged); train again with a lower learning rate (lr_schedule.peak)'
    )
  # The initialized weights are the tree's template (Trax's own
  # `unflatten_weights_and_state` takes their abstract signature, which
  # costs another trace of the whole model).
  markers = [tl.EMPTY_WEIGHTS, tl.GET_WEIGHTS_FROM_CACHE]
  weights, _ = fastmath.tree_unflatten(
    list(flat), layer.weights, copy_from_tree=markers
  )
  layer.weights = jax.tree_util.tree_map(jax.numpy.asarray, weights)


@contextlib.contextmanager
def weights_not_drawn(layer):
  """Within it, `layer.init` makes its weights zeros instead of drawing
  them: every `*_initializer` of `layer` and its sublayers returns zeros
  of the asked shape. For weights that are replaced at once: Trax draws
  each array eagerly, one small compiled program per shape, ~0.5 s of a
  chat's start on the tiny model. The state (hash seeds, rotations) is
  drawn as before."""
  import numpy as np

  def zeros(shape, rng=None):
    del rng
    return np.zeros(shape, np.float32)

  swapped = []
  todo = [layer]
  while todo:
    sub = todo.pop()
    todo.extend(sub.sublayers)
    for name, value in list(vars(sub).items()):
      if name.endswith('_initializer') and callable(value):
        swapped.append((sub, name, value))
        setattr(sub, name, zeros)
  try:
    yield
  finally:
    for sub, name, value in swapped:
      setattr(sub, name, value)


def load_weights(model_dir: str, layer, input_signature, max_bytes=None):
  """Initializes `layer` and loads the saved weights into it.

  Works for a run folder (latest intact checkpoint) and an export, and for
  any mode of the trained model (train, eval, predict share the weights'
  structure).

  Args:
    model_dir: The run or export folder.
    layer: An uninitialized Trax layer of the trained architecture.
    input_signature: `ShapeDtype` of the layer's input.
    max_bytes: Refuse more weights than this (`preflight.weight_file_bytes`).

  Returns:
    The training step of the weights.
  """
  flat, step = read_weights(model_dir, max_bytes)
  set_weights(model_dir, layer, input_signature, flat)
  return step
