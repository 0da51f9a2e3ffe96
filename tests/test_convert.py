"""Importers into the line format and the exporter back to messages JSONL."""

import glob
import json
import os

import pytest

from src.apps import convert
from src.core.errors import UserError
from src.data import chatformat


def converted(fmt, source, out, trim=False, strict=False, **kw):
  """Converts `source` into `out`; the report, the warnings and the
  conversations read back from the written file."""
  warnings = []
  report = convert.convert(
    fmt,
    str(source),
    str(out),
    convert.Options(trim=trim, strict=strict),
    warn=warnings.append,
    **kw,
  )
  name = os.path.splitext(os.path.basename(os.path.normpath(source)))[0]
  return report, warnings, chatformat.read_file(str(out / (name + '.txt')))


def run(fmt, tmp_path, text, name='in.jsonl', strict=False, trim=False, **kw):
  src = tmp_path / name
  src.write_text(text, encoding='utf-8')
  options = dict(
    ai_roles=['gpt'],
    user_roles=['human'],
    ai_side='second',
    user_prefix='User:',
    ai_prefix='Bot:',
  )
  options.update(kw)
  return converted(
    fmt, src, tmp_path / 'out', trim=trim, strict=strict, **options
  )


def roles_and_texts(convs):
  return [[(t.role, t.text) for t in c.turns] for c in convs]


MESSAGES = (
  '\n'.join(
    json.dumps(r)
    for r in [
      {
        'messages': [
          {'role': 'system', 'content': 'Be nice.'},
          {'role': 'user', 'content': 'Hi\nthere'},
          {'role': 'assistant', 'content': 'Hello!'},
        ]
      },
      {'messages': [{'role': 'user', 'content': 'ok'}]},
      {
        'messages': [
          {'role': 'wizard', 'content': 'x'},
          {'role': 'assistant', 'content': 'y'},
        ]
      },
      {
        'messages': [
          {'role': 'user', 'content': ''},
          {'role': 'assistant', 'content': 'y'},
        ]
      },
    ]
  )
  + '\n{"messages": [\n'
)


def test_messages_jsonl_with_malformed_records(tmp_path):
  report, warnings, convs = run('messages', tmp_path, MESSAGES)
  assert roles_and_texts(convs) == [
    [('user', 'Hi |br| there'), ('ai', 'Hello!')]
  ]
  path = str(tmp_path / 'in.jsonl')
  assert warnings == [
    f'{path}:2: skipped: ends on a user turn (the AI must talk last; --trim '
    'drops it)',
    f"{path}:3: skipped: unknown role 'wizard'",
    f'{path}:4: skipped: empty content',
    f'{path}:5: skipped: bad JSON (Expecting value)',
  ]
  assert report.conversations == 1 and report.dropped_system == 1
  assert sum(report.skipped.values()) == 4
  assert 'skipped 4 records' in report.summary()


def test_strict_stops_at_the_first_bad_record(tmp_path):
  with pytest.raises(UserError, match=r'in.jsonl:2: ends on a user turn'):
    run('messages', tmp_path, MESSAGES, strict=True)


def test_round_trip_messages_to_lines_to_messages(tmp_path):
  records = [
    {
      'messages': [
        {'role': 'user', 'content': 'a\nb'},
        {'role': 'assistant', 'content': 'c'},
        {'role': 'user', 'content': 'd'},
        {'role': 'assistant', 'content': 'e\nf', 'weight': 0},
      ]
    },
    {'messages': [{'role': 'assistant', 'content': 'I start.'}]},
  ]
  text = ''.join(json.dumps(r) + '\n' for r in records)
  run('messages', tmp_path, text)
  out = tmp_path / 'back.jsonl'
  report = convert.to_messages(str(tmp_path / 'out'), str(out))
  back = [json.loads(line) for line in out.read_text().splitlines()]
  assert back == records and report.conversations == 2
  assert report.context_only == 1
  # The weight-0 turn is context: in the file with |noloss|, no loss.
  text = (tmp_path / 'out' / 'in.txt').read_text()
  assert '|noloss| |aigenerationstart| e |br| f |endofgeneration|' in text


def test_weight_must_be_0_or_1(tmp_path):
  good = {
    'messages': [
      {'role': 'user', 'content': 'a'},
      {'role': 'assistant', 'content': 'b', 'weight': 1},
    ]
  }
  record = {
    'messages': [
      {'role': 'user', 'content': 'a'},
      {'role': 'assistant', 'content': 'b', 'weight': 0.5},
    ]
  }
  report, warnings, _ = run(
    'messages', tmp_path, json.dumps(record) + '\n' + json.dumps(good) + '\n'
  )
  assert warnings == [
    f'{tmp_path}/in.jsonl:1: skipped: weight 0.5 is not 0 or 1'
  ]


def test_sharegpt_with_configurable_roles(tmp_path):
  data = [
    {
      'conversations': [
        {'from': 'human', 'value': 'Hi'},
        {'from': 'gpt', 'value': 'Hey'},
        {'from': 'gpt', 'value': 'What is up?'},
      ]
    },
    {'conversations': [{'from': 'robot', 'value': 'x'}]},
  ]
  report, warnings, convs = run(
    'sharegpt', tmp_path, json.dumps(data), name='sg.json'
  )
  # Two AI messages in a row become one line joined with |br|.
  assert roles_and_texts(convs) == [
    [('user', 'Hi'), ('ai', 'Hey |br| What is up?')]
  ]
  assert warnings == [
    f"{tmp_path / 'sg.json'}[1]: skipped: unknown role 'robot'"
  ]


def test_chatterbot_yaml_sides_and_trim(tmp_path):
  text = (
    'categories:\n- test\nconversations:\n- - Hello\n  - Hi\n'
    '- - How are you?\n  - Fine.\n  - Good.\n'
  )
  _, warnings, convs = run('chatterbot', tmp_path, text, name='c.yml')
  assert roles_and_texts(convs) == [[('user', 'Hello'), ('ai', 'Hi')]]
  assert 'c.yml[1]: skipped: ends on a user turn' in warnings[0]
  _, _, convs = run(
    'chatterbot', tmp_path / '..', text, name='c2.yml', trim=True
  )
  assert len(convs) == 2
  _, _, convs = run(
    'chatterbot', tmp_path / '..', text, name='c3.yml', ai_side='first'
  )
  # The AI speaks first: only the odd-length list ends on the AI.
  assert roles_and_texts(convs) == [
    [('ai', 'How are you?'), ('user', 'Fine.'), ('ai', 'Good.')]
  ]


def test_transcript_prefixes_and_continuations(tmp_path):
  text = (
    'User: hello\nBot: hi there\nhow can I help?\n\nMe: wrong prefix\nBot: x\n'
  )
  _, warnings, convs = run('transcript', tmp_path, text, name='t.txt')
  assert roles_and_texts(convs) == [
    [('user', 'hello'), ('ai', 'hi there |br| how can I help?')]
  ]
  assert (
    "t.txt:5: skipped: line starts with neither 'User:' nor 'Bot:'"
    in (warnings[0])
  )


def test_installed_chatterbot_corpus_imports(tmp_path):
  import chatterbot_corpus

  root = os.path.dirname(chatterbot_corpus.__file__)
  files = sorted(glob.glob(os.path.join(root, 'data', 'english', '*.yml')))
  assert files
  total = 0
  for path in files:
    report = convert.convert(
      'chatterbot',
      path,
      str(tmp_path),
      convert.Options(trim=True),
      warn=lambda line: None,
      ai_side='second',
    )
    total += report.conversations
  assert total > 500
  convs = chatformat.read_data(str(tmp_path))
  assert len(convs) == total


def test_never_overwrites(tmp_path):
  run('messages', tmp_path, MESSAGES)
  with pytest.raises(UserError, match='exists; choose another'):
    run('messages', tmp_path, MESSAGES)


def test_several_inputs_are_converted_all_or_none(tmp_path):
  good = 'conversations:\n- - Hello\n  - Hi\n'
  bad = 'conversations:\n- - Hello\n  - Hi\n  - Bye?\n'
  for name, text in [('a.yml', good), ('b.yml', bad), ('sub/a.yml', good)]:
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text(text)
  files = [str(tmp_path / n) for n in ('a.yml', 'b.yml', 'sub/a.yml')]
  out = tmp_path / 'out'
  # b.yml has nothing left without --trim: one line naming it, the reason
  # and its fix, and no file of the run left behind (a.yml came first).
  with pytest.raises(UserError) as e:
    convert.main(['chatterbot', *files, str(out)])
  line = str(e.value)
  assert line.startswith(files[1] + ': no conversation could be converted')
  assert 'ends on a user turn' in line and '--trim drops it' in line
  assert not out.exists()
  # An existing folder keeps what it had, and nothing is added.
  out.mkdir()
  (out / 'mine.txt').write_text('x')
  with pytest.raises(UserError, match='--trim drops it'):
    convert.main(['chatterbot', *files, str(out)])
  assert os.listdir(out) == ['mine.txt']
  # Run again as the line says: every input written; a repeated name
  # numbered.
  assert convert.main(['chatterbot', *files, str(out), '--trim']) == 0
  assert sorted(os.listdir(out)) == ['a-2.txt', 'a.txt', 'b.txt', 'mine.txt']
  # A target that exists stops the run before anything is written.
  os.remove(out / 'a.txt')
  with pytest.raises(UserError, match='b.txt exists; .*nothing was written'):
    convert.main(['chatterbot', *files, str(out), '--trim'])
  assert not (out / 'a.txt').exists()


def test_chatterbot_language_name_finds_the_installed_corpus(tmp_path, capsys):
  files = convert.chatterbot_files('english')
  assert len(files) > 10 and all(f.endswith('.yml') for f in files)
  with pytest.raises(UserError, match='nor a chatterbot-corpus language'):
    convert.chatterbot_files('klingon')
  out = tmp_path / 'en'
  assert convert.main(['chatterbot', 'english', str(out), '--trim']) == 0
  summary = capsys.readouterr().out.strip().splitlines()[-1]
  assert summary.startswith(f'chatterbot: {len(files)} file(s): ')
  assert len(chatformat.read_data(str(out))) > 1000
  # The quick start's small talk: four categories left out by name.
  small = tmp_path / 'small'
  skipped = 'coding,computers,tech_support,trivia'
  assert (
    convert.main(
      ['chatterbot', 'english', str(small), '--trim', '--skip', skipped]
    )
    == 0
  )
  names = sorted(os.listdir(small))
  assert 'greetings.txt' in names and len(names) == len(files) - 4
  assert not {'coding.txt', 'trivia.txt'} & set(names)
  with pytest.raises(UserError, match='--skip cooking: no such input'):
    convert.main(
      ['chatterbot', 'english', str(tmp_path / 'x'), '--skip', 'cooking']
    )
  assert not os.path.exists(tmp_path / 'x')


def test_deeply_nested_json_and_bytes_that_are_not_utf8(tmp_path):
  deep = '[' * 5000 + ']' * 5000
  good = json.dumps(
    {
      'messages': [
        {'role': 'user', 'content': 'Hi'},
        {'role': 'assistant', 'content': 'Hello'},
      ]
    }
  )
  text = f'{good}\n{{"messages": {deep}}}\n'
  report, warnings, convs = run('messages', tmp_path, text)
  path = tmp_path / 'in.jsonl'
  assert warnings == [f'{path}:2: skipped: JSON nested too deeply']
  assert report.conversations == 1
  (tmp_path / 'list.json').write_text(deep)
  with pytest.raises(UserError, match='list.json: JSON nested too deeply'):
    convert.main(['sharegpt', str(tmp_path / 'list.json'), str(tmp_path / 'o')])
  (tmp_path / 'bad.jsonl').write_bytes(good.encode() + b'\n{"x": "\xff"}\n')
  with pytest.raises(UserError, match=r'bad.jsonl:2: not UTF-8 \(byte 0xff\)'):
    convert.main(['messages', str(tmp_path / 'bad.jsonl'), str(tmp_path / 'p')])


def convert_to(fmt, source, out, trim=False, strict=False, **kw):
  report, warnings, convs = converted(fmt, source, out, trim, strict, **kw)
  return report, warnings, roles_and_texts(convs)


SEP = ' +++$+++ '


def test_cornell_latin1_speakers_missing_ids_and_bad_lines(tmp_path):
  folder = tmp_path / 'cornell'
  folder.mkdir()
  lines = [
    SEP.join(['L1', 'u0', 'm0', 'BIANCA', 'Can we go?']),
    SEP.join(['L2', 'u2', 'm0', 'CAMERON', 'Caf\xe9 first.']),
    SEP.join(['L3', 'u0', 'm0', 'BIANCA', 'Fine.']),
    SEP.join(['L4', 'u0', 'm0', 'BIANCA', 'And then?']),
    'L5 +++$+++ u2 +++$+++ m0',  # Too few fields.
    SEP.join(['L6', 'u2', 'm0', 'CAMERON', 'Home.']),
    SEP.join(['L7', 'u5', 'm1', 'X', 'Hi']),
  ]
  (folder / 'movie_lines.txt').write_bytes(
    ('\n'.join(lines) + '\n').encode('iso-8859-1')
  )
  conversations = [
    SEP.join(['u0', 'u2', 'm0', "['L1', 'L2', 'L3', 'L4', 'L6']"]),
    SEP.join(['u0', 'u2', 'm0', "['L3', 'L4']"]),  # Ends on the user.
    SEP.join(['u0', 'u2', 'm0', "['L1', 'L99']"]),  # Unknown line id.
    SEP.join(['u5', 'u0', 'm1', 'L7']),  # Not a list.
  ]
  (folder / 'movie_conversations.txt').write_text('\n'.join(conversations))
  report, warnings, convs = convert_to('cornell', folder, tmp_path / 'out')
  assert convs == [
    [
      ('user', 'Can we go?'),
      ('ai', 'Café first.'),
      ('user', 'Fine. |br| And then?'),
      ('ai', 'Home.'),
    ]
  ]
  lines_file = folder / 'movie_lines.txt'
  conv_file = folder / 'movie_conversations.txt'
  assert warnings[0].startswith(f'{lines_file}:5: skipped: 3 field(s)')
  assert warnings[1].startswith(f'{conv_file}:2: skipped: ends on a user')
  assert warnings[2] == (
    f'{conv_file}:3: skipped: line id L99 is not in movie_lines.txt'
  )
  assert warnings[3].startswith(f'{conv_file}:4: skipped: line ids')
  assert report.conversations == 1 and sum(report.skipped.values()) == 4
  # Trimmed, the one-speaker conversation has no turns left.
  _, warned, trimmed = convert_to('cornell', folder, tmp_path / 't', trim=True)
  assert trimmed == convs
  assert warned[1] == f'{conv_file}:2: skipped: no turns'
  with pytest.raises(UserError, match='movie_lines.txt: no such file'):
    convert.main(['cornell', str(tmp_path), str(tmp_path / 'x')])


def test_taskmaster_order_speakers_and_ids(tmp_path):
  records = [
    {
      'conversation_id': 'dlg-1',
      'utterances': [
        {'index': 2, 'speaker': 'ASSISTANT', 'text': 'Which size?'},
        {'index': 0, 'speaker': 'USER', 'text': 'A pizza please.'},
        {'index': 1, 'speaker': 'USER', 'text': 'With olives.'},
        {'index': 3, 'speaker': 'USER', 'text': 'Large.'},
        {
          'index': 4,
          'speaker': 'ASSISTANT',
          'text': 'Done.',
          'segments': [{'text': 'Done'}],
        },
      ],
    },
    {
      'conversationId': 'ccpe-7',
      'utterances': [
        {'index': 0, 'speaker': 'ASSISTANT', 'text': 'What films do you like?'},
        {'index': 1, 'speaker': 'USER', 'text': 'Comedies.'},
        {'index': 2, 'speaker': 'ASSISTANT', 'text': 'Noted.'},
      ],
    },
    {
      'conversation_id': 'dlg-3',
      'utterances': [
        {'index': 0, 'speaker': 'WIZARD', 'text': 'x'},
        {'index': 1, 'speaker': 'ASSISTANT', 'text': 'y'},
      ],
    },
  ]
  path = tmp_path / 'tm.json'
  path.write_text(json.dumps(records))
  report, warnings, convs = convert_to('taskmaster', path, tmp_path / 'out')
  assert convs == [
    [
      ('user', 'A pizza please. |br| With olives.'),
      ('ai', 'Which size?'),
      ('user', 'Large.'),
      ('ai', 'Done.'),
    ],
    [
      ('ai', 'What films do you like?'),
      ('user', 'Comedies.'),
      ('ai', 'Noted.'),
    ],
  ]
  assert warnings == [
    f"{path}[2] (dlg-3): skipped: unknown speaker 'WIZARD' at utterance 0 "
    '(USER or ASSISTANT)'
  ]
  assert report.conversations == 2


SRT = """1
00:00:01,000 --> 00:00:02,000
<i>Where were you?</i>

3
00:00:05,500 --> 00:00:06,000
{\\an8}Nowhere.

2
00:00:02,500 --> 00:00:04,000
Out.
With friends.

4
00:00:20,000 --> 00:00:21,000
New scene.

5
00:00:21,500 -> 00:00:22,000
Broken.

6
00:00:22,500 --> 00:00:23,000
Yes?
"""


def test_subtitles_time_order_markup_gaps_and_broken_cues(tmp_path):
  path = tmp_path / 'film.srt'
  path.write_text(SRT, encoding='utf-8')
  report, warnings, convs = convert_to(
    'subtitles', path, tmp_path / 'out', gap=5.0
  )
  # The first scene ends on the user (cue 3): skipped without --trim.
  assert convs == [[('user', 'New scene.'), ('ai', 'Yes?')]]
  assert warnings == [
    f"{path}:19: skipped: broken time line '00:00:21,500 -> 00:00:22,000' "
    '(expected "00:00:01,000 --> 00:00:03,500")',
    f'{path}:2: skipped: ends on a user turn (the AI must talk last; --trim '
    'drops it)',
  ]
  _, _, trimmed = convert_to(
    'subtitles', path, tmp_path / 'trim', trim=True, gap=5.0
  )
  assert trimmed == [
    [('user', 'Where were you?'), ('ai', 'Out. With friends.')],
    [('user', 'New scene.'), ('ai', 'Yes?')],
  ]
  # A longer allowed pause joins the scenes into one conversation.
  _, _, joined = convert_to(
    'subtitles', path, tmp_path / 'j', trim=True, gap=60.0
  )
  assert joined == [
    [
      ('user', 'Where were you?'),
      ('ai', 'Out. With friends.'),
      ('user', 'Nowhere.'),
      ('ai', 'New scene.'),
    ]
  ]
  latin = tmp_path / 'old.srt'
  latin.write_bytes(
    b'1\n00:00:01,000 --> 00:00:02,000\nCaf\xe9?\n\n'
    b'2\n00:00:02,100 --> 00:00:03,000\nOui.\n'
  )
  _, warnings, convs = convert_to('subtitles', latin, tmp_path / 'l')
  assert convs == [[('user', 'Café?'), ('ai', 'Oui.')]]
  assert 'reading it as Windows-1252' in warnings[0]


def test_every_importer_meets_its_contract():
  """Each registered module has the functions its Protocol names, taking
  the arguments the converters pass."""
  import inspect

  from src.data import importers

  def params(fn):
    return [
      p.name
      for p in inspect.signature(fn).parameters.values()
      if p.kind is not p.VAR_KEYWORD
    ]

  for name, module in importers.FORMATS.items():
    assert isinstance(module, importers.DatasetImporter), name
    assert len(params(module.sources)) == 1, name
    read = inspect.signature(module.read).parameters.values()
    assert any(p.kind is p.VAR_KEYWORD for p in read), name  # **options
    assert len(params(module.read)) >= 2, name  # (source, report, ...)
  for name, module in importers.CHATS.items():
    assert isinstance(module, importers.ChatImporter), name
    assert len(params(module.sources)) == 1, name
    assert params(module.items) == ['source', 'warn'], name
