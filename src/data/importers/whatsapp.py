"""WhatsApp's "Export chat": the `.txt`, or the `.zip` that holds it.

  Android:  12/03/2021, 14:22 - Alice: See you at 8?
  iOS:      [12/03/21, 14:22:01] Alice: See you at 8?
            ‎[12/03/21, 14:23:10] Bob: ‎image omitted

Every locale's layout is read: the date as day, month and year in the
locale's order (d/m/y, m/d/y or y-m-d) with `/`, `.` or `-`, a year of two
or four digits; the time in 24 hours or 12 (AM/PM, am/pm, `a. m.`, with a
space, a no-break or a narrow no-break space before it), with or without
seconds. The date order is found from the file itself: a first field above
12 is a day, and when every date fits both orders the one under which the
chat runs forward in time is taken (day first when both do, as most
locales write it). Lines without a timestamp continue the message above
(its own line breaks). What the app wrote is dropped and counted: lines
without a sender (group events, the encryption notice), iOS's text marked
with U+200E, and what `wording` knows the app writes (media, deleted
messages, missed calls... in every language WhatsApp ships); the
"<This message was edited>" mark is removed and the text kept. Also read:
Arabic-Indic digits and the Arabic comma, Buddhist and Japanese era
years, the time first (`[14:56:01, 3/18/22]`), iOS before 2017 without
brackets (`7/1/16, 4:56:55 PM: Alice: ...`), Android before 2014 with the
month's name (`19:23, 28 Aug 2013 - `, `Mar 5, 8:11 PM - `), and the
group notices it wrote under the exporter's name (`Alice: Bob joined`,
when Bob is one of the chat's people).

The file is read twice (once for the date order), line by line: memory does
not grow with the export.
"""

from __future__ import annotations

import io
import os
import re
import zipfile

from src.core.errors import UserError
from src.data.importers import chatlog, exportfiles, wording
from src.data.importers.base import stem

# A line longer than this (characters) is left out: no chat line is.
MAX_LINE = 1 << 20
# A zip member that inflates more than this many times its packed size is
# refused: text compresses about 3-10 times, a zip bomb thousands.
MAX_RATIO = 200

_SP = r'[ \u00a0\u202f]'
_MARKS = '\u200e\u200f\u061c\ufeff'  # Direction marks and the BOM.
_MARK = f'[{_MARKS}]*'
# A year: digits, or a Japanese era's letter and its year ("R4" is 2022),
# then the Buddhist era's name where Thai phones write it ("2565 BE").
_YEAR = r'[MTSHR]?\d{1,4}'
_DATE = (
  rf'(?P<a>{_YEAR}){_MARK}(?P<sep>[./-]){_MARK}(?P<b>\d{{1,2}}){_MARK}'
  rf'(?P=sep){_MARK}(?P<c>{_YEAR})\.?(?:{_SP}(?:BE|พ\.ศ\.))?'
)
# Before noon and after it, as the locales write them after the time.
_AM = (
  'ص', '午前', '上午', 'ก่อนเที่ยง', 'π.μ.', 'vorm.', 'de la mañana',
  'in the morning', 'SA',
)  # fmt: skip
_PM = (
  'م', '午後', '下午', 'หลังเที่ยง', 'μ.μ.', 'nachm.', 'de la tarde',
  'in the afternoon', 'in the evening', 'CH',
)  # fmt: skip
_NIGHT = ('at night', 'de la noche', 'de la madrugada')  # Before 6: AM.
_HALF = '|'.join(
  re.escape(w) for w in sorted(_AM + _PM + _NIGHT, key=len)[::-1]
)
_TIME = (
  r'(?P<hh>\d{1,2})[:.](?P<mm>\d{2})(?:[:.](?P<ss>\d{2}))?'
  rf'(?:{_SP}?(?P<ampm>[AaPp]\.?{_SP}?[Mm]\.?|{_HALF}))?'
)
# Words some locales put between the date and the time.
_AT = rf'(?:(?:um|à|a las|klo|kl\.|alle|om|в){_SP}+)?'
# Android's end of a header: " - ", then the sender and text.
_TAIL = rf'{_SP}*[-–]{_SP}(?P<rest>.*)$'
ANDROID = re.compile(rf'^{_MARK}{_DATE}[,،]?{_SP}+{_AT}{_TIME}{_TAIL}')
IOS = re.compile(
  rf'^{_MARK}\[{_MARK}{_DATE}[,،]?{_SP}+{_AT}{_TIME}\]{_SP}*(?P<rest>.*)$'
)
# iOS with the time first (Vietnamese: "[14:56:01, 3/18/22] Name: text"),
# and before WhatsApp 2.17 without brackets ("7/1/16, 4:56:55 PM: Name:").
IOS_TIME_FIRST = re.compile(
  rf'^{_MARK}\[{_MARK}{_TIME}[,،]{_SP}+{_DATE}\]{_SP}*(?P<rest>.*)$'
)
IOS_OLD = re.compile(rf'^{_MARK}{_DATE}[,،]?{_SP}+{_TIME}:{_SP}(?P<rest>.*)$')
# Android before 2014 in English wrote the month's name, the year only
# when not this one: "19:23, 28 Aug 2013 - ", "Mar 5, 8:11 PM - ",
# "18 Mar 12:14 - ".
_MONTHS = {
  m: n + 1
  for n, m in enumerate(
    'jan feb mar apr may jun jul aug sep oct nov dec'.split()
  )
}
_MONTH = (
  r'(?P<b>(?i:january|february|march|april|may|june|july|august|september|'
  r'october|november|december|jan|feb|mar|apr|jun|jul|aug|sept|sep|oct|nov|'
  r'dec))\.?'
)
_NAMED_YEAR = rf'(?:,?{_SP}(?P<c>\d{{4}}))?'
ANDROID_NAMED = re.compile(
  rf'^{_MARK}(?P<a>\d{{1,2}}){_SP}{_MONTH}{_NAMED_YEAR},?{_SP}+{_TIME}{_TAIL}'
)
ANDROID_NAMED_MDY = re.compile(
  rf'^{_MARK}{_MONTH}{_SP}(?P<a>\d{{1,2}}){_NAMED_YEAR},{_SP}+{_TIME}{_TAIL}'
)
ANDROID_NAMED_TIME_FIRST = re.compile(
  rf'^{_MARK}{_TIME},{_SP}+(?P<a>\d{{1,2}}){_SP}{_MONTH}{_NAMED_YEAR}{_TAIL}'
)
_LAYOUTS = (
  ('ios', IOS),
  ('android', ANDROID),
  ('ios-time-first', IOS_TIME_FIRST),
  ('ios-old', IOS_OLD),
  ('android-month-name', ANDROID_NAMED),
  ('android-month-name-first', ANDROID_NAMED_MDY),
  ('android-month-name-time-first', ANDROID_NAMED_TIME_FIRST),
)
# Arabic-Indic and Persian digits, and the Arabic comma, as a header is
# matched (each one character for one: the text keeps its own).
_HEAD_CHARS = str.maketrans('٠١٢٣٤٥٦٧٨٩۰۱۲۳۴۵۶۷۸۹،', '01234567890123456789,')
_ARABIC_HEAD = re.compile('[٠-٩۰-۹،]')
_ASCII_HEAD = frozenset('0123456789')  # A head that starts so needs none.
_HEAD_MARKS = '[' + _MARKS
# Thai phones write the Buddhist era: 2565 is 2022.
_BUDDHIST_ERA = 543
# The year of a date written without one (only the gaps between messages
# count; a leap year, so that February 29 is a date).
_SOME_LEAP_YEAR = 2000
# Japanese eras: the year before each one's first ("R1" is 2019).
_ERAS = {'M': 1867, 'T': 1911, 'S': 1925, 'H': 1988, 'R': 2018}
# Group events Android writes with a colon in them ("Alice changed the
# subject from "Trip" to "Trip: day 2""): their "sender" is no name.
_EVENT_SENDER = re.compile(
  r'changed the (?:subject|group description|group name)|created group|'
  r'hat den betreff|cambió el asunto|a modifié le sujet|mudou o assunto|'
  r'ha cambiato l\'oggetto|["“”]',
  re.IGNORECASE,
)
# A document's name as Android writes it under "<Media omitted>".
_FILE_NAME = re.compile(r'[^\n<>:"/\\|?*]{1,200}\.[A-Za-z0-9]{2,5}')
_NOT_EXPORT = (
  'is not a WhatsApp chat export (no line starts like "12/03/2021, 14:22 - '
  'Name: text" or "[12/03/21, 14:22:01] Name: text"); in WhatsApp open the '
  'chat, then More > Export chat, and give the .txt or .zip it makes'
)


def sources(inputs: list[str]) -> list[chatlog.Source]:
  """Each input (a .txt or .zip export) is one chat."""
  out = []
  for path in inputs:
    name = stem(path)
    if name in ('_chat', ''):
      name = 'whatsapp'
    out.append(chatlog.Source((path,), name))
  return out


MAX_ENTRIES = 100_000  # Entries of an export zip ("Include media": files).


def _member(zf: zipfile.ZipFile, path: str) -> zipfile.ZipInfo:
  """The chat text inside an export zip: `_chat.txt` (iOS), else the one
  `.txt` (Android's "WhatsApp Chat with X.txt", in any language)."""
  texts = [
    i
    for i in zf.infolist()
    if not i.is_dir()
    and i.filename.lower().endswith('.txt')
    and not exportfiles.is_mac_copy(i.filename)
  ]
  chosen = [i for i in texts if os.path.basename(i.filename) == '_chat.txt']
  if not chosen:
    chosen = (
      texts
      if len(texts) == 1
      else [i for i in texts if 'whatsapp' in i.filename.lower()]
    )
  if len(chosen) != 1:
    found = ', '.join(i.filename for i in texts[:5]) or 'no .txt file'
    raise UserError(
      f'{path}: holds {found}, not one chat file (_chat.txt or "WhatsApp Chat '
      'with NAME.txt"); give the zip WhatsApp made, or the .txt inside it'
    )
  info = chosen[0]
  if info.flag_bits & 0x1:
    raise UserError(f'{path}: {info.filename} is encrypted; unzip it first')
  if info.file_size > MAX_RATIO * max(info.compress_size, 1) and (
    info.file_size > 1 << 20
  ):
    raise UserError(
      f'{path}: {info.filename} would inflate {info.file_size} bytes from '
      f'{info.compress_size} (more than {MAX_RATIO}x): not a chat export; '
      'export the chat again'
    )
  return info


class _Lines:
  """Opens an export (.txt, or the chat inside a .zip) as numbered lines,
  each at most MAX_LINE characters; can be opened again."""

  def __init__(self, path: str, desc: str = ''):
    self.path, self.desc = path, desc

  def __iter__(self):
    with exportfiles.open_input(self.path) as raw:
      if zipfile.is_zipfile(raw):
        raw.seek(0)
        entries = exportfiles.zip_entries(raw)
        if entries is None or entries > MAX_ENTRIES:
          raise UserError(
            f'{self.path}: a zip of {entries or "too many"} entries, more than '
            f'an export holds ({MAX_ENTRIES}); export the chat again, or give '
            'the .txt inside it'
          )
        raw.seek(0)
        try:
          with zipfile.ZipFile(raw) as zf:
            info = _member(zf, self.path)
            with (
              zf.open(info) as member,
              exportfiles.progress(member, info.file_size, self.desc) as f,
            ):
              yield from self._read(f, f'{self.path}:{info.filename}')
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
          raise UserError(
            f'{self.path}: a damaged zip ({e}); export the chat again'
          ) from None
        return
      raw.seek(0)
      size = os.fstat(raw.fileno()).st_size
      with exportfiles.progress(raw, size, self.desc) as f:
        yield from self._read(f, self.path)

  @staticmethod
  def _read(binary, where: str):
    text = io.TextIOWrapper(binary, encoding='utf-8-sig', newline='')
    no = 0
    while True:
      try:
        line = text.readline(MAX_LINE)
      except UnicodeDecodeError:
        raise UserError(
          f'{where}:{no + 1}: not UTF-8 text; WhatsApp exports are UTF-8: '
          'give the file WhatsApp made, unchanged'
        ) from None
      if not line:
        return
      no += 1
      if len(line) == MAX_LINE and not line.endswith(('\n', '\r')):
        while line and not line.endswith(('\n', '\r')):
          line = text.readline(MAX_LINE)
        yield no, where, None  # Too long to be a chat line.
        continue
      yield no, where, line.rstrip('\r\n')


def _header(line: str):
  """(layout, match) for a line that starts a message, else None (see
  `_match`)."""
  line = _ascii_head(line)
  for layout, pattern in _LAYOUTS:
    m = pattern.match(line)
    if m:
      return layout, m
  return None


def _match(pattern, line: str):
  """`pattern`'s header match of `line`, or None: made on the line with
  the digits and commas of its head made ASCII (one character for one, so
  the match's positions are the line's: take the text from the line)."""
  return pattern.match(_ascii_head(line))


def _ascii_head(line: str) -> str:
  """`line` with the digits and commas of its head made ASCII."""
  first = line[:1]
  if first in _HEAD_MARKS:  # iOS: "[" and marks before the digits.
    first = line[:8].lstrip(_HEAD_MARKS)[:1]
  if first not in _ASCII_HEAD and _ARABIC_HEAD.search(line, 0, 48):
    line = line[:48].translate(_HEAD_CHARS) + line[48:]
  return line


def _sender(rest: str) -> tuple[str | None, str]:
  """(sender, text) of a header's rest; sender None for a group event."""
  sender, sep, body = rest.partition(':')
  if not sep or _EVENT_SENDER.search(sender) or len(sender) > 100:
    return None, rest
  return sender, body[1:] if body.startswith(' ') else body


def _order(path: str) -> tuple[str, str, wording.People]:
  """The file's layout (a name of `_LAYOUTS`), date order ('dmy', 'mdy',
  'ymd') and people, read from the whole file (see the module
  docstring)."""
  layouts = dict.fromkeys(dict(_LAYOUTS), 0)
  senders = set()
  possible = {'dmy': True, 'mdy': True}
  backwards = {'dmy': 0, 'mdy': 0}
  last = {'dmy': None, 'mdy': None}
  ymd = 0
  for _, _, line in _Lines(path, 'reading the dates'):
    found = line is not None and _header(line)
    if not found:
      continue
    layout, m = found
    layouts[layout] += 1
    rest = line[m.start('rest') :]
    if rest.partition(':')[0] not in senders:  # (A sender's name is that.)
      sender = _sender(rest)[0]
      if sender is not None and len(senders) < chatlog.MAX_SENDERS:
        senders.add(sender)
    a, b, c = m.group('a', 'b', 'c')
    if not b.isdigit():  # The month's name: the order is known.
      continue
    if len(a) == 4 or a[0] in _ERAS:
      ymd += 1
      continue
    a, b, c = _number(a), int(b), _number(c)
    for order, (day, month) in (('dmy', (a, b)), ('mdy', (b, a))):
      if month > 12 or day > 31 or not month or not day:
        possible[order] = False
        continue
      key = (c, month, day)
      if last[order] is not None and key < last[order]:
        backwards[order] += 1
      last[order] = key
  if not any(layouts.values()):
    raise UserError(f'{path}: {_NOT_EXPORT}')
  layout = max(layouts, key=layouts.get)
  people = wording.People(senders)
  if ymd and ymd >= sum(layouts.values()) / 2:
    return layout, 'ymd', people
  candidates = [o for o in ('dmy', 'mdy') if possible[o]] or ['dmy']
  order = min(candidates, key=lambda o: (backwards[o], o != 'dmy'))
  return layout, order, people


def _number(field: str) -> int:
  """A date field's number: digits, or a Japanese era's year."""
  if field[0] in _ERAS:
    return _ERAS[field[0]] + int(field[1:])
  return int(field)


def _time(m, order: str) -> float | None:
  """Seconds since the epoch (as if UTC) of a header, or None if it is
  not a real date and time."""
  a, b, c, hh, mm, ss, ampm = m.group('a', 'b', 'c', 'hh', 'mm', 'ss', 'ampm')
  if not b.isdigit():  # "28 Aug 2013", "Mar 5": no year is this year's.
    month = _MONTHS[b[:3].lower()]
    year, day = int(c) if c else _SOME_LEAP_YEAR, int(a)
  else:
    a, b, c = _number(a), int(b), _number(c)
    year, month, day = {'dmy': (c, b, a), 'mdy': (c, a, b), 'ymd': (a, b, c)}[
      order
    ]
  if year < 100:
    year += 2000
  elif year > 2400:
    year -= _BUDDHIST_ERA
  pm = (ampm[0] in 'Pp' or ampm in _PM) if ampm else None
  if ampm in _NIGHT:
    pm = int(hh) >= 6  # "9 at night" is 21:00, "1 at night" 01:00.
  return chatlog.wall_seconds((year, month, day), (hh, mm, ss or 0), pm)


def _finish(current, people: wording.People):
  """The item for a message whose lines are all read."""
  where, time, sender, lines, app = current
  text = '\n'.join(lines)
  if sender is None:
    return chatlog.Drop('system notice')
  if app:  # iOS marks what the app wrote with U+200E.
    kind = wording.kind(text)
    if kind is None and wording.CALL_LOG.match(text.strip(wording.MARKS)):
      kind = 'call'
    return chatlog.Drop(kind or 'system notice')
  text = wording.strip_edited(text)
  text = wording.poll_question(text) or text  # A poll: its question.
  kind = wording.kind(text, people=people)  # Old Android: group notices
  if kind:  # under the exporter's name.
    return chatlog.Drop(kind)
  first, _, caption = text.partition('\n')
  if caption.strip() and wording.kind(first) == 'media':
    if _FILE_NAME.fullmatch(caption.strip()):
      return chatlog.Drop('media')  # Android: a document, then its name.
    text = caption  # An attachment's line, then the caption written.
  if not text.strip(wording.MARKS + ' '):
    return chatlog.Drop('empty')
  return chatlog.Message(where, time, sender, text)


def items(source: chatlog.Source, warn):
  """Yields `Chat`, then a `Message` or `Drop` per message, in file
  order."""
  (path,) = source.paths
  layout, order, people = _order(path)
  pattern = dict(_LAYOUTS)[layout]
  yield chatlog.Chat(source.name)
  current = None  # [where, time, sender, lines, app]
  too_long = 0
  for no, where, line in _Lines(path, 'converting'):
    if line is None:
      too_long += 1
      warn(f'{where}:{no}: left out: a line of over {MAX_LINE} characters')
      continue
    m = _match(pattern, line)
    time = _time(m, order) if m else None
    if time is None:
      if current is not None:
        current[3].append(line)
        if sum(len(part) for part in current[3]) > 4 * MAX_LINE:
          warn(
            f'{current[0]}: left out: a message of over '
            f'{4 * MAX_LINE} characters'
          )
          yield chatlog.Drop('too long')
          current = None
      continue
    if current is not None:
      yield _finish(current, people)
    rest = line[m.start('rest') :]  # The line's own text, digits as written.
    sender, body = _sender(rest)
    if sender is None:
      current = [f'{where}:{no}', time, None, [rest], False]
      continue
    app = body.startswith('\u200e')
    current = [f'{where}:{no}', time, wording.clean_name(sender), [body], app]
  if current is not None:
    yield _finish(current, people)
