"""`--redact`: what identifies people in a chat, replaced by placeholders
(`<url>`, `<email>`, `<iban>`, `<card>`, `<id>`, `<address>`, `<phone>`)
and counted by kind; checksums decide IBANs and card numbers, and dates
and times stay."""

from __future__ import annotations

import collections
import re

# Redaction, most specific first: URLs (they hold digits and "@"), bare
# domains and invite links, e-mail addresses, IBANs (mod-97 checked), card
# numbers (Luhn checked), ID numbers with a reliable form (US SSN, UK
# National Insurance, a number after "passport"/"ID"/"SSN"), street
# addresses of the common forms, then phone numbers: 7 to 15 digits with
# the usual separators, not starting with a date (a date and a time).
# A URL or a path ends before trailing punctuation ("see x.com/a, then").
_PATH = r'[^\s<>"\']*[^\s<>"\'.,;:!?)]'
_URL = re.compile(r'\b(?:https?://|www\.)' + _PATH, re.IGNORECASE)
_EMAIL = re.compile(
  r'\b[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[a-z]{2,}\b', re.IGNORECASE
)
_TLDS = (
  'com|org|net|edu|gov|io|co|gg|me|ly|app|dev|ai|tv|uk|de|fr|es|it|nl|be|'
  'ch|at|se|no|dk|fi|pl|pt|br|ru|jp|cn|in|au|ca|us|info|biz|xyz|site|'
  'online|link|page|club|to|cz|gr|ie|mx|ar|tr|ua|kr'
)
# A domain name, with or without a path: "example.com/invite/x", "t.me/+x".
_DOMAIN = re.compile(
  r'(?<![\w@.-])(?:[a-z0-9-]+\.)+(?:'
  + _TLDS
  + r')(?![\w-])(?:/'
  + _PATH
  + ')?',
  re.IGNORECASE,
)
# (The country in any case: "es91 2100 ..."; the checksum decides.)
_IBAN = re.compile(r'\b(?i:[A-Z]{2})\d{2}(?:[ ]?[A-Z0-9]){11,30}\b')
_CARD = re.compile(r'(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])')
_SSN = re.compile(r'\b(?!000|666|9\d\d)\d{3}([- ])(?!00)\d{2}\1(?!0000)\d{4}\b')
_NINO = re.compile(
  r'\b[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b'
)
_ID_AFTER = re.compile(
  r'\b(passport|id card|identity card|id|ssn|social security|'
  r'driver.?s licen[cs]e|licen[cs]e|tax id|personalausweis|reisepass|dni|'
  r'pasaporte|passeport)(\s*(?:number|no\.?|nr\.?|num(?:ber|ero|éro)?|#)?'
  r'\s*(?:is|:)?\s*)([A-Z0-9][A-Z0-9-]{4,19})\b',
  re.IGNORECASE,
)
_STREET = re.compile(
  # "221B Baker Street", "1600 Pennsylvania Avenue".
  r'\b\d{1,5}[a-zA-Z]?\s+(?:[A-Z][\w\'-]*\s+){1,3}(?:Street|St|Avenue|Ave|'
  r'Road|Rd|Boulevard|Blvd|Lane|Ln|Drive|Dr|Court|Ct|Way|Place|Pl|Terrace|'
  r'Close|Crescent)\b\.?'
  # "Hauptstraße 12", "Kerkstraat 5", "Storgatan 3", "Nørregade 7".
  # (Up to 3 digits: "Spring 2010" is a year.)
  r'|\b[A-ZÄÖÜÆØÅ][\wäöüßæøå-]*(?:straße|strasse|str\.|weg|gasse|platz|'
  r'allee|damm|straat|laan|plein|gracht|singel|gatan|vägen|gata|gade|vej|'
  r'veien)\s+\d{1,3}[a-z]?\b'
  # "Rua das Flores 45", "calle Mayor 5", "via Roma 10".
  r'|\b(?i:Rua|Avenida|Calle|Carrer|Via|Viale|Rue|Boulevard|Avenue|Plaza|'
  r'Praça|Largo|Piazza|Corso|Paseo)\s+(?:(?:de|da|do|del|della|la|le|des|'
  r'dos|das)\s+)?(?:[A-ZÀ-Ý][\wÀ-ÿ\'-]*\s+){1,3},?\s*(?:n[º°o.]\s*)?'
  r'\d{1,4}[a-z]?\b'
  # "42 rue de Rivoli", "12 bis avenue Foch".
  r'|\b\d{1,4}(?:\s?(?:bis|ter))?,?\s+(?i:rue|avenue|boulevard|place|'
  r'chemin|allée|impasse|quai|route)\s+(?:(?:de la|de|du|des|d\')\s*)?'
  r'[A-ZÀ-Ý][\wÀ-ÿ\'-]*'
)
# (Not from inside a time: "20:08 11/12/19" holds no phone number.)
_PHONE = re.compile(
  r'(?<![\w+(])(?<!\d[:.])(?:\+|\(|\b)\d(?:[ ./-]?\(?\d\)?){6,16}(?!\w)'
)
# What the phone pattern also finds but is dates and times: "30/08/2022",
# "2020-10-15 10:00", "10.00-12.00", "18.30/19.00", "24-26/12/2021".
_CLOCK = r'\d{1,2}[:.][0-5]\d(?:[:.][0-5]\d)?'
_PIECE = re.compile(
  r'(?P<a>\d{1,4})(?P<sep>[./-])(?P<b>\d{1,2})(?P=sep)(?P<c>\d{4}|\d{2})\b'
  rf'|(?P<clock>{_CLOCK})\b|(?P<small>\d{{1,2}})\b'
)
_BETWEEN = re.compile(r'[\s,T/–-]*')


def _date_or_time(text: str) -> bool:
  """Whether `text` is dates and times only: real dates (day and month in
  either order, or the year first) and clock times, with at most one
  small number (an hour, a day of a range) between them."""
  i, small, real = 0, 0, False
  while i < len(text):
    m = _PIECE.match(text, i)
    if not m:
      return False
    if m.group('small'):
      small += 1
    elif m.group('clock') or _real_date(m):
      real = True
    else:
      return False
    i = _BETWEEN.match(text, m.end()).end()
    if i == m.end() and i < len(text):
      return False
  return real and small <= 1


def _real_date(m) -> bool:
  a, b, c = (int(m.group(k)) for k in 'abc')
  if len(m.group('a')) == 4:
    return 1 <= b <= 12 and 1 <= c <= 31
  return len(m.group('a')) <= 2 and (
    (1 <= a <= 31 and 1 <= b <= 12) or (1 <= a <= 12 and 1 <= b <= 31)
  )


def _iban_ok(text: str) -> bool:
  """The IBAN checksum (ISO 13616: mod 97 of the rearranged digits is 1)."""
  code = text.replace(' ', '').upper()
  if not 15 <= len(code) <= 34:
    return False
  moved = code[4:] + code[:4]
  digits = ''.join(str(int(c, 36)) for c in moved)
  return int(digits) % 97 == 1


def _luhn_ok(text: str) -> bool:
  """A payment card number's Luhn check digit holds."""
  digits = [int(c) for c in text if c.isdigit()]
  if not 13 <= len(digits) <= 19 or len(set(digits)) == 1:
    return False
  total = 0
  for i, d in enumerate(reversed(digits)):
    if i % 2:
      d = d * 2 - 9 if d > 4 else d * 2
    total += d
  return total % 10 == 0


def redact(text: str, counts: collections.Counter) -> str:
  """`text` with what identifies people replaced by `<url>`, `<email>`,
  `<iban>`, `<card>`, `<id>`, `<address>` and `<phone>`; `counts` counts
  each kind. Checksums decide IBANs and cards, so a long number that is
  neither stays."""

  def sub(kind, check=None):
    def replace(m):
      if check is not None and not check(m.group(0)):
        return m.group(0)
      counts[kind] += 1
      return f'<{kind}>'

    return replace

  def id_after(m):
    if not any(c.isdigit() for c in m.group(3)):
      return m.group(0)  # "ID card" followed by a word.
    counts['id'] += 1
    return f'{m.group(1)}{m.group(2)}<id>'

  def iban(m):
    # The match may run on into a group of the next words ("... 00 OK"):
    # whole groups are taken off its end until the checksum holds.
    found = cut = m.group(0)
    while len(cut.replace(' ', '')) >= 15:
      if _iban_ok(cut):
        counts['iban'] += 1
        return '<iban>' + found[len(cut) :]
      if ' ' not in cut:
        break
      cut = cut[: cut.rindex(' ')]
    return found

  def phone(m):
    found = m.group(0)
    digits = sum(ch.isdigit() for ch in found)
    if digits < 7 or digits > 15 or _date_or_time(found.strip('()')):
      return found
    counts['phone'] += 1
    return '<phone>'

  text = _URL.sub(sub('url'), text)
  text = _EMAIL.sub(sub('email'), text)
  text = _DOMAIN.sub(sub('url'), text)
  text = _IBAN.sub(iban, text)
  text = _CARD.sub(sub('card', _luhn_ok), text)
  text = _SSN.sub(sub('id'), text)
  text = _NINO.sub(sub('id'), text)
  text = _ID_AFTER.sub(id_after, text)
  text = _STREET.sub(sub('address'), text)
  return _PHONE.sub(phone, text)
