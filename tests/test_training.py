"""Training end to end: checkpoints, TensorBoard, resume, devices, CLI."""

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from src.core import safe_pickle
from src.core.errors import UserError
from src.model import ginconf
from src.storage import snapshots
from src.training import plan, trainer
from src.training import progress as progress_line

from .conftest import (
  DATA,
  EXACT_LSH,
  MICRO,
  ROOT,
  micro_args,
  run_script,
  train_settings,
)


def scalars(folder):
  acc = event_accumulator.EventAccumulator(folder)
  acc.Reload()
  return {
    tag: [(e.step, e.value) for e in acc.Scalars(tag)]
    for tag in acc.Tags()['scalars']
  }


def test_run_writes_checkpoint_tokenizer_and_gin(tiny_run):
  out = tiny_run['out']
  files = set(os.listdir(out))
  assert {
    'model.pkl.gz',
    'model.weights.npy.gz',
    'model.opt_slots0.npy.gz',
    'tokenizer.model',
    'tokenizer.json',
    'model.gin',
    'config.gin',
  } <= files
  assert snapshots.latest_step(out) == 4
  operative = open(os.path.join(out, 'config.gin')).read()
  assert 'ReformerLM.n_layers = 3' in operative
  assert 'lr_schedule.warmup_steps = 2' in operative
  # The schedule sets the rate; Trax's unused Adam default is not shown.
  assert 'Adam.learning_rate' not in operative
  assert 'Adam.b2 = 0.98' in operative
  assert tiny_run['loop'].step == 4


def test_tensorboard_events_read_back(tiny_run):
  train = scalars(os.path.join(tiny_run['out'], 'train'))
  evals = scalars(os.path.join(tiny_run['out'], 'eval'))
  # Loss by position in the context (tiny: 128 tokens).
  assert {'metrics/loss at 8-32', 'metrics/loss at 32-128'} <= set(evals)
  assert [s for s, _ in train['metrics/loss']] == [1, 2, 4]
  for step, loss in train['metrics/loss']:
    ppl = dict(train['metrics/perplexity'])[step]
    assert ppl == pytest.approx(np.exp(loss), rel=1e-4)
  assert {
    'training/learning_rate',
    'training/steps per second',
    'training/gradients_l2',
  } <= set(train)
  assert {'metrics/loss', 'metrics/accuracy', 'metrics/perplexity'} <= set(
    evals
  )
  assert all(0 <= v <= 1 for _, v in evals['metrics/accuracy'])
  # Running training scalars every log-every (2) steps.
  assert [s for s, _ in train['running/loss']] == [2, 4]
  for step, loss in train['running/loss']:
    ppl = dict(train['running/perplexity'])[step]
    assert ppl == pytest.approx(np.exp(loss), rel=1e-4)
  assert all(v > 0 for _, v in train['running/tokens_per_second'])
  assert [s for s, _ in train['running/accuracy']] == [2, 4]
  assert all(0 <= v <= 1 for _, v in train['running/accuracy'])
  lr = dict(train['running/learning_rate'])
  assert lr[4] == pytest.approx(dict(train['training/learning_rate'])[4])


def test_sample_replies_at_each_evaluation(tiny_run):
  acc = event_accumulator.EventAccumulator(
    os.path.join(tiny_run['out'], 'eval')
  )
  acc.Reload()
  events = acc.Tensors('samples')
  assert [e.step for e in events] == [1, 2, 4]
  text = events[-1].tensor_proto.string_val[0].decode()
  assert 'Greedy replies at step 4' in text
  assert '| Hello! |' in text and '| Who \\| are you? |' in text


def test_resume_continues_at_the_saved_step(tiny_run, copy_of):
  out = copy_of(tiny_run['out'])
  lines = []
  loop = trainer.train(
    train_settings(out, steps=6), gin_bindings=MICRO, log=lines.append
  )
  assert any('resuming from the checkpoint at step 4' in x for x in lines)
  assert any(x.startswith('data:') and '(cached in' in x for x in lines)
  assert loop.step == 6 and snapshots.latest_step(out) == 6
  train = scalars(os.path.join(out, 'train'))
  assert [s for s, _ in train['metrics/loss']][-2:] == [5, 6]
  lines.clear()
  assert (
    trainer.train(
      train_settings(out, steps=6), gin_bindings=MICRO, log=lines.append
    )
    is None
  )
  assert 'already trained to step 6' in lines[-1]


def test_checkpoint_pickles_are_read_safely(tiny_run, tmp_path):
  meta = snapshots.read_meta(tiny_run['out'])
  assert meta['step'] == 4 and meta['input_signature']

  class Evil:
    def __reduce__(self):
      return (os.system, ('echo pwned > ' + str(tmp_path / 'pwned'),))

  data = pickle.dumps({'step': Evil()})
  with pytest.raises(UserError, match='posix.system|os.system'):
    safe_pickle.safe_load(data, 'evil.pkl')
  assert not (tmp_path / 'pwned').exists()
  (tmp_path / 'model.pkl.gz').write_bytes(b'not gzip')
  with pytest.raises(UserError, match='damaged'):
    snapshots.read_meta(str(tmp_path))


def test_progress_line_shows_rate_and_eta(capsys):
  progress = progress_line.Progress(total=10, start=0, interval=0.0)
  for step in range(1, 11):
    progress.step_done(step, np.array([2.0]), 1e-3, 512)
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith('step 1/10 | loss 2.000 | ppl 7.4 | lr 1.00e-03')
  assert 'compiling' in out[0]
  assert 'tok/s' in out[-1] and 'ETA 0s' in out[-1]
  assert out[-1].startswith('step 10/10')


def test_train_script_output_is_quiet_and_useful(tmp_path):
  out = str(tmp_path / 'run')
  result = run_script(
    micro_args(out, 3) + ['--eval-every', '3', '--tpu-ip', '10.0.0.2']
  )
  assert result.returncode == 0, result.stderr
  assert result.stderr == ''  # No TensorFlow / absl / gym noise.
  lines = result.stdout.splitlines()
  assert lines[0].startswith('note: "tpu-ip" (10.0.0.2) is not needed')
  assert lines[1].startswith('data: 13 conversations')
  assert any(x.startswith('step 3/3 | loss') for x in lines)
  assert any(x.startswith('step 3: eval loss') for x in lines)
  assert lines[-1].startswith('done: step 3.')


MULTI_DEVICE = r"""
import json, sys
sys.path.insert(0, {root!r})
import numpy as np
from tests.conftest import MICRO, train_settings  # bootstraps the process
from src.training import trainer as training
from src.data import windows
rows, losses = [], []
class Recording(training.JadeLoop):
  def _run_one_step(self, task_index, task_changed):
    loss, stats = super()._run_one_step(task_index, task_changed)
    losses.append(np.asarray(loss).tolist())
    return loss, stats
training.JadeLoop = Recording
orig = windows.WindowBatches.batch
def batch(self, step):
  b = orig(self, step)
  if self.seed == 0:
    rows.append([r[w > 0].tolist() for r, w in zip(b[0], b[2])])
    shapes.append(list(b[0].shape))
  return b
shapes = []
windows.WindowBatches.batch = batch
loop = training.train(train_settings({out!r}, steps=2, window={window}),
                      gin_bindings=MICRO, log=lambda s: None)
import jax
print(json.dumps({{'devices': jax.local_device_count(), 'rows': rows,
                  'losses': losses, 'step': loop.step, 'shapes': shapes}}))
"""


@pytest.mark.slow  # 2 devices train in the suite: tests/test_distributed.py
@pytest.mark.parametrize('window', [0, 32], ids=['context', 'short-windows'])
def test_eight_devices_each_train_on_a_different_window(tmp_path, window):
  out = str(tmp_path / 'run8')
  code = MULTI_DEVICE.format(root=ROOT, out=out, window=window)
  result = run_script(
    ['-c', code],
    env={'XLA_FLAGS': '--xla_force_host_platform_device_count=8'},
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report['devices'] == 8 and report['step'] == 2
  # The sample batch plus one batch per step, each with 8 distinct windows.
  for rows in report['rows']:
    assert len(rows) == 8
    assert len({tuple(r) for r in rows}) == 8
  # Trax's loss per device differs: each device saw different data.
  for per_device in report['losses']:
    assert len(per_device) == 8 and len(set(per_device)) == 8
  assert {tuple(s) for s in report['shapes']} == {(8, window or 128)}


@pytest.mark.slow
def test_killed_training_resumes_from_last_checkpoint(tmp_path):
  out = str(tmp_path / 'run')
  proc = subprocess.Popen(
    [
      sys.executable,
      *micro_args(out, 100000),
      '--checkpoint-every',
      '5',
      '--eval-every',
      '1000',
    ],
    cwd=ROOT,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    deadline = time.time() + 300
    while time.time() < deadline:
      if os.path.exists(os.path.join(out, 'model.pkl.gz')) and (
        snapshots.latest_step(out) >= 10
      ):
        break
      time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  finally:
    if proc.poll() is None:
      proc.kill()
  saved = snapshots.latest_step(out)
  assert saved >= 10 and saved % 5 == 0
  result = run_script(micro_args(out, saved + 2) + ['--checkpoint-every', '5'])
  assert result.returncode == 0, result.stderr
  assert f'resuming from the checkpoint at step {saved}' in result.stdout
  assert snapshots.latest_step(out) == saved + 2


@pytest.mark.slow
def test_32k_model_trains_one_step(tmp_path):
  """The real gin/reformer_32k.gin: build it and run one training step."""
  setup = ginconf.parse(os.path.join(ROOT, 'gin', 'reformer_32k.gin'))
  assert setup.max_len == 32768
  out = str(tmp_path / 'run32k')
  result = run_script(
    [
      'train.py',
      '--data',
      DATA,
      '--out-dir',
      out,
      '--steps',
      '1',
      '--eval-fraction',
      '0',
    ],
    timeout=1800,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert snapshots.latest_step(out) == 1


def test_ai_only_loss_reaches_the_batches(tmp_path):
  settings = train_settings(tmp_path / 'ai', **{'ai-only-loss': True})
  run = plan.prepare(settings, MICRO, log=lambda line: None)
  tok = run.tokenizer
  ids, _, weights = run.train_batches.batch(0)
  assert set(weights[ids == tok.ai_start_id].tolist()) == {0.0}
  assert set(weights[ids == tok.ai_end_id].tolist()) == {1.0}
  assert 0 < weights.sum() < (ids != 0).sum()
  eval_ids, _, eval_weights = run.eval_batches.batch(0)
  assert eval_weights.sum() < (eval_ids != 0).sum()


def test_replay_and_epochs_reach_the_plan(tmp_path):
  """A replay folder is tokenized with the run's tokenizer and mixed into
  the training epochs (not the held-out ones); `epochs` sets the steps."""
  replay = os.path.join(ROOT, 'data', 'persona')
  lines = []
  settings = train_settings(
    tmp_path / 'r', replay=replay, **{'replay-share': 0.4, 'epochs': 3}
  )
  run = plan.prepare(settings, MICRO, log=lines.append)
  b = run.train_batches
  assert run.replay_corpus is not None and b.replay is not None
  assert b.replay_tokens == round(run.n_train_tokens * 0.4 / 0.6)
  assert run.settings['steps'] == b.epoch_end(3) > 0
  assert run.eval_batches.replay is None
  # The replay conversations are read with the run's own tokenizer.
  tok = run.tokenizer
  epoch_view = b.epoch_view(0)
  assert len(epoch_view) >= run.n_train_tokens + b.replay_tokens
  text = tok.decode(epoch_view.take(run.n_train_tokens, len(epoch_view))[0])
  assert any(w in text for w in ('Robin', 'Lisbon', 'Pixel', 'cello', 'Maya'))
  with pytest.raises(UserError, match='replay-share 0.0 must be above 0'):
    train_settings(tmp_path / 's', replay=replay, **{'replay-share': 0})
  with pytest.raises(UserError, match='epochs -1 must be 0'):
    train_settings(tmp_path / 's', epochs=-1)


def test_held_out_conversations_are_reported(tmp_path):
  lines = []
  run = plan.prepare(
    train_settings(tmp_path / 'a', **{'eval-fraction': 0.2}),
    MICRO,
    log=lines.append,
  )
  assert run.held.startswith('held out: ')
  assert 'of 13 conversations at random' in run.held
  n_train, n_eval = run.n_train_tokens, run.n_eval_tokens
  assert n_train + n_eval == run.n_tokens and n_eval >= 0.2 * n_train / 0.8
  # A separate folder: all of "data" trains, the folder evaluates.
  held = tmp_path / 'held'
  held.mkdir()
  (held / 'x.txt').write_text(
    'Hi\n|aigenerationstart| Hello there |endofgeneration|\n',
    encoding='utf-8',
  )
  run = plan.prepare(
    train_settings(tmp_path / 'b', **{'eval-data': str(held)}),
    MICRO,
    log=lines.append,
  )
  assert run.n_train_tokens == run.n_tokens
  assert run.held.startswith(f'held out: {held} (1 conversations')
  assert run.eval_batches.view is not run.train_batches.view
  # A broken held-out folder leaves no trace in a new out-dir.
  (held / 'x.txt').write_text('Hi\n', encoding='utf-8')
  with pytest.raises(UserError, match='x.txt:1: the conversation ends'):
    plan.prepare(
      train_settings(tmp_path / 'c', **{'eval-data': str(held)}),
      MICRO,
      log=lines.append,
    )
  assert not (tmp_path / 'c').exists()
  # Nor in an existing one: no tokenizer, no cache is left behind.
  (tmp_path / 'd').mkdir()
  with pytest.raises(UserError, match='x.txt:1: the conversation ends'):
    plan.prepare(
      train_settings(tmp_path / 'd', **{'eval-data': str(held)}),
      MICRO,
      log=lines.append,
    )
  assert os.listdir(tmp_path / 'd') == []


@pytest.mark.parametrize(
  'signum',
  [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
)
def test_a_stop_signal_saves_and_the_run_resumes(tmp_path, signum):
  """What a preemptible VM (SIGTERM) or Ctrl-C (SIGINT) does: the step in
  progress finishes, a checkpoint is written, the exit code says which."""
  out = str(tmp_path / 'run')
  args = micro_args(out, 100000) + ['--checkpoint-every', '100000']
  proc = subprocess.Popen(
    [sys.executable, *args],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )
  try:
    for line in proc.stdout:
      if line.startswith('step 1: eval'):
        break
    time.sleep(1.0)
    proc.send_signal(signum)
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 128 + signum
  finally:
    if proc.poll() is None:
      proc.kill()
  name = signal.Signals(signum).name
  assert f'{name}: stopped after step' in rest, rest
  saved = snapshots.latest_step(out)
  assert saved >= 1 and f'after step {saved};' in rest
  result = run_script(micro_args(out, saved + 2))
  assert result.returncode == 0, result.stderr
  assert f'resuming from the checkpoint at step {saved}' in result.stdout
  assert snapshots.latest_step(out) == saved + 2


class _Payload:
  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (os.system, (f'touch {self.path}',))


def test_one_run_per_out_dir(tiny_run, copy_of, tmp_path):
  from src.core import runlock

  folder = copy_of(tiny_run['out'])
  lock = os.path.join(folder, runlock.LOCK_FILE)
  # A live holder on this host (this test process): refused, untouched.
  with open(lock, 'w') as f:
    json.dump({'pid': os.getpid(), 'host': socket.gethostname()}, f)
  before = sorted(os.listdir(folder))
  with pytest.raises(UserError, match=f'pid {os.getpid()} on'):
    trainer.train(train_settings(folder, steps=6), gin_bindings=MICRO)
  assert sorted(os.listdir(folder)) == before
  # A holder that is gone: taken over with a note, and released at the end.
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  with open(lock, 'w') as f:
    json.dump({'pid': dead.pid, 'host': socket.gethostname()}, f)
  # The same resume shows Trax's data-counter pickle is never loaded: a
  # planted one would run a command.
  mark = os.path.join(folder, 'PWNED')
  with open(os.path.join(folder, 'data_counters0.pkl'), 'wb') as f:
    pickle.dump(_Payload(mark), f)
  lines = []
  loop = trainer.train(
    train_settings(folder, steps=6), gin_bindings=MICRO, log=lines.append
  )
  assert loop.step == 6 and not os.path.exists(lock)
  assert any('taking over the lock of a run that is gone' in x for x in lines)
  assert not os.path.exists(mark)
  # A new out-dir that fails its checks leaves nothing behind.
  new = tmp_path / 'new'
  with pytest.raises(UserError):
    trainer.train(train_settings(new, data=str(tmp_path / 'nope')))
  assert not new.exists()
  with pytest.raises(UserError, match='out-dir is empty'):
    trainer.train(train_settings(''))


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
  """2 micro-batches of 1 window give the same step as 1 batch of 2. Exact
  attention and no dropout, so nothing random differs between the two."""
  exact = MICRO + EXACT_LSH + ('ReformerLM.dropout = 0.0',)
  loops = {}
  for k in (1, 2):
    loops[k] = trainer.train(
      train_settings(
        tmp_path / f'k{k}',
        steps=2,
        **{
          'batch-size': 2,
          'accumulate-steps': k,
          'eval-every': 100,
          'log-every': 1,
        },
      ),
      gin_bindings=exact,
      log=lambda line: None,
    )
  one, two = (
    [np.asarray(w) for w in jax.tree_util.tree_leaves(loops[k].model.weights)]
    for k in (1, 2)
  )
  # Float sums differ in order between the two; Adam's first steps scale a
  # near-zero gradient's noise up to a fraction of the rate (0.0015 here),
  # so a few elements differ by ~1e-4, where counting the last micro-batch
  # only would move most weights by up to twice the rate.
  for a, b in zip(one, two, strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=3e-4)
  losses = [
    scalars(os.path.join(tmp_path / f'k{k}', 'train'))['metrics/loss']
    for k in (1, 2)
  ]
  assert losses[0][-1][1] == pytest.approx(losses[1][-1][1], rel=1e-4)
  # The running accuracy counts every micro-batch, not only the last.
  accuracy = [
    scalars(os.path.join(tmp_path / f'k{k}', 'train'))['running/accuracy']
    for k in (1, 2)
  ]
  assert accuracy[0] == pytest.approx(accuracy[1], abs=1e-3)
  with pytest.raises(UserError, match='accumulate-steps 3 does not split'):
    trainer.train(
      train_settings(tmp_path / 'k3', **{'accumulate-steps': 3}),
      gin_bindings=MICRO,
    )
  assert not os.path.exists(tmp_path / 'k3')
  with pytest.raises(UserError, match='accumulate-steps must be at least 1'):
    trainer.train(
      train_settings(tmp_path / 'k0', **{'accumulate-steps': 0}),
      gin_bindings=MICRO,
    )


def test_the_training_step_is_compiled_once(caplog):
  """`CompileFirstTrainer` compiles the step ahead of its first run (to
  hand the compiler's memory back first), and that executable is the
  one every step runs: the update is compiled once over three steps
  (the chunked loss's state keeps its structure from the first step)."""
  import logging

  import trax

  from src.model import losses
  from src.training.loop import CompileFirstTrainer

  from .conftest import TINY_GIN

  length = ginconf.parse(TINY_GIN, MICRO).max_len
  m = ginconf.init_model(40, 'train', length)
  fused = losses.chunked_model(m, 32)
  optimizer = trax.optimizers.Adam(0.001)
  optimizer.tree_init(fused.weights)
  trainer_ = CompileFirstTrainer(fused, optimizer)
  rng = np.random.default_rng(0)
  ids = jax.numpy.asarray(rng.integers(1, 40, (1, length)), jax.numpy.int32)
  batch = (ids, ids, jax.numpy.ones((1, length), jax.numpy.float32))
  jax.config.update('jax_log_compiles', True)
  try:
    with caplog.at_level(logging.WARNING, logger='jax'):
      for step in (1, 2, 3):
        loss, _ = trainer_.one_step(
          batch, jax.random.PRNGKey(step), step, np.float32(0.001)
        )
        assert np.isfinite(float(loss))
  finally:
    jax.config.update('jax_log_compiles', False)
  compiles = [
    r
    for r in caplog.records
    if 'Finished XLA compilation' in r.getMessage()
    and 'single_device_update_fn' in r.getMessage()
  ]
  assert len(compiles) == 1


UNGUARDED = r"""
import sys
sys.path.insert(0, {root!r})
from tests.conftest import MICRO, train_settings  # bootstraps the process
from src.data import corpus
from src.training import trainer
import os
os.cpu_count = lambda: 2  # Two tokenizing workers on any machine...
corpus.PARALLEL_MIN_BYTES = 0  # ...for the sample data...
corpus.PIECE_BYTES = 1000  # ...in pieces.
trainer.train(train_settings({out!r}, steps=1), gin_bindings=MICRO)
"""


def test_a_script_that_trains_without_the_main_guard_is_told_the_fix(
  tmp_path,
):
  """The tokenizer's spawned workers re-run the script that started them:
  one that calls train() at its top level trained again in each (and
  the first run waited on them). Refused in the worker, and the first run
  names the fix, in seconds."""
  script = tmp_path / 'my_training.py'
  script.write_text(UNGUARDED.format(root=ROOT, out=str(tmp_path / 'run')))
  result = run_script([str(script)], timeout=120)
  assert result.returncode != 0
  assert 'train() was called while a worker process was starting' in (
    result.stderr
  )
  last = result.stderr.strip().splitlines()[-1]
  assert 'a tokenizing process stopped' in last
  assert 'my_training.py calls train() outside `if __name__ ==' in last
  assert not (tmp_path / 'run' / 'model.pkl.gz').exists()
