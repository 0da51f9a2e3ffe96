"""What an export says about where it came from (nothing), and the curves
of a shared model read as untrusted input: crafted TensorBoard records and
`curves.json` values give a note, never a crash (issue 56)."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

from src.storage import curves, eventfile, export, modelfolder
from src.training import trainer

from .conftest import (
  DATA,
  MICRO,
  finetune_settings,
  reseal_export,
  run_script,
  train_settings,
)

# A friend's name, a user name and folder names that must not travel.
MARKERS = ('Zara', 'Quimby', 'qvxuser', 'zq-run', 'zq-export', 'pytest-of')


@pytest.fixture(scope='module')
def private_run(tmp_path_factory):
  """A real run trained on a chat file named after a person, in folders
  named after the user, and its export (default name, then a chosen one)."""
  home = tmp_path_factory.mktemp('home-qvxuser')
  data = home / 'chats'
  data.mkdir()
  source = os.path.join(DATA, sorted(os.listdir(DATA))[0])
  shutil.copy(source, data / 'WhatsApp Chat with Zara Quimby.txt')
  out = home / 'runs' / 'zq-run'
  settings = train_settings(
    out, data=str(data / 'WhatsApp Chat with Zara Quimby.txt'), steps=2
  )
  trainer.train(settings, gin_bindings=MICRO, log=lambda line: None)
  lines = []
  folder = str(home / 'exports' / 'zq-export')
  export.export(str(out), folder, log=lines.append)
  return {'run': str(out), 'export': folder, 'log': lines, 'home': home}


def test_an_export_names_no_path_file_or_person(private_run):
  folder = private_run['export']
  for name in os.listdir(folder):
    data = open(os.path.join(folder, name), 'rb').read()
    for marker in MARKERS + (str(private_run['home']),):
      assert marker.encode() not in data, f'{marker!r} is in {name}'
  info = json.load(open(os.path.join(folder, 'export.json')))
  assert 'exported_from' not in info and 'trained_on' not in info
  data = info['data']
  assert data['files'] == 1 and data['conversations'] > 0
  assert data['tokens'] > 0 and len(data['sha256']) == 64
  card = open(os.path.join(folder, 'README.md')).read()
  assert '# Jade V8 chat model' in card
  assert f'{data["conversations"]:,} conversations' in card
  assert '--model-dir MODEL' in card
  # The export says what it wrote about the data.
  assert any(
    'trained on:' in line and 'sha256' in line for line in private_run['log']
  )


def test_a_name_and_datasets_are_what_the_sharer_chose(private_run, tmp_path):
  folder = str(tmp_path / 'named')
  lines = []
  export.export(
    private_run['run'],
    folder,
    name='Chatty\nsmall',
    datasets=('my chats',),
    log=lines.append,
  )
  card = open(os.path.join(folder, 'README.md')).read()
  assert card.count('# Chatty small') == 1
  assert 'trained on | my chats;' in card
  assert "calls it 'Chatty small'" in lines[-1]
  assert modelfolder.load(folder, 'model', 'x').name == 'Chatty small'


def test_a_fine_tune_names_its_base_by_its_declared_name(tmp_path):
  run = tmp_path / 'run'
  run.mkdir()
  record = {'path': '/home/qvxuser/zq-export', 'weights_sha256': 'ab' * 32}
  (run / 'init.json').write_text(json.dumps(record))
  assert export._base_model(str(run)) == 'jade-v8 weights sha256:' + 'ab' * 8
  (run / 'init.json').write_text(json.dumps({**record, 'name': 'Base'}))
  assert export._base_model(str(run)) == 'Base'


# ---- Event files read with bounds.


def _record(data: bytes, length: int | None = None) -> bytes:
  from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
    masked_crc32c,
  )

  header = struct.pack('<Q', len(data) if length is None else length)
  return (
    header
    + struct.pack('<I', masked_crc32c(header))
    + data
    + struct.pack('<I', masked_crc32c(data))
  )


def _scalar_event(tag: str, step: int, value: float) -> bytes:
  from tensorboard.compat.proto import event_pb2, summary_pb2

  summary = summary_pb2.Summary(
    value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]
  )
  return event_pb2.Event(step=step, summary=summary).SerializeToString()


def _events(folder, *records):
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, 'events.out.tfevents.1.host')
  with open(path, 'wb') as f:
    f.write(b''.join(records))
  return path


def test_a_huge_length_field_ends_the_file_with_a_note(tmp_path):
  good = _record(_scalar_event('metrics/loss', 1, 2.5))
  huge = _record(b'x' * 8, length=1 << 60)  # Valid header checksum.
  _events(tmp_path / 'eval', good, huge, good)
  notes = []
  found = eventfile.scalars(str(tmp_path / 'eval'), 8, 100, notes.append)
  assert found == {'metrics/loss': {1: 2.5}}
  assert len(notes) == 1 and 'claims 1152921504606846976 bytes' in notes[0]


def test_damaged_records_and_too_many_tags_are_bounded(tmp_path):
  events = [_record(_scalar_event(f't{i}', 1, 1.0)) for i in range(10)]
  events.append(_record(b'\xff' * 40))  # Not an Event protobuf.
  _events(tmp_path / 'a', *events)
  notes = []
  found = eventfile.scalars(str(tmp_path / 'a'), 4, 100, notes.append)
  assert sorted(found) == ['t0', 't1', 't2', 't3']
  assert any('more than 4 scalar tags' in n for n in notes)
  bad = bytearray(_record(_scalar_event('x', 1, 1.0)))
  bad[-6] ^= 1  # The data, not its checksum.
  _events(tmp_path / 'b', bytes(bad))
  notes = []
  assert eventfile.scalars(str(tmp_path / 'b'), 4, 100, notes.append) == {}
  assert 'bad checksum' in notes[0]
  # A big record is skipped unread; many points are thinned.
  big = _record(b'\0' * (eventfile.MAX_RECORD + 1))
  many = [_record(_scalar_event('loss', s, float(s))) for s in range(500)]
  _events(tmp_path / 'c', big, *many)
  notes = []
  found = eventfile.scalars(str(tmp_path / 'c'), 4, 100, notes.append)
  assert notes == [] and 100 <= len(found['loss']) <= 200
  assert found['loss'][0] == 0.0


def _crafted_source(tiny_run, tmp_path):
  run = tmp_path / 'run'
  shutil.copytree(
    tiny_run['out'], run, ignore=shutil.ignore_patterns('train.lock')
  )
  folder = run / 'train'
  name = sorted(n for n in os.listdir(folder) if 'tfevents' in n)[0]
  with open(folder / name, 'ab') as f:
    f.write(_record(b'x' * 8, length=1 << 60))
  return str(run)


def test_a_crafted_source_run_exports_and_fine_tunes_with_one_note(
  tiny_run, tmp_path
):
  source = _crafted_source(tiny_run, tmp_path)
  run = run_script(
    ['export.py', source, str(tmp_path / 'e')],
    env={'JADE_COMPILE_CACHE': 'off'},
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-2000:]
  notes = [x for x in run.stderr.splitlines() if 'claims' in x]
  assert len(notes) == 1 and 'Traceback' not in run.stderr
  assert curves.read(str(tmp_path / 'e' / 'curves.json'))['train']
  out = tmp_path / 'ft'
  trainer.train(
    finetune_settings(str(out), source, steps=1), log=lambda line: None
  )
  assert os.listdir(out / 'pretrained-run' / 'train')
  assert not os.path.exists(out / 'train.lock')


@pytest.mark.parametrize(
  'value', ['1' + '0' * 400, '1e400', '-1e999', '"1"', '[1]', 'true']
)
def test_a_curve_value_out_of_float_range_is_a_note(exported, tmp_path, value):
  folder = tmp_path / 'model'
  shutil.copytree(exported['dir'], folder)
  path = folder / 'curves.json'
  text = path.read_text()
  scalars = json.loads(text)
  tag = next(iter(scalars['eval']))
  first = json.dumps(scalars['eval'][tag][0], separators=(',', ':'))
  step = scalars['eval'][tag][0][0]
  text = text.replace(first, f'[{step},{value}]', 1)
  path.write_text(text)
  reseal_export(str(folder), 'curves.json')
  model = modelfolder.load(str(folder), 'model-dir', 'x')
  assert model.curves is None and model.step == 4
