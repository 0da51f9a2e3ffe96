"""OpenAI-style messages JSONL and ShareGPT JSON.

  {"messages": [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "weight": 0}]}
  {"conversations": [{"from": "human", "value": "Hi"},
                     {"from": "gpt", "value": "Hello"}]}

System messages are dropped (counted); `"weight": 0` keeps an assistant
message as context only.
"""

from __future__ import annotations

import json

from src.core.errors import UserError
from src.data import chatformat
from src.data.importers.base import AI, USER, Skip, files

sources = files


def read_records(path: str):
  """Yields (where, record) from a JSON list or a JSONL file."""
  text = chatformat.read_text(path)
  stripped = text.lstrip()
  if stripped.startswith('['):
    try:
      records = json.loads(text)
    except json.JSONDecodeError as e:
      raise UserError(f'{path}:{e.lineno}: not valid JSON ({e.msg})') from None
    except RecursionError:
      raise UserError(
        f'{path}: JSON nested too deeply to be a conversation list; write '
        'one conversation per line (JSONL) to skip such records instead'
      ) from None
    for i, record in enumerate(records):
      yield f'{path}[{i}]', record
    return
  for no, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      record = Skip(f'bad JSON ({e.msg})')
    except RecursionError:
      record = Skip('JSON nested too deeply')
    yield f'{path}:{no}', record


def turns_of(
  record,
  report,
  ai_roles=('assistant',),
  user_roles=('user',),
  key='messages',
  role_key='role',
  text_key='content',
) -> list[tuple]:
  """`(role, text, train)` turns of one messages / ShareGPT record."""
  if not isinstance(record, dict) or not isinstance(record.get(key), list):
    raise Skip(f'no "{key}" list')
  turns = []
  for message in record[key]:
    if not isinstance(message, dict):
      raise Skip('a message is not an object')
    role = message.get(role_key)
    if role == 'system':
      report.dropped_system += 1
      continue
    if role in ai_roles:
      side = AI
    elif role in user_roles:
      side = USER
    else:
      raise Skip(f'unknown role {role!r}')
    weight = message.get('weight', 1)
    if weight not in (0, 1) or isinstance(weight, bool):
      raise Skip(f'weight {weight!r} is not 0 or 1')
    turns.append((side, message.get(text_key), side == USER or weight == 1))
  return turns


def read(
  path: str,
  report,
  fmt: str = 'messages',
  ai_roles=('gpt', 'assistant', 'bot'),
  user_roles=('human', 'user'),
  **_,
):
  """Yields (where, turns | Skip) for each record of a messages or
  ShareGPT file."""
  if fmt == 'sharegpt':
    keys = dict(
      ai_roles=tuple(ai_roles),
      user_roles=tuple(user_roles),
      key='conversations',
      role_key='from',
      text_key='value',
    )
  else:
    keys = {}
  for where, record in read_records(path):
    try:
      if isinstance(record, Skip):
        raise record
      yield where, turns_of(record, report, **keys)
    except Skip as e:
      yield where, e
