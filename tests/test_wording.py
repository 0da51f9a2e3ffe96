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
