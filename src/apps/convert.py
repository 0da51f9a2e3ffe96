"""Importers into the line format, and an exporter back to messages JSONL.

  python convert.py messages   chats.jsonl      data/mine
  python convert.py sharegpt   sharegpt.json    data/mine
  python convert.py chatterbot a.yml b.yml data/mine --ai-side second
  python convert.py chatterbot english data/chatterbot-english --trim
  python convert.py chatterbot english data/smalltalk --trim \
      --skip coding,computers,tech_support,trivia
  python convert.py transcript log.txt data/mine --user-prefix "Me:"
  python convert.py cornell    cornell-corpus/  data/movies --trim
  python convert.py taskmaster tm1.json ccpe.json data/tasks --trim
  python convert.py subtitles  a.srt b.srt  data/films --gap 5 --trim
  python convert.py to-messages data/           chats.jsonl

A person's own chats, from the apps' exports (`--ai NAME`: whose messages
the model learns to write; everyone else is the user):

  python convert.py whatsapp  "WhatsApp Chat with Sam.txt" data/me \
      --ai "Alex Doe" --trim
  python convert.py telegram  result.json      data/me --ai "Alex"
  python convert.py discord   general.json     data/me --ai alex
  python convert.py messenger inbox/sam_1/message_*.json data/me \
      --ai "Alex Doe" --gap 3h --names --redact
  python convert.py slack     "Acme Slack export.zip" data/me --ai alexd
  python convert.py imessage  imessage_export/  data/me --ai Me
  python convert.py signal    signal-chats/     data/me --ai Me
  python convert.py googlechat takeout-20240301.zip data/me \
      --ai alex@example.com

Each importer (`src/data/importers/`, one module per format) writes
`OUT/<input name>.txt` (one conversation per blank-line separated block)
that `src.data.chatformat` accepts, and never overwrites a file. A record that
does not fit is skipped with a warning that names it (`file:line` or
`file[index]`) and says why; `--strict` stops at the first one instead. A
summary ends every run.
"""

from __future__ import annotations

import argparse
import os
import sys

from src.core.errors import UserError
from src.data.importers import CHATS, FORMATS, base, chatlog, subtitles
from src.data.importers.base import Options, Report
from src.data.importers.chatterbot import chatterbot_files
from src.data.importers.to_messages import to_messages

__all__ = [
  'Options',
  'Report',
  'chatterbot_files',
  'convert',
  'convert_all',
  'main',
]


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
  return convert_all(fmt, [source], out_dir, opts, warn, **kw)


def convert_all(
  fmt: str, sources: list[str], out_dir: str, opts: Options, warn=None, **kw
) -> Report:
  """Converts each input into `out_dir/<name>.txt`, all or none: an input
  that stops the run (nothing left to convert, `--strict`, a read error)
  leaves no file of this run behind. Arguments as `convert`'s."""
  if fmt not in FORMATS:
    raise UserError(f'unknown format {fmt!r} (known: {", ".join(FORMATS)})')
  module = FORMATS[fmt]
  module.sources(sources)
  warn = warn or base.warn_stderr
  paths = base.targets([base.stem(s) for s in sources], out_dir)
  total = Report()
  with base.AllOrNone(out_dir) as out:
    for source, target in zip(sources, paths):
      report = Report()
      records = module.read(source, report, fmt=fmt, warn=warn, **kw)
      text = base.render(records, source, opts, warn, report)
      with out.open(target) as f:
        f.write(text)
      total.add(report)
  return total


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


def _chat_options(parser: argparse.ArgumentParser):
  """The options of the chat exports (whatsapp, telegram, ...)."""
  parser.add_argument(
    '--ai',
    action='append',
    default=[],
    metavar='NAME',
    help='chat exports: whose messages become AI lines (the name as the '
    'export writes it; repeat for several names); everyone else is the user',
  )
  parser.add_argument(
    '--names',
    action='store_true',
    help='chat exports: user lines start with the speaker ("Sam: hi"), for '
    'group chats',
  )
  parser.add_argument(
    '--redact',
    action='store_true',
    help='chat exports: e-mail addresses, phone numbers, links, IBANs, card '
    'and ID numbers and street addresses become <email>, <phone>, ...',
  )
  parser.add_argument(
    '--pseudonyms',
    action='store_true',
    help='chat exports: the other people\'s names become "Person 1", '
    '"Person 2", ... (the same person always the same), in --names and in '
    'what is written',
  )


def parser() -> argparse.ArgumentParser:
  """The command line (see the module docstring)."""
  parser = argparse.ArgumentParser(
    prog='python convert.py', description=__doc__.split('\n')[0]
  )
  parser.add_argument('format', choices=[*FORMATS, *CHATS, 'to-messages'])
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
    default=None,
    metavar='DURATION',
    help='a longer silence starts a new conversation: 45s, 90m, 6h, 2d (a '
    'bare number is seconds) or never; default 5s for subtitles, 6h for '
    'chat exports',
  )
  _chat_options(parser)
  return parser


def _out_folder(out: str, fmt: str):
  """OUT must be a folder (made if missing), never a file, a FIFO or a
  device (`/dev/null`), and writable; else one line saying so."""
  if os.path.lexists(out) and not (
    os.path.isdir(out) and not os.path.islink(out)
  ):
    what = 'a link' if os.path.islink(out) else 'not a folder'
    raise UserError(
      f'{out}: is {what}; give a new or existing folder for the converted '
      'files (to-messages: a new .jsonl file)'
      if fmt != 'to-messages'
      else f'{out}: exists; give a new .jsonl file'
    )
  parent = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(f'{parent}: cannot be written by you; choose another OUT')


def main(argv=None):
  args = parser().parse_args(argv)
  if args.format != 'to-messages':
    _out_folder(args.out, args.format)
  try:
    return _main(args)
  except OSError as e:  # A full disk, a folder taken away meanwhile, ...
    where = e.filename or args.out
    raise UserError(
      f'{where}: {e.strerror or e}; nothing was written (free some space or '
      'choose another OUT, then run it again)'
    ) from None


def _main(args):
  if args.format in CHATS:
    return _convert_chats(args)
  if args.ai or args.names or args.redact or args.pseudonyms:
    raise UserError(
      f'--ai, --names, --redact and --pseudonyms are for chat exports '
      f'({", ".join(CHATS)}),'
      f' not {args.format}'
    )
  if args.format == 'to-messages':
    if len(args.source) != 1:
      raise UserError('to-messages takes one data file or folder')
    report = to_messages(args.source[0], args.out)
    print(f'{args.format}: {report.summary()} -> {args.out}')
    return 0
  gap = subtitles.GAP if args.gap is None else chatlog.parse_gap(args.gap)
  sources = skip(FORMATS[args.format].sources(args.source), args.skip)
  total = convert_all(
    args.format,
    sources,
    args.out,
    Options(trim=args.trim, strict=args.strict),
    ai_roles=args.ai_roles.split(','),
    user_roles=args.user_roles.split(','),
    ai_side=args.ai_side,
    user_prefix=args.user_prefix,
    ai_prefix=args.ai_prefix,
    gap=gap,
  )
  print(
    f'{args.format}: {len(sources)} file(s): {total.summary()} -> {args.out}'
  )
  return 0


def _convert_chats(args) -> int:
  if args.skip:
    raise UserError('--skip is for dataset formats; name the exports to read')
  opts = chatlog.ChatOptions(
    ai=tuple(a for a in args.ai if a.strip()),
    gap=(
      chatlog.DEFAULT_GAP if args.gap is None else chatlog.parse_gap(args.gap)
    ),
    names=args.names,
    redact=args.redact,
    pseudonyms=args.pseudonyms,
    trim=args.trim,
    strict=args.strict,
  )
  report = chatlog.convert(
    CHATS[args.format], args.source, args.out, opts, base.warn_stderr
  )
  print(
    f'{args.format}: {len(args.source)} file(s): {report.summary(opts.ai)} '
    f'-> {args.out}'
  )
  return 0


if __name__ == '__main__':
  from src.apps.cli import run_main

  sys.exit(run_main(main))
