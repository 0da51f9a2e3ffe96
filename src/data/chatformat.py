"""The conversation line format, parsed and checked rule by rule.

A data file holds conversations, one message per line::

    Good morning!
    |aigenerationstart| Good morning! |endofgeneration|
    What is your last name?
    |aigenerationstart| I don't have one. |br| Good afternoon! |endofgeneration|

Rules (each violation is a `UserError` naming `file:line` and the fix):

- A user line is plain text. Two messages in a row from the user are one
  line with `|br|` between them (the same for the AI).
- An AI line starts with the start marker and ends with the end marker,
  with the message between them.
- A blank line ends a conversation; each conversation (and so the file)
  must end with an AI line.
- Files are UTF-8 and not empty.
- An AI line may start with `|noloss|` (before the start marker): the turn
  stays in the context but carries no loss (a message that should not be
  learned, e.g. `"weight": 0` in an imported messages file).

Runs of one character repeated many times (`HIIIIIIIII`, `!!!!!!!!!`) make a
model loop on them; they get a warning, or are shortened when asked.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Iterator

from src.core.errors import UserError

USER, AI = 'user', 'ai'
# Written before an AI line's start marker: keep the turn as context, do not
# train on it. It is part of the file format only (never a token).
NO_LOSS = '|noloss|'
# Control characters in a line (ESC, the C1 codes U+0080-U+009F that text
# decoded with the wrong code page holds, tabs, a carriage return inside a
# line) become spaces, as the importers make them: a tokenizer trained on
# them would hold pieces a terminal runs as commands, which loading refuses
# (`src.data.tokenizer`). NUL is refused: it marks a file that is not text.
_CONTROL = re.compile('[\x01-\x09\x0b-\x1f\x7f-\x9f]')


@dataclasses.dataclass(frozen=True)
class Markers:
  """The three markers of the format (configurable as in the original)."""

  ai_start: str = '|aigenerationstart|'
  ai_end: str = '|endofgeneration|'
  line_break: str = '|br|'

  def all(self) -> list[str]:
    return [self.ai_start, self.ai_end, self.line_break]

  def check(self, where: str = 'config'):
    values = self.all()
    for value in values:
      if not value or value != value.strip() or '\n' in value:
        raise UserError(
          f'{where}: marker {value!r} must be non-empty text '
          'without spaces at its ends'
        )
    if len(set(values)) != 3:
      raise UserError(
        f'{where}: the markers ai-start, ai-end and line-break '
        f'must differ (got {values})'
      )


@dataclasses.dataclass(frozen=True)
class Turn:
  """One message. `text` keeps line-break markers; no AI markers."""

  role: str
  text: str
  path: str
  line: int
  train: bool = True  # False: context only (an AI line with `|noloss|`).


@dataclasses.dataclass(frozen=True)
class Conversation:
  turns: tuple[Turn, ...]


@dataclasses.dataclass
class Warning_:
  path: str
  line: int
  message: str

  def __str__(self):
    return f'{self.path}:{self.line}: warning: {self.message}'


def list_files(data: str, setting: str = 'data') -> list[str]:
  """The data files: `data` itself, or the `.txt` files below it, sorted.

  `setting` names the config key in messages (`data`, `eval-data`)."""
  if os.path.isfile(data):
    return [data]
  if not os.path.isdir(data):
    raise UserError(
      f'{setting} {data!r}: no such file or folder; set "{setting}" in '
      f'config.json (or --{setting}) to your conversations folder'
    )
  files = []
  for root, dirs, names in os.walk(data):
    dirs.sort()
    files.extend(
      os.path.join(root, n)
      for n in sorted(names)
      if n.endswith('.txt') and not n.startswith('.')
    )
  if not files:
    raise UserError(
      f'{setting} {data!r}: no .txt files in this folder; put your '
      'conversations in .txt files there'
    )
  return files


def _repeat_re(limit: int) -> re.Pattern:
  return re.compile(r'(\S)\1{' + str(limit) + ',}')


def collapse_repeats(text: str, limit: int) -> str:
  """Shortens runs of one non-space character longer than `limit` to 3."""
  return _repeat_re(limit).sub(lambda m: m.group(1) * 3, text)


def _lines(text: str, path: str, line_offset: int, allow_empty: bool):
  """The text's lines (only "\\n" and "\\r\\n" end one); a NUL byte or,
  unless `allow_empty`, a file without text is refused."""
  nul = text.find('\0')
  if nul >= 0:
    raise UserError(
      f'{path}:{line_offset + 1 + text.count(chr(10), 0, nul)}: a NUL byte; '
      'a text file never holds one, so this file is damaged or not text. '
      'Fix or remove it'
    )
  # Only "\n" (and "\r\n") end a line: U+2028, form feeds and the like are
  # characters of a message, not line breaks (str.splitlines splits there).
  lines = [line.removesuffix('\r') for line in text.split('\n')]
  if lines and lines[-1] == '':
    lines.pop()
  if not allow_empty and not any(line.strip() for line in lines):
    raise UserError(
      f'{path}: the file is empty; add conversations or remove '
      'the file from the data folder'
    )
  return lines


def _role_and_body(line: str, where: str, start: str, end: str):
  """`(role, message, train)` of a non-empty line: a user line, or one AI
  turn `start ... end` (after `NO_LOSS`: context only)."""
  train = True
  if line.startswith(NO_LOSS):
    line = line[len(NO_LOSS) :].lstrip()
    train = False
    if not line.startswith(start):
      raise UserError(
        f'{where}: "{NO_LOSS}" marks an AI line as context only; write '
        f'"{NO_LOSS} {start} message {end}"'
      )
  n_start, n_end = line.count(start), line.count(end)
  if n_start == 0 and n_end == 0:
    role, body = USER, line
  elif (
    n_start == 1
    and n_end == 1
    and line.startswith(start)
    and (line.endswith(end))
  ):
    role, body = AI, line[len(start) : -len(end)].strip()
  elif n_start > 1 or n_end > 1:
    raise UserError(
      f'{where}: more than one AI turn on a line; put each '
      f'"{start} ... {end}" on its own line'
    )
  elif n_start and not n_end:
    raise UserError(
      f'{where}: "{start}" has no "{end}"; end the AI turn '
      f'with "{end}" on the same line'
    )
  elif n_end and not n_start:
    raise UserError(
      f'{where}: "{end}" has no "{start}" before it; start '
      f'the AI turn with "{start}"'
    )
  elif line.index(end) < line.index(start):
    raise UserError(
      f'{where}: "{end}" comes before "{start}"; write "{start} message {end}"'
    )
  elif not line.startswith(start):
    raise UserError(
      f'{where}: text before "{start}"; put the user text on '
      'the line above and start this line with the marker'
    )
  else:
    raise UserError(
      f'{where}: text after "{end}"; put it on the next line '
      '(a user line) or inside the AI turn'
    )
  return role, body, train


def _repeats(body, repeat, repeat_limit, collapse, path, no, warnings):
  """`body` with its long runs of one character shortened (`collapse`),
  or as it is with a warning (into `warnings`, else printed)."""
  run = repeat.search(body).group(0)
  if collapse:
    body = collapse_repeats(body, repeat_limit)
  else:
    note = Warning_(
      path,
      no,
      f'"{run[:12]}..." repeats one character '
      f'{len(run)} times; such runs make the model loop. '
      'Shorten it, or set "collapse-repeats": true',
    )
    if warnings is None:
      print(note, file=sys.stderr)
    else:
      warnings.append(note)
  return body


def _check_turn(role, body, turns, where, no, markers):
  """A message must not be empty, and the roles alternate."""
  if not body.replace(markers.line_break, '').strip():
    raise UserError(
      f'{where}: empty {"AI" if role == AI else "user"} '
      'message; write the message or delete the line'
    )
  if turns and turns[-1].role == role:
    who = 'AI' if role == AI else 'user'
    raise UserError(
      f'{where}: two {who} lines in a row (lines {turns[-1].line} and '
      f'{no}); join them into one line with "{markers.line_break}" '
      'between the messages'
    )


def parse_text(
  text: str,
  path: str,
  markers: Markers = Markers(),
  repeat_limit: int = 8,
  collapse: bool = False,
  warnings: list | None = None,
  line_offset: int = 0,
  allow_empty: bool = False,
) -> list[Conversation]:
  """Parses one file's text into conversations.

  Args:
    text: The file's content.
    path: Used in messages only.
    markers: The format's markers.
    repeat_limit: Runs longer than this get a warning (0 disables).
    collapse: Shorten such runs instead of only warning.
    warnings: If given, warnings are appended here instead of printed.
    line_offset: Lines of the file before `text` (when `text` is a piece of
      a big file), added to every line number in messages.
    allow_empty: Accept text without any conversation (a piece of a file).

  Returns:
    The conversations, in file order.

  Raises:
    UserError: on the first broken rule, naming `path:line` and the fix.
  """
  start, end = markers.ai_start, markers.ai_end
  lines = _lines(text, path, line_offset, allow_empty)
  repeat = _repeat_re(repeat_limit) if repeat_limit > 0 else None
  conversations: list[Conversation] = []
  turns: list[Turn] = []

  def close(line_no: int):
    if not turns:
      return
    if turns[-1].role != AI:
      raise UserError(
        f'{path}:{turns[-1].line}: the conversation ends on a user line; '
        f'end it with an AI line "{start} ... {end}" (the AI must talk '
        'last)'
      )
    conversations.append(Conversation(tuple(turns)))
    turns.clear()

  for no, raw in enumerate(lines, line_offset + 1):
    line = _CONTROL.sub(' ', raw).strip()
    if not line:
      close(no)
      continue
    where = f'{path}:{no}'
    role, body, train = _role_and_body(line, where, start, end)
    _check_turn(role, body, turns, where, no, markers)
    if repeat is not None and repeat.search(body):
      body = _repeats(body, repeat, repeat_limit, collapse, path, no, warnings)
    turns.append(Turn(role, body, path, no, train))
  close(line_offset + len(lines) + 1)
  return conversations


def read_text(path: str) -> str:
  """A UTF-8 file's text; bytes that are not UTF-8 name the line."""
  with open(path, 'rb') as f:
    raw = f.read()
  try:
    return raw.decode('utf-8-sig')
  except UnicodeDecodeError as e:
    line = raw[: e.start].count(b'\n') + 1
    raise UserError(
      f'{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x}); '
      're-save the file as UTF-8'
    ) from None


def read_file(path: str, **kwargs) -> list[Conversation]:
  """Reads and parses one UTF-8 file (see `parse_text` for the arguments)."""
  return parse_text(read_text(path), path, **kwargs)


def read_data(data: str, **kwargs) -> list[Conversation]:
  """Reads every data file (see `list_files`) into one list of conversations."""
  conversations = []
  for path in list_files(data):
    conversations.extend(read_file(path, **kwargs))
  return conversations


def iter_turns(conversations) -> Iterator[Turn]:
  for conversation in conversations:
    yield from conversation.turns


def format_turn(
  role: str, text: str, markers: Markers = Markers(), train: bool = True
) -> str:
  """One turn as its line of the format (without the line's end): the one
  writer of the format, for every writer of it (converters, the REPL's
  /save, analysis files). `text` is one line already (line breaks as the
  marker, no AI markers: `importers.base.clean_message`)."""
  if role != AI:
    return text
  prefix = '' if train else NO_LOSS + ' '
  return f'{prefix}{markers.ai_start} {text} {markers.ai_end}'


def format_conversation(
  conversation: Conversation, markers: Markers = Markers()
) -> str:
  """Renders a conversation back into the line format (one line a turn)."""
  lines = [
    format_turn(t.role, t.text, markers, t.train) for t in conversation.turns
  ]
  return '\n'.join(lines) + '\n'
