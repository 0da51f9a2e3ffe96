"""Importers into the line format, one module per source format.

Every importer yields `(where, turns)` pairs: `where` names the record
(`file:line` or `file[index]`), `turns` is a list of `(role, text)` or
`(role, text, train)` tuples with the raw message text, or a `base.Skip`
saying why the record does not fit. `base.write` turns them into one
line-format file with the same warnings, summary, `--strict` and `--trim`
for every format. `python -m src.apps.convert` is the shared command line.
"""

from src.data.importers import (
  chatterbot,
  cornell,
  messages,
  subtitles,
  taskmaster,
  transcript,
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
