"""Google Chat from Google Takeout (takeout.google.com, "Google Chat"): the
Takeout `.zip` or its unzipped folder, with one folder per conversation.

  Google Chat/Groups/DM k6oxHQAAAAE/group_info.json
      {"members": [{"name": "Sam Roe", "email": "sam@example.com",
                    "user_type": "Human"}, ...]}
  Google Chat/Groups/Space AAAAFyOfy4w/group_info.json
      {"name": "Climbing", "members": [...]}
  Google Chat/Groups/<either>/messages.json
      {"messages": [{"creator": {"name": "Sam Roe",
                                 "email": "sam@example.com",
                                 "user_type": "Human"},
                     "created_date": "Thursday, November 3, 2016 at
                                      11:59:50 AM UTC",
                     "text": "shoe shopping this weekend?",
                     "topic_id": "LqFDi4ScZAQ", "message_id": "..."}]}

An export is one output file; each conversation is one chat in it (a
Space by its name, a DM by its members), its messages in file order.
A message without text (a file, an image: `attached_files`) is dropped as
media; one a bot wrote (`user_type` other than "Human") as a bot's. `--ai`
matches a creator's name or e-mail address. `messages.json` is read as a
stream; `group_info.json` bounded. Written from the Takeout layout as its
users document it; not checked against a real Takeout.
"""

from __future__ import annotations

import os
import re

from src.core import files
from src.core.errors import UserError
from src.data.importers import chatlog, exportfiles, jsonstream
from src.data.importers.base import stem

MAX_INFO = 16 * files.MB  # A conversation's group_info.json.
MAX_MESSAGES = 1 << 40  # A conversation's messages.json (read streaming).
_MESSAGES = re.compile(r'(?:^|/)Groups/([^/]+)/messages\.json$')
_NOT_EXPORT = (
  'is not a Google Chat export (no Groups/.../messages.json); at '
  'takeout.google.com choose Google Chat, and give the .zip Takeout makes '
  'or its unzipped folder'
)
# "Thursday, November 3, 2016 at 11:59:50 AM UTC"; the space before AM/PM
# may be a narrow no-break space.
_DATE = re.compile(
  r'(?:\w+, )?(\w+) (\d{1,2}), (\d{4}) at (\d{1,2}):(\d{2}):(\d{2})'
  r'[\s\u202f]*([AP]M)?(?: (UTC|GMT))?',
  re.IGNORECASE,
)
_MONTHS = {
  m: i + 1
  for i, m in enumerate(
    'january february march april may june july august september october '
    'november december'.split()
  )
}


def sources(inputs: list[str]) -> list[chatlog.Source]:
  """Each input (a Takeout zip or folder) is one export."""
  out = []
  for path in inputs:
    with exportfiles.ExportFiles(path, _NOT_EXPORT) as export:
      found = [n for n in export.names if _MESSAGES.search(n)]
    if not found:
      raise UserError(f'{path}: {_NOT_EXPORT}')
    name = stem(path.rstrip('/' + os.sep)) or 'google-chat'
    out.append(chatlog.Source((path, *found), f'googlechat-{name}'))
  return out


def seconds(text) -> float | None:
  """Seconds of a `created_date` (English, as Takeout writes it), or None."""
  if not isinstance(text, str):
    return None
  m = _DATE.fullmatch(text.strip())
  if not m or m.group(1).lower() not in _MONTHS:
    return None
  date = (m.group(3), _MONTHS[m.group(1).lower()], m.group(2))
  hms = (m.group(4), m.group(5), m.group(6))
  pm = m.group(7).upper() == 'PM' if m.group(7) else None
  return chatlog.wall_seconds(date, hms, pm)


def _person(value) -> tuple[str, str, bool]:
  """(name, e-mail, human) of a `creator` or member object."""
  if not isinstance(value, dict):
    return '', '', True
  name, email = value.get('name'), value.get('email')
  return (
    name.strip() if isinstance(name, str) else '',
    email.strip() if isinstance(email, str) else '',
    value.get('user_type', 'Human') == 'Human',
  )


def chat_name(info, folder: str) -> str:
  """A Space's name, a DM's members' names, else its folder's name."""
  if isinstance(info, dict):
    if isinstance(info.get('name'), str) and info['name'].strip():
      return info['name'].strip()
    members = info.get('members')
    if not isinstance(members, list):
      members = []
    names = [name for name in (_person(m)[0] for m in members) if name][:8]
    if names:
      return ', '.join(names)
  return folder


def item(message, where: str):
  """The `Message` or `Drop` for one message object."""
  if not isinstance(message, dict):
    return chatlog.Drop('unreadable')
  name, email, human = _person(message.get('creator'))
  if not human:
    return chatlog.Drop('bot')
  text = message.get('text')
  if not isinstance(text, str) or not text.strip():
    files_attached = message.get('attached_files') or message.get('annotations')
    return chatlog.Drop('media' if files_attached else 'empty')
  if not name and not email:
    return chatlog.Drop('unreadable')
  return chatlog.Message(
    where, seconds(message.get('created_date')), name or email, text, email
  )


def items(source: chatlog.Source, warn):
  """Yields `Chat` per conversation, then its messages, as they stream."""
  del warn
  path, *conversations = source.paths
  with exportfiles.ExportFiles(path, _NOT_EXPORT) as export:
    present = set(export.names)
    for name in conversations:
      folder = _MESSAGES.search(name).group(1)
      info_name = name[: -len('messages.json')] + 'group_info.json'
      info = (
        export.read_json(info_name, MAX_INFO) if info_name in present else None
      )
      yield chatlog.Chat(chat_name(info, folder))
      where = export.where(name)
      n = 0
      with export.open(name, MAX_MESSAGES) as f:
        for _, value in jsonstream.objects(f, where, {'messages.item'}):
          yield item(value, f'{where}[{n}]')
          n += 1
