"""What WhatsApp writes in place of a message, in every language its apps
ship (`src/data/importers/whatsapp_wording.json`), and what stays a
person's words."""

import json

import pytest

from src.data.importers import wording

LRM, RLM = '\u200e', '\u200f'


def test_the_table_holds_the_apps_own_strings_for_40_languages():
  with open(wording._TABLE, encoding='utf-8') as f:
    table = json.load(f)
  assert 'whats_json' in ' '.join(table['source'])  # Cited.
  for kind in ('deleted', 'call', 'media'):
    for what, texts in table[kind].items():
      assert len(texts) >= 40, what  # iOS's 42 languages, Android's more.
      assert texts[0].isascii(), what  # English first.
  for key in ('document omitted', 'attached', 'file attached', 'location'):
    assert len(table[key]) >= 40, key


@pytest.mark.parametrize(
  'text, kind',
  [
    (f'{RLM}הודעה זו נמחקה', 'deleted'),  # Hebrew.
    ('Це повідомлення було видалено', 'deleted'),  # Ukrainian.
    ('এই মেসেজটি বাদ দেওয়া হয়েছে।', 'deleted'),  # Bengali, its danda.
    ('Αναπάντητη φωνητική κλήση', 'call'),  # Greek.
    ('부재중 전화', 'call'),  # Korean.
    ('Missat röstsamtal', 'call'),  # Swedish.
    (f'{LRM}đã bỏ qua hình ảnh', 'media'),  # Vietnamese iOS image.
    (f'<{LRM}ไม่มีรูปภาพ>', 'media'),  # Thai, in iOS's older brackets.
    ('<Media tidak disertakan>', 'media'),  # Indonesian Android.
    (f'Report.pdf • 3 pages {LRM}documento omesso', 'media'),  # Italian.
    (f'{LRM}<załączono: 00000012-PHOTO-2021-03-04.jpg>', 'media'),
    ('IMG-1.jpg (soubor byl přiložen)', 'media'),  # Czech Android file.
    ('konum: https://maps.google.com/?q=41.0,29.0', 'media'),  # Turkish.
    ('موقع: https://maps.google.com/?q=1,2', 'media'),  # Arabic iOS.
    ('Il tuo codice di sicurezza con Marco è cambiato.', 'system notice'),
    ('Ayşe ile aranızdaki güvenlik kodu değişti.', 'system notice'),
    (
      'Mesajlar ve aramalar uçtan uca şifrelidir. Bu sohbetin dışında...',
      'system notice',
    ),
    ('null', 'media'),  # Android: a view-once photo once opened.
    ('Čeká se na tuto zprávu. Může to chvíli trvat.', 'deleted'),  # Never
    (f'{LRM}obrázek produktu byl vynechán', 'media'),  # received; Czech.
  ],
)
def test_whatsapp_wording_in_the_apps_languages(text, kind):
  assert wording.kind(text) == kind


@pytest.mark.parametrize(
  'text',
  [
    'Media omitted',  # Android's is always in <...>.
    'Без медиафайлов',
    'I deleted this message lol',
    'Llamada perdida ayer, te llamo luego',
    'location',
    'see you at the location',
    'null pointer again',
    'My security code changed',
    'Bild weggelassen? Warum?',
  ],
)
def test_a_persons_words_are_kept(text):
  assert wording.kind(text) is None


PEOPLE = wording.People(['Marco', 'Ayşe', 'Аня', 'ليف', 'Lev Park'])


@pytest.mark.parametrize(
  'text',
  [
    'Marco hat die Gruppe verlassen',  # German.
    'Ayşe ayrıldı',  # Turkish.
    'Вы добавили контакт Аня',  # Russian.
    'ليف غادر المجموعة',  # Arabic.
    'Lev Parkを追加しました',  # Japanese, no space.
    'Hai abbandonato',  # Italian "You left": no name needed.
    'Marco changed the subject to “Trip: day 2”',
    'A participant changed the subject to “Anything”',
    '\u202a+44 7830 332317\u202c joined',  # A number, in its marks.
    "Lev Park changed this group's icon",
  ],
)
def test_group_notices_in_the_apps_languages(text):
  assert wording.group_notice(text, PEOPLE)


@pytest.mark.parametrize(
  'text',
  [
    'I left early',
    'You added sugar?',  # "You added {}" needs one of the chat's people.
    'Sam joined',  # Sam is no one in this chat.
    'Marco left the keys on the table',
    'Marco left\nthe keys',
    'Lev Park',
  ],
)
def test_a_persons_words_are_no_group_notice(text):
  assert not wording.group_notice(text, PEOPLE)


def test_the_table_has_group_notices_in_40_languages():
  with open(wording._TABLE, encoding='utf-8') as f:
    notices = json.load(f)['group notice']
  assert len(notices) >= 10
  for what, texts in notices.items():
    assert len(texts) >= 40 and 'iOS' in what, what
