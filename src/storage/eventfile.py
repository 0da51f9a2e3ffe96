"""TensorBoard event files read with bounds: the scalars of a folder.

A run folder may come from someone else (`train.py --init-from RUN`,
`python export.py RUN`), so its event files are untrusted input.
TensorFlow's native record reader allocates whatever a record's length
field claims (a length of 2**60 with a valid header checksum ends the
process with SIGSEGV), and TensorBoard's accumulator keeps every tag. Here
the TFRecord framing is read in Python:

    uint64 length | uint32 masked CRC-32C of length | data | uint32 CRC of data

A record's length is checked against what is left of the file before
anything is allocated; records over `MAX_RECORD` (scalars are ~100 bytes)
are skipped without being read; both checksums are checked; at most
`MAX_BYTES` of a folder's files are read, `max_tags` tags kept and
`max_points` points a tag (thinned evenly beyond that). The data is parsed
with TensorBoard's `Event` protobuf (no TensorFlow). Anything wrong ends
that file's reading with one note; what was read before it is kept.
"""

from __future__ import annotations

import os
import stat
import struct

from src.core import files
from src.core.errors import UserError

MAX_RECORD = 1 << 20  # A scalar event is ~100 bytes; text samples a few KB.
MAX_BYTES = 64 * files.MB  # Read of one folder's event files, at most.
HEADER = 12  # uint64 length + uint32 masked CRC.


def _masked_crc(data: bytes) -> int:
  from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
    masked_crc32c,
  )

  return masked_crc32c(data)


def event_files(folder: str) -> list[str]:
  """The TensorBoard event files of `folder` (names holding `tfevents`, as
  TensorBoard reads them), sorted: regular files only, never a link."""
  found = []
  for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name)
    if 'tfevents' in name and stat.S_ISREG(os.lstat(path).st_mode):
      found.append(path)
  return found


def records(f, size: int, budget: list[int]):
  """`(data, problem)` of each record of the open file `f` of `size` bytes:
  `data` is None for a record skipped as too big; a `problem` (text) ends
  the file. `budget[0]` is the bytes left to read; it is decreased."""
  pos = 0
  while pos < size:
    if size - pos < HEADER:
      yield None, f'a record is cut at byte {pos}'
      return
    header = f.read(HEADER)
    length, crc = struct.unpack('<QI', header)
    if _masked_crc(header[:8]) != crc:
      yield None, f'the record at byte {pos} has a bad length checksum'
      return
    if length + 4 > size - pos - HEADER:
      yield (
        None,
        (
          f'the record at byte {pos} claims {length} bytes, more than the '
          'file holds'
        ),
      )
      return
    pos += HEADER + length + 4
    if length > MAX_RECORD:  # Not a scalar: skipped, never read.
      f.seek(pos)
      yield None, None
      continue
    if length + 4 > budget[0]:
      yield None, f'over {MAX_BYTES >> 20} MB of events; the rest is left out'
      return
    budget[0] -= length + 4
    data = f.read(length)
    (crc,) = struct.unpack('<I', f.read(4))
    if _masked_crc(data) != crc:
      yield None, f'the record at byte {pos - length - 4} has a bad checksum'
      return
    yield data, None


def _scalar(value) -> float | None:
  """The number of a summary value: a `simple_value`, or a scalar tensor
  of floats (TensorBoard's newer summaries); None for anything else."""
  kind = value.WhichOneof('value')
  if kind == 'simple_value':
    return float(value.simple_value)
  if kind == 'tensor':
    tensor = value.tensor
    if tensor.tensor_shape.dim:
      return None
    for field in (tensor.float_val, tensor.double_val):
      if len(field) == 1:
        return float(field[0])
    if len(tensor.tensor_content) == 4 and tensor.dtype == 1:  # DT_FLOAT.
      return struct.unpack('<f', tensor.tensor_content)[0]
  return None


class _Points:
  """Points by step of each of at most `max_tags` tags (the last value of
  a step wins, as a resumed run logs a step again); a tag's points beyond
  `2 * max_points` are thinned to every other one."""

  def __init__(self, max_tags: int, max_points: int):
    self.max_tags, self.max_points = max_tags, max_points
    self.tags: dict[str, dict[int, float]] = {}
    self.left_out = 0

  def add(self, tag: str, step: int, value: float):
    points = self.tags.get(tag)
    if points is None:
      if len(self.tags) >= self.max_tags:
        self.left_out += 1
        return
      points = self.tags[tag] = {}
    points[step] = value
    if len(points) > 2 * self.max_points:
      kept = sorted(points.items())[::2]
      points.clear()
      points.update(kept)


def scalars(folder: str, max_tags: int, max_points: int, note) -> dict:
  """`{tag: {step: value}}` of the scalars in `folder`'s event files (see
  the module docstring); `note(text)` is told of each file that could not
  be read to its end."""
  from google.protobuf.message import DecodeError
  from tensorboard.compat.proto import event_pb2

  found = _Points(max_tags, max_points)
  budget = [MAX_BYTES]
  for path in event_files(folder):
    try:
      with files.open_regular(path, 1 << 62) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        for data, problem in records(f, size, budget):
          if problem:
            note(f'{path}: {problem}')
            break
          if data is None:
            continue
          event = event_pb2.Event.FromString(data)
          if not event.HasField('summary') or not 0 <= event.step < 1 << 53:
            continue
          for value in event.summary.value:
            number = _scalar(value)
            if number is not None and len(value.tag) <= 200:
              found.add(value.tag, int(event.step), number)
    except (OSError, DecodeError, RecursionError) as e:
      note(f'{path}: not a readable event file ({str(e)[:80]})')
    except UserError as e:
      note(str(e))
  if found.left_out:
    note(f'{folder}: more than {max_tags} scalar tags; the rest are left out')
  return found.tags
