"""The one model loader: a run folder or an export, read and checked here
(an export's files against its `export.json`, a run's latest intact
checkpoint through `snapshots.verify`), once per load.

Every reader of a trained model opens it here: the chat and perplexity
(`src.inference.decoding.load_run`), fine-tuning (`src.training.finetune`)
and the export (`src.storage.export`). The folder is untrusted input:
`model.gin` is read as data (`ginconf`), the tokenizer and weights through
bounded readers, the weights' size is bounded by what `model.gin`
describes, and a model that cannot fit this machine is refused before its
weights are read. Nothing here builds a Trax layer; callers set `flat`
into the layer they build (`checkpoints.set_weights`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import numpy as np

from src.core import files, rundir, safe_pickle
from src.core.errors import UserError
from src.core.safe_pickle import MAX_ARRAYS, is_int
from src.data import chatformat, tokenizer
from src.model import ginconf, preflight
from src.storage import checkpoints, curves, snapshots


@dataclasses.dataclass(frozen=True)
class ModelFolder:
  """A trained model as read from its folder (nothing is written).

  Attributes:
    path: The folder.
    kind: 'export' or 'run'.
    step: The training step of the weights.
    flat: The weight arrays in Trax's flat order (float32, or bfloat16
      where the run trained in bfloat16).
    tok: Its tokenizer.
    tok_info: Its `tokenizer.json` (vocabulary size, markers, settings).
    gin_text: The model's bindings from its `model.gin` (model settings
      only, no optimizer or schedule).
    gin_path: That `model.gin`.
    setup: The parsed settings (`gin_text` plus the caller's bindings;
      they are also the current gin state).
    curves: An export's `curves.json`, checked (`src.storage.curves`);
      None for a run folder (its event files hold them) or without.
    name: The name an export declares for its model (`export.json`'s
      `name`, one printable line), else None.
    curves_at: Where its training curves are, in words
      (`curves.where`), else None.
  """

  path: str
  kind: str
  step: int
  flat: list
  tok: tokenizer.Tokenizer
  tok_info: dict
  gin_text: str
  gin_path: str
  setup: ginconf.GinSetup
  curves: dict | None = None
  name: str | None = None
  curves_at: str | None = None

  @functools.cached_property
  def digest(self) -> str:
    """SHA-256 of the weights (`checkpoints.weights_digest`)."""
    return checkpoints.weights_digest(self.flat)

  def describe(self) -> str:
    return (
      f'{self.path} ({self.kind}, step {self.step}, weights sha256 '
      f'{self.digest[:12]})'
    )


def load(
  path: str,
  what: str,
  fix: str,
  bindings=(),
  checkpoint: str | None = None,
  check_memory: bool = True,
) -> ModelFolder:
  """Reads and checks the model in `path`.

  Args:
    path: A training out-dir or an export.
    what: Names the folder in messages (e.g. "model-dir 'runs/x'").
    fix: What to do when `path` is not a folder.
    bindings: Gin bindings added after the model's own (decoding speed).
    checkpoint: Read the weights from this checkpoint folder of the run
      (a verified snapshot) instead of its latest intact one.
    check_memory: Refuse a model that cannot be loaded on this machine
      (`preflight.check_model`); off for the export, which never builds it.

  Raises:
    UserError: one line naming the file and the fix.
  """
  if not os.path.isdir(path):
    raise UserError(f'{what}: no such folder; {fix}')
  if is_export(path):
    # Every file is checked against export.json before it is read (the
    # weights once model.gin has said how big they may be), and what is
    # parsed is the bytes that were checked.
    meta, contents = verify_export(path, part='rest')
    with files.pinned(contents):
      model = _load(
        path, 'export', what, bindings, checkpoint, check_memory, meta
      )
    return dataclasses.replace(
      model,
      curves=_export_curves(path, contents),
      name=_name(meta),
      curves_at=curves.where(path),
    )
  model = _load(path, 'run', what, bindings, checkpoint, check_memory, None)
  return dataclasses.replace(model, curves_at=curves.where(path))


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
    fix = 'it must be the JSON that python export.py wrote (download the '
    raise files.damaged(path, e, fix + 'model again)') from None
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


def _run_weights(model_dir: str, max_bytes: int | None = None):
  """`(flat weight arrays, training step)` of a run folder's latest intact
  checkpoint (`snapshots.verify`); nothing is unpickled but the
  checkpoint's metadata, through `SafeUnpickler`. More than `max_bytes` of
  weights (see `preflight.weight_file_bytes`) is refused before it is
  read."""
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
    return checkpoints.read_checkpoint_weights(folder, max_bytes)


def read_weights(path: str, max_bytes: int | None = None):
  """`(flat weight arrays, step)` of a run or an export, checked as `load`
  checks them, without the rest of the model (to compare weights)."""
  if is_export(path):
    meta, contents = verify_export(path, max_bytes=max_bytes)
    with files.pinned(contents):
      return export_weights(path, meta), int(meta['step'])
  return _run_weights(path, max_bytes)


NAME_LIMIT = 80  # Characters of a model's declared name.


def clean_name(text) -> str:
  """A name for a model card: printable, one line, at most NAME_LIMIT
  characters."""
  shown = ''.join(c if c.isprintable() else ' ' for c in str(text))
  return shown.strip()[:NAME_LIMIT]


def _name(meta: dict) -> str | None:
  """The model name an export's metadata declares (`clean_name`), else
  None."""
  name = meta.get('name')
  return (clean_name(name) or None) if isinstance(name, str) else None


def _export_curves(path: str, contents: dict) -> dict | None:
  """An export's checked `curves.json`, or None (absent or damaged: a note
  says so; the model is fine without it)."""
  file = os.path.join(path, rundir.CURVES)
  data = contents.get(file)
  if data is None:
    return None
  try:
    return curves.parse(data, file)
  except UserError as e:
    print(f'note: {e}', file=sys.stderr)
    return None


def _load(path, kind, what, bindings, checkpoint, check_memory, export_meta):
  """`load` of a run folder, or of an export whose files but the weights
  are checked (and pinned)."""
  gin_path = os.path.join(path, rundir.MODEL_GIN)
  if not os.path.lexists(gin_path):
    if kind == 'run' and not snapshots.exists(path):
      raise UserError(
        f'{gin_path}: missing; {what} holds no model (no checkpoint in that '
        'folder): train into it first (python train.py --out-dir '
        f'{path}), or point at a finished run or an export'
      )
    raise UserError(f'{gin_path}: missing; {what} is not a complete model')
  gin_text = ginconf.model_bindings(ginconf.read_saved(gin_path), gin_path)
  setup = ginconf.parse_text(gin_text, gin_path, tuple(bindings))
  info = tokenizer.read_info(path)
  tok = tokenizer.load(path, chatformat.Markers(*info['markers']))
  if check_memory:
    preflight.check_model(setup, tok.vocab_size, what)
  limit = preflight.weight_file_bytes(setup, tok.vocab_size)
  if export_meta is not None:
    _, weights = verify_export(path, export_meta, 'weights', limit)
    with files.pinned(weights):
      flat = export_weights(path, export_meta)
    step = export_meta['step']
  elif checkpoint is None:
    flat, step = _run_weights(path, limit)
  else:
    flat, step = checkpoints.read_checkpoint_weights(checkpoint, limit)
  rows = flat[0].shape[0] if flat and np.ndim(flat[0]) == 2 else None
  if rows != tok.vocab_size:
    raise UserError(
      f"{what}: the tokenizer has {tok.vocab_size} pieces but the weights' "
      f'embedding has {rows} rows; the tokenizer does not belong to these '
      'weights (copy the model folder again)'
    )
  return ModelFolder(
    path=path,
    kind=kind,
    step=int(step),
    flat=flat,
    tok=tok,
    tok_info=info,
    gin_text=gin_text,
    gin_path=gin_path,
    setup=setup,
  )
