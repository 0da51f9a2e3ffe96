"""The Cornell Movie-Dialogs Corpus (a folder with `movie_lines.txt` and
`movie_conversations.txt`).

  movie_lines.txt:
    L1045 +++$+++ u0 +++$+++ m0 +++$+++ BIANCA +++$+++ They do not!
  movie_conversations.txt:
    u0 +++$+++ u2 +++$+++ m0 +++$+++ ['L194', 'L195', 'L196']

Both files are ISO-8859-1. The speaker of a conversation's first line is
the user, the other character the AI.
"""

from __future__ import annotations

import ast
import os

from src.core.errors import UserError
from src.data.importers.base import AI, USER, Skip

SEPARATOR = ' +++$+++ '
LINES, CONVERSATIONS = 'movie_lines.txt', 'movie_conversations.txt'


def sources(inputs: list[str]) -> list[str]:
  for folder in inputs:
    for name in (LINES, CONVERSATIONS):
      if not os.path.isfile(os.path.join(folder, name)):
        raise UserError(
          f'{os.path.join(folder, name)}: no such file; give the folder of '
          f'the Cornell Movie-Dialogs Corpus (it holds {LINES} and '
          f'{CONVERSATIONS})'
        )
  return list(inputs)


def _rows(path: str, n_fields: int):
  """Yields (where, fields | Skip) for each non-blank line of `path`."""
  with open(path, 'rb') as f:
    raw = f.read()
  text = raw.decode('iso-8859-1')  # Every byte is a character: no errors.
  for no, line in enumerate(text.split('\n'), 1):
    line = line.rstrip('\r')
    if not line.strip():
      continue
    fields = line.split(SEPARATOR)
    if len(fields) < n_fields:
      yield (
        f'{path}:{no}',
        Skip(
          f'{len(fields)} field(s), expected {n_fields} separated by '
          f'"{SEPARATOR.strip()}"'
        ),
      )
      continue
    # The text (the last field) may itself contain the separator.
    yield (
      f'{path}:{no}',
      fields[: n_fields - 1] + [SEPARATOR.join(fields[n_fields - 1 :])],
    )


def read(folder: str, report, **_):
  """Yields (where, turns | Skip): bad lines, then each conversation."""
  del report
  lines = {}
  for where, fields in _rows(os.path.join(folder, LINES), 5):
    if isinstance(fields, Skip):
      yield where, fields
      continue
    line_id, character, _, _, text = fields
    lines[line_id.strip()] = (character.strip(), text.strip())
  for where, fields in _rows(os.path.join(folder, CONVERSATIONS), 4):
    if isinstance(fields, Skip):
      yield where, fields
      continue
    try:
      ids = ast.literal_eval(fields[3].strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
      ids = None
    if not (
      isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids)
    ):
      yield where, Skip(f'line ids {fields[3].strip()[:40]!r} are not a list')
      continue
    missing = [i for i in ids if i not in lines]
    if missing:
      yield where, Skip(f'line id {missing[0]} is not in {LINES}')
      continue
    first = lines[ids[0]][0]
    yield (
      where,
      [(USER if lines[i][0] == first else AI, lines[i][1]) for i in ids],
    )
