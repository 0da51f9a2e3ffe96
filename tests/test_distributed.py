"""Multi-process training: real processes on localhost joined by JAX's
distributed runtime (gloo collectives on CPU).

Each process runs `train.py` in its own working folder with a relative
out-dir, as on separate machines without a shared disk: what a process
writes lands in its own folder, so "only the chief writes" is checked by
the other folders staying empty.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from src.config import jsonconfig
from src.core.errors import UserError
from src.storage import modelfolder
from src.training import distributed
from tests.conftest import EXACT_LSH, MICRO, ROOT, micro_args

# Attention that sees the whole (128-token) window whatever the hashing,
# and no dropout: nothing random differs between a multi-process and a
# single-process run, so their weights can be compared.
EXACT = MICRO + EXACT_LSH + ('ReformerLM.dropout = 0.0',)
DONE = re.compile(r'done: step (\d+); weights ([0-9a-f]{12}) \(SHA-256\)')


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def train_args(steps, extra=()):
  """`micro_args` with an out-dir relative to each process's folder (so
  `train.py` by its full path), exact attention, batch 2, no samples."""
  args = micro_args('run', steps)
  args[0] = os.path.join(ROOT, 'train.py')
  args += ['--batch-size', '2', '--sample-prompts', '[]']
  for b in EXACT[len(MICRO) :]:  # After MICRO's own binds: these win.
    args += ['--bind', b]
  return args + list(extra)


def start(folder, args, devices=1):
  """Starts `train.py`; its output goes to files beside `folder` (pipes
  that nobody reads while another process is waited on would fill up and
  stall the process writing to them, and with it the whole run)."""
  os.makedirs(folder, exist_ok=True)
  env = {
    **os.environ,
    'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}',
    # A killed process leaves its private cache: keep it in the test's
    # own folder, not the machine's temp folder.
    'TMPDIR': os.path.dirname(os.path.abspath(folder)),
  }
  logs = [open(f'{folder}.{name}', 'w') for name in ('out', 'err')]  # noqa: SIM115
  proc = subprocess.Popen(
    [sys.executable, *args], cwd=folder, env=env, stdout=logs[0], stderr=logs[1]
  )
  proc.logs = logs
  return proc


def output(proc) -> tuple[str, str]:
  texts = []
  for f in proc.logs:
    f.close()
    with open(f.name) as g:
      texts.append(g.read())
  return texts[0], texts[1]


def start_pair(tmp_path, args, per_process=(), heartbeat=20, devices=1):
  """Processes 0 and 1 of one run, each in its own folder."""
  port = free_port()
  procs = []
  for i in (0, 1):
    extra = [
      '--coordinator',
      f'127.0.0.1:{port}',
      '--num-processes',
      '2',
      '--process-id',
      str(i),
      '--connect-timeout',
      '60',
      '--heartbeat-timeout',
      str(heartbeat),
      *(per_process[i] if per_process else ()),
    ]
    procs.append(start(tmp_path / f'p{i}', args + extra, devices=devices))
  return procs


def finish(procs, timeout=400):
  """`(returncode, stdout, stderr)` of each process, once all have ended."""
  deadline = time.time() + timeout
  try:
    for p in procs:
      p.wait(timeout=max(deadline - time.time(), 1))
  finally:
    for p in procs:
      p.kill()
  return [(p.returncode, *output(p)) for p in procs]


def test_two_processes_train_the_model_one_process_trains(tmp_path):
  """2 processes x 1 device == 1 process x 2 devices: same batches, one
  all-reduced update; identical weights everywhere; only process 0 wrote."""
  args = train_args(3, ['--eval-every', '3', '--checkpoint-every', '3'])
  procs = start_pair(tmp_path, args)
  single = start(tmp_path / 'one', args, devices=2)  # Alongside: faster.
  (rc0, out0, err0), (rc1, out1, err1), (rc, out, err) = finish(
    procs + [single]
  )
  assert rc0 == 0, err0[-3000:]
  assert rc1 == 0, err1[-3000:]
  assert '[1/2] model:' in out0 and '2 devices in 2 processes' in out0
  assert '[2/2] step 3: eval loss' in out1
  # (a) The same weights on both processes (each checked against the
  # other's at the end and printed).
  d0, d1 = DONE.search(out0), DONE.search(out1)
  assert d0 and d1 and d0.groups() == d1.groups() and d0.group(1) == '3'
  # (c) Only process 0 wrote: process 1's folder has no out-dir, and its
  # private token cache is gone.
  assert os.path.exists(tmp_path / 'p0' / 'run' / 'model.manifest.json')
  assert os.listdir(tmp_path / 'p1') == []
  private = re.search(r'tokenized in (\S+?)/cache', out1).group(1)
  assert not os.path.exists(os.path.join(tmp_path / 'p1', private))
  # (b) A single process with both devices trains the same weights.
  assert rc == 0, err[-3000:]
  assert '2 device(s)' in out
  multi, _ = modelfolder.read_weights(str(tmp_path / 'p0' / 'run'))
  one, _ = modelfolder.read_weights(str(tmp_path / 'one' / 'run'))
  assert len(multi) == len(one)
  for a, b in zip(multi, one, strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
  # The evaluation averages both processes' rows, as one process does.
  loss = re.compile(r'step 3: eval loss ([0-9.]+)')
  assert float(loss.search(out0).group(1)) == pytest.approx(
    float(loss.search(out).group(1)), rel=1e-3
  )


def test_processes_with_different_settings_refuse_to_train(tmp_path):
  args = train_args(2)
  procs = start_pair(tmp_path, args, per_process=([], ['--seed', '1']))
  (rc0, _, err0), (rc1, _, err1) = finish(procs)
  assert rc0 == 2 and rc1 == 2
  for err, who in ((err0, '[1/2]'), (err1, '[2/2]')):
    assert f'{who} error: process 1 has different settings than process 0' in (
      err
    ), err[-2000:]
    assert re.search(r'\([0-9a-f]{12} vs [0-9a-f]{12}\)', err)
  # Nothing was trained: process 0 wrote no checkpoint.
  assert not os.path.exists(tmp_path / 'p0' / 'run' / 'model.pkl.gz')


def test_unreachable_coordinator_is_one_clear_line(tmp_path):
  port = free_port()
  args = train_args(2) + [
    '--coordinator',
    f'127.0.0.1:{port}',
    '--num-processes',
    '2',
    '--process-id',
    '1',
    '--connect-timeout',
    '3',
  ]
  rc, _, err = finish([start(tmp_path / 'p1', args)])[0]
  assert rc == 2
  line = [x for x in err.splitlines() if 'error:' in x]
  assert len(line) == 1, err[-2000:]
  assert (
    f'could not join the coordinator 127.0.0.1:{port} within 3 s' in (line[0])
  )
  assert os.listdir(tmp_path / 'p1') == []


def test_a_killed_process_stops_the_other(tmp_path):
  """Killing process 1 mid-run: process 0 exits non-zero with one line,
  well within the heartbeat timeout."""
  args = train_args(100000, ['--eval-every', '100000', '--log-every', '1'])
  procs = start_pair(tmp_path, args, heartbeat=10)
  try:
    deadline = time.time() + 300
    while time.time() < deadline:
      if procs[0].poll() is not None or procs[1].poll() is not None:
        break
      if os.path.isdir(tmp_path / 'p0' / 'run' / 'train'):
        break  # TensorBoard events: steps are running.
      time.sleep(0.5)
    time.sleep(2)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.time()
    procs[0].wait(timeout=60)
    took = time.time() - killed
  finally:
    for p in procs:
      p.kill()
  stderr = output(procs[0])[1]
  assert procs[0].returncode not in (0, None)
  assert took < 30
  # Ours when a collective fails first (a connection dropped mid-step);
  # JAX's own fatal line when its heartbeat check gets there first (it ends
  # the process itself, before Python can say anything).
  ours = '[1/2] error: lost contact with another process of this run'
  jaxs = 'The following tasks are unhealthy (stopped sending heartbeats)'
  assert ours in stderr or jaxs in stderr, stderr[-3000:]


def settings(**values):
  return jsonconfig.from_values('train', {'out-dir': 'x', **values})


@pytest.mark.parametrize(
  'values, message',
  [
    ({'process-id': 2, 'num-processes': 2, 'coordinator': 'h:1'}, 'between 0'),
    ({'num-processes': 0}, 'at least 1'),
    ({'num-processes': 2}, 'no coordinator is set'),
    ({'coordinator': 'nohost', 'num-processes': 2}, 'is not HOST:PORT'),
    ({'coordinator': 'h:99999', 'num-processes': 2}, 'is not HOST:PORT'),
    ({'coordinator': '10.0.0.2:1234'}, 'num-processes is 1'),
    ({'connect-timeout': 0}, 'connect-timeout must be at least 1'),
  ],
)
def test_bad_distributed_settings_are_refused(values, message):
  with pytest.raises(UserError, match=message):
    settings(**values)  # jsonconfig.check_train runs as it is read.


def test_good_distributed_settings_pass():
  for values in (
    {},
    {'coordinator': 'auto'},
    {'coordinator': '10.0.0.2:1234', 'num-processes': 4, 'process-id': 3},
    {'coordinator': '[::1]:1234', 'num-processes': 2},
  ):
    settings(**values)  # jsonconfig.check_train runs as it is read.


def test_a_batch_is_split_between_processes():
  from src.data import windows

  tokens = np.arange(5000, dtype=np.int32) % 97 + 3
  whole = windows.WindowBatches(tokens, 64, 8, seed=3)
  parts = [
    windows.WindowBatches(tokens, 64, 8, seed=3, part=(i, 2)) for i in (0, 1)
  ]
  for step in (0, 5, 200):
    ids = [p.batch(step)[0] for p in parts]
    assert all(len(x) == 4 for x in ids)
    np.testing.assert_array_equal(np.concatenate(ids), whole.batch(step)[0])
  with pytest.raises(UserError, match='does not split into 3'):
    windows.WindowBatches(tokens, 64, 8, seed=3, part=(0, 3))


def test_fingerprints_name_what_differs():
  assert distributed.digest({'a': 1, 'b': 2}) == distributed.digest(
    {'b': 2, 'a': 1}
  )
  assert distributed.digest('x') != distributed.digest('y')
  cluster = distributed.Cluster()
  assert cluster.prefix == '' and cluster.part is None
  assert distributed.Cluster(1, 4, 2, 8).prefix == '[2/4] '
  assert cluster.broadcast_json({'k': [1]}) == {'k': [1]}
  distributed.check_same(cluster, None)  # One process: nothing to compare.
  a, b = 'a' * 64, 'b' * 64
  assert distributed.first_mismatch([[a, a], [a, a], [a, a]]) is None
  assert distributed.first_mismatch([[a, a], [a, a], [a, b]]) == (2, 1)


@pytest.mark.slow
def test_two_processes_of_two_devices_resume_like_one_of_four(tmp_path):
  """2 processes x 2 devices, stopped after 2 steps and resumed to 4, equal
  1 process x 4 devices trained 4 steps at once: process 1 (no out-dir of
  its own) takes process 0's checkpoint state on resume."""
  common = ['--eval-every', '2', '--checkpoint-every', '2']
  for steps in (2, 4):
    args = train_args(steps, common)
    args[args.index('--batch-size') + 1] = '4'
    results = finish(start_pair(tmp_path, args, devices=2))
    for rc, _out, err in results:
      assert rc == 0, err[-3000:]
    done = [DONE.search(out).groups() for _, out, _ in results]
    assert done[0] == done[1] and done[0][0] == str(steps)
  assert 'resuming from the checkpoint at step 2' in results[0][1]
  assert os.listdir(tmp_path / 'p1') == []
  args = train_args(4, common)
  args[args.index('--batch-size') + 1] = '4'
  rc, out, err = finish([start(tmp_path / 'one', args, devices=4)])[0]
  assert rc == 0, err[-3000:]
  multi, _ = modelfolder.read_weights(str(tmp_path / 'p0' / 'run'))
  one, _ = modelfolder.read_weights(str(tmp_path / 'one' / 'run'))
  for a, b in zip(multi, one, strict=True):
    np.testing.assert_allclose(a, b, rtol=5e-4, atol=5e-5)
