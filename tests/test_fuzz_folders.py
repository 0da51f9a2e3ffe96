"""Fuzzing the untrusted folders: a real export, a real run's checkpoint
and its weights stream, mutated byte by byte and field by field (with the
checksums resealed, so the mutation reaches the parsers behind them).
Every mutation must end in success or one `UserError` line, within a
bounded allocation, and write nothing outside the folder."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from src.core import safe_pickle
from src.core.errors import UserError
from src.storage import curves, modelfolder, snapshots

from .conftest import json_values, reseal_export

# Mutations tried per target (three targets); the suite's bounded time.
EXAMPLES = 60
# What one load may allocate beyond the model itself (traced by Python's
# allocator, NumPy included): a tiny model is a few hundred KB.
MAX_TRACED = 64 << 20

FUZZ = settings(
  max_examples=EXAMPLES,
  deadline=None,
  derandomize=True,  # The same mutations on every run: a failure repeats.
  suppress_health_check=list(HealthCheck),
)

# Ways to damage bytes: flip one, cut the file, insert junk, overwrite.
_edits = st.one_of(
  st.tuples(st.just('flip'), st.integers(0, 1 << 20), st.integers(1, 255)),
  st.tuples(st.just('cut'), st.integers(0, 1 << 20), st.just(0)),
  st.tuples(
    st.just('insert'),
    st.integers(0, 1 << 20),
    st.binary(min_size=1, max_size=64),
  ),
  st.tuples(
    st.just('write'),
    st.integers(0, 1 << 20),
    st.binary(min_size=1, max_size=16),
  ),
)
# JSON values to put in a header or listing field.
_json = json_values(
  st.none()
  | st.booleans()
  | st.integers(-(1 << 70), 1 << 70)
  | st.floats(allow_nan=False)
  | st.text(max_size=8),
  list_size=4,
  key_size=6,
)


def _edit(data: bytes, edit) -> bytes:
  kind, at, arg = edit
  at = at % (len(data) + 1)
  if kind == 'flip':
    return (
      data[:at] + bytes([data[at] ^ arg]) + data[at + 1 :]
      if data[at:]
      else data
    )
  if kind == 'cut':
    return data[:at]
  if kind == 'insert':
    return data[:at] + arg + data[at:]
  return data[:at] + arg + data[at + len(arg) :]


def _bounded(load):
  """Runs `load`; success or a UserError, within MAX_TRACED."""
  tracemalloc.start()
  try:
    load()
  except UserError as e:
    assert '\n' not in str(e)
  finally:
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
  assert peak < MAX_TRACED, f'{peak >> 20} MB allocated'


@pytest.fixture(scope='module')
def pristine(exported, tiny_run, tmp_path_factory):
  """A copy of the shared export and of the shared run (its checkpoint
  files and manifest), once."""
  root = tmp_path_factory.mktemp('fuzz')
  shutil.copytree(exported['dir'], root / 'export')
  shutil.copytree(
    tiny_run['out'],
    root / 'run',
    ignore=shutil.ignore_patterns('cache', 'events*', 'eval', 'train'),
  )
  return root


def _fresh(pristine, tmp_path, name):
  target = tmp_path / name
  if target.exists():
    shutil.rmtree(target)
  shutil.copytree(pristine / name, target)
  return str(target)


def _outside_untouched(tmp_path, before):
  now = sorted(p.name for p in tmp_path.iterdir())
  assert now == before


@FUZZ
@given(
  name=st.sampled_from(
    [
      'model.safetensors',
      'export.json',
      'tokenizer.json',
      'model.gin',
      'tokenizer.model',
      'curves.json',
      'loss.png',
    ]
  ),
  edit=_edits,
  reseal=st.booleans(),
)
def test_fuzz_an_export(pristine, tmp_path_factory, name, edit, reseal):
  tmp_path = tmp_path_factory.mktemp('e')
  folder = _fresh(pristine, tmp_path, 'export')
  path = os.path.join(folder, name)
  data = open(path, 'rb').read()
  open(path, 'wb').write(_edit(data, edit))
  if reseal and name != 'export.json':
    reseal_export(folder, name)
  _bounded(lambda: modelfolder.load(folder, 'model-dir', 'copy it again'))
  _outside_untouched(tmp_path, ['export'])


@FUZZ
@given(
  field=st.sampled_from(['dtype', 'shape', 'data_offsets', 'entry']),
  value=_json,
)
def test_fuzz_safetensors_header_fields(
  pristine, tmp_path_factory, field, value
):
  tmp_path = tmp_path_factory.mktemp('h')
  folder = _fresh(pristine, tmp_path, 'export')
  path = os.path.join(folder, 'model.safetensors')
  data = open(path, 'rb').read()
  n = struct.unpack('<Q', data[:8])[0]
  header = json.loads(data[8 : 8 + n])
  first = next(k for k in header if k != '__metadata__')
  if field == 'entry':
    header[first] = value
  else:
    header[first][field] = value
  text = json.dumps(header).encode()
  open(path, 'wb').write(struct.pack('<Q', len(text)) + text + data[8 + n :])
  reseal_export(folder, 'model.safetensors')
  _bounded(lambda: modelfolder.load(folder, 'model-dir', 'copy it again'))


@FUZZ
@given(
  name=st.sampled_from(['model.pkl.gz', 'model.weights.npy.gz']),
  edit=_edits,
  inner=st.booleans(),
)
def test_fuzz_a_run_checkpoint(pristine, tmp_path_factory, name, edit, inner):
  """The run's pickle and weights stream, mutated inside the gzip (so the
  mutation reaches the unpickler and the .npy reader) or as bytes, and
  resealed in the manifest."""
  tmp_path = tmp_path_factory.mktemp('r')
  folder = _fresh(pristine, tmp_path, 'run')
  shutil.rmtree(os.path.join(folder, 'checkpoints'), ignore_errors=True)
  path = os.path.join(folder, name)
  data = open(path, 'rb').read()
  if inner:
    data = gzip.compress(_edit(gzip.decompress(data), edit))
  else:
    data = _edit(data, edit)
  open(path, 'wb').write(data)
  snapshots.seal(folder, snapshots.read_manifest(folder)['step'])
  _bounded(lambda: modelfolder.read_weights(folder, 16 << 20))
  _outside_untouched(tmp_path, ['run'])


def test_the_fuzz_targets_load_unmutated(pristine, tmp_path):
  """The mutations start from folders that load: a failure above is the
  mutation's."""
  folder = _fresh(pristine, tmp_path, 'export')
  assert modelfolder.load(folder, 'model-dir', 'copy it').kind == 'export'
  run = _fresh(pristine, tmp_path, 'run')
  flat, step = modelfolder.read_weights(run, 16 << 20)
  assert step > 0 and flat
  assert safe_pickle.read_weights_file(
    os.path.join(run, 'model.weights.npy.gz')
  )


@pytest.fixture(scope='module')
def events(tiny_run, tmp_path_factory):
  """A copy of the shared run's TensorBoard folders (train, eval)."""
  root = tmp_path_factory.mktemp('events')
  for part in ('train', 'eval'):
    shutil.copytree(os.path.join(tiny_run['out'], part), root / part)
  return root


@FUZZ
@given(part=st.sampled_from(['train', 'eval']), edit=_edits)
def test_fuzz_event_files(events, tmp_path_factory, part, edit):
  """A source run's event files (read by `--init-from RUN` and the export)
  mutated as bytes: the curves are read up to the damage, with at most one
  note a file, never a crash, within the bound."""
  tmp_path = tmp_path_factory.mktemp('ev')
  run = tmp_path / 'run'
  shutil.copytree(events, run)
  folder = run / part
  name = sorted(n for n in os.listdir(folder) if 'tfevents' in n)[-1]
  data = (folder / name).read_bytes()
  (folder / name).write_bytes(_edit(data, edit))
  found = []
  _bounded(lambda: found.append(curves.collect(str(run))))
  assert found[0] is None or found[0]['format'] == curves.FORMAT
  _outside_untouched(tmp_path, ['run'])


@FUZZ
@given(
  part=st.sampled_from(['train', 'eval']),
  where=st.sampled_from(['point', 'value', 'step', 'tag', 'part', 'top']),
  value=_json,
)
def test_fuzz_curves_json_fields(
  pristine, tmp_path_factory, part, where, value
):
  """`curves.json` fields replaced by any JSON value (huge integers
  included), resealed: the model loads, with the curves or without them."""
  tmp_path = tmp_path_factory.mktemp('c')
  folder = _fresh(pristine, tmp_path, 'export')
  path = os.path.join(folder, 'curves.json')
  scalars = json.load(open(path))
  tag = next(iter(scalars[part]))
  if where == 'point':
    scalars[part][tag][0] = value
  elif where == 'value':
    scalars[part][tag][0][1] = value
  elif where == 'step':
    scalars[part][tag][0][0] = value
  elif where == 'tag':
    scalars[part][tag] = value
  elif where == 'part':
    scalars[part] = value
  else:
    scalars = value
  with open(path, 'w') as f:
    json.dump(scalars, f)
  reseal_export(folder, 'curves.json')
  loaded = []
  _bounded(
    lambda: loaded.append(modelfolder.load(folder, 'model-dir', 'copy it'))
  )
  assert loaded and loaded[0].step > 0
