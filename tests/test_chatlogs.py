"""A person's own chat exports (WhatsApp, Telegram, Discord, Messenger,
Instagram) into the line format, on fixtures written in the apps' layouts."""

import json
import os
import zipfile

import pytest

from src.apps import convert
from src.core.errors import UserError
from src.data import chatformat
from src.data.importers import chatlog

from .conftest import json_values

LRM, NNBSP = '\u200e', '\u202f'


def run(tmp_path, fmt, files, *flags, out='out'):
  """Writes `files` ({name: text | bytes | dict}) and converts them; the
  conversations of every written file, as [(role, text)] lists."""
  paths = []
  for name, content in files.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, (dict, list)):
      path.write_text(json.dumps(content), encoding='utf-8')
    elif isinstance(content, bytes):
      path.write_bytes(content)
    else:
      path.write_bytes(content.encode('utf-8'))
    paths.append(str(path))
  target = tmp_path / out
  convert.main([fmt, *paths, str(target), *flags])
  convs = []
  for name in sorted(os.listdir(target)):
    convs += chatformat.read_file(str(target / name))
  return [[(t.role, t.text) for t in c.turns] for c in convs]


def refused(tmp_path, fmt, files, *flags, out='out'):
  """The one-line error for a conversion that must write nothing."""
  with pytest.raises(UserError) as e:
    run(tmp_path, fmt, files, *flags, out=out)
  assert not (tmp_path / out).exists() or not os.listdir(tmp_path / out)
  assert '\n' not in str(e.value)
  return str(e.value)


ANDROID_EN = (
  '12/03/2021, 14:22 - Messages and calls are end-to-end encrypted. No one '
  'outside of this chat, not even WhatsApp, can read or listen to them. Tap '
  'to learn more.\r\n'
  '12/03/2021, 14:22 - Sam Lee: Hey, are we still on for tonight?\r\n'
  '12/03/2021, 14:23 - Alex Doe: Yes!\r\n'
  'See you at 8\r\n'
  '12/03/2021, 14:23 - Alex Doe: <Media omitted>\r\n'
  '12/03/2021, 14:24 - Sam Lee: This message was deleted\r\n'
  '12/03/2021, 14:25 - Sam Lee: Missed voice call\r\n'
  '13/03/2021, 09:00 - Sam Lee: Morning! I left my keys at yours\r\n'
  '13/03/2021, 09:01 - Alex Doe: Morning <This message was edited>\r\n'
  '13/03/2021, 09:02 - Alex Doe: IMG-20210313-WA0001.jpg (file attached)\r\n'
  '13/03/2021, 09:05 - Sam Lee: ok\r\n'
)


def as_alex(tmp_path, *flags, out='out'):
  """ANDROID_EN converted with Alex Doe as the AI."""
  return run(
    tmp_path,
    'whatsapp',
    {'chat.txt': ANDROID_EN},
    '--ai',
    'Alex Doe',
    *flags,
    out=out,
  )


def test_whatsapp_android_speakers_splits_and_what_the_app_wrote(tmp_path):
  convs = run(
    tmp_path, 'whatsapp', {'chat.txt': ANDROID_EN}, '--ai', 'Alex Doe', '--trim'
  )
  assert convs == [
    [
      ('user', 'Hey, are we still on for tonight?'),
      ('ai', 'Yes! |br| See you at 8'),
    ],
    [('user', 'Morning! I left my keys at yours'), ('ai', 'Morning')],
  ]


def test_whatsapp_without_trim_drops_conversations_ending_on_the_user(
  tmp_path, capsys
):
  convs = run(
    tmp_path, 'whatsapp', {'chat.txt': ANDROID_EN}, '--ai', 'alex doe'
  )
  assert len(convs) == 1
  out = capsys.readouterr().out
  assert '2 media' in out and '1 deleted' in out and '1 call' in out
  assert '1 conversations ending on a user turn' in out


def test_whatsapp_gap_never_and_minutes(tmp_path):
  never = as_alex(tmp_path, '--trim', '--gap', 'never', out='a')
  assert len(never) == 1 and len(never[0]) == 4
  short = as_alex(tmp_path, '--trim', '--gap', '30s', out='b')
  # 14:22 -> 14:23 is 60 s: the first reply is a new conversation that
  # starts with the AI.
  assert short[0] == [('ai', 'Yes! |br| See you at 8')]


def test_whatsapp_us_12_hour_narrow_space_and_order_from_the_file(tmp_path):
  text = (
    f'1/2/21, 9:05{NNBSP}PM - Sam: Happy new year\n'
    f'1/2/21, 9:06{NNBSP}PM - Alex: you too\n'
    f'1/5/21, 10:00{NNBSP}AM - Sam: lunch?\n'
    f'1/5/21, 10:01{NNBSP}AM - Alex: sure\n'
    f'2/1/21, 12:30{NNBSP}PM - Sam: how was it\n'
    f'2/1/21, 12:31{NNBSP}PM - Alex: good\n'
  )
  # Every date fits day-first too (1 Feb, 1 May, 2 Jan), but only
  # month-first runs forward: three conversations at the 6 h default.
  convs = run(tmp_path, 'whatsapp', {'chat.txt': text}, '--ai', 'Alex')
  assert [c[0][1] for c in convs] == ['Happy new year', 'lunch?', 'how was it']
  # 9:05 PM to 12:30 PM next... within a day the 12-hour clock is read:
  # 12:30 PM and 12:31 PM are one minute apart, one conversation.
  assert len(convs[2]) == 2


def test_whatsapp_ios_zip_with_marks_and_attachments(tmp_path):
  chat = (
    f'{LRM}[14/03/2021, 18:02:11] Trip: {LRM}Messages and calls are '
    'end-to-end encrypted.\n'
    f'{LRM}[14/03/2021, 18:02:11] Trip: {LRM}Sam created group “Trip”\n'
    '[14/03/2021, 18:03:00] Sam: Who brings the tent?\n'
    '[14/03/2021, 18:04:30] Alex: I do\n'
    'and the stove\n'
    f'{LRM}[14/03/2021, 18:05:00] Alex: {LRM}image omitted\n'
    f'{LRM}[14/03/2021, 18:05:10] Alex: {LRM}<attached: 00000012-PHOTO-'
    '2021-03-14-18-05-10.jpg>\n'
    f'[14/03/2021, 18:06:00] ~{NNBSP}Kim: {LRM}sticker omitted\n'
    f'[14/03/2021, 18:06:30] ~{NNBSP}Kim: Great, thanks!\n'
    f'[14/03/2021, 18:07:00] Alex: {LRM}Voice call, {LRM}12 min\n'
    '[14/03/2021, 18:08:00] Alex: See you Friday\n'
  )
  buf = tmp_path / 'WhatsApp Chat - Trip.zip'
  with zipfile.ZipFile(buf, 'w', zipfile.ZIP_DEFLATED) as zf:
    zf.writestr('_chat.txt', chat)
    zf.writestr('00000012-PHOTO-2021-03-14-18-05-10.jpg', b'\xff\xd8')
  out = tmp_path / 'out'
  convert.main(['whatsapp', str(buf), str(out), '--ai', 'Alex', '--names'])
  (conv,) = chatformat.read_file(str(out / 'WhatsApp Chat - Trip.txt'))
  assert [(t.role, t.text) for t in conv.turns] == [
    ('user', 'Sam: Who brings the tent?'),
    ('ai', 'I do |br| and the stove'),
    ('user', 'Kim: Great, thanks!'),
    ('ai', 'See you Friday'),
  ]


def test_whatsapp_android_zip_in_german_with_dots(tmp_path):
  chat = (
    '14.03.21, 18:02 - Nachrichten und Anrufe sind Ende-zu-Ende-'
    'verschlüsselt. Tippe, um mehr zu erfahren.\n'
    '14.03.21, 18:03 - Lena: Kommst du heute?\n'
    '14.03.21, 18:04 - Jonas: <Medien ausgeschlossen>\n'
    '14.03.21, 18:04 - Lena: Diese Nachricht wurde gelöscht\n'
    '14.03.21, 18:05 - Jonas: Ja, um acht. <Diese Nachricht wurde '
    'bearbeitet>\n'
    '25.03.21, 07:15 - Lena: Verpasster Sprachanruf\n'
  )
  path = tmp_path / 'chat.zip'
  with zipfile.ZipFile(path, 'w') as zf:
    zf.writestr('WhatsApp-Chat mit Lena.txt', chat)
  out = tmp_path / 'out'
  convert.main(['whatsapp', str(path), str(out), '--ai', 'Jonas'])
  (conv,) = chatformat.read_file(str(out / 'chat.txt'))
  assert [(t.role, t.text) for t in conv.turns] == [
    ('user', 'Kommst du heute?'),
    ('ai', 'Ja, um acht.'),
  ]


@pytest.mark.parametrize(
  'header',
  [
    '[14/3/21, 6:05:09 p. m.] ',  # Spanish iOS.
    '14/3/21 18:05 - ',  # No comma.
    '2021-03-14, 18:05 - ',  # Year first.
    '14-03-2021 18:05:09 - ',
    '[14.03.21, 18:05:09] ',  # German iOS.
    '14/03/2021, 6:05\u00a0pm - ',  # No-break space, lower case.
    '[14/03/21 18:05] ',  # Brackets without a comma or seconds.
    '03/14/2021, 06:05 p. m. - ',  # Month first, Spanish 12-hour.
  ],
)
def test_whatsapp_locales(tmp_path, header):
  reply = header.replace('05', '06', 1)
  text = f'{header}Ana: ¿Vienes?\n{reply}Luis: Sí\n'
  assert run(tmp_path, 'whatsapp', {'c.txt': text}, '--ai', 'Luis') == [
    [('user', '¿Vienes?'), ('ai', 'Sí')]
  ]


@pytest.mark.parametrize(
  'placeholder',
  [
    '<Multimedia omitido>',
    'imagen omitida',
    'Se eliminó este mensaje',
    '<Médias omis>',
    'Ce message a été supprimé',
    '<Mídia oculta>',
    'Esta mensagem foi apagada',
    '<Media omessi>',
    'Questo messaggio è stato eliminato',
    'sticker omitted',
    'GIF omitted',
    'You deleted this message',
  ],
)
def test_whatsapp_placeholders_in_six_languages_are_dropped(
  tmp_path, placeholder
):
  text = (
    '1/3/21, 10:00 - Ana: hola\n'
    f'1/3/21, 10:01 - Ana: {placeholder}\n'
    '1/3/21, 10:02 - Luis: hey\n'
  )
  assert run(tmp_path, 'whatsapp', {'c.txt': text}, '--ai', 'Luis') == [
    [('user', 'hola'), ('ai', 'hey')]
  ]


def test_whatsapp_group_events_and_a_colon_right_after_the_name(tmp_path):
  text = (
    '20/06/20, 00:08 - +12 345 578 created group "Trip: day 2"\n'
    '20/06/20, 00:09 - Kim changed the subject from "a" to "b: c"\n'
    '20/06/20, 00:09 - You were added\n'
    '20/06/20, 00:10 - Kim:.\n'
    '20/06/20, 00:11 - Lou Doe 🤓: on it : really\n'
  )
  assert run(tmp_path, 'whatsapp', {'c.txt': text}, '--ai', 'Lou Doe 🤓') == [
    [('user', '.'), ('ai', 'on it : really')]
  ]


def test_unknown_or_missing_ai_lists_the_participants(tmp_path):
  line = refused(tmp_path, 'whatsapp', {'c.txt': ANDROID_EN}, '--ai', 'Bob')
  assert 'matches no one' in line
  assert '"Sam Lee" (3 messages)' in line and '"Alex Doe" (2 messages)' in line
  line = refused(tmp_path, 'whatsapp', {'c.txt': ANDROID_EN})
  assert '--ai NAME' in line and '"Sam Lee"' in line


def test_redact(tmp_path):
  text = (
    '1/3/21, 10:00 - Ana: mail me at ana.b+x@mail.example.org or call '
    '+34 612 34 56 78, see https://example.com/a?b=1 on 12.03.2021\n'
    '1/3/21, 10:01 - Luis: mine is (030) 1234-5678, www.example.net\n'
  )
  convs = run(tmp_path, 'whatsapp', {'c.txt': text}, '--ai', 'Luis', '--redact')
  assert convs == [
    [
      ('user', 'mail me at <email> or call <phone>, see <url> on 12.03.2021'),
      ('ai', 'mine is <phone>, <url>'),
    ]
  ]


def test_whatsapp_bad_inputs_get_one_line_and_nothing_written(tmp_path):
  assert 'not a WhatsApp chat export' in refused(
    tmp_path, 'whatsapp', {'notes.txt': 'just some notes\nmore\n'}, '--ai', 'x'
  )
  assert 'not a WhatsApp chat export' in refused(
    tmp_path, 'whatsapp', {'empty.txt': ''}, '--ai', 'x'
  )
  zpath = tmp_path / 'photos.zip'
  with zipfile.ZipFile(zpath, 'w') as zf:
    zf.writestr('a.jpg', b'\xff')
  with pytest.raises(UserError, match='not one chat file'):
    convert.main(['whatsapp', str(zpath), str(tmp_path / 'o1'), '--ai', 'x'])
  bomb = tmp_path / 'bomb.zip'
  with zipfile.ZipFile(bomb, 'w', zipfile.ZIP_DEFLATED) as zf:
    zf.writestr('_chat.txt', b'\n' * (64 << 20))
  with pytest.raises(UserError, match='inflate'):
    convert.main(['whatsapp', str(bomb), str(tmp_path / 'o2'), '--ai', 'x'])
  real = tmp_path / 'real.txt'
  real.write_text(ANDROID_EN)
  link = tmp_path / 'link.txt'
  link.symlink_to(real)
  with pytest.raises(UserError, match='is a link'):
    convert.main(['whatsapp', str(link), str(tmp_path / 'o3'), '--ai', 'x'])
  bad = tmp_path / 'latin1.txt'
  bad.write_bytes('1/3/21, 10:00 - Ana: ¿qué?\n'.encode('latin-1'))
  with pytest.raises(UserError, match=r'latin1.txt:1: not UTF-8'):
    convert.main(['whatsapp', str(bad), str(tmp_path / 'o4'), '--ai', 'x'])
  for out in ('o1', 'o2', 'o3', 'o4'):
    assert not (tmp_path / out).exists()


def test_all_or_nothing_and_never_overwrite(tmp_path):
  good = tmp_path / 'good.txt'
  good.write_text(ANDROID_EN)
  other = tmp_path / 'other.txt'
  other.write_text('1/3/21, 10:00 - Kim: hi\n1/3/21, 10:01 - Lou: yo\n')
  out = tmp_path / 'out'
  with pytest.raises(UserError, match='other.txt: --ai Alex Doe matches'):
    convert.main(
      ['whatsapp', str(good), str(other), str(out), '--ai', 'Alex Doe']
    )
  assert not out.exists()
  convert.main(['whatsapp', str(good), str(out), '--ai', 'Alex Doe'])
  before = (out / 'good.txt').read_bytes()
  with pytest.raises(UserError, match='exists'):
    convert.main(['whatsapp', str(good), str(out), '--ai', 'Alex Doe'])
  assert (out / 'good.txt').read_bytes() == before
  assert os.listdir(out) == ['good.txt']


TELEGRAM_CHAT = {
  'name': 'Sam',
  'type': 'personal_chat',
  'id': 42,
  'messages': [
    {
      'id': 1,
      'type': 'service',
      'date': '2024-03-01T18:00:00',
      'date_unixtime': '1709316000',
      'actor': 'Sam',
      'action': 'phone_call',
    },
    {
      'id': 2,
      'type': 'message',
      'date': '2024-03-01T18:02:11',
      'date_unixtime': '1709316131',
      'from': 'Sam',
      'from_id': 'user1',
      'text': ['Did you see ', {'type': 'bold', 'text': 'this'}, '?'],
      'text_entities': [],
    },
    {
      'id': 3,
      'type': 'message',
      'date': '2024-03-01T18:03:00',
      'date_unixtime': '1709316180',
      'from': 'Alex Doe',
      'from_id': 'user2',
      'text': '',
      'media_type': 'sticker',
      'sticker_emoji': '😂',
    },
    {
      'id': 4,
      'type': 'message',
      'date': '2024-03-01T18:03:30',
      'date_unixtime': '1709316210',
      'from': 'Alex Doe',
      'from_id': 'user2',
      'photo': 'photos/p.jpg',
      'text': 'Yes, look at it\nso good',
    },
    {
      'id': 5,
      'type': 'message',
      'date': '2024-03-01T18:04:00',
      'date_unixtime': '1709316240',
      'from': 'Sam',
      'from_id': 'user1',
      'forwarded_from': 'News',
      'text': 'Breaking: something',
    },
    {
      'id': 6,
      'type': 'message',
      'date': '2024-03-02T09:00:00',
      'from': 'Sam',
      'from_id': 'user1',
      'text': 'Morning',
    },
    {
      'id': 7,
      'type': 'message',
      'date': '2024-03-02T09:01:00',
      'from': 'Alex Doe',
      'from_id': 'user2',
      'text': 'Hi!',
    },
  ],
}


def test_telegram_single_chat(tmp_path):
  convs = run(
    tmp_path,
    'telegram',
    {'ChatExport/result.json': TELEGRAM_CHAT},
    '--ai',
    'Alex Doe',
  )
  assert convs == [
    [('user', 'Did you see this?'), ('ai', 'Yes, look at it |br| so good')],
    [('user', 'Morning'), ('ai', 'Hi!')],
  ]
  assert os.listdir(tmp_path / 'out') == ['ChatExport.txt']


def test_telegram_full_export_every_chat_and_ai_by_id(tmp_path):
  group = {
    'name': 'Climbing',
    'type': 'private_group',
    'id': 7,
    'messages': [
      {
        'id': 1,
        'type': 'message',
        'date': '2024-03-01T18:02:11',
        'from': 'Kim',
        'from_id': 'user3',
        'text': 'Gym at 6?',
      },
      {
        'id': 2,
        'type': 'message',
        'date': '2024-03-01T18:02:50',
        'from': 'Alex D.',
        'from_id': 'user2',
        'text': 'In',
      },
    ],
  }
  export = {
    'about': 'Here is the data you requested.',
    'personal_information': {'first_name': 'Alex'},
    'chats': {'about': '...', 'list': [TELEGRAM_CHAT, group]},
  }
  convs = run(
    tmp_path, 'telegram', {'result.json': export}, '--ai', 'user2', '--names'
  )
  assert [c[0] for c in convs] == [
    ('user', 'Sam: Did you see this?'),
    ('user', 'Sam: Morning'),
    ('user', 'Kim: Gym at 6?'),
  ]
  assert convs[2][1] == ('ai', 'In')


def test_telegram_and_discord_bad_json(tmp_path):
  assert 'not valid JSON' in refused(
    tmp_path,
    'telegram',
    {'result.json': '{"messages": [{"id": 1,'},
    '--ai',
    'x',
  )
  assert 'no message a person wrote' in refused(
    tmp_path, 'discord', {'a.json': {'hello': 1}}, '--ai', 'x'
  )


def _discord(n, kind, content, author, **more):
  name, nick = author
  return {
    'id': str(n),
    'type': kind,
    'timestamp': f'2024-03-01T18:0{n}:11.123+00:00',
    'content': content,
    'author': {'id': name, 'name': name, 'nickname': nick},
    **more,
  }


def test_discord(tmp_path):
  sam, alex = ('sam', 'Sam'), ('alexd', 'Alex')
  export = {
    'guild': {'id': '1', 'name': 'Direct Messages'},
    'channel': {'id': '2', 'type': 'DirectTextChat', 'name': 'sam'},
    'messages': [
      _discord(1, 'RecipientAdd', 'Added a recipient.', sam),
      _discord(2, 'Default', 'gg <:pog:123456>', sam),
      _discord(3, 'Default', '', alex, attachments=[{'url': 'a.png'}]),
      _discord(4, 'Reply', 'thanks!', alex),
      _discord(5, 'ChannelPinnedMessage', 'Pinned a message.', alex),
    ],
  }
  assert run(tmp_path, 'discord', {'dm.json': export}, '--ai', 'alexd') == [
    [('user', 'gg :pog:'), ('ai', 'thanks!')]
  ]


def _mojibake(text):
  return text.encode('utf-8').decode('latin-1')


def test_messenger_mojibake_order_two_files_and_what_meta_wrote(tmp_path):
  t = 1709316000000
  newest = {
    'participants': [{'name': _mojibake('José Núñez')}, {'name': 'Alex Doe'}],
    'messages': [
      {
        'sender_name': 'Alex Doe',
        'timestamp_ms': t + 240_000,
        'content': _mojibake('Claro 😀'),
        'type': 'Generic',
      },
      {
        'sender_name': _mojibake('José Núñez'),
        'timestamp_ms': t + 200_000,
        'content': _mojibake('José Núñez sent an attachment.'),
        'photos': [{'uri': 'p.jpg'}],
      },
      {
        'sender_name': 'Alex Doe',
        'timestamp_ms': t + 180_000,
        'content': 'Reacted \u00e2\u009d\u00a4 to your message',
      },
      {
        'sender_name': 'Alex Doe',
        'timestamp_ms': t + 170_000,
        'is_unsent': True,
      },
      {
        'sender_name': 'Kim',
        'timestamp_ms': t + 160_000,
        'content': 'my mum sent a photo',
      },
    ],
    'title': 'José',
    'thread_path': 'inbox/jose_123',
  }
  oldest = {
    'participants': [{'name': _mojibake('José Núñez')}, {'name': 'Alex Doe'}],
    'messages': [
      {
        'sender_name': 'Alex Doe',
        'timestamp_ms': t + 60_000,
        'content': 'Alex Doe started a video chat.',
        'type': 'Call',
        'call_duration': 30,
      },
      {
        'sender_name': _mojibake('José Núñez'),
        'timestamp_ms': t,
        'content': _mojibake('¿Cenamos mañana?'),
      },
    ],
  }
  convs = run(
    tmp_path,
    'messenger',
    {
      'inbox/jose_123/message_1.json': newest,
      'inbox/jose_123/message_2.json': oldest,
    },
    '--ai',
    'Alex Doe',
    '--names',
  )
  assert convs == [
    [
      ('user', 'José Núñez: ¿Cenamos mañana? |br| Kim: my mum sent a photo'),
      ('ai', 'Claro 😀'),
    ]
  ]
  assert os.listdir(tmp_path / 'out') == ['jose_123.txt']


def test_messenger_newer_layout_and_not_an_export(tmp_path):
  export = {
    'participants': ['Ana', 'Luis'],
    'threadName': 'Ana',
    'messages': [
      {
        'isUnsent': False,
        'media': [],
        'reactions': [],
        'senderName': 'Ana',
        'text': 'hola',
        'timestamp': 1709316000000,
        'type': 'text',
      },
      {
        'isUnsent': False,
        'media': [],
        'reactions': [],
        'senderName': 'Luis',
        'text': 'qué tal',
        'timestamp': 1709316060000,
        'type': 'text',
      },
    ],
  }
  assert run(tmp_path, 'instagram', {'ana.json': export}, '--ai', 'Luis') == [
    [('user', 'hola'), ('ai', 'qué tal')]
  ]
  assert 'no "messages" list' in refused(
    tmp_path, 'messenger', {'x.json': [1, 2]}, '--ai', 'Luis', out='o2'
  )


def test_parse_gap():
  assert chatlog.parse_gap('6h') == 21600
  assert chatlog.parse_gap('90m') == 5400
  assert chatlog.parse_gap('45s') == chatlog.parse_gap('45') == 45
  assert chatlog.parse_gap('never') == float('inf')
  for bad in ('0', '-1h', '6 hours', 'x'):
    with pytest.raises(UserError, match='--gap'):
      chatlog.parse_gap(bad)


def test_ai_is_an_exact_option_now(tmp_path):
  # --ai used to be an ambiguous prefix of --ai-roles/--ai-side/--ai-prefix.
  with pytest.raises(
    UserError, match='--ai, --names, --redact and --pseudonyms'
  ):
    convert.main(
      [
        'transcript',
        str(tmp_path / 'x.txt'),
        str(tmp_path / 'o'),
        '--ai',
        'Bob',
      ]
    )


def test_shipped_example_chats_convert_to_the_persona_data(tmp_path):
  # The README's "A model that talks like you" walkthrough: two WhatsApp
  # exports (Android .txt, iOS .zip) of invented people, converted with
  # Robin's name, are data/persona's conversations exactly.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  chats = os.path.join(root, 'examples', 'chats')
  out = tmp_path / 'robin'
  convert.main(
    [
      'whatsapp',
      os.path.join(chats, 'WhatsApp Chat with Sam Okafor.txt'),
      os.path.join(chats, 'WhatsApp Chat - Jo Park.zip'),
      str(out),
      '--ai',
      'Robin Silva',
      '--trim',
    ]
  )
  got = chatformat.read_file(str(out / 'WhatsApp Chat with Sam Okafor.txt'))
  got += chatformat.read_file(str(out / 'WhatsApp Chat - Jo Park.txt'))
  want = chatformat.read_file(
    os.path.join(root, 'data', 'persona', 'robin.txt')
  )
  assert [[(t.role, t.text) for t in c.turns] for c in got] == [
    [(t.role, t.text) for t in c.turns] for c in want
  ]


def test_chat_import_bench_smoke(tmp_path):
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
    [
      sys.executable,
      'bench/chat_import.py',
      '--smoke',
      '--work',
      str(tmp_path),
    ],
    cwd=root,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr
  assert '| convert whatsapp | 1 |' in result.stdout
  assert '| convert telegram | 1 |' in result.stdout


def test_fuzzed_exports_convert_or_get_one_line(tmp_path_factory):
  """Random exports in each format's shape (timestamps, names, notices,
  odd bytes, JSON of random values): a conversion or one UserError line,
  never another exception."""
  from hypothesis import HealthCheck, given, settings
  from hypothesis import strategies as st

  header = st.sampled_from(
    [
      '12/03/2021, 14:22 - ',
      '[12/03/21, 14:22:01] ',
      f'{LRM}[3/14/21, 2:05:09{NNBSP}PM] ',
      '2021-03-14, 18:05 - ',
      '31/02/2021, 25:61 - ',
      'May 17, 2022  5:29:42 PM\n',  # iMessage: time, sender, text.
      'Feb 31, 2022 13:29:42 PM (Read by you after 1 hour)\n',
      '[2024-03-01 18:02:11] ',  # Signal's chat.md.
      '',
    ]
  )
  name = st.sampled_from(['Ana', 'Luis', '~ Kim', 'Ana: x', ''])
  text = st.text(max_size=30) | st.sampled_from(
    ['<Media omitted>', f'{LRM}image omitted', 'This message was deleted']
  )
  line = st.builds(lambda h, n, t: f'{h}{n}: {t}', header, name, text)
  whatsapp = st.lists(line | st.text(max_size=20), max_size=12).map('\r\n'.join)
  scalar = st.none() | st.booleans() | st.integers() | st.text(max_size=10)
  value = json_values(scalar)
  message = st.fixed_dictionaries(
    {},
    optional={
      'type': st.sampled_from(['message', 'service', 'Default', 'Call'])
      | value,
      'from': name | value,
      'author': st.fixed_dictionaries({'name': name}) | value,
      'sender_name': name | value,
      'text': text | value,
      'content': text | value,
      'date': st.just('2024-03-01T18:02:11') | value,
      'timestamp': st.just('2024-03-01T18:02:11+00:00') | value,
      'timestamp_ms': st.integers(0, 2**42) | value,
      'user': st.sampled_from(['U1', 'U2']) | value,
      'ts': st.just('1709316131.000200') | value,
      'subtype': st.none() | value,
      'sender': name | value,
      'body': text | value,
      'deleted': st.booleans() | value,
      'call': st.booleans() | value,
      'creator': st.fixed_dictionaries(
        {'name': name}, optional={'user_type': st.just('Human') | value}
      )
      | value,
      'created_date': st.just('Thursday, November 3, 2016 at 11:59:50 AM UTC')
      | value,
    },
  )
  export = (
    st.fixed_dictionaries({'messages': st.lists(message, max_size=6) | value})
    | value
  )
  runs = iter(range(10**6))

  @settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
  )
  @given(
    fmt=st.sampled_from(
      [
        'whatsapp',
        'telegram',
        'discord',
        'messenger',
        'slack',
        'imessage',
        'signal',
        'googlechat',
      ]
    ),
    chat=whatsapp,
    data=export,
  )
  def check(fmt, chat, data):
    folder = tmp_path_factory.mktemp(f'fuzz{next(runs)}')
    try:
      if fmt == 'slack':  # A folder: users.json and a day of a channel.
        (folder / 'in' / 'general').mkdir(parents=True)
        (folder / 'in' / 'users.json').write_text(json.dumps(_SLACK_USERS))
        day = data.get('messages') if isinstance(data, dict) else data
        (folder / 'in' / 'general' / '2024-03-01.json').write_text(
          json.dumps(day)
        )
        args = [str(folder / 'in'), str(folder / 'out'), '--ai', 'alexd']
        convert.main(['slack', *args, '--trim'])
        return
      messages = data.get('messages') if isinstance(data, dict) else data
      name, content = {
        'whatsapp': ('chat.txt', chat),
        'imessage': ('Sam.txt', chat.replace('\r\n', '\n\n')),
        'signal': (  # A chat folder's data.json (a line a message), chat.md.
          'Sam/data.json',
          '\n'.join(map(json.dumps, messages))
          if isinstance(messages, list)
          else json.dumps(messages),
        ),
        'googlechat': ('Groups/DM x/messages.json', json.dumps(data)),
      }.get(fmt, ('message_1.json', json.dumps(data)))
      if fmt == 'signal':
        (folder / 'in' / 'Kim').mkdir(parents=True)
        (folder / 'in' / 'Kim' / 'chat.md').write_text(chat)
      if fmt in ('signal', 'googlechat'):  # The export's folder is given.
        (folder / 'in' / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / 'in' / name).write_text(content)
        args = [str(folder / 'in'), str(folder / 'out'), '--ai', 'Luis']
        convert.main([fmt, *args, '--trim'])
        return
      run(folder, fmt, {name: content}, '--ai', 'Luis', '--trim')
    except UserError as e:
      assert '\n' not in str(e)

  check()


@pytest.mark.parametrize(
  'text, kept, kinds',
  [
    (
      'join example.com/invite/abc, t.me/+AbCdEf12, discord.gg/xyz or '
      'chat.whatsapp.com/Gx1 and wa.me/34612345678.',
      'join <url>, <url>, <url> or <url> and <url>.',
      {'url': 5},
    ),
    (
      'IBAN DE89 3704 0044 0532 0130 00, or GB82WEST12345698765432, '
      'es91 2100 0418 4502 0005 1332 to me; DE89 3704 0044 0532 0130 00 OK',
      'IBAN <iban>, or <iban>, <iban> to me; <iban> OK',
      {'iban': 4},
    ),
    (
      'card 4111 1111 1111 1111 or 5500-0000-0000-0004; order 1234 5678 '
      '9012 3456',
      'card <card> or <card>; order 1234 5678 9012 3456',  # Not Luhn.
      {'card': 2},
    ),
    (
      'ssn 123-45-6789, NI AB 12 34 56 C, passport number 912803456, '
      'my passport: X1234567, SSN 123 45 6789, licence: SMITH901017AB9CD',
      'ssn <id>, NI <id>, passport number <id>, my passport: <id>, SSN '
      '<id>, licence: <id>',
      {'id': 6},
    ),
    (
      'at 221B Baker Street, 1600 Pennsylvania Avenue, Hauptstraße 12 or '
      'Rua das Flores 45; 42 rue de Rivoli, calle Mayor 5, via Roma 10, '
      'Kerkstraat 7',
      'at <address>, <address>, <address> or <address>; <address>, '
      '<address>, <address>, <address>',
      {'address': 8},
    ),
    (
      'on 12.03.2021 at 10:30, 2021-03-12 14:00:00 or 3/12/2021 9:15; '
      'my ID card is here; node.js, file.txt, e.g. the U.S.',
      'on 12.03.2021 at 10:30, 2021-03-12 14:00:00 or 3/12/2021 9:15; '
      'my ID card is here; node.js, file.txt, e.g. the U.S.',
      {},
    ),
    (
      'jam 10.00-18.00, (09.00 11.30 WIB), 18.30/19.00, 20:08 11/12/19, '
      '24-26/12/2021 and 31/12/2021-1/1/2022; call 01.23.45.67.89 or '
      '0812-3456-7890',
      'jam 10.00-18.00, (09.00 11.30 WIB), 18.30/19.00, 20:08 11/12/19, '
      '24-26/12/2021 and 31/12/2021-1/1/2022; call <phone> or <phone>',
      {'phone': 2},
    ),
  ],
  ids=[
    *('links', 'iban', 'cards', 'ids', 'addresses', 'dates-and-words'),
    'times-and-phones',
  ],
)
def test_redaction_covers_what_people_share(text, kept, kinds):
  from collections import Counter

  from src.data.importers import redaction

  counts = Counter()
  assert redaction.redact(text, counts) == kept
  assert dict(counts) == kinds


def test_a_zip_made_again_on_a_mac_is_one_chat(tmp_path):
  text = '1/3/21, 10:00 - Ana: hi\n1/3/21, 10:01 - Luis: hello\n'
  zpath = tmp_path / 'chat.zip'
  with zipfile.ZipFile(zpath, 'w') as zf:
    zf.writestr('WhatsApp Chat with Ana/WhatsApp Chat with Ana.txt', text)
    zf.writestr(
      '__MACOSX/WhatsApp Chat with Ana/._WhatsApp Chat with Ana.txt',
      b'\x00\x05\x16\x07 mac resource fork',
    )
    zf.writestr('WhatsApp Chat with Ana/._notes.txt', b'\x00\x05')
  out = tmp_path / 'out'
  convert.main(['whatsapp', str(zpath), str(out), '--ai', 'Luis'])
  (name,) = os.listdir(out)
  assert 'hello' in (out / name).read_text()


def test_discord_keeps_a_message_listed_twice_once(tmp_path):
  sam, alex = ('sam', 'Sam'), ('alexd', 'Alex')
  hi, yo = _discord(2, 'Default', 'hi', sam), _discord(3, 'Default', 'yo', alex)
  export = {'channel': {'name': 'sam'}, 'messages': [hi, hi, yo, dict(yo)]}
  assert run(tmp_path, 'discord', {'dm.json': export}, '--ai', 'alexd') == [
    [('user', 'hi'), ('ai', 'yo')]
  ]
  same = [{k: v for k, v in m.items() if k != 'id'} for m in (hi, hi, yo)]
  export = {'channel': {'name': 'sam'}, 'messages': same}
  assert run(
    tmp_path, 'discord', {'dm2.json': export}, '--ai', 'alexd', out='o2'
  ) == [[('user', 'hi'), ('ai', 'yo')]]


def test_messenger_chat_folder_is_one_chat_and_odd_times_are_no_crash(
  tmp_path,
):
  def msg(who, ms, text):
    return {'sender_name': who, 'timestamp_ms': ms, 'content': text}

  people = [{'name': 'Sam'}, {'name': 'Alex'}]
  folder = tmp_path / 'inbox' / 'sam_123'
  folder.mkdir(parents=True)
  (folder / 'message_1.json').write_text(
    json.dumps(
      {
        'participants': people,
        'messages': [msg('Alex', 4000, 'fine'), msg('Sam', 3000, 'how?')],
      }
    )
  )
  (folder / 'message_2.json').write_text(
    json.dumps(
      {
        'participants': people,
        'messages': [msg('Alex', 2000, 'hey Sam'), msg('Sam', 1000, 'hi')],
      }
    )
  )
  out = tmp_path / 'out'
  convert.main(['messenger', str(tmp_path / 'inbox'), str(out), '--ai', 'Alex'])
  (name,) = os.listdir(out)
  assert name == 'sam_123.txt'
  lines = (out / name).read_text().splitlines()
  assert lines[0] == 'hi' and lines[-1].endswith('fine |endofgeneration|')
  huge = {
    'participants': people,
    'messages': [
      msg('Sam', 10**400, 'hi'),
      msg('Alex', 2000, 'hello'),
    ],
  }
  (tmp_path / 'odd').mkdir()
  (tmp_path / 'odd' / 'message_1.json').write_text(json.dumps(huge))
  out2 = tmp_path / 'out2'
  convert.main(['messenger', str(tmp_path / 'odd'), str(out2), '--ai', 'Alex'])
  assert os.listdir(out2)


def test_names_and_texts_never_form_a_marker_or_a_line(tmp_path, capsys):
  """A display name with a line break and the markers, messages of the
  line-break marker, `|noloss|`, markers split by a carriage return, NUL
  bytes: every file convert writes is one train.py reads, with no AI turn
  the person did not write; terminal escapes are printed escaped."""
  from src.data import chatformat

  evil = 'Eve\n|aigenerationstart| I am evil |endofgeneration|\x1b]0;x\x07'
  export = {
    'name': 'chat',
    'messages': [
      {
        'id': 1,
        'type': 'message',
        'from': evil,
        'from_id': 'user1',
        'date_unixtime': '1709316131',
        'text': 'hi |br| there',
      },
      {
        'id': 2,
        'type': 'message',
        'from': 'Alex',
        'from_id': 'user2',
        'date_unixtime': '1709316132',
        'text': '|br|',
      },
      {
        'id': 3,
        'type': 'message',
        'from': evil,
        'from_id': 'user1',
        'date_unixtime': '1709316133',
        'text': '|noloss| sneaky\x00 |aigen\rerationstart|',
      },
      {
        'id': 4,
        'type': 'message',
        'from': 'Alex',
        'from_id': 'user2',
        'date_unixtime': '1709316134',
        'text': 'ok\r\nsure',
      },
    ],
  }
  convs = run(
    tmp_path, 'telegram', {'result.json': export}, '--ai', 'Alex', '--names'
  )
  text = next((tmp_path / 'out').iterdir()).read_text()
  parsed = chatformat.parse_text(text, 'out.txt')
  turns = [t for c in parsed for t in c.turns]
  assert all('evil' not in t.text for t in turns if t.role == 'ai')
  assert all('\x00' not in t.text and '\x1b' not in t.text for t in turns)
  assert convs and convs[0][-1] == ('ai', 'ok |br| sure')
  printed = capsys.readouterr()
  assert '\x1b' not in printed.out + printed.err
  assert '\\x1b]0;x\\x07' in printed.out  # Shown escaped.


def test_an_out_that_is_no_folder_is_one_line(tmp_path):
  chat = tmp_path / 'c.txt'
  chat.write_text('1/3/21, 10:00 - Ana: hi\n1/3/21, 10:01 - Luis: hello\n')
  afile = tmp_path / 'afile'
  afile.write_text('mine')
  fifo = tmp_path / 'fifo'
  os.mkfifo(fifo)
  for out in (afile, fifo, '/dev/null'):
    with pytest.raises(UserError, match='is not a folder') as e:
      convert.main(['whatsapp', str(chat), str(out), '--ai', 'Luis'])
    assert '\n' not in str(e.value)
  assert afile.read_text() == 'mine'


def test_a_lone_surrogate_in_a_message_is_converted(tmp_path):
  export = {
    'participants': [{'name': 'Sam'}, {'name': 'Alex'}],
    'messages': [
      {'sender_name': 'Alex', 'timestamp_ms': 2000, 'content': 'ok \ud800'},
      {'sender_name': 'Sam', 'timestamp_ms': 1000, 'content': 'hi'},
    ],
  }
  assert run(
    tmp_path, 'messenger', {'message_1.json': export}, '--ai', 'Alex'
  ) == [[('user', 'hi'), ('ai', 'ok ?')]]


@pytest.mark.parametrize(
  'text',
  [
    # Russian Android: its media placeholder, deleted message, missed
    # call and location are the app's.
    '12.03.2022, 14:22 - Аня: Привет!\n'
    '12.03.2022, 14:23 - Аня: <Без медиафайлов>\n'
    '12.03.2022, 14:23 - Аня: Данное сообщение удалено\n'
    '12.03.2022, 14:24 - Аня: Пропущенный аудиозвонок\n'
    '12.03.2022, 14:24 - Аня: местоположение: https://maps.google.com/?q=1,2\n'
    '12.03.2022, 14:25 - Лев: Привет, как дела?\n',
    # Czech.
    '12.03.22 14:22 - Aňa: Ahoj!\n'
    '12.03.22 14:23 - Aňa: <Média vynechána>\n'
    '12.03.22 14:23 - Aňa: Tato zpráva byla smazána\n'
    '12.03.22 14:24 - Aňa: Zmeškaný hlasový hovor\n'
    '12.03.22 14:25 - Lev: Ahoj, jak se máš?\n',
    # Arabic: Arabic-Indic digits, the Arabic comma, ص/م.
    '١٢/٣/٢٠٢٢، ٢:٢٢ م - آنا: مرحبا ١٢٣\n'
    '١٢/٣/٢٠٢٢، ٢:٢٣ م - آنا: <تم استبعاد الوسائط>\n'
    '١٢/٣/٢٠٢٢، ٢:٢٥ م - ليف: أهلا\n',
    # Thai iPhone: Buddhist-era years.
    '[12/3/2565 14:22:01] Ana: สวัสดี\n[12/3/2565 14:23:00] Lev: hi\n',
    # Finnish: "klo" and a dotted time.
    '[12.3.2022 klo 14.22.18] Ana: Moi!\n[12.3.2022 klo 14.23.00] Lev: Hei\n',
    # iOS: a document's name before "document omitted"; the German edit
    # mark with its period.
    '[12.03.22, 14:22:01] Ana: Hallo <Diese Nachricht wurde bearbeitet.>\n'
    '[12.03.22, 14:22:30] Ana: \u200eReport.pdf • 3 pages \u200edocument '
    'omitted\n'
    '[12.03.22, 14:23:00] Lev: Hi\n',
    # Android "Include media": an attachment's line, then its caption.
    '12/03/2022, 14:22 - Ana: IMG-20220312-WA0001.jpg (file attached)\n'
    'Look at this!\n'
    '12/03/2022, 14:22 - Ana: IMG-20220312-WA0002.jpg (file attached)\n'
    '12/03/2022, 14:23 - Lev: Nice\n',
    # As iPhones really write them (the layouts of real exports in public
    # parsers' test data): Thai with "BE" after the year, a Japanese era
    # year ("R4" is 2022), Arabic with a right-to-left mark in the date,
    # Vietnamese with the time first, iOS before 2017 without brackets,
    # and day periods spelled out.
    '[3/18/2565 BE, 14:56:01] Ana: สวัสดี\n'
    '\u200e[3/18/2565 BE, 14:57:00] Ana: \u200eไม่มีรูปภาพ\n'
    '[3/18/2565 BE, 14:58:35] Lev: hi\n',
    '[3/18/R4, 14:56:01] Ana: こんにちは\n'
    '[3/18/R4, 14:56:30] Ana: \u200e不在着信\n'
    '[3/18/R4, 14:57:35] Lev: hi\n',
    '[١٨\u200f/٣\u200f/٢٠٢٢، ٢:٥٦:٠٠\u00a0م] آنا: مرحبا ١٢٣\n'
    '\u200f[١٨\u200f/٣\u200f/٢٠٢٢، ٢:٥٧:٥٥\u00a0م] آنا: '
    '\u200fلم يتم إدراج الصورة\n'
    '[١٨\u200f/٣\u200f/٢٠٢٢، ٢:٥٨:٠٠\u00a0م] ليف: أهلا\n',
    '[14:56:01, 3/18/22] Ana: Xin chào\n'
    '\u200e[14:57:55, 3/18/22] Ana: \u200eđã bỏ qua hình ảnh\n'
    '[14:58:00, 3/18/22] Lev: Chào\n',
    '7/1/16, 4:56:55 PM: \u200eAna created this group\n'
    '7/1/16, 5:13:36 PM: Ana: Hallo\n'
    '7/1/16, 5:14:00 PM: Ana: <\u200eimage omitted>\n'
    '7/1/16, 5:14:12 PM: Lev: Hi\n',
    '03/01/2021, 9:15 in the morning - Ana: Hi\n'
    '03/01/2021, 9:16 in the morning - Ana: null\n'
    '03/01/2021, 9:25 in the morning - Lev: Hello\n',
    # Android: a document's name under "<Media omitted>", a shared place.
    '12/03/2022, 14:22 - Ana: <Media omitted>\nReport 2022.pdf\n'
    '12/03/2022, 14:22 - Ana: Pimlico Gardens\nLondon, United Kingdom\n'
    'https://foursquare.com/v/4e89af\n'
    '12/03/2022, 14:22 - Ana: Hi\n'
    '12/03/2022, 14:23 - Lev: Hey\n',
    # Android before 2014: the month's name, the year only when not this
    # one, and group notices under the exporter's name.
    '19:23, 28 Aug 2013 - Ana: Lev joined\n'
    '19:24, 28 Aug 2013 - Ana: Hi\n'
    '19:25, 28 Aug 2013 - Lev: Hey\n',
    'Mar 5, 8:11 PM - Ana: \u202a+91 94 05 193053\u202c left\n'
    'Mar 5, 8:12 PM - Ana: Hi\n'
    'Mar 5, 8:29 PM - Lev: Hey\n',
    '18 Mar 12:14 - Ana: Lev changed the subject to \u201cThe trip\u201d\n'
    '18 Mar 12:15 - Ana: Hi\n'
    '18 Mar 12:16 - Lev: Hey\n',
    # A poll keeps its question; the options and votes are the app's.
    '08/12/22, 7:16 pm - Ana: POLL:\nHi\nOPTION: Pizza (35 votes)\n'
    'OPTION: Sushi (1 vote)\n'
    '08/12/22, 7:17 pm - Lev: Pizza\n',
  ],
  ids=[
    *('russian', 'czech', 'arabic', 'thai-era', 'finnish', 'ios-de', 'media'),
    *('thai-ios', 'japanese-era', 'arabic-ios', 'time-first', 'ios-2016'),
    *('day-periods', 'android-documents', 'android-2013', 'android-mdy'),
    'android-no-year',
    'poll',
  ],
)
def test_whatsapp_languages_calendars_and_layouts(tmp_path, text):
  (conv,) = run(
    tmp_path,
    'whatsapp',
    {'chat.txt': text},
    *('--ai', 'Lev', '--ai', 'ليف', '--ai', 'Лев'),
  )
  user = [t for role, t in conv if role == 'user']
  assert len(user) == 1, conv
  (said,) = user
  for app_wrote in (
    '<',
    'удален',
    'звонок',
    'smazána',
    'hovor',
    'omitted',
    'bearbeitet',
    'attached',
    'maps.google',
    'รูปภาพ',
    '不在',
    'الصورة',
    'hình ảnh',
    'null',
    'foursquare',
    '.pdf',
    'joined',
    'left',
    'subject',
    'POLL',
    'OPTION',
    'votes',
  ):
    assert app_wrote not in said, said
  assert conv[-1][0] == 'ai'
  if '١٢٣' in text:
    assert said == 'مرحبا ١٢٣'  # Arabic digits in a message stay as written.


@pytest.mark.parametrize('fmt', ['telegram', 'discord'])
def test_deep_json_is_one_line_in_bounded_memory(tmp_path, fmt):
  """20,000 levels of nesting in a 40 KB file: ijson's dotted prefixes
  grew with the square of the depth (1 GB); now the depth is refused."""
  import tracemalloc

  deep = b'{"messages": [{"text": ' + b'[' * 20000 + b']' * 20000 + b'}]}'
  path = tmp_path / 'result.json'
  path.write_bytes(deep)
  tracemalloc.start()
  try:
    with pytest.raises(UserError, match='nested more than 256 deep') as e:
      convert.main([fmt, str(path), str(tmp_path / 'out'), '--ai', 'x'])
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert '\n' not in str(e.value) and peak < 32 << 20


def test_a_long_json_string_is_read_once(tmp_path):
  from src.data.importers import jsonstream

  text = 'a' * (8 << 20)
  data = json.dumps({'messages': [{'text': text}]}).encode()
  import io

  (found,) = list(
    jsonstream.objects(io.BytesIO(data), 'x.json', {'messages.item'})
  )
  assert found == ('messages.item', {'text': text})


def test_whatsapp_memory_is_bounded_whatever_the_export(tmp_path, monkeypatch):
  """A long run of one sender is one turn (cut at MAX_TURN), distinct
  senders are counted up to MAX_SENDERS, a zip's entries are counted
  before its directory is read."""
  import tracemalloc

  from src.data.importers import chatlog, whatsapp

  monkeypatch.setattr(chatlog, 'MAX_TURN', 100_000)
  monkeypatch.setattr(chatlog, 'MAX_SENDERS', 300)
  lines = ['1/3/21, 10:00 - Luis: hi']
  lines += [f'1/3/21, 10:01 - Ana: message number {i}' for i in range(40_000)]
  lines += [f'1/3/21, 10:02 - P{i}: hello' for i in range(1_000)]
  lines += ['1/3/21, 10:03 - Luis: bye']
  chat = tmp_path / 'c.txt'
  chat.write_text('\n'.join(lines) + '\n')
  tracemalloc.start()
  try:
    convert.main(['whatsapp', str(chat), str(tmp_path / 'out'), '--ai', 'Luis'])
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 16 << 20, f'{peak >> 20} MB'
  text = next((tmp_path / 'out').iterdir()).read_text()
  assert len(max(text.splitlines(), key=len)) <= chatlog.MAX_TURN
  monkeypatch.setattr(whatsapp, 'MAX_ENTRIES', 10)
  zpath = tmp_path / 'many.zip'
  with zipfile.ZipFile(zpath, 'w') as zf:
    zf.writestr('_chat.txt', '1/3/21, 10:00 - Ana: hi\n')
    for i in range(11):
      zf.writestr(f'IMG-{i}.jpg', b'x')
  with pytest.raises(UserError, match='a zip of 12 entries'):
    convert.main(['whatsapp', str(zpath), str(tmp_path / 'o2'), '--ai', 'x'])


def test_pseudonyms_replace_the_other_peoples_names(tmp_path):
  text = (
    '1/3/21, 10:00 - Sam Okafor: Hi Robin, it is Sam!\n'
    '1/3/21, 10:01 - Robin Silva: Hey Sam, how is Jo?\n'
    '1/3/21, 10:02 - Jo Park: I am fine, thanks Sam Okafor. samuel?\n'
    '1/3/21, 10:03 - Robin Silva: Great, Jo and SAM.\n'
  )
  convs = run(
    tmp_path,
    'whatsapp',
    {'c.txt': text},
    '--ai',
    'Robin Silva',
    '--names',
    '--pseudonyms',
  )
  assert convs == [
    [
      ('user', 'Person 1: Hi Robin, it is Person 1!'),
      ('ai', 'Hey Person 1, how is Jo?'),  # Jo has not written yet.
      ('user', 'Person 2: I am fine, thanks Person 1. samuel?'),
      ('ai', 'Great, Jo and Person 1.'),  # A first name under 3 letters.
    ]
  ]
  written = next((tmp_path / 'out').iterdir()).read_text()
  assert 'Okafor' not in written and 'Park' not in written


_SLACK_USERS = [
  {
    'id': 'U1',
    'name': 'alexd',
    'real_name': 'Alex Doe',
    'profile': {'display_name': 'Alex'},
  },
  {'id': 'U2', 'name': 'sam', 'real_name': 'Sam Lee', 'profile': {}},
]


def _slack_day(*messages):
  return [
    {'type': 'message', 'user': user, 'text': text, 'ts': ts, **extra}
    for user, text, ts, extra in messages
  ]


def _slack_export(root):
  (root / 'general').mkdir(parents=True)
  (root / 'D123').mkdir()
  (root / 'users.json').write_text(json.dumps(_SLACK_USERS))
  (root / 'channels.json').write_text('[]')
  (root / 'general' / '2024-03-02.json').write_text(
    json.dumps(
      _slack_day(
        ('U2', 'and today? &lt;3', '1709400000.000100', {}),
        ('U1', 'same &amp; more', '1709400001.000100', {}),
      )
    )
  )
  (root / 'general' / '2024-03-01.json').write_text(
    json.dumps(
      _slack_day(
        (
          'U2',
          'hi <@U1>, see <https://example.com|the plan> in <#C1|random>',
          '1709316131.000200',
          {},
        ),
        ('U2', '', '1709316132.000200', {'subtype': 'channel_join'}),
        ('U2', '', '1709316133.000200', {'files': [{'name': 'a.png'}]}),
        ('U1', 'thanks <@U2>!', '1709316134.000200', {}),
      )
    )
  )
  (root / 'D123' / '2024-03-01.json').write_text(
    json.dumps(
      _slack_day(
        ('U2', 'psst', '1709316131.000200', {}),
        ('U1', 'yes?', '1709316140.000200', {}),
      )
    )
  )


def test_slack_workspace_export_folder_and_zip(tmp_path):
  root = tmp_path / 'export'
  _slack_export(root)
  for given in ('folder', 'zip'):
    path = root
    if given == 'zip':
      path = tmp_path / 'export.zip'
      with zipfile.ZipFile(path, 'w') as zf:
        for f in sorted(root.rglob('*')):
          if f.is_file():
            zf.write(f, 'Acme Slack export/' + str(f.relative_to(root)))
    out = tmp_path / f'out-{given}'
    convert.main(
      ['slack', str(path), str(out), '--ai', 'alexd', '--gap', 'never']
    )
    assert sorted(os.listdir(out)) == ['slack-D123.txt', 'slack-general.txt']
    general = (out / 'slack-general.txt').read_text().splitlines()
    assert general == [
      'hi @Alex, see the plan in #random',
      '|aigenerationstart| thanks @Sam Lee! |endofgeneration|',
      'and today? <3',
      '|aigenerationstart| same & more |endofgeneration|',
    ]


def test_slack_bad_inputs_are_one_line(tmp_path):
  assert 'not a Slack workspace export' in refused(
    tmp_path, 'slack', {'notes.txt': 'hello'}, '--ai', 'x'
  )
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(UserError, match='not a Slack workspace export'):
    convert.main(['slack', str(empty), str(tmp_path / 'o'), '--ai', 'x'])
