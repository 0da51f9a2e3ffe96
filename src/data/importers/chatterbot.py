"""ChatterBot corpus YAML (`conversations:` lists of alternating lines)."""

from __future__ import annotations

import os

from src.core.errors import UserError
from src.data import chatformat
from src.data.importers.base import AI, USER, Skip


def sources(inputs: list[str]) -> list[str]:
  return [f for source in inputs for f in chatterbot_files(source)]


def chatterbot_files(source: str) -> list[str]:
  """A YAML file; the `.yml` files of a folder; or a language name of the
  installed `chatterbot-corpus` package (`english`, `spanish`, ...)."""
  if os.path.isfile(source):
    return [source]
  folder = source
  if not os.path.isdir(folder):
    try:
      import chatterbot_corpus
    except ImportError:
      raise UserError(
        f'{source}: no such file or folder (and chatterbot-corpus is not '
        'installed: pip install chatterbot-corpus)'
      ) from None
    root = os.path.join(os.path.dirname(chatterbot_corpus.__file__), 'data')
    folder = os.path.join(root, source)
    if not os.path.isdir(folder):
      languages = ', '.join(sorted(os.listdir(root)))
      raise UserError(
        f'{source}: no such file or folder, nor a chatterbot-corpus '
        f'language ({languages})'
      )
  found = sorted(
    os.path.join(folder, n)
    for n in os.listdir(folder)
    if n.endswith(('.yml', '.yaml'))
  )
  if not found:
    raise UserError(f'{folder}: no .yml files')
  return found


def read(path: str, report, ai_side: str = 'second', **_):
  """Yields (where, turns | Skip) from a ChatterBot corpus YAML file."""
  del report
  import yaml

  text = chatformat.read_text(path)
  try:
    doc = yaml.safe_load(text)
  except (yaml.YAMLError, RecursionError) as e:
    raise UserError(f'{path}: not valid YAML ({e})') from None
  if not isinstance(doc, dict) or not isinstance(
    doc.get('conversations'), list
  ):
    raise UserError(
      f'{path}: no "conversations" list; is it a ChatterBot corpus file?'
    )
  first_ai = ai_side == 'first'
  for i, conversation in enumerate(doc['conversations']):
    if not isinstance(conversation, list):
      yield f'{path}[{i}]', Skip('a conversation is not a list')
      continue
    yield (
      f'{path}[{i}]',
      [
        (AI if (k % 2 == 0) == first_ai else USER, text)
        for k, text in enumerate(conversation)
      ],
    )
