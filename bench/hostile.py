"""Crafted folders at full size: what each costs and what it prints.

  python bench/hostile.py [WORK_DIR] [--smoke]

Trains a small run (the sample data, `gin/tiny.gin`, 4 steps)
and exports it, then crafts from them the folders of the hostile-folder
probes and runs the real command on each in a child process (its peak
resident memory from `ru_maxrss`), against the same command on the
untouched folder:

- a weights stream whose `.npy` header says shape (-1,) then 1.5 GB of
  gzipped zeros (a 1.5 MB file), manifest resealed: `evaluate.py --prompt`;
- the same header claiming 1.5 GB, and one of 2**70 elements;
- a 204 KB checkpoint pickle whose eight arrays are rebuilt from one
  shared 200 MB bytes object (and 100 MB: arrays under the element
  limit): `evaluate.py --prompt`;
- the run's weights saved big-endian: `evaluate.py --prompt` (converted);
- a safetensors header with `data_offsets` ["0", "x"]: `evaluate.py`;
- a hard link to a file outside at `model.weights.npy.gz._tmp_`, and a
  FIFO at `train.lock`: `train.py` resuming (the outside file checked).

`--smoke` makes the big payloads 100x smaller (for the tests).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT  # noqa: E402


def child(argv: list[str]) -> tuple[int, float, str]:
  """(exit status, peak RSS MB, last stderr/stdout line) of a command."""
  proc = subprocess.Popen(
    argv,
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    stdin=subprocess.DEVNULL,
  )
  out = b''
  while chunk := proc.stdout.read(1 << 16):
    out += chunk[-20000:]
  _, status, usage = os.wait4(proc.pid, 0)
  lines = [x for x in out.decode(errors='replace').splitlines() if x.strip()]
  return (
    os.waitstatus_to_exitcode(status),
    usage.ru_maxrss / 1024,
    lines[-1] if lines else '',
  )


def npy_header(shape: str, descr: str = '|u1') -> bytes:
  text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
  text = text.encode() + b' ' * (-(len(text) + 11) % 64) + b'\n'
  return b'\x93NUMPY\x01\x00' + struct.pack('<H', len(text)) + text


def write_stream(path: str, header: bytes, zeros: int):
  with gzip.open(path, 'wb', compresslevel=9) as f:
    f.write(header)
    block = bytes(1 << 20)
    for _ in range(zeros >> 20):
      f.write(block)


def reseal(run: str):
  from src.storage import snapshots

  shutil.rmtree(os.path.join(run, 'checkpoints'), ignore_errors=True)
  snapshots.seal(run, snapshots.read_manifest(run)['step'])


class _Shared:
  def __init__(self, data, n):
    self.data, self.n = data, n

  def __reduce__(self):
    return (list, ([_Array(self.data) for _ in range(self.n)],))


class _Array:
  def __init__(self, data):
    self.data = data

  def __reduce__(self):
    state = (1, (len(self.data) // 8,), np.dtype('<f8'), False, self.data)
    return (np._core.multiarray._reconstruct, (np.ndarray, (0,), b'b'), state)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('work', nargs='?', default='runs/bench-hostile')
  parser.add_argument('--smoke', action='store_true')
  args = parser.parse_args(argv)
  scale = 100 if args.smoke else 1
  work = os.path.abspath(args.work)
  shutil.rmtree(work, ignore_errors=True)
  os.makedirs(work)
  run, exp = os.path.join(work, 'run'), os.path.join(work, 'export')
  py = sys.executable
  train = [
    py,
    'train.py',
    '--data',
    'data/examples',
    '--gin',
    'gin/tiny.gin',
    '--vocab-size',
    '300',
    '--eval-batches',
    '1',
    '--eval-every',
    '2',
    '--checkpoint-every',
    '2',
  ]
  status, _, line = child(train + ['--out-dir', run, '--steps', '4'])
  if status:
    raise SystemExit(f'training failed: {line}')
  child([py, '-m', 'src.apps.export', run, exp])
  chat = [
    py,
    'evaluate.py',
    '--prompt',
    'Hello',
    '--temperature',
    '0',
    '--max-new-tokens',
    '16',
    '--model-dir',
  ]
  rows = [('untouched run: evaluate.py --prompt', *child(chat + [run]))]
  rows.append(('untouched export: evaluate.py --prompt', *child(chat + [exp])))

  def crafted(name, make, argv):
    folder = os.path.join(work, name)
    shutil.copytree(run, folder, ignore=shutil.ignore_patterns('cache'))
    target = make(folder)
    rows.append((target, *child(argv(folder))))

  weights = 'model.weights.npy.gz'
  big = (1536 << 20) // scale

  def minus_one(folder):
    write_stream(os.path.join(folder, weights), npy_header('(-1,)'), big)
    reseal(folder)
    size = os.path.getsize(os.path.join(folder, weights)) >> 10
    return f'weights shape (-1,), {big >> 20} MB of zeros in {size} KB'

  def claims(folder):
    write_stream(os.path.join(folder, weights), npy_header(f'({big},)'), big)
    reseal(folder)
    return f'weights header claiming {big >> 20} MB, and holding it'

  def huge(folder):
    write_stream(
      os.path.join(folder, weights),
      npy_header('(2**70,)'.replace('2**70', str(2**70)), '<f4'),
      1 << 20,
    )
    reseal(folder)
    return 'weights shape (2**70,)'

  def shared(mb):
    def make(folder):
      data = pickle.dumps(_Shared(bytes((mb << 20) // scale), 8), protocol=4)
      path = os.path.join(folder, 'model.pkl.gz')
      with gzip.open(path, 'wb', compresslevel=9) as f:
        f.write(data)
      reseal(folder)
      return (
        f'pickle: 8 arrays from one shared {mb // scale} MB buffer '
        f'({os.path.getsize(path) >> 10} KB)'
      )

    make.__name__ = f'shared{mb}'
    return make

  def big_endian(folder):
    from src.core import safe_pickle

    path = os.path.join(folder, weights)
    arrays = safe_pickle.read_weights_file(path)
    with gzip.open(path, 'wb') as f:
      for a in arrays:
        np.save(f, a.astype(a.dtype.newbyteorder('>')))
    reseal(folder)
    return 'weights saved big-endian'

  for make in (minus_one, claims, huge, shared(200), shared(100), big_endian):
    crafted(make.__name__, make, lambda folder: chat + [folder])

  bad = os.path.join(work, 'offsets')
  shutil.copytree(exp, bad)
  path = os.path.join(bad, 'model.safetensors')
  data = open(path, 'rb').read()
  n = struct.unpack('<Q', data[:8])[0]
  header = json.loads(data[8 : 8 + n])
  first = next(k for k in header if k != '__metadata__')
  header[first]['data_offsets'] = ['0', 'x']
  text = json.dumps(header).encode()
  open(path, 'wb').write(struct.pack('<Q', len(text)) + text + data[8 + n :])
  meta = json.load(open(os.path.join(bad, 'export.json')))
  blob = open(path, 'rb').read()
  meta['files']['model.safetensors'] = {
    'size': len(blob),
    'sha256': hashlib.sha256(blob).hexdigest(),
  }
  json.dump(meta, open(os.path.join(bad, 'export.json'), 'w'))
  rows.append(('export: data_offsets ["0", "x"]', *child(chat + [bad])))

  outside = os.path.join(work, 'outside.txt')
  with open(outside, 'w') as f:
    f.write('precious')

  def hard_link(folder):
    os.link(outside, os.path.join(folder, weights + '._tmp_'))
    return 'resume with a hard link at model.weights.npy.gz._tmp_'

  def fifo(folder):
    os.mkfifo(os.path.join(folder, 'train.lock'))
    return 'resume with a FIFO at train.lock'

  for make in (hard_link, fifo):
    crafted(
      make.__name__,
      make,
      lambda folder: train + ['--out-dir', folder, '--steps', '6'],
    )
  intact = open(outside).read() == 'precious'

  print(
    f'\nPython {sys.version.split()[0]}, numpy {np.__version__}, '
    f'{time.strftime("%Y-%m-%d")}\n'
  )
  print('| crafted | exit | peak RSS MB | what it printed |')
  print('|---|---|---|---|')
  for what, status, peak, line in rows:
    print(f'| {what} | {status} | {peak:.0f} | {line[:150]} |')
  print(
    f'\nthe file outside the out-dir after the resumes: '
    f'{"unchanged" if intact else "CHANGED"}'
  )
  return 0 if intact else 1


if __name__ == '__main__':
  sys.exit(main())
