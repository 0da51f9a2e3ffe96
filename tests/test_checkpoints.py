"""Checkpoints are whole or absent; divergence stops before saving."""

import os
import shutil
import types

import numpy as np
import pytest

from src.core.errors import UserError
from src.inference import decoding
from src.storage import snapshots
from src.training import callbacks, trainer

from .conftest import MICRO, train_settings


def _resume(folder, steps=6, bindings=()):
  lines = []
  loop = trainer.train(
    train_settings(folder, steps=steps),
    gin_bindings=MICRO + tuple(bindings),
    log=lines.append,
  )
  return loop, '\n'.join(lines)


def test_every_checkpoint_is_sealed_and_the_last_two_are_kept(tiny_run):
  out = tiny_run['out']
  assert [s for s, _ in snapshots.snapshots(out)] == [4, 2]
  assert snapshots.verify(out) == (4, out, '')
  # Snapshots are hard links of the same bytes, not copies.
  top = os.stat(os.path.join(out, snapshots.WEIGHTS))
  snap = os.stat(os.path.join(out, 'checkpoints/step-4', snapshots.WEIGHTS))
  assert top.st_ino == snap.st_ino


def test_a_kill_between_the_renames_falls_back_not_mixed(tiny_run, copy_of):
  """Trax renames slots, weights, then the pickle: simulate a kill after
  the weights of a newer step replaced the file (by rename, as Trax does)
  but before the pickle and the manifest."""
  folder = copy_of(tiny_run['out'])
  weights = os.path.join(folder, snapshots.WEIGHTS)
  newer = weights + '.other'
  shutil.copy(
    os.path.join(folder, 'checkpoints/step-2', snapshots.WEIGHTS), newer
  )
  os.replace(newer, weights)  # Step-2 bytes under the step-4 pickle.
  step, used, problem = snapshots.verify(folder)
  assert step == 4 and used.endswith('step-4')
  assert problem.startswith('model.weights.npy.gz')
  # Chat reads the intact step-4 set; a resume restores it (tested below
  # with truncated weights), so nothing of two steps is ever mixed.
  assert decoding.load_run(folder, 'eval')[3] == 4


@pytest.mark.parametrize('damage', ['truncated', 'garbage', 'missing'])
def test_damaged_weights_are_never_resumed_from(damage, tiny_run, copy_of):
  folder = copy_of(tiny_run['out'])
  path = os.path.join(folder, snapshots.WEIGHTS)
  if damage == 'truncated':
    # In place, and the newest snapshot shares the file (copy_of copied
    # the links apart; sealing again links them): both are damaged, so
    # the step-2 snapshot is used.
    snapshots.seal(folder, 4)
    os.truncate(path, os.path.getsize(path) // 2)
    expected_step = 2
  elif damage == 'garbage':
    with open(path, 'r+b') as f:
      f.write(os.urandom(64))
    expected_step = 4
  else:
    os.remove(path)
    expected_step = 4
  assert snapshots.verify(folder)[0] == expected_step
  # Reading for chat falls back too, and says so.
  layer_step = decoding.load_run(folder, 'eval')[3]
  assert layer_step == expected_step
  if damage == 'truncated':  # Training restores it (one resume suffices).
    loop, log = _resume(folder)
    assert 'resuming from the intact one at step 2' in log
    assert loop.step == 6


def test_nothing_intact_is_refused(tiny_run, copy_of):
  folder = copy_of(tiny_run['out'])
  shutil.rmtree(os.path.join(folder, snapshots.SNAPSHOTS))
  with open(os.path.join(folder, snapshots.CHECKPOINT), 'r+b') as f:
    f.write(b'\0' * 16)
  before = sorted(os.listdir(folder))
  with pytest.raises(UserError, match='the checkpoint is damaged .* no intact'):
    _resume(folder)
  with pytest.raises(UserError, match='no intact'):
    decoding.load_run(folder, 'eval')
  assert sorted(os.listdir(folder)) == before


def test_divergence_stops_before_saving(tmp_path, capsys):
  folder = str(tmp_path / 'run')
  settings = train_settings(folder, steps=20, **{'checkpoint-every': 1})
  with pytest.raises(SystemExit) as stop:
    trainer.train(
      settings,
      gin_bindings=MICRO + ('lr_schedule.peak = 1e30',),
      log=lambda line: None,
    )
  assert stop.value.code == 3
  out = capsys.readouterr().out
  line = next(x for x in out.splitlines() if 'diverged' in x)
  assert line.startswith('error: training diverged at step ')
  bad = int(line.split('at step ')[1].split(':')[0])
  assert 'lr_schedule.peak = 1e+29' in line
  # Every checkpoint on disk is intact, from before the bad step, and
  # holds finite weights.
  step, used, problem = snapshots.verify(folder)
  assert step < bad and not problem
  if step:  # A checkpoint from before the bad step, finite weights.
    assert used == folder
    assert decoding.load_run(folder, 'eval')[3] == step
  else:  # The bad step-1 checkpoint was taken back.
    assert used is None and snapshots.checkpoint_files(folder) == []


def test_a_model_with_nan_weights_is_reported(tiny_run, copy_of):
  from trax import layers as tl

  folder = copy_of(tiny_run['out'])
  meta = snapshots.read_meta(folder)
  path = os.path.join(folder, snapshots.WEIGHTS)
  flat = tl.np_from_file(path, compresslevel=meta['flat_weights'])
  flat = [np.full_like(w, np.nan) if w.dtype.kind == 'f' else w for w in flat]
  tl.np_to_file(flat, path, compresslevel=meta['flat_weights'])
  snapshots.seal(folder, 4)
  with pytest.raises(UserError, match='weights contain NaN/inf'):
    decoding.load_run(folder, 'eval')


def test_step_values_are_checked_one_step_later_without_waiting():
  """Each step checks the one before it (already finished on the device);
  a save checks its own step first."""
  stub = types.SimpleNamespace(_unchecked=(7, np.float32(np.nan), 1.0))
  with pytest.raises(callbacks.Diverged) as d:
    callbacks.FiniteCheck.check(stub)
  assert d.value.step == 7 and d.value.what == 'the loss is nan'
  assert d.value.saved_bad and stub._unchecked is None
  stub._unchecked = (8, np.ones(2), np.float32(np.inf))
  with pytest.raises(callbacks.Diverged, match='gradient norm is inf'):
    callbacks.FiniteCheck.check(stub)
  stub._unchecked = (9, 1.5, 2.0)
  callbacks.FiniteCheck.check(stub)  # Finite: nothing happens.
  assert stub._unchecked is None


def test_loading_draws_no_weights_and_gives_trax_init_state(tiny_run):
  """`set_weights` skips drawing weights it replaces (a chat's start), and
  gives the same weights and state as Trax's own init, then the weights."""
  import jax
  import trax
  from trax import layers as tl

  from src.model import ginconf
  from src.storage import checkpoints, modelfolder

  folder = tiny_run['out']
  _, tok, loaded, _ = decoding.load_run(folder, 'predict')
  flat, _ = modelfolder.read_weights(folder)
  trax_way = ginconf.model(tok.vocab_size, 'predict')
  one = trax.shapes.ShapeDtype((1, 1), np.int32)
  trax_way.rng = jax.random.PRNGKey(0)
  trax_way.init(one)
  sig = trax_way.weights_and_state_signature(one)
  trax_way.weights = tl.unflatten_weights_and_state(
    flat, (), sig, weights_only=True
  )[0]
  for a, b in zip(
    jax.tree_util.tree_leaves((loaded.weights, loaded.state)),
    jax.tree_util.tree_leaves((trax_way.weights, trax_way.state)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  drawn = []
  with checkpoints.weights_not_drawn(trax_way):
    dense = next(
      layer for layer in _all_layers(trax_way) if isinstance(layer, tl.Dense)
    )
    drawn.append(dense._kernel_initializer((3, 2), None))
  assert not np.asarray(drawn[0]).any()
  assert dense._kernel_initializer((3, 2), jax.random.PRNGKey(1)).any()


def _all_layers(layer):
  yield layer
  for sub in layer.sublayers:
    yield from _all_layers(sub)
