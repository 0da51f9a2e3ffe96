"""SubRip (`.srt`) subtitles as conversations.

  1
  00:00:01,000 --> 00:00:03,500
  <i>Where were you?</i>

Cues are read in time order; markup (`<i>`, `{\\an8}`) is removed and a
cue's lines are joined with a space. A pause longer than `gap` seconds
starts a new conversation; within one, cues alternate user and AI, the
first being the user's.
"""

from __future__ import annotations

import re

from src.core.errors import UserError
from src.data import chatformat
from src.data.importers.base import AI, USER, Skip, files

sources = files
GAP = 5.0
_TIME = re.compile(
  r'^\s*(\d+):(\d{1,2}):(\d{1,2})[,.](\d{1,3})\s*-->\s*'
  r'(\d+):(\d{1,2}):(\d{1,2})[,.](\d{1,3})'
)
_MARKUP = re.compile(r'<[^>]*>|\{\\[^}]*\}')


def _seconds(h, m, s, ms) -> float:
  return int(h) * 3600 + int(m) * 60 + int(s) + int(ms.ljust(3, '0')) / 1000


def _text(path: str, warn) -> str:
  try:
    return chatformat.read_text(path)
  except UserError as e:
    # Subtitles are often saved in a legacy 8-bit encoding.
    with open(path, 'rb') as f:
      raw = f.read()
    warn(f'{e}; reading it as Windows-1252 instead')
    return raw.decode('cp1252', errors='replace')


def cues(path: str, warn=None):
  """Yields (line, start, end, text) per cue, or (where, Skip) for a cue
  that cannot be read, in file order."""
  text = _text(path, warn or (lambda line: None))
  lines = text.replace('\r\n', '\n').replace('\r', '\n').split('\n')
  block: list[tuple[int, str]] = []
  for no, line in enumerate(lines + [''], 1):
    if line.strip():
      block.append((no, line.strip()))
      continue
    if not block:
      continue
    rows, block = block, []
    if rows[0][1].isdigit() and len(rows) > 1:  # The cue number.
      rows = rows[1:]
    at, timing = rows[0]
    m = _TIME.match(timing)
    if not m:
      yield (
        f'{path}:{at}',
        Skip(
          f'broken time line {timing[:40]!r} (expected '
          '"00:00:01,000 --> 00:00:03,500")'
        ),
      )
      continue
    start, end = _seconds(*m.groups()[:4]), _seconds(*m.groups()[4:])
    words = ' '.join(_MARKUP.sub('', t).strip() for _, t in rows[1:])
    words = ' '.join(words.split())
    if not words:
      continue  # An empty cue (markup only) says nothing.
    yield at, start, end, words


def read(path: str, report, gap: float = GAP, warn=None, **_):
  """Yields (where, turns | Skip): unreadable cues, then conversations."""
  del report
  good = []
  for cue in cues(path, warn):
    if isinstance(cue[1], Skip):
      yield cue
    else:
      good.append(cue)
  good.sort(key=lambda c: (c[1], c[0]))
  conversation: list = []
  last_end = None
  for cue in good + [None]:
    if cue is None or (last_end is not None and cue[1] - last_end > gap):
      if conversation:
        yield (
          f'{path}:{conversation[0][0]}',
          [
            (USER if k % 2 == 0 else AI, c[3])
            for k, c in enumerate(conversation)
          ],
        )
      conversation = []
    if cue is not None:
      conversation.append(cue)
      last_end = cue[2] if last_end is None else max(last_end, cue[2])
