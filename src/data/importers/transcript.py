"""Plain transcripts: `User:` / `Bot:` prefixed lines, blank lines between
conversations, unprefixed lines continuing the message before them."""

from __future__ import annotations

from src.data import chatformat
from src.data.importers.base import AI, USER, Skip, files

sources = files


def read(path: str, report, user_prefix='User:', ai_prefix='Bot:', **_):
  """Yields (where, turns | Skip) for each conversation of a transcript."""
  del report
  lines = chatformat.read_text(path).split('\n')
  turns, start, bad = [], 1, False
  for no, raw in enumerate(lines + [''], 1):
    line = raw.strip()
    if not line:  # A blank line ends the conversation.
      if turns and not bad:
        yield f'{path}:{start}', [(role, text) for role, text, _ in turns]
      turns, bad = [], False
      continue
    if bad:
      continue
    if not turns:
      start = no
    if line.startswith(user_prefix):
      turns.append([USER, line[len(user_prefix) :].strip(), no])
    elif line.startswith(ai_prefix):
      turns.append([AI, line[len(ai_prefix) :].strip(), no])
    elif turns:  # A continuation line of the previous message.
      turns[-1][1] += '\n' + line
    else:  # Skip this conversation, up to the next blank line.
      yield (
        f'{path}:{no}',
        Skip(f'line starts with neither {user_prefix!r} nor {ai_prefix!r}'),
      )
      bad = True
