"""Fine-tuning: a run that starts from a trained model.

`init-from` names a training out-dir or an export (`src.storage.export`). A new
run then takes over the model's tokenizer, its model settings (the gin
file adds only optimizer, schedule and dropout) and its weights; the
optimizer state and the step count start fresh. `init.json` in the new
out-dir records where it started (path, step, a hash of the weights); a
run with `init.json` resumes from its own checkpoints and never goes back
to the source.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os

import numpy as np

from src.core import files, rundir
from src.core.errors import UserError
from src.data import tokenizer
from src.model import ginconf, tied
from src.model import settings as settings_table
from src.storage import checkpoints, modelfolder, snapshots

INIT_FILE = rundir.INIT
# Settings that may differ from the pretrained model's: dropout, and how
# many batch x head slices an attention computes at once (the same
# function; only speed and memory depend on it).
MAY_DIFFER = ('dropout', 'n_parallel_heads')
# How an attention layer reads (no weight depends on these): a fine-tune
# may read longer windows with longer chunks, as the long-conversation
# curriculum does (BENCHMARKS "Recall in a long chat, fifth round").
READING = ('chunk_len', 'n_chunks_before', 'n_hashes', 'n_buckets')
# Train settings that must agree with the pretrained tokenizer.
TOKENIZER_KEYS = {
  'vocab-size': 'requested_vocab_size',
  'ai-start': 0,
  'ai-end': 1,
  'line-break': 2,
}
UNKNOWN_WARN = 0.01  # Warn above this share of unknown-piece tokens.


@dataclasses.dataclass
class Plan:
  """How a run relates to a pretrained model."""

  gin: tuple[str, str]  # Base model bindings for ginconf.parse.
  tok_info: dict  # The tokenizer's info (vocab size, markers).
  source: modelfolder.ModelFolder | None  # Set when the run starts now.
  record: dict | None  # init.json of a fine-tune run being resumed.


def read_record(out_dir: str) -> dict | None:
  path = os.path.join(out_dir, INIT_FILE)
  if not os.path.exists(path):
    return None
  record = files.read_json(path)
  try:
    str(record['path'])
    int(record['step'])
  except (OSError, ValueError, KeyError, TypeError) as e:
    fix = 'it records where this fine-tune run started; restore it or use '
    raise files.damaged(path, e, fix + 'a new out-dir') from None
  return record


INIT_FROM_FIX = (
  'give a training out-dir or an export (python export.py RUN_DIR OUT_DIR)'
)


def load(path: str) -> modelfolder.ModelFolder:
  """Reads and checks a pretrained model (a run folder or an export)."""
  source = modelfolder.load(path, f'init-from {path!r}', INIT_FROM_FIX)
  check_shapes(path, source.setup, source.tok.vocab_size, source.flat)
  return source


def check_shapes(path: str, setup, vocab_size: int, flat):
  """The weights fit the model that `setup` (the parsed settings, the
  current gin state) describes; shapes are worked out without computing."""
  import jax
  import trax

  layer = ginconf.model(vocab_size, 'eval')
  signature = trax.shapes.ShapeDtype((1, setup.max_len), np.int32)
  wanted = jax.tree_util.tree_leaves(
    layer.weights_and_state_signature(signature, unsafe=True)[0]
  )
  checkpoints.check_fit(
    path, flat, wanted, 'the weights and model.gin do not match'
  )


def plan(settings, out_dir: str) -> Plan | None:
  """The fine-tune plan of a run: None for a run from scratch.

  Raises:
    UserError: `init-from` for an out-dir that already holds a run
      trained from scratch, or any problem with the pretrained model.
  """
  given = settings['init-from']
  if given and os.path.realpath(given) == os.path.realpath(out_dir):
    raise UserError(
      f'init-from and out-dir are the same folder ({out_dir!r}): a '
      'fine-tune run starts from one model and writes into a new folder; '
      'give another --out-dir'
    )
  record = read_record(out_dir)
  if snapshots.exists(out_dir):
    if record is None:
      if settings['init-from']:
        raise UserError(
          f'{out_dir} already holds a run trained from scratch (step '
          f'{snapshots.latest_step(out_dir)}); fine-tune into a new '
          'out-dir'
        )
      return None
    gin_path = os.path.join(out_dir, ginconf.MODEL_GIN)
    saved = ginconf.saved_text(out_dir)
    if saved is None:
      raise UserError(f'{gin_path}: missing; the fine-tune run is incomplete')
    return Plan(
      gin=(ginconf.model_bindings(saved, gin_path), gin_path),
      tok_info=tokenizer.read_info(out_dir),
      source=None,
      record=record,
    )
  path = settings['init-from'] or (record and record['path'])
  if not path:
    return None
  source = load(path)
  return Plan(
    gin=(source.gin_text, source.gin_path),
    tok_info=source.tok_info,
    source=source,
    record=None,
  )


def tokenizer_settings(settings, info: dict, where: str) -> dict:
  """Train settings that follow the pretrained tokenizer; one that the
  user set to another value is an error naming both."""
  values = {}
  for key, field in TOKENIZER_KEYS.items():
    value = (
      info['markers'][field] if isinstance(field, int) else info.get(field)
    )
    if value is None:
      continue
    if key in settings.given and settings[key] != value:
      raise UserError(
        f'{settings.source}: train.{key} is {settings[key]!r} but the '
        f'pretrained tokenizer ({where}) has {value!r}; a fine-tune run '
        f'keeps the tokenizer: remove "{key}" or set it to {value!r}'
      )
    values[key] = value
  return values


def _classes(setup) -> list:
  return settings_table.attention_kinds(setup.model, setup.path)


def grown_blocks(setup, source_setup) -> tuple[bool, ...] | None:
  """Which entries of `ReformerLM.attention_type` a fine-tune grows (a
  class bound where the pretrained model has the class it `GROWS_FROM`,
  e.g. `ContextLSHSelfAttention` for `SmearedDirectedLSHSelfAttention`);
  None when the lists differ otherwise (or not at all)."""
  mine, theirs = _classes(setup), _classes(source_setup)
  if len(mine) != len(theirs) or mine == theirs:
    return None
  grown = []
  for new, old in zip(mine, theirs):
    # Gin binds its own subclass of each class: compare them by name.
    grows = _name(new) != _name(old)
    if grows and _name(getattr(new, 'GROWS_FROM', None)) != _name(old):
      return None
    grown.append(grows)
  return tuple(grown)


def _name(kind) -> str:
  return f'{kind.__module__}.{kind.__qualname__}' if kind else ''


def grown_output(setup, source_setup) -> bool:
  """Whether a fine-tune grows the pretrained output layer into a tied
  one (`output_layer.tied = True` on a model trained without it; the
  copy map starts at zero: `src.model.tied`). A layer tied 'only' has
  no kernel of its own to grow from a `Dense`: it is never grown."""
  mine, theirs = setup.output, source_setup.output
  grows = mine.tied is True and not theirs.tied
  return grows and mine.halves == theirs.halves


def _said(output) -> str:
  """An output layer's settings in words."""
  said = f'halves {output.halves!r}, tied {output.tied!r}'
  if output.shortlist:
    said += f', shortlist {output.shortlist}, width {output.width}'
  return said


def growth(setup, source_setup) -> list[str]:
  """What the fine-tune grows (`grown_blocks`, `grown_output`), as
  `old -> new`."""
  grown = grown_blocks(setup, source_setup) or ()
  pairs = zip(_classes(source_setup), _classes(setup), grown)
  said = [f'{old.__name__} -> {new.__name__}' for old, new, g in pairs if g]
  if grown_output(setup, source_setup):
    said.append('output layer -> tied (output_layer.tied)')
  return said


def _new_settings(setup, grown) -> set:
  """The settings a grown class adds (`GROWN_SETTINGS`)."""
  return {
    name
    for new, is_grown in zip(_classes(setup), grown or ())
    if is_grown
    for name in new.GROWN_SETTINGS
  }


def check_settings(
  setup: ginconf.GinSetup, source: modelfolder.ModelFolder, gin_path: str
) -> list[str]:
  """The gin file may not change the pretrained model's settings but
  dropout, how the attention reads (`READING`) and a grown attention
  class (`grown_blocks`, said by `growth`) with its new settings.

  Returns:
    The reading settings that differ, as `name old -> new`.
  """
  changed = []
  grown = grown_blocks(setup, source.setup)
  added = _new_settings(setup, grown)
  mine, theirs = setup.output, source.setup.output
  if mine != theirs and not grown_output(setup, source.setup):
    raise UserError(
      f'{gin_path}: sets output_layer ({_said(mine)}), but the pretrained '
      f'model ({source.gin_path}) has {_said(theirs)}; a fine-tune keeps '
      'the output layer (it may only grow a tied one: output_layer.tied = '
      'True): remove the binding'
    )
  for group, mine, theirs in (
    ('ReformerLM', setup.model, source.setup.model),
    (source.setup.attention_name, setup.attention, source.setup.attention),
    ('SelfAttention', setup.local or {}, source.setup.local or {}),
  ):
    for key in sorted(set(mine) | set(theirs)):
      if key.startswith('_') or any(d in key for d in MAY_DIFFER):
        continue
      if mine.get(key) == theirs.get(key):
        continue
      if group == 'ReformerLM' and key == 'attention_type' and grown:
        continue
      if key in added and key not in theirs:
        continue
      if group != 'ReformerLM' and key in READING:
        changed.append(f'{group}.{key} {theirs.get(key)} -> {mine.get(key)}')
        continue
      raise UserError(
        f'{gin_path}: sets {group}.{key} = {mine.get(key)!r}, but the '
        f'pretrained model ({source.gin_path}) has {theirs.get(key)!r}; a '
        "fine-tune run keeps the model's settings (only dropout, "
        "n_parallel_heads and the attention's "
        f'{", ".join(READING)} may differ): remove it from the '
        'gin file (gin/finetune.gin binds none)'
      )
  return changed


def grow_weights(
  model, flat: list, setup, grown: tuple[bool, ...] | None, output=False
) -> list:
  """The pretrained `flat` weights laid out for `model` (initialized; the
  run's settings `setup`), whose attention classes grow where `grown`
  says (`grown_blocks`; None: none), and whose output layer grows where
  `output` (`grown_output`): a grown layer's new weights, its last
  `GROWN_WEIGHTS`, are zeros. Block `i` has entry `i % len(grown)`, as
  Trax cycles `ReformerLM.attention_type` through the blocks."""
  import jax

  kinds = {_name(c) for c in _classes(setup)}
  out, taken, seen = [], 0, 0

  def walk(layer):
    nonlocal taken, seen
    if _name(type(layer)) in kinds:
      extra = layer.GROWN_WEIGHTS if grown and grown[seen % len(grown)] else 0
      seen += 1
    elif isinstance(layer, tied.TiedOutput):
      extra = layer.GROWN_WEIGHTS if output else 0
    elif layer.sublayers:
      for sub in layer.sublayers:
        walk(sub)
      return
    else:
      extra = 0
    leaves = jax.tree_util.tree_leaves(layer.weights)
    keep = len(leaves) - extra
    out.extend(flat[taken : taken + keep])
    out.extend(np.zeros(w.shape, w.dtype) for w in leaves[keep:])
    taken += keep

  walk(model)
  if taken != len(flat):
    raise UserError(
      f'the pretrained model has {len(flat)} weight arrays, its grown '
      f'model takes {taken}; the model folder does not fit its model.gin'
    )
  return out


def unknown_share(tokens) -> float:
  """Share of unknown-piece tokens in a token array."""
  n = len(tokens)
  return float(np.count_nonzero(np.asarray(tokens) == tokenizer.UNK_ID)) / max(
    n, 1
  )


def record(out_dir: str, source: modelfolder.ModelFolder):
  """Writes `init.json`: where this run started."""
  info = {
    'path': os.path.abspath(source.path),
    'kind': source.kind,
    'step': source.step,
    'weights_sha256': source.digest,
    # The name the source export declares (what a later export of this
    # run calls its base model; never the local path above).
    'name': source.name,
    'started_at': datetime.datetime.now(datetime.UTC).isoformat(
      timespec='seconds'
    ),
  }
  files.write_atomic(
    os.path.join(out_dir, INIT_FILE),
    (json.dumps(info, indent=2) + '\n').encode(),
  )
  return info


def copy_curves(
  out_dir: str, source: modelfolder.ModelFolder, log
) -> str | None:
  """Writes the pretrained model's curves into the new run's out-dir as
  TensorBoard event files (`pretrained-NAME/`), so TensorBoard shows both
  runs side by side; returns that folder, or None when the source has no
  curves. An export's come from its checked `curves.json`, a run folder's
  from its event files."""
  from src.storage import curves

  scalars = source.curves
  if scalars is None and source.kind == 'run':
    scalars = curves.collect(source.path)
  if not scalars:
    return None
  name = os.path.basename(os.path.normpath(source.path)) or 'model'
  folder = os.path.join(out_dir, rundir.PRETRAINED_CURVES + name)
  if os.path.lexists(folder):
    return folder
  curves.to_tensorboard(scalars, folder)
  log(
    f'curves of {name} (the pretrained run) are in {folder}: tensorboard '
    f'--logdir {out_dir} shows them beside this run'
  )
  return folder
