"""A run's curves, shared with its export: scalars, a picture, TensorBoard.

An export carries `curves.json`: the run's training and held-out scalars
(loss, accuracy, learning rate, tokens/s, ...: every scalar TensorBoard
logged; no sample replies, which can quote private chats), at most
`MAX_POINTS` points a tag, and `loss.png`, its training and held-out loss
by step. A run fine-tuned from the export writes the curves again as
TensorBoard event files in its out-dir (`pretrained-NAME/train`, `/eval`),
so `tensorboard --logdir runs/mine` shows both runs side by side.

`curves.json` comes from someone else: it is read bounded (`MAX_BYTES`),
never through a link, and checked field by field; a damaged one is one
line and the model still loads. A run folder's event files are read only
when none is a link or a special file.
"""

from __future__ import annotations

import math
import os
import sys

from src.core import files, rundir
from src.core.errors import UserError

FORMAT = 'jade-v8-curves'
CURVES = rundir.CURVES
PICTURE = rundir.CURVES_PICTURE
MAX_BYTES = 4 * files.MB
MAX_TAGS = 64  # Per part (train, eval).
MAX_POINTS = 2000  # Per tag; longer runs are thinned evenly.
PARTS = ('train', 'eval')  # The run's TensorBoard folders.
# The tags of the picture and the card's table, per part.
TRAIN_LOSS = ('running/loss', 'training/loss', 'metrics/loss')
EVAL_LOSS = ('metrics/loss',)


def _thin(points: list, limit: int = MAX_POINTS) -> list:
  """At most `limit` of `points`, evenly spread, the last one kept."""
  if len(points) <= limit:
    return points
  step = len(points) / (limit - 1)
  return [points[int(i * step)] for i in range(limit - 1)] + [points[-1]]


def collect(run_dir: str, until: int | None = None) -> dict | None:
  """The scalars of a run's TensorBoard event files (`run_dir/train`,
  `run_dir/eval`) up to step `until` (default all), or None if it logged
  none. The files are read with bounds (`src.storage.eventfile`): a
  damaged or crafted one is a note, never a crash."""
  from src.storage import eventfile

  def note(text):
    print(
      f'note: {text}; the curves keep what was read before it', file=sys.stderr
    )

  parts = {}
  for part in PARTS:
    folder = os.path.join(run_dir, part)
    if not os.path.isdir(folder) or os.path.islink(folder):
      continue
    found = files.links_inside(folder)
    if found:  # Never read through a link, never block on a FIFO.
      path, problem = found[0]
      print(
        f'note: {path} {problem}; the curves of {folder} are left out',
        file=sys.stderr,
      )
      continue
    read = eventfile.scalars(folder, MAX_TAGS, MAX_POINTS, note)
    tags = {}
    for tag in sorted(read):
      points = {
        step: float(f'{value:.6g}')
        for step, value in read[tag].items()
        if math.isfinite(value) and (until is None or step <= until)
      }
      if points:
        tags[tag] = _thin(sorted([s, v] for s, v in points.items()))
    if tags:
      parts[part] = tags
  if not parts:
    return None
  return {'format': FORMAT, **parts}


def _finite(value) -> bool:
  """Whether `value` is a JSON number within float range (a 400-digit
  integer is not: `float()` of it overflows)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return False
  try:
    return math.isfinite(float(value))
  except OverflowError:
    return False


def parse(data: bytes, path: str) -> dict:
  """`curves.json`'s content, checked: a UserError names what is wrong."""
  if len(data) > MAX_BYTES:
    raise UserError(
      f'{path}: more than {MAX_BYTES >> 20} MB, more than curves hold; '
      'the export is damaged: download it again'
    )
  try:
    curves = files.parse_json(data.decode('utf-8'), path)
    if not isinstance(curves, dict) or curves.get('format') != FORMAT:
      raise ValueError(f'its format is not {FORMAT!r}')
    if not isinstance(curves.get('run', ''), str):
      raise ValueError('its run name is not text')
    for part in PARTS:
      tags = curves.get(part, {})
      if not isinstance(tags, dict) or len(tags) > MAX_TAGS:
        raise ValueError(f'{part} is not an object of at most {MAX_TAGS} tags')
      for tag, points in tags.items():
        if len(tag) > 200 or not isinstance(points, list):
          raise ValueError(f'{part} tag {tag[:40]!r} is not a list')
        if len(points) > MAX_POINTS:
          raise ValueError(f'{part} tag {tag[:40]!r} has over {MAX_POINTS}')
        for point in points:
          if not (
            isinstance(point, list)
            and len(point) == 2
            and isinstance(point[0], int)
            and not isinstance(point[0], bool)
            and 0 <= point[0] < 1 << 53
            and _finite(point[1])
          ):
            raise ValueError(f'{part} tag {tag[:40]!r} has a bad point')
  except (ValueError, UnicodeDecodeError, RecursionError) as e:
    raise UserError(
      f'{path}: damaged ({str(e)[:120]}); the curves are left out (the '
      'model itself is fine)'
    ) from None
  return curves


def read(path: str) -> dict:
  """A `curves.json` from a folder (see `parse`)."""
  return parse(files.read_regular(path, MAX_BYTES), path)


def series(curves: dict, part: str, tags: tuple[str, ...]):
  """`(tag, points)` of the one of `tags` with the most points in `part`
  (the first on a tie); `(None, [])` if none is there."""
  found = [(tag, curves.get(part, {}).get(tag) or []) for tag in tags]
  tag, points = max(found, key=lambda f: len(f[1]), default=(None, []))
  return (tag, points) if points else (None, [])


def plot(curves: dict, path: str, title: str):
  """Writes `path`: a PNG of the training and held-out loss by step."""
  import matplotlib

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
  try:
    for part, tags, label in (
      ('train', TRAIN_LOSS, 'training loss'),
      ('eval', EVAL_LOSS, 'held-out loss'),
    ):
      tag, points = series(curves, part, tags)
      if points:
        steps, values = zip(*points)
        marker = 'o' if len(points) < 30 else None
        ax.plot(steps, values, label=f'{label} ({tag})', marker=marker)
    ax.set_xlabel('step')
    ax.set_ylabel('loss (nats per token)')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format='png')
  finally:
    plt.close(fig)


def to_tensorboard(curves: dict, log_dir: str):
  """Writes the curves as TensorBoard event files in `log_dir/train` and
  `log_dir/eval` (a folder that must not exist yet)."""
  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.summary.writer.event_file_writer import EventFileWriter

  for part in PARTS:
    tags = curves.get(part)
    if not tags:
      continue
    folder = os.path.join(log_dir, part)
    os.makedirs(folder)
    writer = EventFileWriter(folder, 10, 120, '')
    try:
      for tag, points in tags.items():
        for step, value in points:
          value = summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
          writer.add_event(
            event_pb2.Event(
              step=int(step), summary=summary_pb2.Summary(value=[value])
            )
          )
    finally:
      writer.close()


def final_rows(curves: dict) -> list[tuple[str, str]]:
  """`(what, value)` rows of the last figures, for a model card."""
  rows = []
  for part, tag, what in (
    ('train', 'training/loss', 'training loss'),
    ('train', 'running/accuracy', 'training accuracy'),
    ('eval', 'metrics/loss', 'held-out loss'),
    ('eval', 'metrics/accuracy', 'held-out accuracy'),
    ('train', 'running/tokens_per_second', 'tokens per second'),
    ('train', 'training/learning_rate', 'learning rate'),
  ):
    points = curves.get(part, {}).get(tag)
    if points:
      step, value = points[-1]
      shown = f'{value:,.0f}' if abs(value) >= 1000 else f'{value:.4g}'
      rows.append((what, f'{shown} at step {step}'))
  return rows


def last_eval(curves: dict | None) -> tuple[int, float] | None:
  """(step, held-out loss) of the last evaluation the curves hold."""
  points = (curves or {}).get('eval', {}).get('metrics/loss')
  return (int(points[-1][0]), float(points[-1][1])) if points else None


def where(model_dir: str) -> str | None:
  """Where a model folder's curves are, in words (None when it has none):
  an export's picture and scalars, or a run's TensorBoard folder."""
  names = [
    n
    for n in (PICTURE, CURVES)
    if os.path.isfile(os.path.join(model_dir, n))
    and not os.path.islink(os.path.join(model_dir, n))
  ]
  if names:
    return ' and '.join(os.path.join(model_dir, n) for n in names)
  if any(os.path.isdir(os.path.join(model_dir, p)) for p in PARTS):
    return f'tensorboard --logdir {model_dir}'
  return None
