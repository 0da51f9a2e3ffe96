"""Signal Desktop's chats as `sigexport` (signal-export) writes them: a
folder (or a `.zip` of it) with one folder per chat, each holding
`data.json` (one JSON object a line, written by default) and `chat.md`.

  Sam/data.json:
    {"date": "2024-03-01T18:02:11", "sender": "Sam", "body": "hi  ",
     "quote": "", "sticker": null, "reactions": [], "attachments": [],
     "deleted": false, "call": false, "missed": false}
  Sam/chat.md:
    [2024-03-01 18:02:11] Sam: hi
    [2024-03-01 18:03:40] Me: hello, ![IMG_1.jpg](./media/IMG_1.jpg)

An export is one output file; each chat folder is one chat in it, read
from `data.json` where it is there, else from `chat.md` (older exports
write `[2024-03-01, 18:02]`). Your own messages are "Me" (`--ai Me`).
Deleted messages and calls are dropped as what the app wrote; a message
without text (a sticker, an attachment) as media; a quoted message (a
reply's quote) and reactions are left out, the reply kept. Attachment
links and stickers are taken out of the text. Every line is read
bounded; `exported_stickers/` is not a chat. Written from sigexport's
source (its `Message.to_md` and `dict`); not checked against a real
export.
"""

from __future__ import annotations

import os
import re

from src.core import files
from src.core.errors import UserError
from src.data.importers import chatlog, exportfiles
from src.data.importers.base import stem

MAX_FILE = 1 << 40  # A chat's data.json or chat.md (read a line at a time).
MAX_LINE = 4 * chatlog.MAX_MESSAGE  # Bytes in one line of either.
_CHAT = re.compile(r'(?:^|/)(data\.json|chat\.md)$')
_NOT_EXPORT = (
  'is not a Signal export (no CHAT/data.json or CHAT/chat.md); give the '
  'folder sigexport wrote (sigexport ~/signal-chats), or a .zip of it'
)
# A chat.md message: "[2024-03-01 18:02:11] Sam: text" (older exports:
# "[2024-03-01, 18:02]").
_HEADER = re.compile(
  r'\[(\d{4}-\d{2}-\d{2}),? (\d{2}:\d{2}(?::\d{2})?)\] ([^\n]{1,300}?): ?'
)
# What sigexport appends to a body: attachment links to ./media/...,
# stickers, attachments it could not export.
_ATTACHMENT = re.compile(r'!?\[[^\]\n]{0,300}\]\(\.{1,2}/[^)\n]{0,500}\) *')
_MISSING = re.compile(r'\((?:media|attachment) not exported\) *')
_STICKER_LINE = re.compile(r'\(\( [^\n]{0,80} \)\)')
_REACTIONS_LINE = re.compile(r'\(- [^\n]* -\)')
_CALL = re.compile(
  r'(?:Incoming|Outgoing|Missed) (?:(?:voice|video) )?call(?: \([^)]*\))?'
)


def sources(inputs: list[str]) -> list[chatlog.Source]:
  """Each input (an export folder or zip, or one chat's folder) is one
  export: its chats, each read from data.json (else chat.md)."""
  out = []
  for path in inputs:
    with exportfiles.ExportFiles(path, _NOT_EXPORT) as export:
      names = export.names
    chats: dict[str, str] = {}  # Folder -> the file read.
    for name in names:
      m = _CHAT.search(name)
      if m and 'exported_stickers' not in name.split('/'):
        folder = name[: m.start(1)]
        if not chats.get(folder, '').endswith('data.json'):
          chats[folder] = name
    # A chat's own files (its media/ may hold a "data.json" someone sent)
    # are not chats: a folder inside a chat's folder is left out.
    chats = {
      f: n for f, n in chats.items() if _parent(f) not in chats or f == ''
    }
    if not chats:
      raise UserError(f'{path}: {_NOT_EXPORT}')
    name = stem(path.rstrip('/' + os.sep)) or 'signal'
    out.append(
      chatlog.Source(
        (path, *(chats[f] for f in sorted(chats))), f'signal-{name}'
      )
    )
  return out


def _parent(folder: str) -> str | None:
  """'a/b/' -> 'a/', 'a/' -> '', '' -> None."""
  if not folder:
    return None
  head = folder.rstrip('/').rpartition('/')[0]
  return head + '/' if head else ''


def _clean(body: str) -> str:
  """A body without what sigexport added: attachment links, stickers,
  reactions, markdown's line-end spaces."""
  body = _MISSING.sub('', _ATTACHMENT.sub('', body))
  lines = [
    line.rstrip()
    for line in body.split('\n')
    if not _STICKER_LINE.fullmatch(line.strip())
    and not _REACTIONS_LINE.fullmatch(line.strip())
  ]
  return '\n'.join(lines).strip()


def record(value, where: str):
  """The `Message` or `Drop` for one data.json object."""
  if not isinstance(value, dict):
    return chatlog.Drop('unreadable')
  if value.get('deleted') is True:
    return chatlog.Drop('deleted')
  if value.get('call') is True:
    return chatlog.Drop('call')
  sender, body = value.get('sender'), value.get('body')
  if not isinstance(sender, str) or not sender.strip():
    return chatlog.Drop('unreadable')
  text = _clean(body) if isinstance(body, str) else ''
  if not text:
    media = value.get('attachments') or value.get('sticker')
    return chatlog.Drop('media' if media else 'empty')
  return chatlog.Message(
    where, chatlog.iso_seconds(value.get('date')), sender.strip(), text
  )


def _markdown_item(head, text: str, where: str):
  """The item of one chat.md message: its header's match and its text."""
  date, clock, sender = head.groups()
  if text.startswith('\n\n> '):  # A reply: the quoted message first.
    parts = text.split('\n\n', 2)
    text = parts[2] if len(parts) == 3 else ''
  if text.strip() == '(This message was deleted)':
    return chatlog.Drop('deleted')
  if _CALL.fullmatch(text.strip()):
    return chatlog.Drop('call')
  cleaned = _clean(text)
  if not cleaned:
    return chatlog.Drop('media' if text.strip() else 'empty')
  when = chatlog.iso_seconds(f'{date}T{clock}')
  return chatlog.Message(where, when, sender.strip(), cleaned)


def _markdown(lines, where: str):
  """The items of a chat.md: a message is its header line and the lines
  up to the next header."""
  head, at = None, ''  # The pending message's header match and place.
  text: list[str] = []
  size = 0
  for n, line in lines:
    if line is None:
      continue
    line = line.rstrip('\n')
    m = _HEADER.match(line)
    if m:
      if head is not None:
        yield _markdown_item(head, '\n'.join(text).rstrip(), at)
      head, at, text = m, f'{where}:{n}', [line[m.end() :]]
      size = len(text[0])
      continue
    if head is not None and size <= chatlog.MAX_MESSAGE:
      text.append(line)
      size += len(line)
  if head is not None:
    yield _markdown_item(head, '\n'.join(text).rstrip(), at)


def _chat_items(f, where: str, is_json: bool, warn):
  lines = exportfiles.lines(f, where, warn, MAX_LINE)
  if not is_json:
    yield from _markdown(lines, where)
    return
  for n, line in lines:
    if line is None or not line.strip():
      continue
    try:
      value = files.parse_json(line, f'{where}:{n}')
    except UserError:
      value = None
    yield record(value, f'{where}:{n}')


def items(source: chatlog.Source, warn):
  """Yields `Chat` per chat folder, then its messages, line by line."""
  path, *chats = source.paths
  with exportfiles.ExportFiles(path, _NOT_EXPORT) as export:
    for name in chats:
      folder = name.rsplit('/', 2)[-2] if '/' in name else stem(path)
      yield chatlog.Chat(folder)
      with export.open(name, MAX_FILE) as f:
        yield from _chat_items(
          f, export.where(name), name.endswith('.json'), warn
        )
