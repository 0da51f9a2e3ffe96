"""A shared model folder or out-dir cannot hurt you: no writes through
links, bounded memory, one line for every bad file (issue: hostile
folders). Each test is one crafted folder or file."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from src.core import files, safe_pickle
from src.core.errors import UserError
from src.data import tokenizer
from src.inference import decoding
from src.storage import export, modelfolder, snapshots
from src.training import trainer

from .conftest import (
  MICRO,
  ROOT,
  finetune_settings,
  reseal_export,
  train_settings,
)


@pytest.fixture
def victim(tmp_path):
  """A file and a folder outside any run, which must stay as they are."""
  outside = tmp_path / 'outside'
  (outside / 'train-notes').mkdir(parents=True)
  (outside / 'train-notes' / 'keep.txt').write_text('mine')
  for i in range(1, 6):
    (outside / f'step-{i}').mkdir()
  note = outside / 'victim.txt'
  note.write_text('notes')
  return outside


def _unchanged(outside):
  assert (outside / 'victim.txt').read_text() == 'notes'
  assert (outside / 'train-notes' / 'keep.txt').read_text() == 'mine'
  assert all((outside / f'step-{i}').is_dir() for i in range(1, 6))


@pytest.mark.parametrize(
  'plant',
  [
    ('model.pkl.gz._tmp_', 'victim.txt'),  # Trax's fixed temporary name.
    ('checkpoints', '.'),  # Snapshot pruning would delete step-1..4.
    ('cache', '.'),  # Old-cache cleanup would delete train-notes/.
  ],
)
def test_a_resume_never_writes_or_deletes_through_links(
  tiny_run, copy_of, victim, plant
):
  out = copy_of(tiny_run['out'])
  name, target = plant
  planted = os.path.join(out, name)
  if os.path.isdir(planted):
    shutil.rmtree(planted)
  os.symlink(str(victim / target), planted)
  with pytest.raises(UserError, match='is a link to .*remove the links'):
    trainer.train(train_settings(out, steps=6), gin_bindings=MICRO)
  _unchanged(victim)


def test_writes_and_deletes_refuse_links_themselves(tmp_path, victim):
  """Behind the out-dir check: Trax's checkpoint writes open with
  O_NOFOLLOW, and cleanup removes only real entries inside the folder."""
  from src.runtime.trax_patches import lazy_tensorflow

  run = tmp_path / 'run'
  run.mkdir()
  os.symlink(str(victim / 'victim.txt'), run / 'x._tmp_')
  with lazy_tensorflow._LocalGFile.GFile(str(run / 'x._tmp_'), 'wb') as f:
    f.write(b'checkpoint')  # A new file replaces the link.
  assert not os.path.islink(run / 'x._tmp_')
  assert (run / 'x._tmp_').read_bytes() == b'checkpoint'
  os.symlink(str(victim / 'victim.txt'), run / 'log')
  with pytest.raises(UserError, match='is a link'):
    lazy_tensorflow._LocalGFile.GFile(str(run / 'log'), 'ab')
  os.symlink(str(victim / 'train-notes'), run / 'old')
  files.remove_inside(str(run / 'old'), str(run))
  files.remove_inside(str(victim / 'step-1'), str(run))  # Outside.
  _unchanged(victim)
  (run / 'mine').mkdir()
  files.remove_inside(str(run / 'mine'), str(run))
  assert not (run / 'mine').exists()


def test_export_into_a_dangling_link_is_one_line(tiny_run, tmp_path):
  link = tmp_path / 'dangling'
  os.symlink(str(tmp_path / 'nowhere'), link)
  with pytest.raises(UserError, match='is a link; choose a new folder'):
    export.export(tiny_run['out'], str(link), log=lambda line: None)


def _run_child(code: str, limit_mb: int):
  """Runs `code` in a process whose address space is capped (only
  `src.core` and `src.data` are imported: no JAX)."""
  prelude = (
    'import resource, sys\n'
    f'sys.path.insert(0, {ROOT!r})\n'
    f'resource.setrlimit(resource.RLIMIT_AS, ({limit_mb << 20}, '
    f'{limit_mb << 20}))\n'
    'from src.core.errors import UserError\n'
  )
  return subprocess.run(
    [sys.executable, '-c', prelude + code],
    capture_output=True,
    text=True,
    timeout=120,
  )


def _line_in_child(call: str, limit_mb: int) -> str:
  """The UserError line of `safe_pickle.<call>` run in a process capped at
  `limit_mb` of address space (it must not run out)."""
  code = (
    'from src.core import safe_pickle\n'
    'try:\n'
    f'  {call}\n'
    'except UserError as e:\n'
    '  print(e)\n'
  )
  result = _run_child(code, limit_mb)
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout


def test_a_gzip_bomb_checkpoint_is_refused_in_bounded_memory(tmp_path):
  bomb = tmp_path / 'model.pkl.gz'
  packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing.
  zeros = bytes(1 << 20)
  with open(bomb, 'wb') as f:
    for _ in range(300):  # 300 MB of zeros, under 1 MB on disk.
      f.write(packer.compress(zeros))
    f.write(packer.flush())
  assert bomb.stat().st_size < 1 << 20
  line = _line_in_child(f'safe_pickle.read_pickle({str(bomb)!r})', 700)
  assert 'decompresses to more than 256 MB' in line


def test_a_pickled_huge_array_is_refused_before_allocation():
  class Huge:
    def __reduce__(self):
      return (np.ndarray, ((10**13,),))

  with pytest.raises(UserError, match='elements, more than a checkpoint'):
    safe_pickle.safe_load(pickle.dumps(Huge()), 'evil.pkl')
  # Arrays of a real checkpoint still load, as plain NumPy arrays.
  got = safe_pickle.safe_load(pickle.dumps({'a': np.arange(6).reshape(2, 3)}))
  assert type(got['a']) is np.ndarray and got['a'].sum() == 15


@pytest.mark.parametrize(
  'meta, match',
  [
    ([1, 2], 'holds a list, not a dict'),
    ({'step': 4}, 'no flat_weights'),
    ({'step': 'abc', 'flat_weights': 0}, "step is 'abc'"),
  ],
)
def test_a_checkpoint_pickle_of_the_wrong_shape_is_one_line(
  tmp_path, meta, match
):
  with gzip.open(tmp_path / 'model.pkl.gz', 'wb') as f:
    pickle.dump(meta, f)
  with pytest.raises(UserError, match=match):
    snapshots.read_meta(str(tmp_path))


def _pieces_proto(n: int) -> bytes:
  """A sentencepiece ModelProto's wire format with `n` pieces."""
  piece = b'\x0a\x03\x0a\x01a'  # pieces { piece: "a" }
  return piece * n


def test_a_tokenizer_with_too_many_pieces_is_refused_unread(tmp_path):
  path = tmp_path / 'tokenizer.model'
  path.write_bytes(_pieces_proto(tokenizer.MAX_PIECES + 1))
  with pytest.raises(UserError, match='more than 131072 pieces'):
    tokenizer._read_model(str(path), None)


def test_tokenizer_files_that_are_links_or_fifos_are_refused(
  exported, tmp_path
):
  folder = tmp_path / 'model'
  shutil.copytree(exported['dir'], folder)
  (folder / 'tokenizer.model').unlink()
  os.symlink('/dev/zero', folder / 'tokenizer.model')
  with pytest.raises(UserError, match='tokenizer.model: is a link'):
    tokenizer.load(str(folder))
  (folder / 'tokenizer.json').unlink()
  os.mkfifo(folder / 'tokenizer.json')
  with pytest.raises(UserError, match='tokenizer.json: is not a regular'):
    tokenizer.read_info(str(folder))  # Would hang on open before.


def test_deeply_nested_json_is_one_line(tmp_path):
  path = tmp_path / 'tokenizer.json'
  path.write_text('[' * 100_000 + ']' * 100_000)
  with pytest.raises(UserError, match='nested more than 64 deep'):
    tokenizer.read_info(str(tmp_path))


def test_text_from_a_tokenizer_is_shown_as_text(trained_tokenizer):
  class Pieces:
    def get_piece_size(self):
      return 3

    def id_to_piece(self, i):
      return ['<s>', 'ok', 'x\x1b]0;title\x07'][i]

  assert tokenizer._control_piece(Pieces()) == (2, 'x\x1b]0;title\x07')
  assert tokenizer._CONTROL.sub('?', 'a\x1b[2Jb\x9bc') == 'a?[2Jb?c'
  tok = trained_tokenizer
  assert tok.decode(tok.encode('Hello there')) == 'Hello there'


@pytest.mark.parametrize('dtype', ['BF16', 'F8_E4M3'])
def test_export_weights_of_another_dtype_are_one_line(
  exported, tmp_path, dtype
):
  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  path = os.path.join(folder, 'model.safetensors')
  data = open(path, 'rb').read()
  n = struct.unpack('<Q', data[:8])[0]
  header = json.loads(data[8 : 8 + n])
  first = next(k for k in header if k != '__metadata__')
  header[first]['dtype'] = dtype
  text = json.dumps(header).encode()
  with open(path, 'wb') as f:
    f.write(struct.pack('<Q', len(text)) + text + data[8 + n :])
  reseal_export(folder, 'model.safetensors')
  with pytest.raises(UserError, match=f"dtype '{dtype}'"):
    decoding.load_run(folder, 'eval')


def test_every_file_of_an_export_is_checked(exported, tmp_path):
  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  with open(os.path.join(folder, 'tokenizer.json'), 'a') as f:
    f.write(' ')
  with pytest.raises(UserError, match='tokenizer.json: damaged or truncated'):
    decoding.load_run(folder, 'eval')


@pytest.mark.parametrize(
  'change, match',
  [
    (lambda m: m.update(files=['model.safetensors']), 'files is a list'),
    (lambda m: m.update(n_arrays=10**12), 'n_arrays is 1000000000000'),
  ],
)
def test_a_malformed_export_json_is_one_line(exported, tmp_path, change, match):
  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  meta_path = os.path.join(folder, 'export.json')
  meta = json.load(open(meta_path))
  change(meta)
  json.dump(meta, open(meta_path, 'w'))
  with pytest.raises(UserError, match=match):
    decoding.load_run(folder, 'eval')


@pytest.mark.parametrize(
  'change',
  [
    lambda m: m['files'].update({'model.pkl.gz': 'x'}),
    lambda m: m.update(tokens='abc'),
  ],
)
def test_a_malformed_manifest_is_not_trusted(tiny_run, copy_of, change):
  out = copy_of(tiny_run['out'])
  path = os.path.join(out, 'model.manifest.json')
  manifest = json.load(open(path))
  change(manifest)
  json.dump(manifest, open(path, 'w'))
  assert snapshots.read_manifest(out) is None
  # The kept snapshot is intact: exporting uses it, with one note.
  info = export.export(out, out + '-export', log=lambda line: None)
  assert info['step'] == 4


def test_model_card_text_from_settings_stays_in_its_cell():
  text = 'x`\n\n[click](http://e.example) | run `rm -rf ~`'
  cell = export._md_code(text)
  assert '\n' not in cell and '`' not in cell
  assert cell.count('|') == cell.count('\\|') == 1  # Every pipe escaped.


def test_bad_gin_in_a_model_folder_is_one_line_from_evaluate(
  exported, tmp_path
):
  folder = tmp_path / 'model'
  shutil.copytree(exported['dir'], folder)
  gin_path = folder / 'model.gin'
  gin_path.write_text(gin_path.read_text() + '\nReformerLM.n_layers = 99999\n')
  reseal_export(str(folder), 'model.gin')
  result = subprocess.run(
    [
      sys.executable,
      'evaluate.py',
      '--model-dir',
      str(folder),
      '--prompt',
      'Hi',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 2
  lines = [x for x in result.stderr.splitlines() if x.startswith('error:')]
  assert len(lines) == 1 and 'n_layers = 99999 must be' in lines[0]
  assert 'Traceback' not in result.stderr


def test_memory_and_recursion_errors_are_one_line(capsys):
  from src.apps.cli import run_main

  def main():
    raise RecursionError('deep')

  assert run_main(main) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'nested too deeply' in err


def test_init_from_the_out_dir_itself_says_so(exported, tmp_path):
  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  with pytest.raises(UserError, match='init-from and out-dir are the same'):
    trainer.train(finetune_settings(folder, folder))


def test_weights_files_claiming_more_than_the_model_are_refused(
  exported, tmp_path
):
  # A .npy record whose header claims 40 GB, in a file of a few bytes.
  header = {'descr': '<f4', 'fortran_order': False, 'shape': (10**10,)}
  buffer = io.BytesIO()
  np.lib.format.write_array_header_1_0(buffer, header)
  path = tmp_path / 'model.weights.npy.gz'
  with gzip.open(path, 'wb') as f:
    f.write(buffer.getvalue())  # Magic and header, then no data.
  with pytest.raises(ValueError, match='MB of weights the model needs'):
    safe_pickle.read_npy_stream(str(path), path.stat().st_size, 1 << 20)
  # A 10 GB sparse safetensors file listed with its size: refused by its
  # size, before its checksum is computed or a byte is read.
  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  weights = os.path.join(folder, 'model.safetensors')
  os.truncate(weights, 10 * 2**30)
  meta = json.load(open(os.path.join(folder, 'export.json')))
  meta['files']['model.safetensors']['size'] = 10 * 2**30
  json.dump(meta, open(os.path.join(folder, 'export.json'), 'w'))
  with pytest.raises(UserError, match='more than the .* MB of weights'):
    decoding.load_run(folder, 'eval')


@pytest.mark.parametrize(
  'binding, match',
  [
    ('ReformerLM.pos_axial_shape = 5', 'pos_axial_shape = 5 must be a tuple'),
    ('LSHSelfAttention.chunk_len = 0', 'chunk_len = 0 must be a whole'),
    ("LSHSelfAttention.n_buckets = 'x'", "n_buckets = 'x' must be a whole"),
    ("ReformerLM.n_heads = 'x'", "n_heads = 'x' must be a whole"),
    (
      'ReformerLM.ff_activation = @trax.optimizers.Adam',
      'ff_activation = @Adam must be one of',
    ),
    (
      'ReformerLM.attention_type = @trax.layers.Relu',
      'attention_type = @Relu must be @LocalSelfAttention',
    ),
    (
      'LSHSelfAttention.predict_mem_len = 10000000000',
      'predict_mem_len = 10000000000 must be a whole number',
    ),
  ],
)
def test_model_settings_of_the_wrong_type_or_range_are_one_line(binding, match):
  from src.model import ginconf

  text = open(os.path.join(ROOT, 'gin', 'tiny.gin')).read()
  with pytest.raises(UserError, match=match):
    ginconf.parse_text(text + '\n' + binding + '\n', 'model.gin')
  ginconf.parse_text(text, 'model.gin')  # The shipped settings pass.


def test_resuming_checks_the_checkpoint_trax_reads(tiny_run, copy_of):
  """Trax's Loop reads the metadata pickle and the weight files itself
  when resuming: through the same checks (shape of the metadata, NumPy
  headers before data)."""
  import trax.layers

  from src.runtime.trax_patches import checkpoint_io

  out = copy_of(tiny_run['out'])
  path = os.path.join(out, 'model.pkl.gz')
  with gzip.open(path, 'wb') as f:
    pickle.dump([1, 2], f)
  with pytest.raises(UserError, match='holds a list, not a dict'):
    checkpoint_io._trax_unpickle_from_file(path, gzip=True)
  assert trax.layers.np_from_file is safe_pickle.np_from_file
  weights = os.path.join(out, 'model.weights.npy.gz')
  with open(weights, 'r+b') as f:
    f.truncate(os.path.getsize(weights) // 2)
  with pytest.raises(UserError, match='damaged or not the weights'):
    trax.layers.np_from_file(weights, compresslevel=2)


# ---- Round 2 (issue 45): hard links, FIFOs, amplifying streams and
# pickles, untyped headers, what is hashed is what is parsed.


def test_a_hard_link_in_an_out_dir_is_never_written_through(
  tiny_run, copy_of, victim
):
  out = copy_of(tiny_run['out'])
  os.link(
    victim / 'victim.txt', os.path.join(out, 'model.weights.npy.gz._tmp_')
  )
  with pytest.raises(UserError, match='has a hard link outside the folder'):
    trainer.train(train_settings(out, steps=6), gin_bindings=MICRO)
  _unchanged(victim)
  # Behind the check: the writer replaces the name, never the file.
  from src.runtime.trax_patches import lazy_tensorflow

  path = os.path.join(out, 'model.weights.npy.gz._tmp_')
  with lazy_tensorflow._LocalGFile.GFile(path, 'wb') as f:
    f.write(b'checkpoint')
  _unchanged(victim)
  os.link(victim / 'victim.txt', os.path.join(out, 'events.log'))
  with pytest.raises(UserError, match='not a file of its own'):
    lazy_tensorflow._LocalGFile.GFile(os.path.join(out, 'events.log'), 'ab')
  _unchanged(victim)


def test_checkpoint_snapshots_are_hard_links_the_check_allows(
  tiny_run, copy_of
):
  out = copy_of(tiny_run['out'])
  shutil.rmtree(os.path.join(out, 'checkpoints'))
  snapshots.seal(out, 4)  # Snapshots link the top-level files.
  assert os.stat(os.path.join(out, 'model.pkl.gz')).st_nlink == 2
  assert files.links_inside(out) == []


def test_a_fifo_lock_or_file_in_an_out_dir_is_one_line(tiny_run, copy_of):
  out = copy_of(tiny_run['out'])
  os.mkfifo(os.path.join(out, 'train.lock'))
  with pytest.raises(UserError, match='train.lock is not a regular file'):
    trainer.train(train_settings(out, steps=6), gin_bindings=MICRO)
  # The lock itself never opens a FIFO (it would block forever).
  from src.core import runlock

  with pytest.raises(UserError, match='train.lock: is not a lock file'):
    with runlock.held(out):
      pass
  os.remove(os.path.join(out, 'train.lock'))
  os.mkfifo(os.path.join(out, 'notes'))
  with pytest.raises(UserError, match='notes is not a regular file'):
    trainer.train(train_settings(out, steps=6), gin_bindings=MICRO)


def _npy_stream(path, header: bytes, payload: bytes = b'', zeros: int = 0):
  """A gzipped .npy record with a crafted header, then data."""
  head = b'\x93NUMPY\x01\x00'
  text = header + b' ' * (-(len(header) + 11) % 64) + b'\n'
  with gzip.open(path, 'wb', compresslevel=9) as f:
    f.write(head + struct.pack('<H', len(text)) + text + payload)
    chunk = bytes(1 << 20)
    for _ in range(zeros >> 20):
      f.write(chunk)


@pytest.mark.parametrize(
  'header, match',
  [
    (b"{'descr': '|u1', 'fortran_order': False, 'shape': (-1,), }", 'shape'),
    (
      b"{'descr': '<f4', 'fortran_order': False, "
      b"'shape': (1180591620717411303424,), }",
      'big',
    ),
    (b"{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", 'complex'),
    (
      b"{'descr': '|V8', 'fortran_order': False, 'shape': (2,), }",
      'no weights',
    ),
  ],
)
def test_a_crafted_weights_header_is_one_line(tmp_path, header, match):
  path = tmp_path / 'model.weights.npy.gz'
  _npy_stream(path, header, zeros=4 << 20)
  with pytest.raises(UserError, match=match):
    safe_pickle.read_weights_file(str(path))


def test_a_weights_stream_claiming_more_than_it_holds_stays_bounded(tmp_path):
  # 300 MB of zeros behind a header of shape (-1,) (read whole before) and
  # behind one claiming 400 MB: refused in a 700 MB address space.
  for shape in (b'(-1,)', b'(400000000,)'):
    path = tmp_path / 'model.weights.npy.gz'
    header = b"{'descr': '|u1', 'fortran_order': False, 'shape': %s, }" % shape
    _npy_stream(path, header, zeros=300 << 20)
    assert path.stat().st_size < 1 << 20
    call = f'safe_pickle.read_weights_file({str(path)!r}, 64 << 20)'
    assert 'model.weights.npy.gz: damaged' in _line_in_child(call, 700)


def test_big_endian_weights_are_converted(tmp_path):
  path = tmp_path / 'model.weights.npy.gz'
  with gzip.open(path, 'wb') as f:
    np.save(f, np.arange(6, dtype='>f4').reshape(2, 3))
    np.save(f, np.array([1, 2], dtype='>u4'))
  a, b = safe_pickle.read_weights_file(str(path))
  assert a.dtype == np.dtype('<f4') and a.tolist() == [[0, 1, 2], [3, 4, 5]]
  assert b.dtype == np.dtype('<u4') and b.tolist() == [1, 2]


class _Shared:
  """Pickles as `n` arrays rebuilt from one shared bytes object."""

  def __init__(self, nbytes, n, dtype='<f8'):
    self.data, self.n, self.dtype = bytes(nbytes), n, dtype

  def __reduce__(self):
    return (list, ([_State(self.data, self.dtype) for _ in range(self.n)],))


class _State:
  def __init__(self, data, dtype):
    self.data, self.dtype = data, dtype

  def __reduce__(self):
    shape = (len(self.data) // np.dtype(self.dtype).itemsize,)
    state = (1, shape, np.dtype(self.dtype), False, self.data)
    return (
      np._core.multiarray._reconstruct,
      (np.ndarray, (0,), b'b'),
      state,
    )


def test_a_pickle_cannot_amplify_a_shared_buffer():
  # Eight arrays from one 8 MB buffer: 64 MB built from an 8 MB pickle.
  data = pickle.dumps(_Shared(8 << 20, 8), protocol=4)
  assert len(data) < 9 << 20
  with pytest.raises(UserError, match='more bytes than the pickle holds'):
    safe_pickle.safe_load(data, 'model.pkl.gz')
  with pytest.raises(UserError, match='big-endian'):
    safe_pickle.safe_load(pickle.dumps(_Shared(64, 1, '>f8')), 'model.pkl.gz')
  # One array from its own bytes loads.
  (one,) = safe_pickle.safe_load(pickle.dumps(_Shared(64, 1)), 'model.pkl.gz')
  assert one.shape == (8,) and one.dtype == np.dtype('<f8')


def test_a_pickle_setstate_past_the_element_limit_is_refused():
  n = safe_pickle.MAX_ARRAY_ELEMENTS + 1
  data = pickle.dumps(_Shared(n, 1, '|u1'), protocol=4)
  with pytest.raises(UserError, match='elements, more than a checkpoint'):
    safe_pickle.safe_load(data, 'model.pkl.gz')


def _rewrite_header(folder, change):
  path = os.path.join(folder, 'model.safetensors')
  data = open(path, 'rb').read()
  n = struct.unpack('<Q', data[:8])[0]
  header = json.loads(data[8 : 8 + n])
  first = next(k for k in header if k != '__metadata__')
  change(header[first])
  text = json.dumps(header).encode()
  with open(path, 'wb') as f:
    f.write(struct.pack('<Q', len(text)) + text + data[8 + n :])
  reseal_export(folder, 'model.safetensors')


@pytest.mark.parametrize(
  'change, match',
  [
    (lambda e: e.update(data_offsets=['0', 'x']), 'data_offsets'),
    (lambda e: e.update(data_offsets=[8, 4]), 'data_offsets'),
    (lambda e: e.update(shape=[-1, 2]), 'shape'),
    (lambda e: e.update(shape='big'), 'shape'),
    (lambda e: e.update(shape=[1, 1]), 'do not match its shape'),
    (
      lambda e: e.update(
        data_offsets=[e['data_offsets'][0] + 4, e['data_offsets'][1] + 4]
      ),
      'overlap or leave gaps',
    ),
  ],
)
def test_safetensors_header_fields_are_typed(exported, tmp_path, change, match):
  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  _rewrite_header(folder, change)
  with pytest.raises(UserError, match=match):
    decoding.load_run(folder, 'eval')


def test_an_export_is_checked_before_its_tokenizer_or_gin_is_read(
  exported, tmp_path, monkeypatch
):
  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  with open(os.path.join(folder, 'model.gin'), 'a') as f:
    f.write('\n# changed\n')
  read = []
  real = files.read_regular
  monkeypatch.setattr(
    files, 'read_regular', lambda p, n: read.append(p) or real(p, n)
  )
  with pytest.raises(UserError, match='model.gin: damaged or truncated'):
    decoding.load_run(folder, 'eval')
  assert not any(p.endswith(('model.gin', 'tokenizer.model')) for p in read)


def test_what_is_parsed_is_what_was_hashed(exported, tmp_path, monkeypatch):
  """A file swapped after its checksum was checked is not read: the
  checked bytes are."""

  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  real = modelfolder.verify_export

  def verify_then_swap(path, *args, **kwargs):
    meta, contents = real(path, *args, **kwargs)
    os.remove(os.path.join(path, 'model.gin'))
    os.mkfifo(os.path.join(path, 'model.gin'))  # Would block a reader.
    return meta, contents

  monkeypatch.setattr(modelfolder, 'verify_export', verify_then_swap)
  model = modelfolder.load(folder, 'model-dir', 'copy it again')
  assert model.kind == 'export' and model.step == exported['info']['step']


def test_a_run_saved_big_endian_is_converted_and_scores_the_same(
  tiny_run, copy_of
):
  from src.inference import scoring

  from .conftest import DATA

  out = copy_of(tiny_run['out'])
  before = scoring.evaluate(out, DATA, show_progress=False)['loss']
  path = os.path.join(out, 'model.weights.npy.gz')
  arrays = safe_pickle.read_weights_file(path)
  with gzip.open(path, 'wb') as f:
    for a in arrays:
      np.save(f, a.astype(a.dtype.newbyteorder('>')))
  shutil.rmtree(os.path.join(out, 'checkpoints'))
  snapshots.seal(out, 4)
  assert scoring.evaluate(out, DATA, show_progress=False)['loss'] == before
