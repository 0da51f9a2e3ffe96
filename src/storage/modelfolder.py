"""The one model loader: a run folder or an export, read and checked.

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

from src.core import files, rundir
from src.core.errors import UserError
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
  if checkpoints.is_export(path):
    # Every file is checked against export.json before it is read (the
    # weights once model.gin has said how big they may be), and what is
    # parsed is the bytes that were checked.
    meta, contents = checkpoints.verify_export(path, part='rest')
    with files.pinned(contents):
      model = _load(
        path, 'export', what, bindings, checkpoint, check_memory, meta
      )
    return dataclasses.replace(
      model, curves=_export_curves(path, contents), name=_name(meta)
    )
  return _load(path, 'run', what, bindings, checkpoint, check_memory, None)


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
    _, weights = checkpoints.verify_export(path, export_meta, 'weights', limit)
    with files.pinned(weights):
      flat = checkpoints.export_weights(path, export_meta)
    step = export_meta['step']
  elif checkpoint is None:
    flat, step = checkpoints.read_weights(path, limit)
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
