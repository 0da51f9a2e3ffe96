"""Does a model know the text, or where the text sat in its windows?

A model trained on windows cut at the same offsets every epoch can learn
text by its absolute position (the axial position embeddings make that
easy): it then scores a training window well only where it was seen. This
check takes the windows of a run's last training steps and scores each
(teacher-forced, no dropout) as trained and moved along the stream by a
few tokens; a model that learned the text scores them about the same.

`measure` also scores the whole data folder the way `evaluate.py
--perplexity` does (fixed windows from its first token) for comparison with
the final training loss.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from src.config import jsonconfig
from src.core import rundir
from src.core.errors import UserError
from src.inference import decoding, scoring
from src.training import plan

SHIFTS = (0, 1, 7, 64)


def run_settings(run_dir: str, data: str | None = None) -> jsonconfig.Section:
  """The `train` settings a run was trained with (its `settings.json`),
  pointed at `run_dir` (and at `data` if given)."""
  path = os.path.join(run_dir, rundir.SETTINGS)
  if not os.path.isfile(path):
    raise UserError(
      f'{path}: missing; {run_dir!r} is not a training run of this version '
      '(train into it with python train.py --out-dir ...)'
    )
  values = jsonconfig.read_section(path, 'train', {}).values
  values = dict(values, **{'out-dir': run_dir})
  values['gin'] = os.path.join(run_dir, rundir.MODEL_GIN)
  if data is not None:
    values['data'] = data
  return jsonconfig.from_values('train', values, path)


def split(run_dir: str, data: str | None = None):
  """`(training, held-out)` conversations as the run split them (whole
  conversations, by its seed and eval-fraction, or its eval-data)."""
  from src.data import chatformat, tokenizer, windows

  settings = run_settings(run_dir, data)
  tok = tokenizer.load(run_dir)
  convs = chatformat.read_data(settings['data'], markers=tok.markers)
  if settings['eval-data'] is not None:
    held = chatformat.read_data(settings['eval-data'], markers=tok.markers)
    return convs, held
  lengths = [len(tok.encode_conversations([c])) for c in convs]
  ends = np.cumsum(lengths)
  _, held_spans, _ = windows.split_conversations(
    ends, settings['eval-fraction'], settings['seed']
  )
  if held_spans is None:
    return convs, []
  held_ends = set(held_spans[:, 1].tolist())
  train = [c for c, e in zip(convs, ends) if int(e) not in held_ends]
  return train, [c for c, e in zip(convs, ends) if int(e) in held_ends]


def held_out_loss(run_dir: str, data: str | None = None) -> float | None:
  """The `evaluate.py --perplexity` loss of the run's held-out
  conversations (the same procedure whatever the training windows)."""
  import tempfile

  from src.data import chatformat, tokenizer

  _, held = split(run_dir, data)
  if not held:
    return None
  markers = tokenizer.load(run_dir).markers
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'held-out.txt')
    with open(path, 'w', encoding='utf-8') as f:
      f.write(
        '\n'.join(chatformat.format_conversation(c, markers) for c in held)
      )
    return scoring.evaluate(run_dir, path, show_progress=False)['loss']


def final_training_loss(run_dir: str) -> float | None:
  """The last `training/loss` TensorBoard logged (mean of the last steps)."""
  from src.storage import eventfile

  points = eventfile.scalars(
    os.path.join(run_dir, rundir.TRAIN_EVENTS), 64, 1 << 16, lambda t: None
  ).get('training/loss')
  return float(points[max(points)]) if points else None


def window_losses(run_dir: str, data=None, last_steps=64, shifts=SHIFTS):
  """Mean loss of the windows of the run's last `last_steps` steps.

  Returns:
    `{shift: nats per token}`, the windows moved by `shift` tokens along
    the stream of the epoch they were trained in (0: as trained).
  """
  settings = run_settings(run_dir, data)
  run = plan.prepare(settings, log=lambda line: None)
  batches = run.train_batches
  end = run.start_step
  if end == 0:
    raise UserError(f'{run_dir}: no checkpoint yet; train the run first')
  _, _, layer, _ = decoding.load_run(run_dir, 'eval')
  forward = scoring.forward_fn(layer)

  windows = []
  for step in range(max(0, end - last_steps), end):
    windows.extend(batches.windows(step))
  out = {}
  for shift in shifts:
    ids, w = batches.rows(windows, shift)
    total, count = 0.0, 0.0
    for row, row_w in zip(ids, w):
      logits = np.asarray(forward(row[None]))[0]
      losses = scoring.token_losses(logits, row)
      total += float((losses * row_w).sum())
      count += float(row_w.sum())
    out[shift] = total / max(count, 1.0)
  return out


def measure(run_dir: str, data=None, last_steps: int = 64) -> dict:
  """Window losses at every shift, the data's perplexity-pass loss and the
  final training loss, with the issue's two ratios."""
  settings = run_settings(run_dir, data)
  shifted = window_losses(run_dir, data, last_steps)
  scored = scoring.evaluate(run_dir, settings['data'], show_progress=False)
  train_loss = final_training_loss(run_dir)
  held = held_out_loss(run_dir, data)
  base = shifted[0]
  return {
    'run': run_dir,
    'windows': settings['windows'],
    'pad_fraction': settings['pad-fraction'],
    'window_loss': shifted,
    'shift_ratio': {k: v / base for k, v in shifted.items() if k},
    'data_loss': scored['loss'],
    'final_train_loss': train_loss,
    'held_out_loss': held,
    'data_vs_train': (scored['loss'] / train_loss if train_loss else math.nan),
  }


def summary(result: dict) -> str:
  w = result['window_loss']
  parts = [f'shift {k}: {v:.3f}' for k, v in w.items()]
  worst = max(abs(r - 1) for r in result['shift_ratio'].values())
  return (
    f'{result["run"]} ({result["windows"]} windows): window loss '
    + ', '.join(parts)
    + f' (worst shift {100 * worst:.1f}% off); data loss '
    f'{result["data_loss"]:.3f} vs final training loss '
    f'{result["final_train_loss"]:.3f} '
    f'({100 * (result["data_vs_train"] - 1):+.1f}%); held-out loss '
    + (
      f'{result["held_out_loss"]:.3f}'
      if result['held_out_loss'] is not None
      else 'none (nothing held out)'
    )
  )


def to_json(result: dict) -> str:
  return json.dumps(result, indent=2, default=float)
