"""Taskmaster-1/2/3 and CCPE-M JSON: a list of conversations (or one per
line), each with `utterances` (`index`, `speaker` USER/ASSISTANT, `text`,
optional `segments`) and an id (`conversation_id` or `conversationId`).

Utterances are taken in index order; a conversation may start with the
assistant.
"""

from __future__ import annotations

from src.data.importers.base import AI, USER, Skip, files
from src.data.importers.messages import read_records

sources = files
SPEAKERS = {'USER': USER, 'ASSISTANT': AI}


def turns_of(record) -> list[tuple]:
  if not isinstance(record, dict) or not isinstance(
    record.get('utterances'), list
  ):
    raise Skip('no "utterances" list')
  utterances = record['utterances']
  for u in utterances:
    if not isinstance(u, dict):
      raise Skip('an utterance is not an object')
  indexed = all(
    isinstance(u.get('index'), int) and not isinstance(u['index'], bool)
    for u in utterances
  )
  if indexed:
    utterances = sorted(utterances, key=lambda u: u['index'])
  turns = []
  for k, u in enumerate(utterances):
    speaker = u.get('speaker')
    if not isinstance(speaker, str) or speaker.upper() not in SPEAKERS:
      at = u.get('index', k)
      raise Skip(
        f'unknown speaker {speaker!r} at utterance {at} (USER or ASSISTANT)'
      )
    turns.append((SPEAKERS[speaker.upper()], u.get('text')))
  return turns


def read(path: str, report, **_):
  """Yields (where, turns | Skip) for each conversation of a file."""
  del report
  for where, record in read_records(path):
    if isinstance(record, dict):
      cid = record.get('conversation_id', record.get('conversationId'))
      if isinstance(cid, str) and cid:
        where = f'{where} ({cid})'
    try:
      if isinstance(record, Skip):
        raise record
      yield where, turns_of(record)
    except Skip as e:
      yield where, e
