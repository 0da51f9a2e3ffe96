"""JSON exports read as a stream (ijson): objects at chosen paths are built
one at a time, so a 200 MB export never sits in memory whole."""

from __future__ import annotations

import ijson

from src.core.errors import UserError


def objects(binary, path: str, wanted: set[str], marks: set[str] = frozenset()):
  """Yields `(prefix, value)` for every object at a prefix in `wanted`
  (ijson's dotted paths, e.g. 'messages.item'), and `(prefix, value)` for
  every string or number at a prefix in `marks` (a chat's name), in file
  order; `(prefix, None)` when an array at a prefix in `marks` starts.

  Raises:
    UserError: the file is not valid JSON (naming where it breaks).
  """
  builder = None
  inside = None
  events = ijson.parse(binary, use_float=True)
  try:
    for prefix, event, value in events:
      if builder is not None:
        builder.event(event, value)
        if prefix == inside and event == 'end_map':
          yield inside, builder.value
          builder = None
        continue
      if event == 'start_map' and prefix in wanted:
        builder = ijson.ObjectBuilder()
        builder.event(event, value)
        inside = prefix
      elif prefix in marks:
        if event == 'start_array':
          yield prefix, None
        elif event in ('string', 'number'):
          yield prefix, value
  except ijson.JSONError as e:
    raise UserError(
      f'{path}: not valid JSON ({str(e).splitlines()[0][:120]}); give the '
      'file the app '
      'exported, unchanged'
    ) from None
  except UnicodeDecodeError:
    raise UserError(
      f'{path}: not UTF-8 text; give the file the app exported, unchanged'
    ) from None
