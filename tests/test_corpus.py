"""Corpus preparation: pieces, the token cache, hits and invalidation."""

import json
import os

import numpy as np
import pytest

from src.core.errors import UserError
from src.data import chatformat, corpus, tokenizer

MARKERS = chatformat.Markers()
CONV = (
  'hello number {i}\n'
  '|aigenerationstart| hi {i}, how are you? |endofgeneration|\n'
  'fine |br| thanks\n'
  '|noloss| |aigenerationstart| good to hear {i} |endofgeneration|\n'
)


def write_data(folder, n=200, name='a.txt'):
  os.makedirs(folder, exist_ok=True)
  text = '\n'.join(CONV.format(i=i) for i in range(n))
  path = os.path.join(folder, name)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  return path


def prepare(data, out, **kw):
  kw.setdefault('vocab_size', 120)
  return corpus.prepare(str(data), str(out), markers=MARKERS, log=print, **kw)


def test_tokens_match_direct_encoding_and_cache_is_reused(
  tmp_path, monkeypatch
):
  data = tmp_path / 'data'
  write_data(data)
  tok, c = prepare(data, tmp_path / 'run')
  assert not c.hit and c.n_conversations == 200 and c.n_turns == 800
  convs = chatformat.read_data(str(data))
  ids, roles, lengths = tok.encode_with_roles(convs)
  np.testing.assert_array_equal(c.tokens, ids)
  np.testing.assert_array_equal(c.roles, roles)
  np.testing.assert_array_equal(c.conversation_ends, np.cumsum(lengths))
  assert c.tokens.dtype == np.uint16 and isinstance(c.tokens, np.memmap)
  assert os.path.exists(tmp_path / 'run' / tokenizer.MODEL_FILE)

  # A second run reads no text: parsing would fail.
  def no_parsing(*a, **k):
    raise AssertionError('parsed again')

  monkeypatch.setattr(chatformat, 'parse_text', no_parsing)
  tok2, again = prepare(data, tmp_path / 'run')
  assert again.hit and again.folder == c.folder
  np.testing.assert_array_equal(again.tokens, ids)
  assert tok2.model_proto == tok.model_proto


def test_changed_data_or_tokenizer_makes_a_new_cache(tmp_path):
  data, out = tmp_path / 'data', tmp_path / 'run'
  path = write_data(data)
  tok, first = prepare(data, out)
  with open(path, 'a', encoding='utf-8') as f:
    f.write('\nnew\n|aigenerationstart| line |endofgeneration|\n')
  _, second = prepare(data, out)
  assert not second.hit and second.folder != first.folder
  assert second.n_conversations == 201
  assert not os.path.exists(first.folder)  # The stale cache is removed.
  # Another tokenizer (same data): another cache.
  other = tokenizer.Tokenizer(
    tokenizer.train(chatformat.read_data(str(data)), 90, MARKERS), MARKERS
  )
  _, third = prepare(data, out, tok=other, name='train')
  assert not third.hit and third.folder != second.folder
  # Other parse settings: another cache.
  _, fourth = prepare(data, out, tok=other, collapse=True)
  assert not fourth.hit and fourth.folder != third.folder


def test_pieces_and_workers_give_the_same_stream(tmp_path, monkeypatch):
  data = tmp_path / 'data'
  write_data(data, n=300)
  write_data(data, n=50, name='b.txt')
  tok, whole = prepare(data, tmp_path / 'one')
  monkeypatch.setattr(corpus, 'PIECE_BYTES', 1000)
  monkeypatch.setattr(corpus, 'PARALLEL_MIN_BYTES', 0)
  scanned = corpus.scan(chatformat.list_files(str(data)))
  assert len(scanned.pieces) > 10
  for piece in scanned.pieces:  # Each piece starts a conversation.
    with open(piece.path, 'rb') as f:
      f.seek(piece.start)
      assert f.read(5) == b'hello'
  _, parallel = prepare(data, tmp_path / 'two', tok=tok, workers=2)
  np.testing.assert_array_equal(parallel.tokens, whole.tokens)
  np.testing.assert_array_equal(parallel.roles, whole.roles)
  np.testing.assert_array_equal(
    parallel.conversation_ends, whole.conversation_ends
  )


def test_error_in_a_later_piece_names_the_file_line(tmp_path, monkeypatch):
  data, out = tmp_path / 'data', tmp_path / 'run'
  path = write_data(data, n=100)
  with open(path, encoding='utf-8') as f:
    lines = f.read().splitlines()
  bad = 301  # A user line in conversation 76 (5 lines per conversation).
  lines[bad - 1] = '|aigenerationstart| no end marker'
  with open(path, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines))
  monkeypatch.setattr(corpus, 'PIECE_BYTES', 1000)
  for workers in (1, 2):
    monkeypatch.setattr(corpus, 'PARALLEL_MIN_BYTES', 0)
    with pytest.raises(UserError, match=f'a.txt:{bad}: .* has no'):
      prepare(data, out, workers=workers)
    assert not os.path.exists(out / corpus.CACHE_DIR) or not any(
      n.startswith('train-') for n in os.listdir(out / corpus.CACHE_DIR)
    )


class _KilledAtStart:
  """A tokenizer whose markers end the worker process that unpickles them:
  a tokenizing worker killed (as for memory) before it answers."""

  def __init__(self, tok):
    self._tok = tok
    self.markers = _DyingMarkers(tok.markers)

  def __getattr__(self, name):
    return getattr(self._tok, name)


class _DyingMarkers:
  def __init__(self, markers):
    self._markers = markers

  def all(self):
    return self._markers.all()

  def __reduce__(self):
    return (os._exit, (9,))


def test_a_worker_that_dies_fails_the_run_with_one_line(tmp_path, monkeypatch):
  """multiprocessing.Pool waited forever for a dead worker's piece; the
  run now stops with one line, and nothing is cached."""
  import threading

  data, out = tmp_path / 'data', tmp_path / 'run'
  write_data(data, n=100)
  tok, _ = prepare(data, tmp_path / 'first')
  monkeypatch.setattr(corpus, 'PIECE_BYTES', 1000)
  monkeypatch.setattr(corpus, 'PARALLEL_MIN_BYTES', 0)
  raised = []

  def run():
    try:
      prepare(data, out, tok=_KilledAtStart(tok), workers=2)
    except UserError as e:
      raised.append(str(e))

  worker = threading.Thread(target=run, daemon=True)
  worker.start()
  worker.join(120)
  assert not worker.is_alive(), 'the tokenizing hung on a dead worker'
  assert len(raised) == 1 and 'a tokenizing process stopped' in raised[0]
  assert str(data) in raised[0]
  cache = out / corpus.CACHE_DIR
  assert not cache.exists() or not os.listdir(cache)


def test_tokenizer_trains_on_a_sample_of_big_corpora(tmp_path, monkeypatch):
  data = tmp_path / 'data'
  write_data(data, n=400)
  monkeypatch.setattr(corpus, 'PIECE_BYTES', 2000)
  monkeypatch.setattr(corpus, 'SAMPLE_BYTES', 6000)
  seen = []
  real_train = tokenizer.train

  def spy(conversations, *a):
    seen.append(len(conversations))
    return real_train(conversations, *a)

  monkeypatch.setattr(tokenizer, 'train', spy)
  _, c = prepare(data, tmp_path / 'run', vocab_size=80)
  assert c.n_conversations == 400
  assert 0 < seen[0] < 100  # About 6000 of the ~37000 bytes.


def test_empty_file_is_refused(tmp_path):
  data = tmp_path / 'data'
  write_data(data)
  (data / 'empty.txt').write_text('\n  \n', encoding='utf-8')
  with pytest.raises(UserError, match='empty.txt: the file is empty'):
    prepare(data, tmp_path / 'run')
  assert not os.path.exists(tmp_path / 'run' / tokenizer.MODEL_FILE)


def test_a_damaged_token_cache_is_built_again(tmp_path, capsys):
  data = tmp_path / 'data'
  write_data(data)
  _, c = prepare(data, tmp_path / 'run')
  good = np.array(c.tokens)
  path = os.path.join(c.folder, 'tokens.bin')
  size = os.path.getsize(path)
  del c
  with open(path, 'wb') as f:  # Random bytes of the same size.
    f.write(np.random.default_rng(0).bytes(size))
  _, again = prepare(data, tmp_path / 'run')
  assert 'tokens.bin does not match its checksum' in capsys.readouterr().out
  assert not again.hit
  np.testing.assert_array_equal(again.tokens, good)
  # A meta.json without a key: rebuilt too, never a traceback.
  meta_path = os.path.join(again.folder, 'meta.json')
  meta = json.load(open(meta_path))
  del meta['crc32']
  json.dump(meta, open(meta_path, 'w'))
  _, third = prepare(data, tmp_path / 'run')
  assert 'meta.json is damaged' in capsys.readouterr().out
  np.testing.assert_array_equal(third.tokens, good)


def test_nul_bytes_and_unicode_line_separators(tmp_path):
  data = tmp_path / 'data'
  data.mkdir()
  (data / 'a.txt').write_text(
    'hi\n|aigenerationstart| yo |endofgeneration|\n\nbad \0 here\n'
    '|aigenerationstart| x |endofgeneration|\n'
  )
  with pytest.raises(UserError, match=r'a.txt:4: a NUL byte'):
    prepare(data, tmp_path / 'run')
  # U+2028 is a character of the message, not a second user line.
  convs = chatformat.parse_text(
    'one\u2028two\n|aigenerationstart| ok |endofgeneration|\n', 'b.txt'
  )
  assert [t.text for t in convs[0].turns] == ['one\u2028two', 'ok']


def test_control_characters_in_messages_become_spaces_and_the_model_loads(
  tmp_path,
):
  """Text with control characters (a C1 code from text decoded with the
  wrong code page, an ANSI colour, a tab, a carriage return inside a
  line) trains a tokenizer that loads: each became a space before the
  tokenizer learned its pieces (a piece holding one is refused at
  loading, since a terminal would run it)."""
  data = tmp_path / 'data'
  data.mkdir()
  odd = ['caf\x80 \x9b2J', '\x1b[31mred\x1b[0m', 'a\tb', 'x\ry']
  conversations = [
    f'{odd[i % 4]} {i}\n|aigenerationstart| {odd[(i + 1) % 4]} ok '
    '|endofgeneration|\n'
    for i in range(200)
  ]
  (data / 'a.txt').write_text('\n'.join(conversations), encoding='utf-8')
  convs = chatformat.read_data(str(data))
  assert [t.text for t in convs[0].turns] == ['caf   2J 0', '[31mred [0m ok']
  assert [t.text for t in convs[2].turns[:1]] == ['a b 2']
  prepare(data, tmp_path / 'run', vocab_size=200)
  tok = tokenizer.load(str(tmp_path / 'run'), MARKERS)
  pieces = [tok.sp.id_to_piece(i) for i in range(tok.sp.get_piece_size())]
  assert not any(c in p for p in pieces for c in '\x80\x9b\x1b\t\r')


def test_a_finetune_copies_its_pretrained_runs_cache(tmp_path, monkeypatch):
  """`reuse` (a fine-tune's pretrained run): its cache of the same data
  and tokenizer is copied and checked as our own, not built again; a
  damaged one, or one whose file is a link, is built again; the source
  is never written."""
  data = tmp_path / 'data'
  write_data(data)
  tok, c = prepare(data, tmp_path / 'pre')
  good = np.array(c.tokens)
  lines = []

  def no_parsing(*a, **k):
    raise AssertionError('parsed again')

  with monkeypatch.context() as m:
    m.setattr(chatformat, 'parse_text', no_parsing)
    _, copy = corpus.prepare(
      str(data), str(tmp_path / 'ft'), markers=MARKERS, vocab_size=120,
      tok=tok, reuse=str(tmp_path / 'pre'), log=lines.append,
    )  # fmt: skip
  assert [line for line in lines if 'copied from' in line] == [
    f'token cache (train): copied from {tmp_path / "pre"} (same data and '
    'tokenizer)'
  ]
  assert copy.folder.startswith(str(tmp_path / 'ft'))
  np.testing.assert_array_equal(copy.tokens, good)
  np.testing.assert_array_equal(copy.conversation_ends, c.conversation_ends)
  # Damaged in the source (the same size): built, the source untouched.
  path = os.path.join(c.folder, 'tokens.bin')
  bad = np.random.default_rng(0).bytes(os.path.getsize(path))
  with open(path, 'wb') as f:
    f.write(bad)
  for i, spoil in enumerate(('damaged', 'link')):
    if spoil == 'link':
      os.remove(path)
      os.symlink(str(tmp_path / 'ft' / 'cache'), path)
    lines = []
    _, built = corpus.prepare(
      str(data), str(tmp_path / f'ft{i}'), markers=MARKERS, vocab_size=120,
      tok=tok, reuse=str(tmp_path / 'pre'), log=lines.append,
    )  # fmt: skip
    assert not [line for line in lines if 'copied from' in line]
    np.testing.assert_array_equal(built.tokens, good)
    assert not [
      n for n in os.listdir(os.path.dirname(built.folder)) if '.tmp' in n
    ]
  assert os.path.islink(path)  # The source as it was left.
