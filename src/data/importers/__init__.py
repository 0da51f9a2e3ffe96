"""Importers into the line format, one module per source format.

Every importer yields `(where, turns)` pairs: `where` names the record
(`file:line` or `file[index]`), `turns` is a list of `(role, text)` or
`(role, text, train)` tuples with the raw message text, or a `base.Skip`
saying why the record does not fit (the dataset formats, `FORMATS`).
The chat exports of messenger apps (`CHATS`) yield messages with their
sender and time instead; `chatlog` chooses the sides and the
conversations. `base.write` turns them into one
line-format file with the same warnings, summary, `--strict` and `--trim`
for every format. `python convert.py` is the shared command line.
"""

from src.data.importers import (
  chatterbot,
  cornell,
  discord,
  messages,
  messenger,
  slack,
  subtitles,
  taskmaster,
  telegram,
  transcript,
  whatsapp,
)

# Format name -> module with `sources(inputs) -> [source]`,
# `read(source, **options) -> iterator of (where, turns | Skip)`.
FORMATS = {
  'messages': messages,
  'sharegpt': messages,
  'chatterbot': chatterbot,
  'transcript': transcript,
  'cornell': cornell,
  'taskmaster': taskmaster,
  'subtitles': subtitles,
}

# A person's own chat exports: module with `sources(inputs) -> [Source]`,
# `items(source, warn) -> iterator of Chat | Message | Drop`, written by
# `chatlog.convert` with `--ai`, `--gap`, `--names`, `--redact`.
CHATS = {
  'whatsapp': whatsapp,
  'telegram': telegram,
  'discord': discord,
  'messenger': messenger,
  'instagram': messenger,
  'slack': slack,
}
