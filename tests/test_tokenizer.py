"""The sentencepiece tokenizer: markers, round trip, atomic writes, reuse."""

import json
import os

import numpy as np
import pytest

from src.core.errors import UserError
from src.data import chatformat, tokenizer

MARKERS = chatformat.Markers()


def test_markers_are_single_ids(trained_tokenizer):
  tok = trained_tokenizer
  for marker, i in zip(MARKERS.all(), tok.marker_ids()):
    assert tok.encode(marker) == [i] or tok.encode(marker)[-1:] == [i]
    assert tok.sp.id_to_piece(i) == marker
  ids = tok.encode('hello |br| world')
  assert ids.count(tok.line_break_id) == 1
  assert {tokenizer.PAD_ID, tokenizer.EOS_ID, tokenizer.UNK_ID} == {0, 1, 2}
  assert tok.sp.pad_id() == 0 and tok.sp.eos_id() == 1
  assert tok.sp.unk_id() == 2 and tok.sp.bos_id() == -1


def test_round_trip_and_turn_encoding(trained_tokenizer):
  tok = trained_tokenizer
  text = 'How are you doing? |br| Good morning!'
  assert tok.decode(tok.encode(text)) == text
  turn = chatformat.Turn('ai', 'Doing good.', 'x', 1)
  ids = tok.encode_turn(turn)
  assert ids[0] == tok.ai_start_id and ids[-1] == tok.ai_end_id
  assert tok.decode(ids[1:-1]) == 'Doing good.'


def test_stream_has_eos_after_each_conversation(
  trained_tokenizer, conversations
):
  stream = trained_tokenizer.encode_conversations(conversations)
  assert stream.dtype == np.int32
  assert int((stream == tokenizer.EOS_ID).sum()) == len(conversations)
  assert stream[-1] == tokenizer.EOS_ID
  assert int((stream == trained_tokenizer.ai_start_id).sum()) == sum(
    t.role == 'ai' for t in chatformat.iter_turns(conversations)
  )


def test_written_atomically_and_reused(tmp_path, conversations, monkeypatch):
  out = str(tmp_path)
  tok = tokenizer.load_or_train(out, conversations, 300, MARKERS)
  assert sorted(os.listdir(out)) == ['tokenizer.json', 'tokenizer.model']
  info = json.loads((tmp_path / 'tokenizer.json').read_text())
  assert info['vocab_size'] == tok.vocab_size <= 300
  # A second call loads; it must not train again.
  monkeypatch.setattr(tokenizer, 'train', lambda *a: pytest.fail('retrained'))
  again = tokenizer.load_or_train(out, conversations, 300, MARKERS)
  assert again.model_proto == tok.model_proto


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
  def broken_replace(src, dst):
    raise OSError('disk full')

  monkeypatch.setattr(os, 'replace', broken_replace)
  with pytest.raises(OSError):
    tokenizer.write_atomic(str(tmp_path / 'tokenizer.model'), b'x' * 100)
  assert os.listdir(tmp_path) == []


def test_changed_data_is_reported_not_silently_retrained(
  tmp_path, conversations
):
  out = str(tmp_path)
  tok = tokenizer.load_or_train(out, conversations, 300, MARKERS)
  notes = []
  again = tokenizer.load_or_train(
    out, conversations[:2], 300, MARKERS, log=notes.append
  )
  assert again.model_proto == tok.model_proto
  assert len(notes) == 1 and 'the data changed' in notes[0]
  with pytest.raises(
    UserError, match='vocab-size 300, the config asks for 400'
  ):
    tokenizer.load_or_train(out, conversations, 400, MARKERS)
  with pytest.raises(UserError, match='trained with markers'):
    tokenizer.load_or_train(
      out, conversations, 300, chatformat.Markers('<a>', '</a>', '<br>')
    )


def test_large_vocabulary_is_possible(tmp_path):
  # Enough distinct words for a 2000-piece vocabulary; the same code path
  # serves 32000 on a real corpus.
  rng = np.random.default_rng(0)
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
  words = [
    ''.join(rng.choice(letters, size=rng.integers(3, 9))) for _ in range(3000)
  ]
  lines = []
  for i in range(0, 3000, 6):
    lines.append(' '.join(words[i : i + 3]))
    lines.append(
      f'|aigenerationstart| {" ".join(words[i + 3 : i + 6])} |endofgeneration|'
    )
  convs = chatformat.parse_text('\n'.join(lines), 'big.txt')
  tok = tokenizer.load_or_train(str(tmp_path), convs, 2000, MARKERS)
  assert tok.vocab_size == 2000


def test_messages_too_long_for_the_tokenizer_are_named(tmp_path):
  text = 'word ' * 14000
  convs = chatformat.parse_text(
    f'{text}\n|aigenerationstart| {text} |endofgeneration|\n', 'long.txt'
  )
  with pytest.raises(UserError, match=r'long.txt:1: a message of 69,999 char'):
    tokenizer.train(convs, 100, chatformat.Markers())
