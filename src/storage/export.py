"""A shareable, weights-only copy of a training run.

  python export.py runs/pretrained exports/pretrained [--step N]

writes a folder another person can chat with (`python evaluate.py
--model-dir FOLDER`) and fine-tune from (`python train.py --init-from
FOLDER ...`): `model.safetensors` (the weights, no optimizer slots, no
pickle), `tokenizer.model` and `tokenizer.json`, `model.gin` (the model's
settings only), `export.json` (metadata and every file's SHA-256) and a
`README.md` model card. The folder is written beside its final name and
renamed when complete; an existing folder is never overwritten.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile

import numpy as np

from src.core import files, rundir
from src.core.errors import UserError
from src.data import tokenizer
from src.model import ginconf, losses
from src.storage import checkpoints, curves, modelfolder, snapshots

PACKAGES = ('trax', 'jax', 'jaxlib', 'sentencepiece', 'safetensors', 'numpy')


def _versions() -> dict:
  found = {'python': platform.python_version()}
  for name in PACKAGES:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def _last_eval(meta: dict) -> tuple[int, float] | None:
  """(step, loss) of the run's last held-out evaluation, from Trax's
  history in the checkpoint metadata."""
  try:
    values = meta['history']['_values']['eval']['metrics/loss']
    step, loss = values[-1]
    return int(step), float(loss)
  except (KeyError, IndexError, TypeError, ValueError, AttributeError):
    return None


def _base_model(run_dir: str) -> str | None:
  """What a fine-tuned run started from (its init.json): the name its
  export declared, else the start of its weights' SHA-256; None for a run
  trained from scratch. Never the folder it was read from (a local
  path)."""
  path = os.path.join(run_dir, rundir.INIT)
  try:
    record = files.read_json(path)
  except (OSError, UserError):
    return None
  if not isinstance(record, dict):
    return None
  name = record.get('name')
  if isinstance(name, str) and name.strip():
    return clean_name(name)
  digest = record.get('weights_sha256')
  if isinstance(digest, str) and digest:
    return f'jade-v8 weights sha256:{clean_name(digest)[:16]}'
  return None


DEFAULT_NAME = 'Jade V8 chat model'
# Numbers of the token cache's meta.json that describe the data.
DATA_COUNTS = ('files', 'conversations', 'turns', 'tokens', 'bytes')
clean_name = modelfolder.clean_name


def describe_data(run_dir: str) -> dict | None:
  """What the run trained on, by what it is and never by name or path:
  the line format, its file, conversation, turn and token counts and a
  hash of its bytes (the run's token cache `cache/train-*/meta.json`);
  None when the run has no such cache."""
  root = os.path.join(run_dir, rundir.CACHE)
  try:
    names = sorted(n for n in os.listdir(root) if n.startswith('train-'))
  except OSError:
    return None
  for name in names:
    try:
      meta = files.read_json(os.path.join(root, name, 'meta.json'))
    except (OSError, UserError):
      continue
    if not isinstance(meta, dict):
      continue
    described = {'format': 'jade-v8 conversations (line format)'}
    for key in DATA_COUNTS:
      value = meta.get(key)
      if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        described[key] = value
    digest = meta.get('data_sha256')
    if isinstance(digest, str) and len(digest) == 64:
      described['sha256'] = digest
    return described
  return None


def data_text(info: dict) -> str:
  """One line on what the model was trained on, for the card and the
  export's report."""
  parts = []
  data = info.get('data') or {}
  if info.get('datasets'):
    parts.append(', '.join(info['datasets']))  # Cleaned by `export`.
  counts = [
    f'{data[k]:,} {k}' for k in ('conversations', 'tokens') if k in data
  ]
  if counts:
    parts.append(', '.join(counts) + ' in the line format')
  if 'sha256' in data:
    parts.append(f'data sha256 {data["sha256"][:16]}')
  return '; '.join(parts) or 'not recorded'


def _yaml(value) -> str:
  """`value` as a YAML scalar that cannot break out of its line: a JSON
  string (a valid YAML double-quoted scalar), control characters
  escaped."""
  return json.dumps(''.join(c if c.isprintable() else ' ' for c in str(value)))


def front_matter(info: dict) -> str:
  """Hugging Face-style metadata for the top of the model card."""
  lines = ['---', 'library_name: jade-v8']
  if info.get('license'):
    lines.append(f'license: {_yaml(info["license"])}')
  lines += [
    'pipeline_tag: text-generation',
    'tags:',
    '- jade-v8',
    '- reformer',
    '- trax',
    '- conversational',
    '- long-context',
  ]
  if info.get('base_model'):
    lines.append(f'base_model: {_yaml(info["base_model"])}')
  if info.get('datasets'):
    lines.append('datasets:')
    lines += [f'- {_yaml(d)}' for d in info['datasets']]
  lines += [f'context_length: {int(info["context_length"])}', '---', '']
  return '\n'.join(lines)


def _md_code(value, limit: int = 120) -> str:
  """`value` as the inside of a Markdown code span in a table cell: one
  line, no backticks, pipes escaped, at most `limit` characters. Text from
  a run folder never becomes links or instructions in a model card."""
  text = ''.join(c if c.isprintable() else ' ' for c in str(value))
  text = text.replace('`', "'")[:limit]
  return text.replace('|', '\\|')


def _folder_size(folder: str, names=None) -> int:
  names = names if names is not None else os.listdir(folder)
  return sum(os.path.getsize(os.path.join(folder, n)) for n in names)


def _choose(run_dir: str, step: int | None) -> str:
  """The checkpoint folder to export: the latest intact one, or the kept
  snapshot of `step`."""
  if not os.path.isdir(run_dir):
    raise UserError(f'{run_dir}: no such folder; give a training out-dir')
  if modelfolder.is_export(run_dir):
    raise UserError(
      f'{run_dir} is already an export; copy the folder to share it'
    )
  latest, folder, problem = snapshots.verify(run_dir)
  if folder is None:
    raise UserError(
      f'{run_dir}: no checkpoint; train into it first (python train.py '
      f'--out-dir {run_dir})'
    )
  if problem:
    print(
      f'note: the latest checkpoint is damaged ({problem}); exporting the '
      f'intact one at step {latest}',
      file=sys.stderr,
    )
  if step is None or step == latest:
    return folder
  for kept, snap in snapshots.snapshots(run_dir):
    if kept == step and snapshots.check(snap)[0] is not None:
      return snap
  steps = [kept for kept, _ in snapshots.snapshots(run_dir)]
  raise UserError(
    f'{run_dir}: no intact checkpoint of step {step} (kept: '
    f'{", ".join(map(str, steps)) or "none"}); leave out --step for the '
    'latest'
  )


def export(
  run_dir: str,
  out_dir: str,
  step: int | None = None,
  log=print,
  datasets: tuple[str, ...] = (),
  license: str | None = None,  # noqa: A002 (the card's word)
  name: str | None = None,
):
  """Writes the export of `run_dir` (see the module docstring).

  Nothing in the export names a local path, a folder or a data file: the
  data is described by what it is (`describe_data`), the model by `name`.

  Args:
    datasets: Names of the data the model was trained on, for the card's
      metadata (the user's words; nothing is read from them).
    license: The card's license identifier (e.g. "apache-2.0").
    name: The model's name: the card's title and its picture's (default
      `DEFAULT_NAME`; never the folder's name, which may name a person).

  Returns:
    The export's metadata (`export.json`).
  """
  if os.path.lexists(out_dir):
    what = 'is a link' if os.path.islink(out_dir) else 'exists'
    raise UserError(f'{out_dir} {what}; choose a new folder for the export')
  folder = _choose(run_dir, step)  # Verified.
  model = modelfolder.load(
    run_dir,
    run_dir,
    'give a training out-dir',
    checkpoint=folder,
    check_memory=False,
  )
  # bfloat16 weights are stored as float32 (exact), so any reader can
  # load them.
  flat = [
    np.asarray(w, np.float32) if w.dtype.name == 'bfloat16' else np.asarray(w)
    for w in model.flat
  ]
  scalars = curves.collect(run_dir, until=model.step)
  info = _info(run_dir, folder, model, flat, scalars)
  info.update(
    datasets=[clean_name(d) for d in datasets],
    license=license,
    name=clean_name(name) if name and clean_name(name) else None,
  )
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(out_dir)}.')
  try:
    _write(tmp, run_dir, out_dir, model, flat, info, scalars)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  _report(run_dir, out_dir, folder, model.step, info, log)
  return info


def _report(run_dir, out_dir, folder, step, info, log):
  """Two lines: what was exported and its size, and what the card says of
  the model and its data (so the sharer sees it before sharing)."""
  run_size = _folder_size(folder, snapshots.checkpoint_files(folder))
  size = _folder_size(out_dir)
  log(
    f'exported step {step} of {run_dir} to {out_dir}: '
    f'{size / 1e6:.2f} MB (the checkpoint is {run_size / 1e6:.2f} MB with '
    'optimizer slots); '
    f'{info["n_weights"]:,} weights'
  )
  log(
    f'the card calls it {info["name"] or DEFAULT_NAME!r} (--name) and says '
    f'it was trained on: {data_text(info)} (--dataset); no path, folder or '
    'file name of yours is in the export'
  )


def _info(run_dir: str, folder: str, model, flat, scalars) -> dict:
  """`export.json`'s facts (the file listing is added once written)."""
  step, tok = model.step, model.tok
  manifest = snapshots.read_manifest(folder) or {}
  # The last evaluation: the curves hold the final one, which the
  # checkpoint's history (saved first) may not.
  logged = curves.last_eval(scalars)
  evaluated = _last_eval(snapshots.read_meta(folder) or {})
  if logged and (not evaluated or logged[0] > evaluated[0]):
    evaluated = logged
  return {
    'format': modelfolder.EXPORT_FORMAT,
    'step': int(step),
    'context_length': model.setup.max_len,
    'vocab_size': tok.vocab_size,
    'markers': tok.markers.all(),
    'n_weights': int(sum(w.size for w in flat)),
    'n_arrays': len(flat),
    'tokens_trained_on': manifest.get('tokens'),
    'held_out_loss': evaluated and evaluated[1],
    'held_out_perplexity': evaluated and losses.perplexity(evaluated[1]),
    'held_out_step': evaluated and evaluated[0],
    'data': describe_data(run_dir),
    'exported_at': datetime.datetime.now(datetime.UTC).isoformat(
      timespec='seconds'
    ),
    'weights_sha256': checkpoints.weights_digest(flat),
    'versions': _versions(),
    'base_model': _base_model(run_dir),
  }


def _write(tmp, run_dir, out_dir, model, flat, info, scalars):
  """Writes the export's files into the folder `tmp`, `export.json` last
  (every file listed with its size and SHA-256)."""
  from safetensors.numpy import save_file

  step = model.step
  save_file(
    {modelfolder.weight_key(i): w for i, w in enumerate(flat)},
    os.path.join(tmp, modelfolder.EXPORT_WEIGHTS),
    metadata={'format': modelfolder.EXPORT_FORMAT, 'step': str(step)},
  )
  for name in (tokenizer.MODEL_FILE, tokenizer.INFO_FILE):
    data = files.read_regular(os.path.join(run_dir, name), tokenizer.MAX_BYTES)
    with open(os.path.join(tmp, name), 'wb') as f:
      f.write(data)
  with open(os.path.join(tmp, ginconf.MODEL_GIN), 'w', encoding='utf-8') as f:
    f.write(
      f'# Model settings at step {step} (read as data; see README.md).\n'
      + model.gin_text
    )
  if scalars:
    with open(os.path.join(tmp, curves.CURVES), 'w', encoding='utf-8') as f:
      json.dump(scalars, f, separators=(',', ':'))
    curves.plot(
      scalars,
      os.path.join(tmp, curves.PICTURE),
      f'{info["name"] or DEFAULT_NAME}: loss by step',
    )
  with open(os.path.join(tmp, rundir.MODEL_CARD), 'w', encoding='utf-8') as f:
    f.write(model_card(info, model.setup, scalars))
  info['files'] = {
    name: {
      'size': os.path.getsize(os.path.join(tmp, name)),
      'sha256': snapshots.sha256(os.path.join(tmp, name)),
    }
    for name in sorted(os.listdir(tmp))
  }
  snapshots.write_json(os.path.join(tmp, modelfolder.EXPORT_META), info)
  for name in os.listdir(tmp):  # Readable by others: it is for sharing.
    os.chmod(os.path.join(tmp, name), 0o644)


def _curves_text(scalars: dict | None) -> str:
  """The card's section on how the model trained."""
  if not scalars:
    return ''
  rows = '\n'.join(
    f'| {what} | {value} |' for what, value in curves.final_rows(scalars)
  )
  return f"""
## How it trained

![Training and held-out loss by step]({curves.PICTURE})

| final figure | value |
|---|---|
{rows}

`{curves.CURVES}` holds every scalar the run logged (TensorBoard's loss,
accuracy, learning rate, tokens per second). A run fine-tuned from this
folder writes them into its out-dir, so `tensorboard --logdir runs/mine`
shows this run beside yours.
"""


def model_card(info: dict, setup, scalars=None) -> str:
  """The export's README.md: front matter, then the card."""
  loss = info['held_out_loss']
  quality = (
    f'held-out loss {loss:.3f} nats/token (perplexity '
    f'{info["held_out_perplexity"]:.2f}) at step {info["held_out_step"]}'
    if loss is not None
    else 'no held-out evaluation was recorded'
  )
  tokens = info['tokens_trained_on']
  m, a = setup.model, setup.attention
  return (
    front_matter(info)
    + f"""# {_md_code(info.get('name') or DEFAULT_NAME)}

A ReformerLM chat model exported from a Jade V8 training run at step
{info['step']}.

| | |
|---|---|
| trained on | {_md_code(data_text(info))} ({
      f'{tokens:,} tokens seen with loss' if tokens else 'not recorded'
    }) |
| quality | {quality} |
| context | {info['context_length']} tokens |
| model | {m['n_layers']} layers, d_model {m['d_model']}, d_ff {m['d_ff']}, \
{m['n_heads']} heads, {setup.attention_text} ({a.get('n_hashes', '-')} hashes) |
| weights | {info['n_weights']:,} ({info['n_arrays']} arrays) |
| vocabulary | {info['vocab_size']} sentencepiece pieces |
| markers | `{'`, `'.join(_md_code(m, 40) for m in info['markers'])}` |
{_curves_text(scalars)}
## Chat with it

Put this folder where you like (here `MODEL`), then:

    python evaluate.py --model-dir MODEL

## Fine-tune it on your own chats

    python train.py --init-from MODEL --gin gin/finetune.gin \\
      --data data/mine --out-dir runs/mine --steps 1000
    python evaluate.py --model-dir runs/mine

The fine-tune run takes this model's tokenizer and settings; only the
optimizer and schedule come from `gin/finetune.gin`.

## What is in this folder, and what is trusted

- `model.safetensors`: the weights (safetensors: a JSON header and raw
  arrays; loading it runs no code).
- `tokenizer.model`, `tokenizer.json`: the sentencepiece tokenizer.
- `model.gin`: the model's settings, read as data (only `Name.setting =
  value` lines of known settings are accepted).
- `export.json`: step, sizes, package versions and the SHA-256 of every
  file; Jade V8 checks every file against it before loading any.
- `curves.json`, `loss.png` (when the run logged curves): its scalars and
  their picture; a damaged one is left out with a note.
"""
  )
