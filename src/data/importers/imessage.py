"""iMessage (and SMS) chats as `imessage-exporter -f txt` writes them: a
folder with one `.txt` per chat, named by its members (`+15551234567.txt`,
`Sam, Kim.txt`), and `orphaned.txt`.

  May 17, 2022  5:29:42 PM (Read by you after 1 hour, 49 seconds)
  Sam
  Hello world
  /Users/alex/Library/Messages/Attachments/ab/11/IMG_0001.HEIC
  Reactions:
  Loved by Me

  May 17, 2022  5:31:02 PM
  Me
  hi Sam

  May 17, 2022  5:40:00 PM Sam renamed the conversation to Climbing

A message is its time line, its sender's line ("Me" for your own: `--ai
Me`, or the name given to `--custom-name`) and its text, up to a blank
line before the next time line. Attachment paths, reactions and their
senders, effects ("Sent with Confetti"), replies shown again under the
message they answer (indented; each reply is also a message of its own)
and the exporter's notes are taken out; an edited message keeps its last
version; a deleted message, and a line that starts with its time (a
rename, a member added or leaving), are dropped as what the app wrote.
The folder's `.txt` files that start with a time line are the chats;
every line is read bounded. Written from imessage-exporter's source (its
TXT exporter and its tests); not checked against a real export.
"""

from __future__ import annotations

import os
import re

from src.core.errors import UserError
from src.data.importers import chatlog, exportfiles
from src.data.importers.base import stem

MAX_FILE = 1 << 40  # One chat's .txt (read a line at a time).
MAX_LINE = chatlog.MAX_MESSAGE  # Bytes in one line.
_NOT_EXPORT = (
  'is not an iMessage export (imessage-exporter writes a .txt a chat that '
  'starts with a time like "May 17, 2022  5:29:42 PM"); run '
  'imessage-exporter -f txt and give its folder or its .txt files'
)
_MONTHS = 'Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec'.split()
# chrono's "%b %d, %Y %l:%M:%S %p", and what may follow on the line.
_TIME = re.compile(
  r'(' + '|'.join(_MONTHS) + r') (\d{2}), (\d{4}) ([ \d]\d):(\d{2}):(\d{2})'
  r' ([AP]M)(?P<rest>.*)'
)
_READ = re.compile(r' \(Read by .{1,200} after .{1,200}\)')
_PATH = re.compile(
  r'(?:/|~/|[A-Za-z]:\\|\.{0,2}/?attachments/)[^\n]{0,1000}\.\w{1,8}'
)
_NOTES = re.compile(
  r'This message responded to an earlier message\.|'
  r'This message was deleted from the conversation!|'
  r'Attachment missing!|'
  r'Sent with (?:Confetti|Echo|Fireworks|Balloons|Heart|Lasers|Shooting '
  r'Start?|Sparkles|Spotlight|Slam|Loud|Gentle|Invisible Ink)|'
  r'(?:Started|Stopped) sharing location!|'
  r'Unable to format app message: .*|'
  r'Handwritten messages are not yet supported!|'
  r'(?:\S+ )?Sticker from .{1,200}?(?:: .+| not found!)'
)
_TAPBACKS = ('Reactions:', 'Tapbacks:')
_TAPBACK = re.compile(r'.{1,80} by .{1,200}|(?:\S+ )?Sticker from .{1,300}')
_EDITED = re.compile(r'Edited .{1,100}? later: ')
_DELETED = re.compile(r'.{1,200} deleted a message\.')


def _time_line(line: str):
  """The match of a time line, or None."""
  m = _TIME.match(line)
  return m if m and m.group(2) <= '31' else None


def seconds(m) -> float | None:
  """Seconds of a time line's match (see `chatlog.wall_seconds`)."""
  date = (m.group(3), _MONTHS.index(m.group(1)) + 1, m.group(2))
  hms = (m.group(4), m.group(5), m.group(6))
  return chatlog.wall_seconds(date, hms, m.group(7) == 'PM')


def _starts_with_time(f) -> bool:
  """Whether the open binary file's first non-blank line is a time line."""
  head = f.read(4096).decode('utf-8-sig', errors='replace')
  first = next((line for line in head.splitlines() if line.strip()), '')
  return _time_line(first) is not None


def _looks_like_chat(export, name: str) -> bool:
  with export.open(name, MAX_FILE) as f:
    return _starts_with_time(f)


def sources(inputs: list[str]) -> list[chatlog.Source]:
  """Each input (imessage-exporter's folder, a zip of it, or one chat's
  .txt) is one export: its chats in name order."""
  out = []
  for path in inputs:
    if os.path.isdir(path) or not path.lower().endswith('.txt'):
      with exportfiles.ExportFiles(path, _NOT_EXPORT) as export:
        chats = [
          n
          for n in export.names
          if n.lower().endswith('.txt') and _looks_like_chat(export, n)
        ]
    else:
      with exportfiles.open_input(path) as f:
        chats = [''] if _starts_with_time(f) else []
    if not chats:
      raise UserError(f'{path}: {_NOT_EXPORT}')
    name = stem(path.rstrip('/' + os.sep)) or 'imessage'
    out.append(chatlog.Source((path, *chats), f'imessage-{name}'))
  return out


def _text(body: list[str]) -> tuple[str, bool]:
  """A message's text from its body lines, and whether anything the app
  wrote (an attachment, a sticker) was taken out."""
  kept, took, tapbacks = [], False, False
  for line in body:
    if line.startswith('    '):  # A reply, shown again under its message.
      continue
    if line in _TAPBACKS:
      tapbacks = True
      continue
    if tapbacks and _TAPBACK.fullmatch(line):
      continue
    tapbacks = False
    if _PATH.fullmatch(line) or _NOTES.fullmatch(line):
      took = True
      continue
    kept.append(line)
  text = '\n'.join(kept)
  edits = list(_EDITED.finditer(text))
  if edits:  # "TIME first version\nEdited 1 minute later: the last".
    text = text[edits[-1].end() :]
  return text.strip(), took


def message(head, sender: str, body: list[str], where: str):
  """The `Message` or `Drop` for one message block."""
  rest = _READ.sub('', head.group('rest'), count=1)
  if rest.strip():  # "TIME Sam renamed the conversation to ...".
    return chatlog.Drop('system notice')
  if body[:2] == ['SharePlay Message', 'Ended']:
    return chatlog.Drop('call')
  text, took = _text(body)
  if _DELETED.fullmatch(text):
    return chatlog.Drop('deleted')
  if not text:
    return chatlog.Drop('media' if took else 'empty')
  if not sender.strip():
    return chatlog.Drop('unreadable')
  return chatlog.Message(where, seconds(head), sender.strip(), text)


def _chat(lines, where: str):
  """The items of one chat's lines: a block starts at a time line after a
  blank line (or at the top)."""
  head, at, sender, body = None, '', None, []
  size, blank = 0, True
  for n, line in lines:
    if line is None:
      continue
    line = line.rstrip('\r\n')
    m = _time_line(line) if blank else None
    blank = not line.strip()
    if m:
      if head is not None:
        yield message(head, sender or '', body, at)
      head, at, body, size = m, f'{where}:{n}', [], 0
      # A notice ("TIME Sam renamed ...") has no sender's line.
      sender = '' if _READ.sub('', m.group('rest'), count=1).strip() else None
    elif head is not None and sender is None:
      sender = line
    elif head is not None and size <= chatlog.MAX_MESSAGE:
      body.append(line)
      size += len(line)
  if head is not None:
    yield message(head, sender or '', body, at)


def items(source: chatlog.Source, warn):
  """Yields `Chat` per chat file, then its messages, line by line."""
  path, *chats = source.paths
  if chats == ['']:  # One chat's .txt.
    yield chatlog.Chat(stem(path))
    with exportfiles.open_input(path) as f:
      yield from _chat(exportfiles.lines(f, path, warn, MAX_LINE), path)
    return
  with exportfiles.ExportFiles(path, _NOT_EXPORT) as export:
    for name in chats:
      yield chatlog.Chat(stem(name))
      with export.open(name, MAX_FILE) as f:
        where = export.where(name)
        yield from _chat(exportfiles.lines(f, where, warn, MAX_LINE), where)
