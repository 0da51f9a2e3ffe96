"""DiscordChatExporter's JSON export of a channel or a direct-message chat.

  {"channel": {"name": "general"}, "messages": [
    {"id": "1", "type": "Default", "timestamp": "2024-03-01T18:02:11+00:00",
     "content": "See you at 8", "author": {"name": "alice",
     "nickname": "Alice"}, "attachments": []}]}

Messages of type Default and Reply are what people wrote; every other type
(joins, pins, calls, thread notices) is dropped as a notice, a message with
no content (an attachment, a sticker, an embed only) as media, a message
listed twice (the same id, or the same author, time and text) once. `--ai`
matches the author's `name` or `nickname`; user lines with `--names` carry
the nickname. Custom emoji (`<:wave:123>`) become `:wave:`. The file is
read as a stream.
"""

from __future__ import annotations

import hashlib
import re

from src.data.importers import chatlog, exportfiles
from src.data.importers.base import stem

_EMOJI = re.compile(r'<a?:(\w{1,64}):\d{1,24}>')


def sources(inputs: list[str]) -> list[chatlog.Source]:
  return [chatlog.Source((p,), stem(p)) for p in inputs]


def item(message, where: str):
  """The `Message` or `Drop` for one exported message object."""
  if not isinstance(message, dict):
    return chatlog.Drop('unreadable')
  if message.get('type', 'Default') not in ('Default', 'Reply'):
    return chatlog.Drop('system notice')
  content = message.get('content')
  if not isinstance(content, str) or not content.strip():
    return chatlog.Drop('media')
  author = message.get('author')
  author = author if isinstance(author, dict) else {}
  name = author.get('name') if isinstance(author.get('name'), str) else ''
  nick = author.get('nickname')
  nick = nick if isinstance(nick, str) and nick else name
  if not nick:
    return chatlog.Drop('unreadable')
  return chatlog.Message(
    where,
    chatlog.iso_seconds(message.get('timestamp')),
    nick,
    _EMOJI.sub(r':\1:', content),
    name if name != nick else '',
  )


# Messages remembered to find one listed twice (DiscordChatExporter
# repeats messages where exports of a channel overlap): the last ones.
DEDUP_WINDOW = 10_000


def _key(message) -> tuple | None:
  """What makes a message the same one: its id, else its author, time and
  text (a digest)."""
  if not isinstance(message, dict):
    return None
  ident = message.get('id')
  if isinstance(ident, str) and 0 < len(ident) <= 64:
    return ('id', ident)
  body = repr(
    (message.get('author'), message.get('timestamp'), message.get('content'))
  )
  return ('same', hashlib.sha256(body.encode('utf-8', 'replace')).digest())


def items(source: chatlog.Source, warn):
  del warn
  (path,) = source.paths
  seen: dict = {}  # Insertion-ordered: the oldest key is dropped first.
  messages = exportfiles.json_items(path, {'messages.item'}, {'messages'})
  for _, value, where in messages:
    if where is None:
      if value is None:  # The channel's messages start.
        yield chatlog.Chat(source.name)
      continue
    key = _key(value)
    if key is not None and key in seen:
      yield chatlog.Drop('duplicate')
      continue
    if key is not None:
      seen[key] = None
      if len(seen) > DEDUP_WINDOW:
        del seen[next(iter(seen))]
    yield item(value, where)
