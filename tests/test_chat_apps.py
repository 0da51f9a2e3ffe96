"""iMessage (imessage-exporter's txt), Signal (sigexport's data.json and
chat.md) and Google Chat (Takeout) exports into the line format, on
fixtures written from the exporters' own sources (see each importer's
docstring)."""

import json
import zipfile

import pytest

from src.apps import convert
from src.core.errors import UserError
from src.data import chatformat
from src.data.importers import googlechat, imessage

from .test_chatlogs import refused, run


def _converted(fmt, path, out, *flags):
  """Converts the export `path` into the folder `out`; the conversations
  of the one file written, as [(role, text)] lists."""
  convert.main([fmt, str(path), str(out), *flags])
  (written,) = out.iterdir()
  return [
    [(t.role, t.text) for t in c.turns]
    for c in chatformat.read_file(str(written))
  ]


def _zipped(root, path, prefix, junk):
  """`root`'s files zipped into `path` under `prefix`, as a Mac re-zips
  them: with the `__MACOSX/` entry `junk`."""
  with zipfile.ZipFile(path, 'w') as zf:
    for f in sorted(root.rglob('*')):
      if f.is_file():
        zf.write(f, prefix + str(f.relative_to(root)))
    zf.writestr(junk, b'\x00\x05junk')
  return path


IMESSAGE = (
  'May 17, 2022  5:29:42 PM (Read by you after 1 hour, 49 seconds)\n'
  'Sam\n'
  'Hello world\n'
  '/Users/alex/Library/Messages/Attachments/ab/11/IMG_0001.HEIC\n'
  'Reactions:\n'
  'Loved by Me\n'
  '\n'
  'May 17, 2022  5:31:02 PM (Read by them after 2 minutes)\n'
  'Me\n'
  'hi Sam\n'
  'Sent with Confetti\n'
  '    May 17, 2022  5:33:00 PM\n'
  '    Sam\n'
  '    a reply\n'
  '\n'
  'May 17, 2022  5:33:00 PM\n'
  'Sam\n'
  'a reply\n'
  '\n'
  'with a blank line\n'
  'This message responded to an earlier message.\n'
  '\n'
  'May 17, 2022  5:34:00 PM\n'
  'Sam\n'
  '/Users/alex/Library/Messages/Attachments/ab/11/IMG_0002.HEIC\n'
  '\n'
  'May 17, 2022  5:35:00 PM\n'
  'Me\n'
  'May 17, 2022  5:35:00 PM first try\n'
  'Edited 1 minute later: second try\n'
  '\n'
  'May 17, 2022  5:36:00 PM\n'
  'Sam\n'
  'They deleted a message.\n'
  '\n'
  'May 17, 2022  5:40:00 PM Sam renamed the conversation to Climbing\n'
  '\n'
  'May 18, 2022 12:41:00 AM\n'
  'Sam\n'
  'much later\n'
  '\n'
  'May 18, 2022 12:42:00 AM\n'
  'Me\n'
  'yes\n'
  '\n'
)


def test_imessage_exporter_txt_folder(tmp_path):
  (tmp_path / 'export').mkdir()
  (tmp_path / 'export' / 'Sam.txt').write_text(IMESSAGE)
  (tmp_path / 'export' / 'notes.txt').write_text('not a chat\n')
  convs = _converted(
    'imessage', tmp_path / 'export', tmp_path / 'out', '--ai', 'Me'
  )
  # The folder is the input (notes.txt does not start with a time line).
  assert convs == [
    [
      ('user', 'Hello world'),
      ('ai', 'hi Sam'),
      ('user', 'a reply |br| with a blank line'),
      ('ai', 'second try'),
    ],
    [('user', 'much later'), ('ai', 'yes')],
  ]


def test_imessage_one_chat_file_and_what_is_not_one(tmp_path):
  convs = run(tmp_path, 'imessage', {'Sam.txt': IMESSAGE}, '--ai', 'Me')
  assert len(convs) == 2
  assert 'is not an iMessage export' in refused(
    tmp_path,
    'imessage',
    {'chat.txt': 'hello\nthere\n'},
    '--ai',
    'Me',
    out='out2',
  )


def test_imessage_times():
  m = imessage._time_line('Dec 31, 2022 12:05:09 AM')
  assert imessage.seconds(m) % 86400 == 5 * 60 + 9
  m = imessage._time_line('Dec 31, 2022  1:05:09 PM (Read by you after 1 hour)')
  assert imessage.seconds(m) % 86400 == 13 * 3600 + 5 * 60 + 9
  assert imessage._time_line('Dec 32, 2022  1:05:09 PM') is None


def _signal(root):
  sam = [
    {
      'date': '2024-03-01T18:02:11',
      'sender': 'Sam',
      'body': 'hi  ',
      'quote': '',
      'sticker': None,
      'reactions': [],
      'attachments': [],
      'deleted': False,
      'call': False,
      'missed': False,
    },
    {
      'date': '2024-03-01T18:03:11',
      'sender': 'Me',
      'body': 'hello  ',
      'quote': '\n\n> hi\n\n',
      'sticker': None,
      'reactions': [['Sam', '👍']],
      'attachments': [{'name': 'a.jpg', 'path': 'media/a.jpg'}],
      'deleted': False,
      'call': False,
      'missed': False,
    },
    {
      'date': '2024-03-01T18:04:11',
      'sender': 'Sam',
      'body': 'Missed voice call  ',
      'call': True,
      'missed': True,
    },
    {'date': '2024-03-01T18:05:11', 'sender': 'Sam', 'deleted': True},
    {'date': '2024-03-01T18:06:11', 'sender': 'Sam', 'sticker': {'id': 1}},
  ]
  files = {
    'Sam/data.json': ''.join(json.dumps(m) + '\n' for m in sam),
    'Sam/chat.md': '[2024-03-01 18:02:11] Sam: not read: data.json is\n',
    'Sam/media/data.json': '{"an": "attachment named data.json"}\n',
    'exported_stickers/p1/data.json': '{"stickers": []}\n',
    'Kim/chat.md': (
      '[2024-03-01 18:02:11] Kim: hey there  \n\n'
      '[2024-03-01 18:03:00] Me: \n\n> hey there\n\n'
      'yo, ![IMG_1.jpg](./media/IMG_1.jpg)  \n\n'
      '[2024-03-01 18:04:00] Kim: (This message was deleted)\n\n'
      '[2024-03-01 18:05:00] Kim: Incoming video call (accepted, 1m 2s)  \n\n'
      '[2024-03-01 18:06:00] Kim: line one  \nline two  \n(- Me: 👍 -)\n\n'
      '[2024-03-01, 18:07] Me: [IMG_2.jpg](./media/IMG_2.jpg)  \n\n'
      '[2024-03-01, 18:08] Me: (( 😀 ))\nsee  \n\n'
    ),
  }
  for name, text in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text, encoding='utf-8')


SIGNAL = [
  [
    ('user', 'hey there'),
    ('ai', 'yo,'),
    ('user', 'line one |br| line two'),
    ('ai', 'see'),
  ],
  [('user', 'hi'), ('ai', 'hello')],
]


@pytest.mark.parametrize('as_zip', [False, True])
def test_signal_export_folder_and_zip(tmp_path, as_zip):
  root = tmp_path / 'signal-chats'
  _signal(root)
  path = root
  if as_zip:
    path = _zipped(
      root,
      tmp_path / 'signal.zip',
      'signal-chats/',
      '__MACOSX/signal-chats/Sam/._data.json',
    )
  convs = _converted('signal', path, tmp_path / 'out', '--ai', 'Me')
  assert convs == SIGNAL


def test_signal_bad_inputs_are_one_line(tmp_path):
  assert 'is not a Signal export' in refused(
    tmp_path, 'signal', {'notes.txt': 'hello'}, '--ai', 'Me'
  )
  (tmp_path / 'empty').mkdir()
  with pytest.raises(UserError, match='is not a Signal export'):
    convert.main(['signal', str(tmp_path / 'empty'), str(tmp_path / 'o')])


def _takeout(root):
  groups = root / 'Takeout' / 'Google Chat' / 'Groups'
  sam = {'name': 'Sam Roe', 'email': 'sam@example.com', 'user_type': 'Human'}
  alex = {'name': 'Alex Doe', 'email': 'alex@example.com', 'user_type': 'Human'}
  bot = {'name': 'Giphy', 'user_type': 'Bot'}
  day = 'Thursday, November 3, 2016 at '
  content = {
    'DM k6oxHQAAAAE': (
      {'members': [sam, alex]},
      [
        {'creator': sam, 'created_date': day + '11:59:50 AM UTC', 'text': 'a?'},
        {
          'creator': alex,
          'created_date': day + '12:01:50\u202fPM UTC',
          'text': 'b',
        },
        {
          'creator': sam,
          'created_date': day + '12:02:50 PM UTC',
          'attached_files': [{'export_name': 'File-2016-11-03.png'}],
        },
        {'creator': sam, 'created_date': day + '9:02:50 PM UTC', 'text': 'c?'},
        {'creator': alex, 'created_date': day + '9:03:00 PM UTC', 'text': 'd'},
      ],
    ),
    'Space AAAAFyOfy4w': (
      {'name': 'Climbing', 'members': [sam, alex]},
      [
        {'creator': bot, 'created_date': day + '1:00:00 PM UTC', 'text': 'gif'},
        {'creator': sam, 'created_date': day + '1:01:00 PM UTC', 'text': 'e?'},
        {'creator': alex, 'created_date': day + '1:02:00 PM UTC', 'text': 'f'},
      ],
    ),
  }
  for folder, (info, messages) in content.items():
    (groups / folder).mkdir(parents=True)
    (groups / folder / 'group_info.json').write_text(json.dumps(info))
    (groups / folder / 'messages.json').write_text(
      json.dumps({'messages': messages})
    )


@pytest.mark.parametrize('as_zip', [False, True])
def test_google_chat_takeout_folder_and_zip(tmp_path, as_zip):
  root = tmp_path / 'takeout'
  _takeout(root)
  path = root
  if as_zip:
    path = _zipped(
      root,
      tmp_path / 'takeout-20240301.zip',
      '',
      '__MACOSX/Takeout/Google Chat/Groups/DM k6oxHQAAAAE/._messages.json',
    )
  convs = _converted(
    'googlechat', path, tmp_path / 'out', '--ai', 'alex@example.com'
  )
  assert convs == [
    [('user', 'a?'), ('ai', 'b')],
    [('user', 'c?'), ('ai', 'd')],  # 9 hours later: a new conversation.
    [('user', 'e?'), ('ai', 'f')],
  ]


def test_google_chat_names_dates_and_bad_inputs(tmp_path):
  assert googlechat.chat_name({'name': 'Climbing'}, 'Space x') == 'Climbing'
  members = {'members': [{'name': 'Sam'}, {'name': 'Alex'}]}
  assert googlechat.chat_name(members, 'DM x') == 'Sam, Alex'
  assert googlechat.chat_name(None, 'DM x') == 'DM x'
  noon = googlechat.seconds('Thursday, November 3, 2016 at 12:00:00 PM UTC')
  assert noon % 86400 == 12 * 3600
  assert googlechat.seconds('Thursday, November 3, 2016 at 13:00:00 PM') is None
  assert googlechat.seconds('Donnerstag, 3. November 2016 um 12:00:00') is None
  assert 'is not a Google Chat export' in refused(
    tmp_path, 'googlechat', {'Takeout/Mail/x.mbox': 'From x'}, '--ai', 'x'
  )


def test_imessage_takes_out_only_what_the_exporter_wrote():
  text, took = imessage._text(
    [
      'Sent with Love',  # A person's words: no such effect.
      'Sent with Invisible Ink',
      'Sticker from the shop on the corner',
      'Sticker from Sam: /Users/a/Library/Messages/Stickers/x.heic',
    ]
  )
  assert (text, took) == (
    'Sent with Love\nSticker from the shop on the corner',
    True,
  )
