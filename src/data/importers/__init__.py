"""Importers into the line format, one module per source format.

Two contracts, each a `Protocol` a module meets:
- `DatasetImporter` (`FORMATS`): `read` yields `(where, turns)` pairs:
  `where` names the record (`file:line` or `file[index]`), `turns` is a
  list of `(role, text)` or `(role, text, train)` tuples with the raw
  message text, or a `base.Skip` saying why the record does not fit.
  `base.render` turns them into one line-format file's text with the same
  warnings, summary, `--strict` and `--trim` for every format (written
  all or none: `base.AllOrNone`).
- `ChatImporter` (`CHATS`, a person's own chat exports): `items` yields
  messages with their sender and time (`chatlog.Message`), what the app
  wrote (`chatlog.Drop`) and where a chat starts (`chatlog.Chat`), as they
  stream; `chatlog.convert` chooses the sides and the conversations.
Every line is written by `chatformat.format_turn`. `python convert.py` is
the shared command line.
"""

from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

from src.data.importers import (
  base,
  chatlog,
  chatterbot,
  cornell,
  discord,
  googlechat,
  imessage,
  messages,
  messenger,
  signal,
  slack,
  subtitles,
  taskmaster,
  telegram,
  transcript,
  whatsapp,
)


@runtime_checkable
class DatasetImporter(Protocol):
  """A dataset format's module."""

  def sources(self, inputs: list[str]) -> list[str]:
    """The inputs to read, each checked (a file, a folder)."""

  def read(
    self, source: str, report: base.Report, **options
  ) -> Iterator[tuple[str, list | base.Skip]]:
    """`(where, turns | Skip)` per record, counting into `report`."""


@runtime_checkable
class ChatImporter(Protocol):
  """A messenger app's export module."""

  def sources(self, inputs: list[str]) -> list[chatlog.Source]:
    """One `Source` per export (its files and name)."""

  def items(
    self, source: chatlog.Source, warn: Callable[[str], None]
  ) -> Iterator[chatlog.Chat | chatlog.Message | chatlog.Drop]:
    """What the export holds, in order, as it streams."""


FORMATS: dict[str, DatasetImporter] = {
  'messages': messages,
  'sharegpt': messages,
  'chatterbot': chatterbot,
  'transcript': transcript,
  'cornell': cornell,
  'taskmaster': taskmaster,
  'subtitles': subtitles,
}

# A person's own chat exports, written by `chatlog.convert` with `--ai`,
# `--gap`, `--names`, `--redact`.
CHATS: dict[str, ChatImporter] = {
  'whatsapp': whatsapp,
  'telegram': telegram,
  'discord': discord,
  'messenger': messenger,
  'instagram': messenger,
  'slack': slack,
  'imessage': imessage,
  'signal': signal,
  'googlechat': googlechat,
}
