"""JSON exports read as a stream (ijson): objects at chosen paths are built
one at a time, so a 200 MB export never sits in memory whole."""

from __future__ import annotations

import ijson

from src.core.errors import UserError

MAX_DEPTH = 256  # Arrays and objects nested in an export, at most.
BUFFER = 1 << 20  # Bytes read at a time: long strings in near-linear time.


def objects(binary, path: str, wanted: set[str], marks: set[str] = frozenset()):
  """Yields `(prefix, value)` for every object at a prefix in `wanted`
  (ijson's dotted paths, e.g. 'messages.item'), and `(prefix, value)` for
  every string or number at a prefix in `marks` (a chat's name), in file
  order; `(prefix, None)` when an array at a prefix in `marks` starts.

  Memory does not grow with the nesting: the path is kept as a list (its
  dotted prefix is made only at the depths `wanted` and `marks` reach),
  and nesting deeper than MAX_DEPTH is refused with one line.

  Raises:
    UserError: the file is not valid JSON (naming where it breaks), or
      nested deeper than any export is.
  """
  deepest = max((p.count('.') + 1 for p in (*wanted, *marks)), default=0)
  keys: list = []  # The position: a map's current key, or 'item'.
  builder, depth, found = None, 0, ''
  events = ijson.basic_parse(binary, use_float=True, buf_size=BUFFER)
  try:
    for event, value in events:
      if event == 'map_key':
        keys[-1] = value
      elif event in ('end_map', 'end_array'):
        keys.pop()
      if builder is not None:
        builder.event(event, value)
        if event == 'end_map' and len(keys) == depth:
          yield found, builder.value
          builder = None
      elif event not in ('map_key', 'end_map', 'end_array'):
        prefix = '.'.join(keys) if len(keys) <= deepest else None
        if event == 'start_map' and prefix in wanted:
          builder, depth, found = ijson.ObjectBuilder(), len(keys), prefix
          builder.event(event, value)
        elif prefix in marks:
          if event == 'start_array':
            yield prefix, None
          elif event in ('string', 'number'):
            yield prefix, value
      if event in ('start_map', 'start_array'):
        if len(keys) >= MAX_DEPTH:
          raise UserError(
            f'{path}: JSON nested more than {MAX_DEPTH} deep, which no chat '
            'export is; give the file the app exported, unchanged'
          )
        keys.append('' if event == 'start_map' else 'item')
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
