"""What messenger apps write into a chat export that no person wrote:
WhatsApp's first, then Messenger's and Instagram's (`MESSENGER_NAMED`,
`MESSENGER_BARE`); Telegram and Discord mark theirs with a type in the
JSON.

WhatsApp's come from two sources, matched against a whole message after
its ends are stripped: `whatsapp_wording.json`, WhatsApp's own strings in
every language its apps ship (40+: deleted messages, missed calls,
left-out images, videos, audio, stickers, GIFs, documents and contact
cards, attachments, locations, the end-to-end notice, security codes,
group notices; the file names its source and each string's key), and the
patterns below, for what the table lacks (view-once media, "waiting for
this message", the edit mark, older and Android-only wordings in the
languages seen in real exports). `kind(text)` names what a message is
when the app wrote it ('media', 'deleted', 'call', 'system notice') and
`None` when a person did; `strip_edited(text)` removes the "edited" mark
that WhatsApp appends and keeps the text."""

from __future__ import annotations

import functools
import json
import os
import re
import unicodedata

# Whole-message placeholders for a photo, video, voice note, sticker, GIF,
# document or contact that the export left out, and attachment names.
_MEDIA = [
  # Android: "<Media omitted>" and its translations.
  r'[<‹](?:media omitted|medien ausgeschlossen|medien weggelassen|'
  r'multimedia omitido|archivo multimedia omitido|médias omis|'
  r'fichier multimédia omis|mídia oculta|arquivo de mídia oculto|'
  r'media omessi|media weggelaten|multimedia omesso|без медиафайлов|'
  r'média vynechána|média vynechány|médium vynecháno|'
  r'تم استبعاد الوسائط|メディアは含まれていません|'
  r'ไม่รวมสื่อ|media dihilangkan|media dihapus|medya dahil edilmedi|'
  r'pominięto multimedia|media jätetty pois|media utelatt|'
  r'media udeladt|media utelämnad|πολυμέσα παραλείφθηκαν|multimedia omitted)'
  r'[>›]',
  # Android: a view-once photo or video once it was opened.
  r'null',
  r'<(?:view once|einmalige ansicht|ver una vez|vue unique|visualização '
  r'única|visualizza una volta)[^<>]{0,40}(?:omitted|weggelassen|omitid[oa]|'
  r'omis|omise|ocultad[oa]|omess[oa])>',
  # iOS: "image omitted", "sticker omitted" ... in each language.
  r'(?:image|video|audio|sticker|gif|document|contact card|'
  r'bild|audio|dokument|kontaktkarte|'
  r'imagen|vídeo|tarjeta de contacto|'
  r'vidéo|autocollant|fiche contact|'
  r'imagem|figurinha|cartão de contato|'
  r'immagine|scheda contatto|documento)'
  r' (?:omitted|weggelassen|omitid[oa]|absente?|omise?|omis|'
  r'ocultad[oa]|omess[oa])',
  r'(?:gif|sticker|audio|video|document|documento|dokument) ?'
  r'(?:omitted|weggelassen|omitid[oa]|omis|omess[oa]|ocultad[oa])',
  r'(?:изображение|видео|аудио|стикер|gif|документ) (?:опущено|опущен)',
  # iOS attachment lines: "<attached: 00000012-PHOTO-2021-03-04.jpg>".
  r'<(?:attached|anhang|adjunto|pièce jointe|joint|anexado|anexo|'
  r'allegato|bijlage): [^<>]{1,300}>',
  # Shared locations.
  r'(?:location|standort|ubicación|position|localização|posizione|'
  r'местоположение|геопозиция|poloha|umístění|الموقع|位置情報|sijainti|'
  r'lokalizacja|konum|locatie): https?://\S+',
  # Any language: a place's name or "Location", then its map link.
  r'[^\n:]{1,40}: https://maps\.google\.com/\?q=\S+',
  r'(?:live location shared|live-standort wird geteilt|ubicación en tiempo '
  r'real compartida|position en direct partagée|localização em tempo real '
  r'compartilhada|posizione in tempo reale condivisa)',
]

# Placeholders that start with a name (a file's, a place's): a pattern
# that starts with "anything" is tried at every length of a message, so
# each is tried only on a message that ends as it does (`_named_media`).
_DOCUMENT_ENDS = (
  'omitted', 'weggelassen', 'omitido', 'omitida', 'omis', 'omesso', 'omessa',
  'ocultado', 'ocultada', 'опущен',
)  # fmt: skip
_NAMED_MEDIA = [
  # iOS: a document's name, its pages, then "document omitted".
  (
    _DOCUMENT_ENDS,
    r'[^\n]{1,300}[\s\u200e](?:document|dokument|documento|документ) '
    r'(?:omitted|weggelassen|omitid[oa]|omis|omess[oa]|ocultad[oa]|опущен)',
  ),
  # Android with media: "IMG-20210304-WA0001.jpg (file attached)".
  (
    (')',),
    r'[^\n]{1,300}\.\w{1,5} \((?:file attached|datei angehängt|archivo '
    r'adjunto|fichier joint|arquivo anexado|file allegato|bestand '
    r'bijgevoegd)\)',
  ),
  # A foursquare venue: its name (and address) on the line(s) before.
  (
    None,
    r'[^\n]{1,200}(?::|(?:\n[^\n]{1,200}){0,2}\n)'
    r' ?https://foursquare\.com/\S+',
  ),
]
_NAMED_COMPILED = [
  (ends, re.compile(f'(?:{pattern})\\Z', re.IGNORECASE))
  for ends, pattern in _NAMED_MEDIA
]


def _named_media(body: str) -> bool:
  """Whether `body` is one of `_NAMED_MEDIA`: the cheap check first."""
  low = body[-16:].casefold()
  for ends, pattern in _NAMED_COMPILED:
    if ends is None:
      if 'foursquare.com/' not in body:
        continue
    elif not low.endswith(ends):
      continue
    if pattern.match(body):
      return True
  return False


# "This message was deleted" (by the other person) and "You deleted this
# message" where the table lacks a wording, and messages the phone never
# received.
_DELETED = [
  r'tu as supprimé ce message\.?',
  r'essa mensagem foi apagada\.?',
  r'você apagou essa mensagem\.?',
  r'je hebt dit bericht verwijderd\.?',
  r'это сообщение было удалено\.?',
  r'smazali jste tuto zprávu\.?',
  r'odstranili jste tuto zprávu\.?',
  r'لقد حذفت هذه الرسالة\.?',
  r'メッセージを削除しました。?',
  r'usunięto tę wiadomość\.?',
  r'bu mesajı sildiniz\.?',
  r'waiting for this message\. this may take a while\.?',
  r'warte auf diese nachricht\.[^\n]{0,60}',
  r'esperando el mensaje\.[^\n]{0,60}',
  r'en attente de ce message\.[^\n]{0,60}',
  r'aguardando mensagem\.[^\n]{0,60}',
  r'in attesa di questo messaggio\.[^\n]{0,60}',
]

# Calls the app logged as messages.
_CALL = [
  r'missed (?:voice|video|group voice|group video) call',
  r'verpasster (?:sprach|video|gruppen)?anruf',
  r'(?:llamada|videollamada|llamada de voz) perdida',
  r'appel (?:vocal |vidéo |de groupe )?manqué',
  r'chamada de (?:voz|vídeo) perdida',
  r'(?:chiamata vocale|videochiamata|chiamata) persa',
  r'пропущенный (?:аудиозвонок|видеозвонок|звонок|групповой '
  r'(?:аудио|видео)звонок)',
  r'zmeškaný (?:hlasový hovor|videohovor|hovor|skupinový hovor)',
  r'مكالمة (?:صوتية|فيديو) فائتة',
  r'不在着信(?:（音声）|（ビデオ）)?',
  r'(?:vastaamaton|vastaamattomat) (?:äänipuhelu|videopuhelu)',
  r'nieodebrane połączenie(?: głosowe| wideo)?',
  r'cevapsız (?:sesli|görüntülü) arama',
]
# A call line iOS writes (after its U+200E mark): "Voice call, 3 min".
CALL_LOG = re.compile(
  r'(?:voice call|video call|sprachanruf|videoanruf|llamada de voz|'
  r'videollamada|appel vocal|appel vidéo|chamada de voz|chamada de vídeo|'
  r'chiamata vocale|videochiamata)\b',
  re.IGNORECASE,
)

# Notices about the chat itself that can come under a sender's name (iOS
# writes them under the chat's name). Android writes group events without
# a sender, and iOS marks its own text with U+200E: the importers drop
# those whatever they say, so group events need no list here, and a
# person's "I left early" is never taken for one.
_SYSTEM = [
  r'messages (?:and calls )?are end-to-end encrypted\.[^\n]*',
  r'nachrichten und anrufe sind ende-zu-ende-verschlüsselt\.[^\n]*',
  r'los mensajes y las llamadas están cifrados de extremo a extremo\.'
  r'[^\n]*',
  r'les messages et les appels sont chiffrés de bout en bout\.[^\n]*',
  r'as mensagens e as chamadas são protegidas com a criptografia de ponta '
  r'a ponta[^\n]*',
  r'i messaggi e le chiamate sono crittografati end-to-end\.[^\n]*',
  r'(?:your )?security code (?:with [^\n]{1,80} )?changed\.[^\n]*',
  r'(?:dein |ihr )?sicherheitsnummer[^\n]{0,80}geändert\.[^\n]*',
  r'this chat is with a business account\.[^\n]*',
  r'disappearing messages (?:were|are) [^\n]*',
  r'[^\n]{0,80} turned (?:on|off) disappearing messages\.[^\n]*',
]

_KINDS = [
  ('deleted', _DELETED),
  ('call', _CALL),
  ('media', _MEDIA),
  ('system notice', _SYSTEM),
]
_COMPILED = [
  (name, re.compile('(?:' + '|'.join(pats) + r')\Z', re.IGNORECASE))
  for name, pats in _KINDS
]

# "<This message was edited>" after a message's text, in each language.
_EDITED = re.compile(
  r'[\s\u200e]*<(?:this message was edited|diese nachricht wurde bearbeitet|'
  r'se editó este mensaje\.?|este mensaje fue editado|ce message a été '
  r'modifié|mensagem editada|essa mensagem foi editada|questo messaggio è '
  r'stato modificato|dit bericht is bewerkt|сообщение изменено|'
  r'zpráva byla upravena|تم تعديل هذه الرسالة|編集済み|'
  r'tätä viestiä on muokattu)\.?>\s*\Z',
  re.IGNORECASE,
)

# Direction and invisible marks an app puts around names and notices.
MARKS = '\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069'
MARKS += '\ufeff'
# What a user may be sure is not text: the end of a message after them.
_STRIP = MARKS + ' \t\u00a0\u202f'


_HERE = os.path.dirname(os.path.abspath(__file__))
_TABLE = os.path.join(_HERE, 'whatsapp_wording.json')
_NO_MARKS = str.maketrans({m: ' ' for m in MARKS + '\u00a0\u202f'})
_NO_MARKS.update(str.maketrans(dict.fromkeys('“”„«»', '"')))  # Quotes as one.
_ENDS = '.。। '


def _key(text: str) -> str:
  """`text` as the table holds it: marks and odd spaces made spaces,
  quotes made '"' (Android's strings write "{}", its exports “{}”),
  spaces collapsed, casefolded, composed alike (NFC), without a final
  period."""
  if not text.isascii():  # (ASCII has no marks and is composed.)
    text = unicodedata.normalize('NFC', text.translate(_NO_MARKS))
  return ' '.join(text.split()).casefold().rstrip(_ENDS)


class _Table:
  """`whatsapp_wording.json`, read once, as sets and tuples: a lookup per
  message whatever the number of languages (a regex of a thousand
  alternatives would be tried branch by branch on every message)."""

  def __init__(self, path: str = _TABLE):
    with open(path, encoding='utf-8') as f:
      table = json.load(f)
    self.whole = {}  # key -> kind, for whole messages.
    self.wrapped = set()  # Android's "<Media omitted>": only in <...>.
    for name in ('deleted', 'call', 'media'):
      for what, texts in table[name].items():
        if what.startswith('<'):
          self.wrapped.update(_key(t) for t in texts)
        else:
          self.whole.update((_key(t), name) for t in texts)
    self.document = tuple(' ' + _key(t) for t in table['document omitted'])
    self.attached = {_key(t) for t in table['attached']}
    self.file_attached = {_key(t) for t in table['file attached']}
    self.location = {_key(t) for t in table['location']}
    notices = list(table['system notice'].values())
    self.notice = tuple(_key(t) for t in notices[0])
    self.group = _GroupNotices(table['group notice'])
    self.code = []  # (its longest fixed part, the whole as a pattern)
    for text in notices[1]:
      parts = _key(text).split('{}')
      pattern = re.compile('.{1,80}?'.join(map(re.escape, parts)))
      self.code.append((max(parts, key=len), pattern))

  def kind(self, body: str, people: People | None = None) -> str | None:
    """The kind of `body` (a message without its ends) by the table; with
    `people`, group notices too (see `group_notice`)."""
    key = _key(body)
    bare = key.strip('<>‹› ').rstrip(_ENDS)
    if bare in self.whole:
      return self.whole[bare]
    if key[:1] in '<‹' and bare in self.wrapped:
      return 'media'
    if (' ' + bare).endswith(self.document):  # "<name> document omitted".
      return 'media'
    if key.endswith('>') and '<' in key:  # iOS: "<attached: NAME>".
      word = key[key.rindex('<') + 1 :].split(':', 1)[0].strip()
      if word in self.attached:
        return 'media'
    if key.endswith(')') and ' (' in key:  # Android: "NAME (file attached)".
      if key[key.rindex(' (') + 2 : -1].strip() in self.file_attached:
        return 'media'
    head, sep, _ = key.partition(' http')
    if sep and head.rstrip(':').strip() in self.location:
      return 'media'
    if key.startswith(self.notice):
      return 'system notice'
    for fixed, pattern in self.code:  # "Your security code with {}..."
      if fixed in key and pattern.match(key):
        return 'system notice'
    if people is not None and '\n' not in body and self.group(key, people):
      return 'system notice'
    return None


# Quotes around a group's subject in a notice ("changed the subject to
# “{}”"): what a quoted placeholder may hold is anything.
_QUOTES = '"「」『』\'‘’'
_PHONE = re.compile(r'\+?[\d ()-]{6,24}')


class People:
  """The people of one chat (their names as senders), as group notices
  are matched against them."""

  def __init__(self, names=()):
    self.keys = {_key(clean_name(n)) for n in names} - {''}
    starts = {}
    for k in self.keys:
      starts.setdefault(k[0], []).append(k)
    self.starts = {c: tuple(ks) for c, ks in starts.items()}

  def named(self, text: str) -> bool:
    """Whether a notice's placeholder holds one of them or a number."""
    text = text.strip()
    if text in self.keys:
      return True
    return bool(_PHONE.fullmatch(text)) and sum(map(str.isdigit, text)) > 5

  def may_start(self, key: str) -> bool:
    """Whether `key` may start with one of them (or a number)."""
    first = key[:1]
    return first in '+0123456789' or key.startswith(self.starts.get(first, ()))


class _GroupNotices:
  """WhatsApp's group notices ("{} left", "{} added {}", "You changed this
  group's icon"...) in every language of the table. A message is one when
  it is a whole notice whose placeholders hold one of the chat's people
  (or a phone number), or are all quoted (a subject), or it has none: a
  person's "I left early" or "You added sugar?" is no notice."""

  def __init__(self, entries: dict):
    self.whole = set()
    # Those that start with fixed text, by its first two characters (or
    # one, when that is all of it): (fixed start, pattern, quoted).
    self.by_start = {}
    self.named = []  # (pattern, quoted) of those that start with a name.
    for texts in entries.values():
      for text in texts:
        parts = _key(text).split('{}')
        if len(parts) == 1:
          self.whole.add(parts[0])
          continue
        pattern = re.compile('(.{1,200}?)'.join(map(re.escape, parts)) + r'\Z')
        quoted = all(p and p[-1] in _QUOTES for p in parts[:-1])
        if parts[0]:
          self.by_start.setdefault(parts[0][:2], []).append(
            (parts[0], pattern, quoted)
          )
        else:
          self.named.append((pattern, quoted))

  def __call__(self, key: str, people: People) -> bool:
    if key in self.whole:
      return True
    starts = self.by_start.get(key[:2], []) + self.by_start.get(key[:1], [])
    for start, pattern, quoted in starts:
      if key.startswith(start) and self._holds(pattern, quoted, key, people):
        return True
    if people.may_start(key):
      for pattern, quoted in self.named:
        if self._holds(pattern, quoted, key, people):
          return True
    return False

  @staticmethod
  def _holds(pattern, quoted: bool, key: str, people: People) -> bool:
    m = pattern.match(key)
    return bool(m) and (quoted or any(map(people.named, m.groups())))


def group_notice(text: str, people: People) -> bool:
  """Whether `text` (a message under a sender's name) is a group notice
  WhatsApp wrote: old Android exports put them under the exporter's name
  ("Sam: Kim joined"); newer ones write them without a sender."""
  body = text.strip(_STRIP)
  if len(body) > 400 or '\n' in body:
    return False
  return table().group(_key(body), people)


@functools.lru_cache(maxsize=1)
def table() -> _Table:
  """The WhatsApp wording table (read at first use)."""
  return _Table()


def kind(
  text: str, notices: tuple[str, ...] = (), people: People | None = None
) -> str | None:
  """What the app wrote as `text` ('deleted', 'call', 'media', 'system
  notice'), or None when a person wrote it. `notices` are extra
  whole-message patterns of the format (its own wording); with `people`
  (of the chat), group notices under a sender's name count too."""
  body = text.strip(_STRIP)
  if len(body) > 400:  # No app notice is this long.
    return None
  for name, pattern in _COMPILED:
    if pattern.match(body):
      return name
  if _named_media(body):
    return 'media'
  found = table().kind(body, people)
  if found is not None:
    return found
  for pattern in notices:
    if re.match(pattern + r'\Z', body, re.IGNORECASE):
      return 'system notice'
  return None


# A poll as exports write it: "POLL:", the question, then "OPTION: Pizza
# (2 votes)" lines (seen in English exports only).
_POLL_OPTION = re.compile(r'option: .* \(\d+ votes?\)', re.IGNORECASE)


def poll_question(text: str) -> str | None:
  """The question of a poll message (its options and counts are the
  app's layout), or None when `text` is no poll."""
  lines = [line.strip(_STRIP) for line in text.split('\n')]
  if len(lines) < 3 or lines[0].casefold() != 'poll:':
    return None
  question = [line for line in lines[1:] if not _POLL_OPTION.fullmatch(line)]
  if len(question) == len(lines) - 1:
    return None  # No option: not the app's poll.
  return '\n'.join(question)


def strip_edited(text: str) -> str:
  """`text` without WhatsApp's trailing "<This message was edited>"."""
  if not text.rstrip().endswith('>'):
    return text
  return _EDITED.sub('', text)


def clean_name(name: str) -> str:
  """A sender's name without direction marks, WhatsApp's "~ " prefix for
  people not in the contacts, and spare spaces."""
  if not name.isascii():  # (ASCII has neither marks nor odd spaces.)
    name = ''.join(ch for ch in name if ch not in MARKS)
    name = name.replace('\u00a0', ' ').replace('\u202f', ' ')
  name = name.strip()
  if name.startswith('~'):
    name = name[1:].strip()
  return name


# ---- Messenger and Instagram (Meta's export) ----------------------------
# What Meta writes, as (kind, pattern). A pattern that starts with a name
# counts only when the name is the message's sender or "You": a person's
# "my mum sent a photo" is kept.
_MESSENGER_NAMED = [
  (
    'media',
    r'(?:sent an attachment|sent a photo|sent \d+ photos|'
    r'sent a video|sent a voice message|sent an audio clip|sent a gif|'
    r'sent a sticker|sent a link|sent a location|shared a location|'
    r'shared a story|shared a post|shared a reel|sent a post|'
    r'hat einen anhang gesendet|hat ein foto gesendet|envió un archivo '
    r'adjunto|envió una foto|a envoyé une pièce jointe|a envoyé une photo|'
    r'enviou um anexo|enviou uma foto|ha inviato un allegato|'
    r'ha inviato una foto)\.?',
  ),
  ('deleted', r'unsent a message\.?'),
  (
    'call',
    r'(?:started a (?:video |audio )?call|joined the (?:video |audio )?'
    r'call|missed (?:a|your) (?:video |audio )?call|called you|started '
    r'sharing video|started a video chat|joined the video chat)\.?',
  ),
  (
    'reaction',
    r'(?:reacted [^\n]{1,40} to (?:your|a) message|liked a '
    r'message|waved at [^\n]{1,100})[.!]?',
  ),
  (
    'system notice',
    r'(?:named the group|changed the group photo|set the '
    r'nickname|set (?:his|her|their|your) own nickname|set your nickname|'
    r'cleared (?:the|his|her|their|your)(?: own)? nickname|set the emoji|'
    r'changed the (?:chat )?theme|set the quick reaction|added [^\n]{1,200} '
    r'to the group|removed [^\n]{1,200} from the group|left the group|'
    r'created the group|pinned a message|changed the group name|turned (?:on|'
    r'off) [^\n]{1,80}|made [^\n]{1,100} an admin|joined the group)'
    r'[^\n]{0,200}',
  ),
]
_MESSENGER_BARE = [
  (
    'media',
    r'(?:mentioned you in (?:their|his|her) story|replied to your '
    r'story|sent an attachment)\.?',
  ),
  ('deleted', r'this message was unsent\.?|message unavailable'),
  (
    'call',
    r'the (?:video chat|call) ended\.?|(?:video|audio) call ended\.?|'
    r'missed (?:video |audio )?call',
  ),
  ('reaction', r'reacted [^\n]{1,40} to (?:your|a) message|liked a message'),
  (
    'system notice',
    r'you are now connected on messenger\.?|say hi to your '
    r'new facebook friend[^\n]{0,100}|you can now message and call each '
    r'other[^\n]{0,200}|messages and calls are secured with end-to-end '
    r'encryption[^\n]{0,200}',
  ),
]
MESSENGER_NAMED = [
  (k, re.compile(p, re.IGNORECASE)) for k, p in _MESSENGER_NAMED
]
MESSENGER_BARE = [(k, re.compile(p, re.IGNORECASE)) for k, p in _MESSENGER_BARE]
