"""Strict `config.json` reading: run settings and paths, never model settings.

`config.json` has a `train` section (read by `train.py`) and an `eval` section
(read by `evaluate.py`). Every key has a default below; an unknown key, a
value of the wrong type or a missing file is a `UserError` naming the file,
the key and the fix. Model and optimizer settings live in gin files only
(`gin/`), so no setting can be given in two places.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
from typing import Any

from src.core import files
from src.core.errors import UserError

WINDOWS = ('moving', 'fixed')  # Values of train.windows.

# Each entry: key -> (default, help). The default's type is the key's type;
# None means "optional string".
TRAIN_KEYS: dict[str, tuple[Any, str]] = {
  'out-dir': (
    'train',
    'Folder for the tokenizer, checkpoints, gin config '
    'and TensorBoard logs of this run.',
  ),
  'data': (
    'data',
    'A folder of .txt conversation files (read in sorted '
    'order) or one .txt file.',
  ),
  'gin': (
    'gin/reformer_32k.gin',
    'Gin file with the model, optimizer and learning-rate schedule.',
  ),
  'gin-bindings': (
    [],
    'Gin bindings applied after the gin file, e.g. ["lr_schedule.peak = '
    '0.004"] (a preset\'s settings; --bind on the command line comes after '
    'these).',
  ),
  'tpu-ip': (
    None,
    'Unused: JAX on a TPU VM finds its TPU cores itself. Leave null.',
  ),
  'steps': (
    20000,
    'Total training steps; a resumed run trains up to this step count.',
  ),
  'eval-every': (200, 'Run the held-out evaluation every N steps.'),
  'log-every': (
    10,
    'Write the running training loss, perplexity, learning rate and '
    'tokens/s to TensorBoard every N steps (averaged over them); the '
    'progress line shows the same running average.',
  ),
  'sample-prompts': (
    ['Hello!', 'How are you?', 'What is your name?'],
    'At each evaluation the model answers these greedily (a fresh '
    "conversation each); the replies go to the log and to TensorBoard's "
    'text tab. [] turns it off.',
  ),
  'eval-batches': (2, 'Held-out batches per evaluation.'),
  'checkpoint-every': (
    200,
    'Save a checkpoint every N steps (and at the last step).',
  ),
  'keep-checkpoints': (
    2,
    'Intact checkpoints kept in out-dir/checkpoints/ (hard links, no extra '
    'disk for the newest); a damaged latest one falls back to these.',
  ),
  'batch-size': (
    0,
    'Training windows per step across all devices; 0 means one '
    'window per device. Must be a multiple of the device '
    'count.',
  ),
  'accumulate-steps': (
    1,
    'Gradient accumulation: each optimizer step averages the gradients of '
    'this many micro-batches per device, run one after another, so '
    'batch-size can exceed what fits in memory at once (the per-device '
    'batch must split evenly).',
  ),
  'coordinator': (
    '',
    'Multi-host training: HOST:PORT of process 0 (the same on every '
    'process; process 0 opens the port), or "auto" where JAX finds the '
    'processes itself (Cloud TPU pod slice, SLURM, Open MPI). Empty: one '
    'process (the default).',
  ),
  'num-processes': (1, 'Multi-host: processes in the run (with coordinator).'),
  'process-id': (
    0,
    'Multi-host: this process, 0..num-processes-1; 0 is the chief, the only '
    'one that writes to out-dir.',
  ),
  'connect-timeout': (
    300,
    'Multi-host: seconds to wait for every process to join at start.',
  ),
  'heartbeat-timeout': (
    100,
    'Multi-host: seconds without a sign of life after which a process '
    'counts as dead and the run stops on every process.',
  ),
  'eval-fraction': (
    0.05,
    'Share of the tokens held out for evaluation, as whole conversations '
    'drawn at random (by seed); 0 evaluates on the training data.',
  ),
  'eval-data': (
    None,
    'A folder (or file) of conversations to evaluate on instead; then '
    'nothing is held out of "data" and eval-fraction is not used.',
  ),
  'seed': (0, 'Seed for weights, padding split and window shuffling.'),
  'vocab-size': (
    500,
    'Sentencepiece vocabulary size (up to 32000 and '
    'more); fewer if the data is too small. From 8000 a new run scores '
    'its rarer pieces through a shortlist (output_layer.shortlist).',
  ),
  'ai-start': ('|aigenerationstart|', 'Marker that starts an AI turn.'),
  'ai-end': ('|endofgeneration|', 'Marker that ends an AI turn.'),
  'line-break': ('|br|', 'Marker for a line break inside a message.'),
  'repeat-limit': (
    8,
    'Warn about a character repeated more than this many '
    'times in a row (HIIIIIIIII).',
  ),
  'collapse-repeats': (
    False,
    'Shorten such runs to 3 characters instead of only warning.',
  ),
  'windows': (
    'moving',
    '"moving": every epoch re-packs the conversations in a new random '
    'order and cuts windows at a new random offset, so text is seen at a '
    'different position each time; "fixed": one grid in file order (the '
    'old behaviour, for comparison).',
  ),
  'window': (
    0,
    'Training windows of this many tokens, each placed at a random offset '
    "of the model's position grid (a different one per window and step), "
    'so a long-context model trains at the cost of short windows; 0: the '
    "model's whole context. A multiple of the attention chunk lengths.",
  ),
  'splice': (
    0.0,
    'Share of the training windows (0 to 1, drawn at random) that hold a '
    "long conversation's first tokens and its last ones, joined, instead "
    'of a stretch of its middle: what was said first and what is said '
    'last then share a short window, so a long-context model trained on '
    'short windows learns to reach back. 0: none.',
  ),
  'pad-fraction': (
    0.1,
    'A moving window holds between (1 - pad-fraction) x and 1 x the '
    'context in tokens (random); the rest is padding, split at random '
    'between its two ends.',
  ),
  'init-from': (
    None,
    'Fine-tune: a training out-dir or an export (python export.py) to '
    'start from. Its tokenizer, model settings and weights are taken over '
    '(the gin file then sets only optimizer, schedule and dropout: use '
    'gin/finetune.gin); the step count and optimizer start fresh.',
  ),
  'replay': (
    None,
    'Fine-tune: a folder (or file) of general conversations, e.g. the '
    'pretraining data, mixed into every epoch so the model keeps what it '
    'knew while it learns your chats (each epoch draws new ones at random). '
    'null: none.',
  ),
  'replay-share': (
    0.5,
    'Share of each epoch\'s training tokens drawn from "replay" (above 0, '
    'below 1); used only when replay is set.',
  ),
  'epochs': (
    0,
    'Train this many epochs (passes over the data, replay included) '
    'instead of a number of steps: "steps" is then derived from the data '
    'and the batch (the log says how many). 0: use "steps".',
  ),
  'ai-only-loss': (
    False,
    'Put loss only on AI turns (their text and end marker); user text and '
    'markers still form the context.',
  ),
}

EVAL_KEYS: dict[str, tuple[Any, str]] = {
  'model-dir': (
    'train',
    'Folder of a training run (its out-dir) or an export (python -m '
    'src.storage.export).',
  ),
}

SECTIONS = {'train': TRAIN_KEYS, 'eval': EVAL_KEYS}

# Train keys that count something: each must be at least 1.
AT_LEAST_ONE = (
  'steps',
  'eval-every',
  'log-every',
  'checkpoint-every',
  'eval-batches',
  'keep-checkpoints',
  'accumulate-steps',
  'num-processes',
  'connect-timeout',
  'heartbeat-timeout',
)
_ADDRESS = re.compile(r'^\[?[A-Za-z0-9_.:-]+?\]?:(\d{1,5})$')


def check_train(s: Section) -> None:
  """Every range and choice check of the train settings, in one place
  (run when a section is read). Checks that need the devices (the batch
  splits across them) are made when the run is planned.

  Raises:
    UserError: naming the setting, its value and the fix.
  """
  where = s.source
  for key in AT_LEAST_ONE:
    if s[key] < 1:
      raise UserError(f'{where}: train.{key} must be at least 1 (got {s[key]})')
  if s['vocab-size'] < 16:
    raise UserError(
      f'{where}: train.vocab-size {s["vocab-size"]} is too small; use at '
      'least 16 (the default is 500)'
    )
  if not 0 <= s['seed'] < 2**31:
    raise UserError(
      f'{where}: train.seed {s["seed"]} must be between 0 and {2**31 - 1}'
    )
  if s['windows'] not in WINDOWS:
    raise UserError(
      f'{where}: train.windows {s["windows"]!r} is not "moving" or '
      '"fixed"; use "moving" (the default)'
    )
  if not 0 <= s['pad-fraction'] < 1:
    raise UserError(
      f'{where}: train.pad-fraction {s["pad-fraction"]} must be at least 0 '
      f'and below 1 (the default is {TRAIN_KEYS["pad-fraction"][0]})'
    )
  if not 0 <= s['splice'] <= 1:
    raise UserError(
      f'{where}: train.splice {s["splice"]} must be between 0 and 1 (e.g. '
      '0.5: half the windows)'
    )
  if not 0 < s['replay-share'] < 1:
    raise UserError(
      f'{where}: train.replay-share {s["replay-share"]} must be above 0 and '
      f'below 1 (the default is {TRAIN_KEYS["replay-share"][0]})'
    )
  if s['window'] < 0:
    raise UserError(
      f"{where}: train.window {s['window']} must be 0 (the model's whole "
      'context) or a number of tokens'
    )
  if s['epochs'] < 0:
    raise UserError(
      f'{where}: train.epochs {s["epochs"]} must be 0 (use steps) or more'
    )
  if s['eval-data'] is None and not 0 <= s['eval-fraction'] < 1:
    raise UserError(
      f'{where}: eval-fraction {s["eval-fraction"]} must be at least 0 '
      'and below 1 (e.g. 0.05)'
    )
  _check_processes(s)


def _check_processes(s: Section) -> None:
  """The multi-host settings describe a possible run."""
  where = s.source
  coordinator = (s['coordinator'] or '').strip()
  n, i = s['num-processes'], s['process-id']
  if not 0 <= i < n:
    raise UserError(
      f'{where}: train.process-id {i} must be between 0 and '
      f'num-processes - 1 = {n - 1}; number the processes 0..{n - 1}, '
      "the coordinator's host being 0"
    )
  if coordinator in ('', 'auto'):
    if n > 1 and coordinator == '':
      raise UserError(
        f'{where}: train.num-processes is {n} but no coordinator is set; '
        'set coordinator to "HOST:PORT" of process 0 (or "auto" on a TPU '
        'pod slice, SLURM or Open MPI)'
      )
    return
  m = _ADDRESS.match(coordinator)
  if not m or not 0 < int(m.group(1)) < 65536:
    raise UserError(
      f'{where}: train.coordinator {coordinator!r} is not HOST:PORT; use '
      "the address of process 0's machine and a free port, e.g. "
      '"10.0.0.2:1234" (or "auto")'
    )
  if n < 2:
    raise UserError(
      f'{where}: train.coordinator is set but num-processes is {n}; set '
      'num-processes to the number of processes (machines) in the run'
    )


CHECKS = {'train': check_train, 'eval': lambda s: None}


def _type_name(default) -> str:
  if default is None:
    return 'a string or null'
  return {
    bool: 'true or false',
    int: 'an integer',
    float: 'a number',
    str: 'a string',
    list: 'a list of strings',
  }[type(default)]


def _string_list(value, default: list, where: str) -> list:
  """A list of strings from JSON or the command line (a JSON list, or one
  item)."""
  if isinstance(value, str):
    try:
      value = json.loads(value) if value.lstrip().startswith('[') else [value]
    except json.JSONDecodeError:
      value = None
  if isinstance(value, list) and all(isinstance(v, str) for v in value):
    return list(value)
  raise UserError(
    f'{where}: {json.dumps(value)} is not a list of strings (e.g. '
    f'["Hello!", "How are you?"]); the default is {json.dumps(default)}'
  )


def _from_text(value: str, default, where: str):
  """A command-line string as the type of `default` (bool, int, float)."""
  text = value.strip().lower()
  try:
    if isinstance(default, bool):
      if text in ('true', '1', 'yes'):
        return True
      if text in ('false', '0', 'no'):
        return False
      raise ValueError(text)
    return type(default)(text)
  except ValueError:
    raise UserError(
      f'{where}: {value!r} is not {_type_name(default)}; '
      f'the default is {json.dumps(default)}'
    ) from None


def convert(value, default, where: str):
  """Converts `value` to the type of `default`; raises UserError if it can't.

  Args:
    value: The value from JSON or the command line (a string there).
    default: The key's default; its type is the key's type.
    where: Names the key for the error message ("config.json: train.steps").

  Returns:
    The converted value.
  """
  want = type(default)
  if value is None and default is None:
    return None
  if want is list:
    return _string_list(value, default, where)
  if isinstance(value, str) and want is not str and default is not None:
    return _from_text(value, default, where)
  if default is None:
    if isinstance(value, str):
      return value
  elif want is bool:
    if isinstance(value, bool):
      return value
  elif want is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    if isinstance(value, float) and value.is_integer():
      return int(value)
  elif want is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif isinstance(value, want):
    return value
  raise UserError(
    f'{where}: {json.dumps(value)} is not {_type_name(default)}'
    f'; the default is {json.dumps(default)}'
  )


def _unknown(section: str, key: str, keys) -> str:
  close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5)
  hint = f'did you mean "{close[0]}"? ' if close else ''
  return (
    f'unknown key "{section}.{key}"; {hint}known keys: '
    f'{", ".join(sorted(keys))}'
  )


def _key_to_attr(key: str) -> str:
  return key.replace('-', '_')


@dataclasses.dataclass(frozen=True)
class Section:
  """Settings of one config section, keyed as in JSON (`out-dir`)."""

  values: dict[str, Any]
  source: str
  given: frozenset = frozenset()  # Keys set in the file or on the command line.

  def __getitem__(self, key: str):
    return self.values[key]


def _read_section_data(path: str, section: str) -> dict:
  """The settings of `section` in the JSON file `path` (strict: valid
  JSON, no key twice, only the known sections)."""
  text = files.read_text(path, 'JSON')

  def no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
      if key in seen:
        raise UserError(
          f'{path}: "{key}" is given twice in one object; keep one (JSON '
          'would silently use the last)'
        )
      seen[key] = value
    return seen

  try:
    raw = json.loads(text, object_pairs_hook=no_duplicates)
  except json.JSONDecodeError as e:
    raise UserError(
      f'{path}:{e.lineno}:{e.colno}: not valid JSON '
      f'({e.msg}); compare with config.EXAMPLE.json'
    ) from None
  if not isinstance(raw, dict):
    raise UserError(
      f'{path}: the top level must be an object with '
      f'"train" and "eval" sections'
    )
  unknown = sorted(set(raw) - set(SECTIONS))
  if unknown:
    raise UserError(
      f'{path}: unknown section {unknown[0]!r}; the sections '
      f'are "train" and "eval"'
    )
  if section == 'train' and 'train' not in raw:
    raise UserError(
      f'{path}: no "train" section; train.py reads its settings from '
      '{"train": {...}} (see config.EXAMPLE.json)'
    )
  data = raw.get(section, {})
  if not isinstance(data, dict):
    raise UserError(f'{path}: "{section}" must be an object of settings')
  return data


def read_section(
  path: str | None,
  section: str,
  overrides: dict[str, Any],
  required: bool = False,
) -> Section:
  """Reads one section of a config file, applies overrides, checks types.

  Args:
    path: The JSON file; None means `config.json` in the working directory
      if it exists, else defaults only.
    section: 'train' or 'eval'.
    overrides: key -> value from the command line (None values ignored).
    required: If True a missing file is an error even when path is None.

  Returns:
    A `Section` with every key of the section.
  """
  keys = SECTIONS[section]
  explicit = path is not None
  path = path or 'config.json'
  data: dict[str, Any] = {}
  if os.path.exists(path):
    data = _read_section_data(path, section)
  elif explicit or required:
    raise UserError(
      f'{path}: no such config file; copy config.EXAMPLE.json '
      f'to config.json and edit it'
    )
  values = {}
  for key, value in data.items():
    if key not in keys:
      raise UserError(f'{path}: {_unknown(section, key, keys)}')
    values[key] = convert(value, keys[key][0], f'{path}: {section}.{key}')
  for key, value in overrides.items():
    if value is not None:
      values[key] = convert(value, keys[key][0], f'--{key}')
  full = {k: values.get(k, default) for k, (default, _) in keys.items()}
  found = Section(
    full, path if os.path.exists(path) else '(defaults)', frozenset(values)
  )
  CHECKS[section](found)
  return found


def from_values(
  section: str, values: dict[str, Any], source: str = '(settings)'
) -> Section:
  """A Section from defaults and `values` only (no file is read)."""
  keys = SECTIONS[section]
  for key in values:
    if key not in keys:
      raise UserError(f'{source}: {_unknown(section, key, keys)}')
  full = {
    k: convert(values[k], d, f'{source}: {section}.{k}') if k in values else d
    for k, (d, _) in keys.items()
  }
  found = Section(full, source, frozenset(values))
  CHECKS[section](found)
  return found


def add_arguments(parser: argparse.ArgumentParser, section: str):
  """Adds a `--key` option for every key of `section` (all default None)."""
  for key, (default, text) in SECTIONS[section].items():
    parser.add_argument(
      f'--{key}',
      dest=_key_to_attr(key),
      default=None,
      metavar={bool: 'BOOL', int: 'N', float: 'X', list: 'JSON'}.get(
        type(default), 'TEXT'
      ),
      help=f'{text} (config default: {json.dumps(default)})',
    )


def overrides_from_args(args: argparse.Namespace, section: str):
  return {key: getattr(args, _key_to_attr(key)) for key in SECTIONS[section]}


def from_args(args, section: str) -> Section:
  """The `section` of the config file `args.config` names (or
  ./config.json), with the command line's overrides on top."""
  return read_section(args.config, section, overrides_from_args(args, section))
