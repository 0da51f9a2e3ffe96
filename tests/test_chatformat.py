"""Every rule of the line format, and its exact error."""

import os

import pytest

from src.core.errors import UserError
from src.data import chatformat

S, E, BR = '|aigenerationstart|', '|endofgeneration|', '|br|'


def parse(text, **kwargs):
  return chatformat.parse_text(text, 'chat.txt', **kwargs)


def error_of(text, **kwargs):
  with pytest.raises(UserError) as info:
    parse(text, **kwargs)
  return str(info.value)


def test_parses_turns_conversations_and_line_breaks():
  text = (
    f'Hi {BR} you there?\n{S} Yes. {BR} Hello! {E}\n\n'
    f'{S} I start this one. {E}\nok\n{S} bye {E}\n'
  )
  convs = parse(text)
  assert [[(t.role, t.text, t.line) for t in c.turns] for c in convs] == [
    [('user', f'Hi {BR} you there?', 1), ('ai', f'Yes. {BR} Hello!', 2)],
    [('ai', 'I start this one.', 4), ('user', 'ok', 5), ('ai', 'bye', 6)],
  ]


@pytest.mark.parametrize(
  'text, expected',
  [
    (f'hi\n{S} hello\n', f'chat.txt:2: "{S}" has no "{E}"'),
    (f'hi\nhello {E}\n', f'chat.txt:2: "{E}" has no "{S}" before it'),
    (
      f'hi\n{S} a {E}\nbye\n',
      'chat.txt:3: the conversation ends on a user line',
    ),
    (
      f'hi\n{S} a {E}\nbye\n\nhi\n{S} b {E}\n',
      'chat.txt:3: the conversation ends on a user line',
    ),
    (f'hi\nyou {S} a {E}\n', f'chat.txt:2: text before "{S}"'),
    (f'hi\n{S} a {E} more\n', f'chat.txt:2: text after "{E}"'),
    (f'hi\n{E} a {S}\n', f'chat.txt:2: "{E}" comes before "{S}"'),
    (f'hi\n{S} a {E} {S} b {E}\n', 'chat.txt:2: more than one AI turn'),
    (f'hi\n{S} {E}\n', 'chat.txt:2: empty AI message'),
    (f'hi\n{S} {BR} {E}\n', 'chat.txt:2: empty AI message'),
    (f'{BR}\n{S} a {E}\n', 'chat.txt:1: empty user message'),
    (
      f'hi\nthere\n{S} a {E}\n',
      'chat.txt:2: two user lines in a row '
      f'(lines 1 and 2); join them into one line with "{BR}"',
    ),
    (f'hi\n{S} a {E}\n{S} b {E}\n', 'chat.txt:3: two AI lines in a row'),
    ('\n  \n', 'chat.txt: the file is empty'),
  ],
)
def test_each_rule_names_file_line_and_fix(text, expected):
  assert error_of(text).startswith(expected)


def test_custom_markers():
  markers = chatformat.Markers('<ai>', '</ai>', '<br>')
  convs = parse('hi <br> there\n<ai> yo </ai>\n', markers=markers)
  assert convs[0].turns[1].text == 'yo'
  # With other markers, the default ones are plain user text.
  assert error_of(f'hi\n{S} a {E}\n', markers=markers).startswith(
    'chat.txt:2: two user lines in a row'
  )
  with pytest.raises(UserError, match='must differ'):
    chatformat.Markers('<a>', '<a>', '<br>').check()


def test_repeated_characters_warn_with_line_or_collapse():
  text = f'HIIIIIIIIIII\n{S} wow!!!!!!!!!!!! ok {E}\n'
  warnings = []
  convs = parse(text, warnings=warnings)
  assert [str(w).split(': warning')[0] for w in warnings] == [
    'chat.txt:1',
    'chat.txt:2',
  ]
  assert 'collapse-repeats' in str(warnings[0])
  assert convs[0].turns[0].text == 'HIIIIIIIIIII'
  convs = parse(text, collapse=True, warnings=warnings)
  assert convs[0].turns[0].text == 'HIII'
  assert convs[0].turns[1].text == 'wow!!! ok'
  assert parse('.......\n' + f'{S} ok {E}\n', warnings=(w := []))
  assert w == []  # Seven is under the default limit of eight.


def test_not_utf8_names_line(tmp_path):
  p = tmp_path / 'bad.txt'
  p.write_bytes(f'hi\n{S} ok {E}\ncaf\xe9\n'.encode('latin-1'))
  with pytest.raises(UserError, match=r'bad.txt:3: not UTF-8 \(byte 0xe9\)'):
    chatformat.read_file(str(p))


def test_folder_is_read_in_sorted_order_and_single_file_works(tmp_path):
  (tmp_path / 'sub').mkdir()
  for name, word in [
    ('b.txt', 'second'),
    ('a.txt', 'first'),
    ('sub/c.txt', 'third'),
    ('notes.md', 'ignored'),
  ]:
    (tmp_path / name).write_text(f'{word}\n{S} ok {E}\n', encoding='utf-8')
  convs = chatformat.read_data(str(tmp_path))
  assert [c.turns[0].text for c in convs] == ['first', 'second', 'third']
  single = chatformat.read_data(str(tmp_path / 'b.txt'))
  assert single[0].turns[0].text == 'second'


def test_missing_and_empty_data_folder(tmp_path):
  with pytest.raises(UserError, match='no such file or folder'):
    chatformat.read_data(str(tmp_path / 'nope'))
  with pytest.raises(UserError, match='no .txt files'):
    chatformat.read_data(str(tmp_path))


def test_shipped_data_uses_every_feature(conversations):
  texts = [t.text for t in chatformat.iter_turns(conversations)]
  roles = {t.role for t in chatformat.iter_turns(conversations)}
  assert roles == {'user', 'ai'}
  assert len(conversations) > 3
  files = {t.path for t in chatformat.iter_turns(conversations)}
  assert len(files) == len(os.listdir(os.path.dirname(next(iter(files)))))
  assert any(BR in t for t in texts)


def test_format_conversation_round_trips(conversations):
  for conv in conversations:
    again = parse(chatformat.format_conversation(conv))
    assert [(t.role, t.text) for t in again[0].turns] == [
      (t.role, t.text) for t in conv.turns
    ]


def test_noloss_marks_an_ai_turn_as_context_only():
  convs = chatformat.parse_text(
    'hi\n|noloss| |aigenerationstart| ok |endofgeneration|\n', 'f.txt'
  )
  turn = convs[0].turns[1]
  assert turn.role == chatformat.AI and turn.text == 'ok' and not turn.train
  assert convs[0].turns[0].train
  again = chatformat.format_conversation(convs[0])
  assert again == 'hi\n|noloss| |aigenerationstart| ok |endofgeneration|\n'
  with pytest.raises(UserError, match=r'f.txt:2: "\|noloss\|" marks an AI'):
    chatformat.parse_text('hi\n|noloss| hello\n', 'f.txt')
