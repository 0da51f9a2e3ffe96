"""Importers into the line format, and an exporter back to messages JSONL.

  python -m src.apps.convert messages   chats.jsonl      data/mine
  python -m src.apps.convert sharegpt   sharegpt.json    data/mine
  python -m src.apps.convert chatterbot a.yml b.yml data/mine --ai-side second
  python -m src.apps.convert chatterbot english data/chatterbot-english --trim
  python -m src.apps.convert chatterbot english data/smalltalk --trim \
      --skip coding,computers,tech_support,trivia
  python -m src.apps.convert transcript log.txt data/mine --user-prefix "Me:"
  python -m src.apps.convert cornell    cornell-corpus/  data/movies --trim
  python -m src.apps.convert taskmaster tm1.json ccpe.json data/tasks --trim
  python -m src.apps.convert subtitles  a.srt b.srt  data/films --gap 5 --trim
  python -m src.apps.convert to-messages data/           chats.jsonl

Each importer (`src/data/importers/`, one module per format) writes
`OUT/<input name>.txt` (one conversation per blank-line separated block)
that `src.data.chatformat` accepts, and never overwrites a file. A record that
does not fit is skipped with a warning that names it (`file:line` or
`file[index]`) and says why; `--strict` stops at the first one instead. A
summary ends every run.
"""

from __future__ import annotations

import argparse
import sys

from src.core.errors import UserError
from src.data.importers import FORMATS, base
from src.data.importers.base import Options, Report
from src.data.importers.chatterbot import chatterbot_files
from src.data.importers.to_messages import to_messages

__all__ = ['Options', 'Report', 'chatterbot_files', 'convert', 'main']


def convert(
  fmt: str, source: str, out_dir: str, opts: Options, warn=None, **kw
) -> Report:
  """Converts one input (a file; a folder for cornell) into
  `out_dir/<name>.txt`; returns the report.

  Args:
    fmt: A name in `src.data.importers.FORMATS`.
    source: The input.
    out_dir: Folder for the converted file.
    opts: Markers, trimming and strictness.
    warn: Receives one line per skipped record (default: stderr).
    **kw: Format options (ai_roles, user_roles, ai_side, user_prefix,
      ai_prefix, gap).
  """
  if fmt not in FORMATS:
    raise UserError(f'unknown format {fmt!r} (known: {", ".join(FORMATS)})')
  module = FORMATS[fmt]
  module.sources([source])
  warn = warn or base.warn_stderr
  report = Report()
  records = module.read(source, report, fmt=fmt, warn=warn, **kw)
  return base.write(records, source, out_dir, opts, warn, report)


def skip(sources: list[str], names: str) -> list[str]:
  """`sources` without those whose name (`base.stem`: the output file's
  name without .txt) is in the comma-separated `names`; a name that matches
  no input is an error."""
  wanted = [n.strip() for n in names.split(',') if n.strip()]
  stems = {base.stem(s) for s in sources}
  unknown = [n for n in wanted if n not in stems]
  if unknown:
    raise UserError(
      f'--skip {",".join(unknown)}: no such input (the inputs are '
      f'{", ".join(sorted(stems))})'
    )
  kept = [s for s in sources if base.stem(s) not in wanted]
  if not kept:
    raise UserError(f'--skip {names}: leaves no input to convert')
  return kept


def main(argv=None):
  parser = argparse.ArgumentParser(
    prog='python -m src.apps.convert', description=__doc__.split('\n')[0]
  )
  parser.add_argument('format', choices=[*FORMATS, 'to-messages'])
  parser.add_argument(
    'source',
    nargs='+',
    help='input file(s); cornell: the corpus folder; to-messages: one data '
    'folder',
  )
  parser.add_argument('out', help='output folder (to-messages: .jsonl file)')
  parser.add_argument(
    '--strict',
    action='store_true',
    help='stop at the first record that does not fit',
  )
  parser.add_argument(
    '--trim',
    action='store_true',
    help='drop a trailing user turn instead of skipping',
  )
  parser.add_argument(
    '--ai-roles',
    default='gpt,assistant,bot',
    help='sharegpt: "from" values of the AI',
  )
  parser.add_argument(
    '--user-roles',
    default='human,user',
    help='sharegpt: "from" values of the user',
  )
  parser.add_argument(
    '--ai-side',
    choices=['first', 'second'],
    default='second',
    help='chatterbot: which speaker of each list is the AI',
  )
  parser.add_argument(
    '--skip',
    default='',
    metavar='NAMES',
    help='comma-separated input names (file names without extension, e.g. '
    'chatterbot categories: coding,trivia) to leave out',
  )
  parser.add_argument('--user-prefix', default='User:', help='transcript')
  parser.add_argument('--ai-prefix', default='Bot:', help='transcript')
  parser.add_argument(
    '--gap',
    type=float,
    default=5.0,
    help='subtitles: a pause of more seconds starts a new conversation',
  )
  args = parser.parse_args(argv)
  if args.format == 'to-messages':
    if len(args.source) != 1:
      raise UserError('to-messages takes one data file or folder')
    report = to_messages(args.source[0], args.out)
    print(f'{args.format}: {report.summary()} -> {args.out}')
    return 0
  if args.gap <= 0:
    raise UserError(f'--gap {args.gap}: must be above 0 seconds (e.g. 5)')
  sources = skip(FORMATS[args.format].sources(args.source), args.skip)
  total = Report()
  for source in sources:
    total.add(
      convert(
        args.format,
        source,
        args.out,
        Options(trim=args.trim, strict=args.strict),
        ai_roles=args.ai_roles.split(','),
        user_roles=args.user_roles.split(','),
        ai_side=args.ai_side,
        user_prefix=args.user_prefix,
        ai_prefix=args.ai_prefix,
        gap=args.gap,
      )
    )
  print(
    f'{args.format}: {len(sources)} file(s): {total.summary()} -> {args.out}'
  )
  return 0


if __name__ == '__main__':
  from src.apps.cli import run_main

  sys.exit(run_main(main))
