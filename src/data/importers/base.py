"""What every importer shares: skipping, cleaning, merging, writing."""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys
import tempfile

from src.core.errors import UserError
from src.data import chatformat

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
  # A skip reason's fix, where its message gives one ("--trim drops it").
  hints: dict = dataclasses.field(default_factory=dict)

  def add(self, other: Report):
    """Adds another file's counts to these."""
    self.conversations += other.conversations
    self.turns += other.turns
    self.characters += other.characters
    self.skipped.update(other.skipped)
    self.hints.update(other.hints)
    self.dropped_system += other.dropped_system
    self.context_only += other.context_only

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


# Control characters (C0 and C1, but the tab and the line feed: escapes,
# NUL, a carriage return hiding a marker) and lone surrogates (not UTF-8).
_CONTROL = re.compile('[\x00-\x08\x0b-\x1f\x7f-\x9f]')
_SURROGATE = re.compile('[\ud800-\udfff]')


def _plain(text: str) -> str:
  """`text` with line breaks as `\n`, other control characters as spaces
  and lone surrogates as `?` (format marks and joiners, which emoji are
  made of, are kept)."""
  text = text.replace('\r\n', '\n').replace('\r', '\n')
  if _SURROGATE.search(text):
    text = _SURROGATE.sub('?', text)
  return _CONTROL.sub(' ', text)


def clean_message(text, markers: chatformat.Markers) -> str:
  """One message as one line: line breaks become the line-break marker.
  Control characters go first (a `\r` inside a marker would hide it);
  a message holding the AI markers is skipped; the line-break marker and
  `|noloss|` typed in a message become spaces, so what is written is
  always a line `train.py` reads as this one message."""
  if not isinstance(text, str):
    raise Skip('content is not text')
  text = _plain(text)
  for marker in (markers.ai_start, markers.ai_end):
    if marker in text:
      raise Skip(f'content contains the marker {marker}')
  for marker in (markers.line_break, chatformat.NO_LOSS):
    text = text.replace(marker, ' ')
  parts = [p.strip() for p in text.split('\n')]
  line = f' {markers.line_break} '.join(p for p in parts if p)
  if not line:
    raise Skip('empty content')
  return line


def speaker_label(name: str, markers: chatformat.Markers) -> str:
  """A speaker's name as `--names` writes it before a message: one line,
  no control characters, no marker of the format (each becomes a space),
  at most 100 characters."""
  text = ' '.join(_plain(str(name)).split())
  for marker in (*markers.all(), chatformat.NO_LOSS):
    text = text.replace(marker, ' ')
  return ' '.join(text.split())[:100] or '?'


def build(turns: list[tuple], opts: Options) -> list[tuple]:
  """Cleans each message, merges same-side runs, checks the ending.

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
    text = clean_message(text, opts.markers)
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


def warn_stderr(line: str):
  print(line, file=sys.stderr)


def render(records, source: str, opts: Options, warn=None, report=None) -> str:
  """The conversations of one input as the text of its line-format file.

  Args:
    records: `(where, turns | Skip)` pairs from an importer.
    source: The input file or folder (named when nothing is left).
    opts: Markers, trimming and strictness.
    warn: Receives one line per skipped record (default: stderr).
    report: The `Report` the importer counts into (default: a new one).

  Raises:
    UserError: `--strict` met a record that does not fit, or no
      conversation is left (the line names the reasons and their fix).
  """
  warn = warn or warn_stderr
  report = Report() if report is None else report
  blocks = []
  m = opts.markers
  for where, turns in records:
    try:
      if isinstance(turns, Skip):
        raise turns
      built = build(turns, opts)
    except Skip as e:
      if opts.strict:
        raise UserError(f'{where}: {e}') from None
      warn(f'{where}: skipped: {e}')
      reason, _, hint = str(e).partition(' (')
      report.skipped[reason] += 1
      if hint:
        report.hints[reason] = hint.removesuffix(')')
      continue
    lines = [
      chatformat.format_turn(role, text, m, train)
      for role, text, train in built
    ]
    blocks.append('\n'.join(lines))
    report.conversations += 1
    report.turns += len(built)
    report.characters += sum(len(text) for _, text, _ in built)
    report.context_only += sum(not train for _, _, train in built)
  if not blocks:
    fix = ''.join(f'; {h}' for h in report.hints.values())
    raise UserError(
      f'{source}: no conversation could be converted ({report.summary()}){fix}'
    )
  text = '\n\n'.join(blocks) + '\n'
  chatformat.parse_text(text, source, markers=m, repeat_limit=0)
  return text


def targets(names: list[str], out_dir: str) -> list[str]:
  """`out_dir/<name>.txt` for each name (a repeated name numbered:
  `name-2.txt`), none of which may exist (else one line, before anything
  is written)."""
  seen = collections.Counter()
  paths = []
  for name in names:
    seen[name] += 1
    n = seen[name]
    path = os.path.join(out_dir, name + (f'-{n}' if n > 1 else '') + '.txt')
    if os.path.lexists(path):
      raise UserError(
        f'{path} exists; choose another output folder (nothing was written)'
      )
    paths.append(path)
  return paths


class AllOrNone:
  """Files of one conversion, all placed or none: `open(target)` writes a
  hidden temporary file beside the target; leaving the `with` block
  without an error places each at its target (never over a file that
  appeared meanwhile), with one removes every temporary file, and the
  output folder too when this made it and it is still empty."""

  def __init__(self, out_dir: str):
    self.out_dir = out_dir
    self.staged: list[tuple[str, str]] = []
    self.created = False

  def __enter__(self):
    self.created = not os.path.isdir(self.out_dir)
    os.makedirs(self.out_dir, exist_ok=True)
    return self

  def open(self, target: str):
    """A new temporary file (text, UTF-8, `\n` line ends) for `target`."""
    fd, tmp = tempfile.mkstemp(
      dir=self.out_dir, prefix='.' + os.path.basename(target), suffix='.partial'
    )
    self.staged.append((tmp, target))
    return os.fdopen(fd, 'w', encoding='utf-8', newline='\n')

  def __exit__(self, kind, error, trace):
    try:
      if kind is None:
        for tmp, target in self.staged:
          _place(tmp, target)
    finally:
      for tmp, _ in self.staged:
        if os.path.lexists(tmp):
          os.remove(tmp)
      if kind is not None and self.created and not os.listdir(self.out_dir):
        os.rmdir(self.out_dir)


def _place(tmp: str, target: str):
  """Moves `tmp` to `target` unless `target` exists (then a UserError)."""
  try:
    os.link(tmp, target)
  except FileExistsError:
    raise UserError(f'{target} exists; choose another output folder') from None
  except OSError:  # No hard links here: check, then rename.
    if os.path.lexists(target):
      raise UserError(
        f'{target} exists; choose another output folder'
      ) from None
    os.rename(tmp, target)
    return
  os.remove(tmp)


def files(inputs: list[str]) -> list[str]:
  """The inputs, each checked to be a file."""
  for path in inputs:
    if not os.path.isfile(path):
      raise UserError(f'{path}: no such file')
  return list(inputs)


def stem(path: str) -> str:
  """The output name for an input file or folder."""
  return os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
