"""Telegram Desktop's JSON export ("Export chat history" or "Export Telegram
data" in machine-readable JSON): a single chat's `result.json` (its
`messages`) or a full export (every chat in `chats.list`, and
`left_chats.list`).

  {"name": "Alice", "type": "personal_chat", "messages": [
    {"id": 1, "type": "message", "date": "2024-03-01T18:02:11",
     "date_unixtime": "1709316131", "from": "Alice", "from_id": "user42",
     "text": ["See ", {"type": "bold", "text": "you"}, " at 8"]}]}

`text` is a string, or a list of strings and entity objects joined in
order. Service messages (joined, pinned, calls) are dropped as notices;
a message without text (a sticker, a photo, a voice note) as media; a
photo's caption is its text and is kept. Forwarded messages are dropped
(another person wrote them) and counted. `--ai` matches `from` or
`from_id`. The file is read as a stream.
"""

from __future__ import annotations

import os

from src.data.importers import chatlog, exportfiles
from src.data.importers.base import stem

_CHATS = ('chats.list.item', 'left_chats.list.item')
_WANTED = {'messages.item'} | {c + '.messages.item' for c in _CHATS}
_MARKS = (
  {'messages'}
  | {c + '.messages' for c in _CHATS}
  | {c + '.name' for c in _CHATS}
)
_MEDIA_KEYS = (
  'media_type',
  'photo',
  'file',
  'sticker_emoji',
  'location_information',
  'poll',
  'contact_information',
)


def sources(inputs: list[str]) -> list[chatlog.Source]:
  """Each input is one export; `result.json` takes its folder's name."""
  out = []
  for path in inputs:
    name = stem(path)
    if name == 'result':
      folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
      name = folder or 'telegram'
    out.append(chatlog.Source((path,), name))
  return out


def _text(value) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    return ''.join(
      part
      if isinstance(part, str)
      else str(part.get('text', ''))
      if isinstance(part, dict)
      else ''
      for part in value
    )
  return ''


def _time(message: dict) -> float | None:
  unix = message.get('date_unixtime')
  if unix is None:
    return chatlog.iso_seconds(message.get('date'))
  try:
    return float(unix)
  except (TypeError, ValueError, OverflowError):
    return None


def item(message, where: str):
  """The `Message` or `Drop` for one exported message object."""
  if not isinstance(message, dict):
    return chatlog.Drop('unreadable')
  if message.get('type') != 'message':
    return chatlog.Drop('system notice')
  if message.get('forwarded_from') is not None:
    return chatlog.Drop('forwarded')
  text = _text(message.get('text'))
  if not text.strip():
    media = any(k in message for k in _MEDIA_KEYS)
    return chatlog.Drop('media' if media else 'empty')
  sender = message.get('from')
  sender = sender if isinstance(sender, str) and sender else 'Deleted Account'
  alias = message.get('from_id')
  return chatlog.Message(
    where,
    _time(message),
    sender,
    text,
    alias if isinstance(alias, str) else '',
  )


def items(source: chatlog.Source, warn):
  """Yields `Chat` per chat, then its messages' items, as they stream."""
  del warn
  (path,) = source.paths
  name = source.name
  for prefix, value, where in exportfiles.json_items(path, _WANTED, _MARKS):
    if where is not None:
      yield item(value, where)
    elif prefix.endswith('.name'):
      name = str(value)
    elif value is None:  # A chat's messages start.
      yield chatlog.Chat(name)
