"""Slack's workspace export (Workspace settings > Import/Export data >
Export): a `.zip` (or its unzipped folder) with `users.json` and one
folder per channel or direct message holding one JSON file a day.

  users.json:          [{"id": "U1", "name": "alice",
                         "real_name": "Alice Doe",
                         "profile": {"display_name": "Alice"}}]
  general/2024-03-01.json:
                       [{"type": "message", "user": "U1", "text": "hi <@U2>",
                         "ts": "1709316131.000200"}]

Each channel (or DM folder) is one chat, its days read in date order.
Messages with a `subtype` (joins, leaves, topic changes, bot and app
messages, ...) are dropped as notices; a message without text (a file, an
image) as media; `<@U2>` becomes `@` and the person's name, links
`<https://x|label>` their label (else the address), `<#C1|general>`
`#general`, and `&amp;`, `&lt;`, `&gt;` their characters. `--ai` matches
the user's `name`, `real_name`, display name or id. Every file is read
bounded (`MAX_FILE`), and no link is followed.
"""

from __future__ import annotations

import re

from src.core import files
from src.core.errors import UserError
from src.data.importers import chatlog, exportfiles

MAX_FILE = 64 * files.MB  # One day of one channel, or users.json.
_DAY = re.compile(r'(?:^|/)([^/]+)/(\d{4}-\d{2}-\d{2})\.json$')
_MENTION = re.compile(r'<@([A-Z0-9]{1,32})(?:\|([^>]{0,80}))?>')
_CHANNEL = re.compile(r'<#[A-Z0-9]{1,32}\|([^>]{0,80})>')
_LINK = re.compile(r'<((?:https?|mailto):[^|>]{1,2000})(?:\|([^>]{0,300}))?>')
_SPECIAL = re.compile(r'<!(here|channel|everyone)(?:\|[^>]*)?>')
_NOT_EXPORT = (
  'is not a Slack workspace export (no CHANNEL/YYYY-MM-DD.json files); in '
  'Slack choose Workspace settings > Import/Export data > Export, and give '
  'the .zip it makes or its unzipped folder'
)


def sources(inputs: list[str]) -> list[chatlog.Source]:
  """One chat per channel (or DM folder) of each export."""
  out = []
  for path in inputs:
    with exportfiles.ExportFiles(path, _NOT_EXPORT) as export:
      names = export.names
    days: dict[str, list[str]] = {}
    for name in names:
      m = _DAY.search(name)
      if m:
        days.setdefault(name[: m.start(2)], []).append(name)
    if not days:
      raise UserError(f'{path}: {_NOT_EXPORT}')
    for folder in sorted(days):
      channel = folder.rstrip('/').split('/')[-1] or 'slack'
      out.append(
        chatlog.Source((path, *sorted(days[folder])), f'slack-{channel}')
      )
  return out


def _users(export: exportfiles.ExportFiles) -> dict[str, tuple[str, str]]:
  """id -> (shown name, other name `--ai` may use) from `users.json`."""
  found = {}
  names = [n for n in export.names if n.split('/')[-1] == 'users.json']
  users = export.read_json(min(names, key=len), MAX_FILE) if names else None
  for user in users if isinstance(users, list) else []:
    if not isinstance(user, dict) or not isinstance(user.get('id'), str):
      continue
    profile = (
      user.get('profile') if isinstance(user.get('profile'), dict) else {}
    )
    shown = next(
      (
        v
        for v in (
          profile.get('display_name'),
          user.get('real_name'),
          profile.get('real_name'),
          user.get('name'),
        )
        if isinstance(v, str) and v.strip()
      ),
      user['id'],
    )
    other = user.get('name') if isinstance(user.get('name'), str) else ''
    found[user['id']] = (shown.strip(), other)
  return found


def text_of(text: str, users: dict) -> str:
  """Slack's markup as what a person reads."""
  text = _MENTION.sub(
    lambda m: '@' + (users.get(m.group(1), (m.group(2) or m.group(1),))[0]),
    text,
  )
  text = _CHANNEL.sub(lambda m: '#' + m.group(1), text)
  text = _LINK.sub(lambda m: m.group(2) or m.group(1), text)
  text = _SPECIAL.sub(lambda m: '@' + m.group(1), text)
  return text.replace('&lt;', '<').replace('&gt;', '>').replace('&amp;', '&')


def item(message, where: str, users: dict):
  """`(time, Message | Drop)` for one message object."""
  if not isinstance(message, dict) or message.get('type') != 'message':
    return 0.0, chatlog.Drop('unreadable')
  try:
    time = float(message.get('ts'))
  except (TypeError, ValueError, OverflowError):
    time = None
  if time is not None and not 0 <= time < 1e11:
    time = None
  order = time if time is not None else 0.0
  if message.get('subtype'):
    return order, chatlog.Drop('system notice')
  text = message.get('text')
  if not isinstance(text, str) or not text.strip():
    return order, chatlog.Drop('media')
  user = message.get('user')
  if not isinstance(user, str) or not user:
    return order, chatlog.Drop('unreadable')
  shown, other = users.get(user, (user, ''))
  alias = other if other and other != shown else user
  return order, chatlog.Message(where, time, shown, text_of(text, users), alias)


def items(source: chatlog.Source, warn):
  """Yields `Chat`, then the channel's messages, day by day in time order."""
  del warn
  path, *days = source.paths
  with exportfiles.ExportFiles(path, _NOT_EXPORT) as export:
    users = _users(export)
    yield chatlog.Chat(source.name)
    for day in days:
      messages = export.read_json(day, MAX_FILE)
      if not isinstance(messages, list):
        yield chatlog.Drop('unreadable')
        continue
      found = [
        item(m, f'{path}:{day}[{i}]', users) for i, m in enumerate(messages)
      ]
      found.sort(key=lambda pair: pair[0])
      for _, it in found:
        yield it
