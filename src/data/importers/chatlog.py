"""A person's own chat exports into the line format: whose voice the model
learns, where a conversation ends, what is kept and what the app wrote.

The messenger importers (`whatsapp`, `telegram`, `discord`, `messenger`)
each turn one export into a stream of items: `Chat` (a new chat begins),
`Message` (a person wrote it) or `Drop` (the app wrote it: a media
placeholder, a deleted message, a call, a notice). `convert` reads every
export given, writes each as `OUT/<name>.txt`, and keeps nothing when any
of them fails: the files are written under temporary names and moved into
place only when all are done (an existing file is never replaced).

Memory stays bounded by one message, whatever the export's size: lines are
written as soon as the other side talks, and a conversation that must be
dropped whole (it ends with someone else talking, without `--trim`) is cut
from the file by truncating back to where it began.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import math
import os
import re
import unicodedata

from src.core.errors import UserError
from src.data import chatformat
from src.data.importers import wording
from src.data.importers.base import (
  AI,
  USER,
  AllOrNone,
  Options,
  Report,
  Skip,
  clean_message,
  speaker_label,
  targets,
)
from src.data.importers.redaction import redact

# A message longer than this (characters) is dropped with a warning: no
# chat message is, and it bounds what one message can hold in memory.
MAX_MESSAGE = 1 << 20
# A turn (one side's messages in a row, one line) longer than this is cut:
# what follows is left out and counted, so memory stays bounded whatever
# an export holds (4M messages of one sender are one turn).
MAX_TURN = 1 << 20
# Distinct senders counted by name; more are counted together ("others").
MAX_SENDERS = 10_000
# Default silence that starts a new conversation in a messenger chat.
DEFAULT_GAP = 6 * 3600.0


@dataclasses.dataclass(frozen=True)
class Chat:
  """A new chat (a thread, a channel) starts: a conversation ends here."""

  name: str


@dataclasses.dataclass(frozen=True)
class Message:
  """What a person wrote."""

  where: str  # file:line or file[index]
  time: float | None  # Seconds (any epoch); None if the export has none.
  sender: str
  text: str
  alias: str = ''  # Another name `--ai` may use (a user name, an id).


@dataclasses.dataclass(frozen=True)
class Drop:
  """What the app wrote (or nobody can read): counted, never written."""

  kind: str  # 'media', 'deleted', 'call', 'system notice', ...


@dataclasses.dataclass
class ChatOptions(Options):
  """The dataset formats' options (markers, `trim`: drop a trailing user
  turn instead of the whole conversation, `strict`: stop at the first
  message that does not fit) and the chat exports' own."""

  ai: tuple[str, ...] = ()  # Names whose messages become AI lines.
  gap: float = DEFAULT_GAP  # Seconds of silence that end a conversation.
  names: bool = False  # User lines carry "Name: text".
  redact: bool = False  # E-mail addresses, phone numbers, URLs replaced.
  pseudonyms: bool = False  # Other people's names as "Person N".


@dataclasses.dataclass
class ChatReport(Report):
  """What one conversion kept and dropped, for the summary: the dataset
  formats' counts, and who wrote what, what the app wrote, what was
  redacted."""

  messages: collections.Counter = dataclasses.field(
    default_factory=collections.Counter
  )  # Sender -> messages kept.
  ai_messages: int = 0
  dropped: collections.Counter = dataclasses.field(
    default_factory=collections.Counter
  )  # Kind -> messages the app wrote.
  redacted: collections.Counter = dataclasses.field(
    default_factory=collections.Counter
  )

  def add(self, other: ChatReport):
    super().add(other)
    self.messages.update(other.messages)
    self.ai_messages += other.ai_messages
    self.dropped.update(other.dropped)
    self.redacted.update(other.redacted)

  def summary(self, ai: tuple[str, ...] = ()) -> str:
    text = (
      f'{self.conversations} conversations, {self.turns} turns, '
      f'{self.characters} characters'
    )
    people = [
      f'{escaped(name, 80)}'
      + (' (AI)' if _matches(name, '', ai) else '')
      + f' {n}'
      for name, n in self.messages.most_common(8)
    ]
    if len(self.messages) > 8:
      people.append(f'{len(self.messages) - 8} more')
    if people:
      text += '; messages: ' + ', '.join(people)
    if self.dropped:
      text += '; dropped (the app wrote them): ' + ', '.join(
        f'{n} {kind}' for kind, n in self.dropped.most_common()
      )
    if self.redacted:
      text += '; redacted: ' + ', '.join(
        f'{n} {kind}' for kind, n in self.redacted.most_common()
      )
    if self.skipped:
      text += '; left out: ' + ', '.join(
        f'{n} {why}' for why, n in self.skipped.most_common()
      )
    return text


def parse_gap(text: str) -> float:
  """`--gap`: '6h', '90m', '45s', '2d', a bare number of seconds, or
  'never' (infinite)."""
  value = text.strip().lower()
  if value == 'never':
    return math.inf
  m = re.fullmatch(r'(\d+(?:\.\d+)?)\s*([smhd]?)', value)
  if not m or float(m.group(1)) <= 0:
    raise UserError(
      f'--gap {text}: write a duration above 0 with its unit (45s, 90m, 6h, '
      '2d; a bare number is seconds) or "never"'
    )
  unit = {'': 1, 's': 1, 'm': 60, 'h': 3600, 'd': 86400}[m.group(2)]
  return float(m.group(1)) * unit


def iso_seconds(value) -> float | None:
  """Seconds of an ISO 8601 time (UTC when it names no zone), or None
  when `value` is not one."""
  if not isinstance(value, str):
    return None
  try:
    when = datetime.datetime.fromisoformat(value)
    if when.tzinfo is None:
      when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()
  except (ValueError, OverflowError):
    return None


def wall_seconds(date: tuple, hms: tuple, pm: bool | None = None):
  """Seconds of a wall-clock time taken as UTC (an export's local time:
  only the gaps between messages count), or None when it is not a real
  date and time. `date`: (year, month, day); `hms`: (hour, minute,
  second); `pm`: None for a 24-hour clock, else whether the 12-hour time
  is after noon."""
  hour = int(hms[0])
  if pm is not None:
    if hour > 12:
      return None
    hour = hour % 12 + (12 if pm else 0)
  minute, second = int(hms[1]), int(hms[2])
  day = _day_seconds(*map(int, date))
  if day is None or hour > 23 or minute > 59 or second > 59:
    return None
  return day + hour * 3600 + minute * 60 + second


@functools.lru_cache(maxsize=4096)
def _day_seconds(year: int, month: int, day: int) -> int | None:
  """Seconds from the epoch to the start of a day (UTC), or None when it
  is no date: a cache, an export has a few thousand days."""
  try:
    start = datetime.datetime(year, month, day, tzinfo=datetime.UTC)
  except (ValueError, OverflowError):
    return None
  return int(start.timestamp())


def _key(name: str) -> str:
  return unicodedata.normalize('NFC', wording.clean_name(name)).casefold()


@functools.lru_cache(maxsize=1024)  # An export has a few senders.
def _matches(sender: str, alias: str, ai: tuple[str, ...]) -> bool:
  keys = {_key(a) for a in ai}
  return _key(sender) in keys or (bool(alias) and _key(alias) in keys)


class _Writer:
  """Writes one export's conversations into an open text file, merging
  each side's consecutive messages into one line and cutting a
  conversation that may not be kept."""

  def __init__(self, f, opts: ChatOptions, report: ChatReport, warn):
    self.f, self.opts, self.report, self.warn = f, opts, report, warn
    self.written = 0  # Conversations in the file.
    self._reset()

  def _reset(self):
    self.start = None  # Where the conversation began, once written to.
    self.role = None  # Side of the pending turn.
    self.parts: list[str] = []
    self.speaker = None  # Last speaker of the pending turn.
    self.pending = 0  # Characters of the pending turn.
    self.lines = 0
    self.chars = 0
    self.has_ai = False
    self.any = False

  def add(self, message: Message, role: str):
    try:
      line = clean_message(message.text, self.opts.markers)
    except Skip as e:
      if self.opts.strict:
        raise UserError(f'{message.where}: {e}') from None
      self.warn(f'{message.where}: left out: {e}')
      self.report.skipped[f'messages with {str(e).split(" ")[-1]}'] += 1
      return
    self.any = True
    if role != self.role:
      self._flush()
      self.role, self.speaker = role, None
    if self.opts.names and role == USER and message.sender != self.speaker:
      line = f'{speaker_label(message.sender, self.opts.markers)}: {line}'
    self.speaker = message.sender
    if self.pending + len(line) > MAX_TURN:
      self.report.skipped[f'messages past a turn of {MAX_TURN} characters'] += 1
      return
    self.pending += len(line) + len(self.opts.markers.line_break) + 2
    self.parts.append(line)

  def _flush(self):
    if not self.parts:
      return
    m = self.opts.markers
    text = f' {m.line_break} '.join(self.parts)
    if self.start is None:
      self.start = self.f.tell()
    if self.lines == 0 and self.written:
      self.f.write('\n')  # The blank line between conversations.
    self.f.write(chatformat.format_turn(self.role, text, m) + '\n')
    self.has_ai = self.has_ai or self.role == AI
    self.lines += 1
    self.chars += len(text)
    self.parts, self.pending = [], 0

  def end(self):
    """Ends the conversation: kept if the AI talks last (or `--trim` can
    make it so), else cut from the file."""
    if self.role == AI:
      self._flush()
    elif self.parts and self.opts.trim and self.has_ai:
      self.report.skipped['last user turns trimmed (--trim)'] += 1
    elif self.parts and not self.opts.trim:
      self._cut('conversations ending on a user turn (--trim keeps them)')
      return
    if not self.has_ai:
      if self.any:
        self._cut('conversations without an AI message')
      else:
        self._reset()
      return
    self.written += 1
    self.report.conversations += 1
    self.report.turns += self.lines
    self.report.characters += self.chars
    self._reset()

  def _cut(self, why: str):
    self.report.skipped[why] += 1
    if self.start is not None:
      self.f.seek(self.start)
      self.f.truncate()
    self._reset()


def write_chat(items, f, opts: ChatOptions, report: ChatReport, warn):
  """Writes the conversations of one export's `items` (see the module
  docstring) into the open text file `f`."""
  writer = _Writer(f, opts, report, warn)
  people = _Pseudonyms()
  last = None
  for item in items:
    if isinstance(item, Drop):
      report.dropped[item.kind] += 1
      continue
    if isinstance(item, Chat):
      writer.end()
      last = None
      continue
    text = item.text
    if len(text) > MAX_MESSAGE:
      warn(f'{item.where}: left out: longer than {MAX_MESSAGE} characters')
      report.skipped['messages too long'] += 1
      continue
    if opts.redact:
      text = redact(text, report.redacted)
    if item.time is not None:
      if last is not None and item.time - last > opts.gap:
        writer.end()
      last = item.time
    ai = _matches(item.sender, item.alias, opts.ai)
    counted = report.messages  # Real names: the summary is yours alone.
    if item.sender in counted or len(counted) < MAX_SENDERS:
      counted[item.sender] += 1
    else:
      counted[f'({MAX_SENDERS}+ others)'] += 1
    if opts.pseudonyms:
      item, text = people.disguise(item, text, ai)
    report.ai_messages += ai
    if text is not item.text:
      item = dataclasses.replace(item, text=text)
    writer.add(item, AI if ai else USER)
  writer.end()


class _Pseudonyms:
  """`--pseudonyms`: each person other than the AI becomes "Person N" (in
  order of their first message; the same person always the same), as a
  sender and where their name (or its first word of 3 letters or more) is
  written in a message from then on. A name mentioned before its owner's
  first message, and nicknames, stay."""

  def __init__(self):
    self.names: dict[str, str] = {}
    self.pattern = None

  def disguise(self, item, text: str, ai: bool):
    sender = item.sender
    if not ai and sender not in self.names and len(self.names) < MAX_SENDERS:
      self.names[sender] = f'Person {len(self.names) + 1}'
      self.pattern = self._compile()
    if self.pattern is not None:
      text = self.pattern.sub(lambda m: self._by_word[m.group(0).lower()], text)
    if sender in self.names:
      item = dataclasses.replace(item, sender=self.names[sender], alias='')
    return item, text

  def _compile(self):
    self._by_word = {}
    for name, placeholder in self.names.items():
      words = [name] + [w for w in name.split()[:1] if len(w) >= 3]
      for word in words:
        self._by_word.setdefault(word.lower(), placeholder)
    alternatives = sorted(self._by_word, key=len, reverse=True)
    return re.compile(
      r'(?<!\w)(?:' + '|'.join(map(re.escape, alternatives)) + r')(?!\w)',
      re.IGNORECASE,
    )


def escaped(text: str, limit: int) -> str:
  """`text` safe to print on a terminal: control characters (ANSI and OSC
  escapes, line breaks) shown as Python escapes, at most `limit`
  characters."""
  shown = ''.join(
    c if c.isprintable() else repr(c)[1:-1] for c in str(text)[:limit]
  )
  return shown + ('...' if len(str(text)) > limit else '')


def _participants(report: ChatReport) -> str:
  found = report.messages.most_common()
  shown = ', '.join(
    f'"{escaped(name, 80)}" ({n} messages)' for name, n in found[:20]
  )
  if len(found) > 20:
    shown += f' and {len(found) - 20} more'
  return shown


@dataclasses.dataclass(frozen=True)
class Source:
  """One export to convert: what to read and the output's name."""

  paths: tuple[str, ...]  # Files read together (Messenger's message_N).
  name: str  # Output file name without .txt.

  @property
  def shown(self) -> str:
    return (
      self.paths[0]
      if len(self.paths) == 1
      else os.path.dirname(self.paths[0])
      + os.sep
      + '{'
      + ','.join(os.path.basename(p) for p in self.paths)
      + '}'
    )


def convert(
  module, inputs: list[str], out_dir: str, opts: ChatOptions, warn
) -> ChatReport:
  """Converts every export in `inputs` with the importer `module` (its
  `sources(inputs) -> [Source]` and `items(source, warn) -> iterator`).
  Writes `out_dir/<name>.txt` for each, all or none; returns the report."""
  sources = module.sources(inputs)
  paths = targets([source.name for source in sources], out_dir)
  total = ChatReport()
  with AllOrNone(out_dir) as out:
    for source, target in zip(sources, paths):
      report = ChatReport()
      with out.open(target) as f:
        write_chat(module.items(source, warn), f, opts, report, warn)
      _check_report(source, report, opts)
      total.add(report)
  return total


def _check_report(source: Source, report: ChatReport, opts: ChatOptions):
  """One line for an export that gives nothing to train on: no one wrote
  in it, no `--ai` or one matching no one (the participants listed), or
  no conversation kept."""
  if not report.messages:
    raise UserError(
      f'{source.shown}: no message a person wrote was found '
      f'({report.summary()}); is it the right export?'
    )
  if not opts.ai:
    raise UserError(
      f'{source.shown}: say whose messages the model learns to write '
      f'with --ai NAME; the participants are {_participants(report)}'
    )
  if not report.ai_messages:
    raise UserError(
      f'{source.shown}: --ai {" / ".join(opts.ai)} matches no one; the '
      f'participants are {_participants(report)}'
    )
  if not report.conversations:
    trim = '' if opts.trim else '; --trim keeps those that end on a user turn'
    raise UserError(
      f'{source.shown}: no conversation could be kept '
      f'({report.summary(opts.ai)}){trim}'
    )
