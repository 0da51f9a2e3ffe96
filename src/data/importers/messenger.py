"""Facebook Messenger and Instagram chats from Meta's "Download your
information" (JSON): one folder per conversation with `message_1.json`,
`message_2.json`, ...

  {"participants": [{"name": "Alice"}, {"name": "Bob"}],
   "messages": [{"sender_name": "Bob", "timestamp_ms": 1709316131000,
                 "content": "See you at 8"}, ...]}

Messages come newest first, split over several files: the files of one
folder are read together and put in time order. Meta writes text as
UTF-8 bytes escaped one by one (`\\u00c3\\u00a9` for é, four escapes for
an emoji); that is repaired in messages and names. The newer layout
(`senderName`, `timestamp`, `text`, `isUnsent`) is read too.

Dropped and counted: messages with only an attachment (photos, videos,
audio, a sticker, a GIF, a file), what Meta writes for them ("Alice sent an
attachment."), calls, reactions ("Reacted ❤ to your message", "Liked a
message"), unsent messages, and notices about the chat (names, nicknames,
themes, members). A sender missing from `participants` still counts.
"""

from __future__ import annotations

import collections
import os
import re

from src.core import files
from src.core.errors import UserError
from src.data.importers import wording
from src.data.importers.base import stem
from src.data.importers.chatlog import Chat, Drop, Message, Source
from src.data.importers.exportfiles import files_in, open_input

# Meta's files are split at about 10,000 messages (a few MB); a bigger
# one is not an export.
MAX_FILE = 256 * files.MB

_MEDIA_KEYS = (
  'photos',
  'videos',
  'audio_files',
  'gifs',
  'files',
  'sticker',
  'share',
  'media',
)


MAX_FOLDER_FILES = 10_000  # message_N.json files found in given folders.


def _in_folder(folder: str) -> list[str]:
  """The `message_N.json` files in `folder` and its subfolders (Meta's
  `messages/inbox/NAME/`), links never followed; sorted."""
  found = [
    os.path.join(folder, name)
    for name in files_in(folder, MAX_FOLDER_FILES)
    if re.fullmatch(r'message_\d+\.json', name.rsplit('/', 1)[-1])
  ]
  if not found:
    raise UserError(
      f"{folder}: no message_N.json in it; give a chat folder of Meta's "
      'export (messages/inbox/NAME) or its message_N.json files'
    )
  return found


def sources(inputs: list[str]) -> list[Source]:
  """Files of one folder are one conversation, named after the folder
  (Meta's `alice_123456`); other names stand alone. A folder given stands
  for the message files inside it (a chat folder, or `inbox/` with one
  folder a chat)."""
  folders: dict[str, list[str]] = collections.defaultdict(list)
  out = []
  expanded = []
  for path in inputs:
    is_folder = os.path.isdir(path) and not os.path.islink(path)
    expanded += _in_folder(path) if is_folder else [path]
  for path in expanded:
    base = os.path.basename(path)
    if re.fullmatch(r'message_\d+\.json', base):
      folders[os.path.dirname(os.path.abspath(path))].append(path)
    else:
      out.append(Source((path,), stem(path)))
  for folder, paths in folders.items():
    paths.sort(key=lambda p: int(re.findall(r'\d+', os.path.basename(p))[0]))
    out.append(Source(tuple(paths), os.path.basename(folder) or 'messenger'))
  return out


def repair(text: str) -> str:
  """Meta's mis-encoded text (UTF-8 bytes read as Latin-1) made right;
  text that is not mis-encoded comes back unchanged."""
  try:
    return text.encode('latin-1').decode('utf-8')
  except (UnicodeEncodeError, UnicodeDecodeError):
    return text


def _kind(text: str, sender: str) -> str | None:
  body = text.strip()
  if len(body) > 500:
    return None
  for kind, pattern in wording.MESSENGER_BARE:
    if pattern.fullmatch(body):
      return kind
  lower = body.lower()
  for name in (sender.lower(), 'you'):
    if lower.startswith(name + ' '):
      rest = body[len(name) + 1 :]
      for kind, pattern in wording.MESSENGER_NAMED:
        if pattern.fullmatch(rest):
          return kind
  return None


def _load(path: str) -> dict:
  with open_input(path) as f:
    size = os.fstat(f.fileno()).st_size
    data = f.read(min(size, MAX_FILE) + 1)
  if len(data) > MAX_FILE:
    raise UserError(
      f'{path}: more than {MAX_FILE // files.MB} MB, which no Meta message '
      'file is; give the message_N.json files of a chat folder'
    )
  try:
    text = data.decode('utf-8-sig')
  except UnicodeDecodeError:
    raise UserError(
      f'{path}: not UTF-8 text; give the file Meta exported, unchanged'
    ) from None
  record = files.parse_json(text, path) if text.strip() else None
  if not isinstance(record, dict) or not isinstance(
    record.get('messages'), list
  ):
    raise UserError(
      f'{path}: not a Messenger or Instagram chat (no "messages" list); in '
      'Meta\'s "Download your information" choose JSON, then give '
      'messages/inbox/NAME/message_1.json'
    )
  return record


def _field(message: dict, *keys):
  for key in keys:
    if key in message:
      return message[key]
  return None


def item(message, where: str, names: dict):
  """(time, `Message` or `Drop`) for one exported message object."""
  if not isinstance(message, dict):
    return 0.0, Drop('unreadable')
  time = _field(message, 'timestamp_ms', 'timestamp')
  ok = isinstance(time, (int, float)) and not isinstance(time, bool)
  # A time past year 9999 (a 400-digit number) is no time: none is read.
  time = float(time) / 1000 if ok and abs(time) < 1e17 else None
  order = time if time is not None else 0.0
  if _field(message, 'is_unsent', 'isUnsent') is True:
    return order, Drop('deleted')
  if message.get('type') == 'Call' or 'call_duration' in message:
    return order, Drop('call')
  sender = _field(message, 'sender_name', 'senderName')
  sender = repair(sender) if isinstance(sender, str) and sender else ''
  sender = names.get(sender, sender)
  text = _field(message, 'content', 'text')
  text = repair(text) if isinstance(text, str) else ''
  if not text.strip():
    has_media = any(message.get(k) for k in _MEDIA_KEYS)
    return order, Drop('media' if has_media else 'empty')
  if not sender:
    return order, Drop('unreadable')
  kind = _kind(text, sender)
  if kind:
    return order, Drop(kind)
  return order, Message(where, time, sender, text)


def items(source: Source, warn):
  """Yields `Chat`, then the folder's messages in time order."""
  del warn
  found = []
  for path in source.paths:
    record = _load(path)
    names = {}
    for person in record.get('participants') or []:
      name = person.get('name') if isinstance(person, dict) else person
      if isinstance(name, str):
        names[repair(name)] = repair(name)
    mine = [
      item(message, f'{path}[{i}]', names)
      for i, message in enumerate(record['messages'])
    ]
    if len(mine) > 1 and mine[0][0] > mine[-1][0]:
      mine.reverse()  # Newest first, as Meta writes it.
    found.extend(mine)
  found.sort(key=lambda pair: pair[0])  # Stable: ties keep file order.
  yield Chat(source.name)
  for _, it in found:
    yield it
