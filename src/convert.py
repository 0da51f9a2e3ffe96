"""Importers into the line format, and an exporter back to messages JSONL.

  python -m src.convert messages   chats.jsonl      data/mine
  python -m src.convert sharegpt   sharegpt.json    data/mine
  python -m src.convert chatterbot a.yml b.yml data/mine --ai-side second
  python -m src.convert chatterbot english data/chatterbot-english --trim
  python -m src.convert transcript log.txt data/mine --user-prefix "Me:"
  python -m src.convert to-messages data/           chats.jsonl

Each importer writes `OUT/<input name>.txt` (one conversation per blank-line
separated block) that `src.chatformat` accepts, and never overwrites a file.
A record that does not fit is skipped with a warning that names it
(`file:line` or `file[index]`) and says why; `--strict` stops at the first
one instead. A summary ends every run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys

from src import chatformat
from src.errors import UserError

USER, AI = chatformat.USER, chatformat.AI


class Skip(Exception):
  """A record that does not fit; the message says why."""


@dataclasses.dataclass
class Report:
  conversations: int = 0
  turns: int = 0
  characters: int = 0
  skipped: collections.Counter = dataclasses.field(
    default_factory=collections.Counter
  )
  dropped_system: int = 0
  context_only: int = 0  # AI turns kept as context only ("weight": 0).

  def summary(self) -> str:
    text = (
      f'{self.conversations} conversations, {self.turns} turns, '
      f'{self.characters} characters'
    )
    if self.context_only:
      text += f'; {self.context_only} AI turns as context only (weight 0)'
    if self.dropped_system:
      text += f'; {self.dropped_system} system messages dropped'
    if self.skipped:
      why = '; '.join(f'{n} {reason}' for reason, n in self.skipped.items())
      text += f'; skipped {sum(self.skipped.values())} records ({why})'
    return text


@dataclasses.dataclass
class Options:
  markers: chatformat.Markers = dataclasses.field(
    default_factory=chatformat.Markers
  )
  trim: bool = False  # Drop a trailing user turn instead of skipping.
  strict: bool = False


def clean_message(text, markers: chatformat.Markers) -> str:
  """One message as one line: line breaks become the line-break marker."""
  if not isinstance(text, str):
    raise Skip('content is not text')
  for marker in (markers.ai_start, markers.ai_end):
    if marker in text:
      raise Skip(f'content contains the marker {marker}')
  parts = [p.strip() for p in text.replace('\r', '').split('\n')]
  line = f' {markers.line_break} '.join(p for p in parts if p)
  if not line:
    raise Skip('empty content')
  return line


def build(turns: list[tuple], opts: Options) -> list[tuple]:
  """Merges same-side runs, checks the ending.

  Args:
    turns: `(role, text)` or `(role, text, train)` tuples.
    opts: Markers, trimming.

  Returns:
    `(role, text, train)` turns. A merged turn is trained on only if all
    its messages are (an explicit `"weight": 0` wins).
  """
  merged: list[list] = []
  for role, text, *rest in turns:
    train = rest[0] if rest else True
    if merged and merged[-1][0] == role:
      merged[-1][1] += f' {opts.markers.line_break} {text}'
      merged[-1][2] = merged[-1][2] and train
    else:
      merged.append([role, text, train])
  if opts.trim:
    while merged and merged[-1][0] == USER:
      merged.pop()
  if not merged:
    raise Skip('no turns')
  if merged[-1][0] != AI:
    raise Skip('ends on a user turn (the AI must talk last; --trim drops it)')
  return [tuple(t) for t in merged]


def from_messages(
  record,
  opts: Options,
  report: Report,
  ai_roles=('assistant',),
  user_roles=('user',),
  key='messages',
  role_key='role',
  text_key='content',
):
  """One conversation from a messages / ShareGPT style record."""
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
    text = clean_message(message.get(text_key), opts.markers)
    turns.append((side, text, side == USER or weight == 1))
  return build(turns, opts)


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


def from_chatterbot(path: str, ai_side: str):
  """Yields (where, turns) from a ChatterBot corpus YAML file."""
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
    sides = [
      (AI if (k % 2 == 0) == first_ai else USER, text)
      for k, text in enumerate(conversation)
    ]
    yield f'{path}[{i}]', sides


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
  files = sorted(
    os.path.join(folder, n)
    for n in os.listdir(folder)
    if n.endswith(('.yml', '.yaml'))
  )
  if not files:
    raise UserError(f'{folder}: no .yml files')
  return files


def from_transcript(path: str, user_prefix: str, ai_prefix: str):
  """Yields (where, turns): prefixed lines, blank lines between chats."""
  lines = chatformat.read_text(path).split('\n')
  turns, start, bad = [], 1, False
  for no, raw in enumerate(lines + [''], 1):
    line = raw.strip()
    if not line:  # A blank line ends the conversation.
      if turns and not bad:
        yield f'{path}:{start}', turns
      turns, bad = [], False
      continue
    if bad:
      continue
    if not turns:
      start = no
    if line.startswith(user_prefix):
      turns.append([USER, line[len(user_prefix) :].strip(), no])
    elif line.startswith(ai_prefix):
      turns.append([AI, line[len(ai_prefix) :].strip(), no])
    elif turns:  # A continuation line of the previous message.
      turns[-1][1] += '\n' + line
    else:  # Skip this conversation, up to the next blank line.
      yield (
        f'{path}:{no}',
        Skip(f'line starts with neither {user_prefix!r} nor {ai_prefix!r}'),
      )
      bad = True


def convert(
  fmt: str, source: str, out_dir: str, opts: Options, warn=None, **kw
) -> Report:
  """Converts one input file into `out_dir/<name>.txt`; returns the report.

  Args:
    fmt: 'messages', 'sharegpt', 'chatterbot' or 'transcript'.
    source: The input file.
    out_dir: Folder for the converted file.
    opts: Markers, trimming and strictness.
    warn: Receives one line per skipped record (default: stderr).
    **kw: Format options (ai_roles, user_roles, ai_side, user_prefix,
      ai_prefix).
  """
  warn = warn or (lambda line: print(line, file=sys.stderr))
  if not os.path.isfile(source):
    raise UserError(f'{source}: no such file')
  report = Report()
  blocks = []

  def add(where, turns):
    try:
      if isinstance(turns, Skip):
        raise turns
      if fmt in ('messages', 'sharegpt'):
        built = turns
      else:
        built = build(
          [
            (role, clean_message(text, opts.markers))
            for role, text, *_ in turns
          ],
          opts,
        )
    except Skip as e:
      if opts.strict:
        raise UserError(f'{where}: {e}') from None
      warn(f'{where}: skipped: {e}')
      report.skipped[str(e).split(' (')[0]] += 1
      return
    m = opts.markers
    lines = [
      (
        ('' if train else chatformat.NO_LOSS + ' ')
        + f'{m.ai_start} {text} {m.ai_end}'
      )
      if role == AI
      else text
      for role, text, train in built
    ]
    blocks.append('\n'.join(lines))
    report.conversations += 1
    report.turns += len(built)
    report.characters += sum(len(text) for _, text, _ in built)
    report.context_only += sum(not train for _, _, train in built)

  if fmt in ('messages', 'sharegpt'):
    for where, record in read_records(source):
      try:
        if isinstance(record, Skip):
          raise record
        if fmt == 'messages':
          built = from_messages(record, opts, report)
        else:
          built = from_messages(
            record,
            opts,
            report,
            ai_roles=tuple(kw['ai_roles']),
            user_roles=tuple(kw['user_roles']),
            key='conversations',
            role_key='from',
            text_key='value',
          )
      except Skip as e:
        add(where, e)
        continue
      add(where, built)
  elif fmt == 'chatterbot':
    for where, turns in from_chatterbot(source, kw['ai_side']):
      add(where, turns)
  elif fmt == 'transcript':
    for where, turns in from_transcript(
      source, kw['user_prefix'], kw['ai_prefix']
    ):
      add(where, turns)
  else:
    raise UserError(f'unknown format {fmt!r}')
  if not blocks:
    raise UserError(
      f'{source}: no conversation could be converted ({report.summary()})'
    )
  os.makedirs(out_dir, exist_ok=True)
  name = os.path.splitext(os.path.basename(source))[0] + '.txt'
  target = os.path.join(out_dir, name)
  if os.path.exists(target):
    raise UserError(f'{target} exists; choose another output folder')
  with open(target, 'x', encoding='utf-8') as f:
    f.write('\n\n'.join(blocks) + '\n')
  chatformat.read_file(target, markers=opts.markers, repeat_limit=0)
  return report


def to_messages(data: str, out_path: str, markers=None) -> Report:
  """Exports conversations in the line format to messages JSONL."""
  markers = markers or chatformat.Markers()
  if os.path.exists(out_path):
    raise UserError(f'{out_path} exists; choose another file name')
  convs = chatformat.read_data(data, markers=markers, repeat_limit=0)
  report = Report()
  with open(out_path, 'x', encoding='utf-8') as f:
    for conv in convs:
      messages = []
      for t in conv.turns:
        message = {
          'role': 'assistant' if t.role == AI else 'user',
          'content': t.text.replace(f' {markers.line_break} ', '\n'),
        }
        if not t.train:
          message['weight'] = 0
          report.context_only += 1
        messages.append(message)
      f.write(json.dumps({'messages': messages}, ensure_ascii=False) + '\n')
      report.conversations += 1
      report.turns += len(messages)
      report.characters += sum(len(m['content']) for m in messages)
  return report


def main(argv=None):
  parser = argparse.ArgumentParser(
    prog='python -m src.convert', description=__doc__.split('\n')[0]
  )
  parser.add_argument(
    'format',
    choices=['messages', 'sharegpt', 'chatterbot', 'transcript', 'to-messages'],
  )
  parser.add_argument(
    'source', nargs='+', help='input file(s) (to-messages: one data folder)'
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
  parser.add_argument('--user-prefix', default='User:')
  parser.add_argument('--ai-prefix', default='Bot:')
  args = parser.parse_args(argv)
  if args.format == 'to-messages':
    if len(args.source) != 1:
      raise UserError('to-messages takes one data file or folder')
    report = to_messages(args.source[0], args.out)
    print(f'{args.format}: {report.summary()} -> {args.out}')
    return 0
  sources = args.source
  if args.format == 'chatterbot':
    sources = [f for s in sources for f in chatterbot_files(s)]
  total = Report()
  for source in sources:
    report = convert(
      args.format,
      source,
      args.out,
      Options(trim=args.trim, strict=args.strict),
      ai_roles=args.ai_roles.split(','),
      user_roles=args.user_roles.split(','),
      ai_side=args.ai_side,
      user_prefix=args.user_prefix,
      ai_prefix=args.ai_prefix,
    )
    total.conversations += report.conversations
    total.turns += report.turns
    total.characters += report.characters
    total.skipped.update(report.skipped)
    total.dropped_system += report.dropped_system
    total.context_only += report.context_only
  print(
    f'{args.format}: {len(sources)} file(s): {total.summary()} -> {args.out}'
  )
  return 0


if __name__ == '__main__':
  from src.cli import run_main

  sys.exit(run_main(main))
