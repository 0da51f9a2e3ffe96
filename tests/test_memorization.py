"""The memorization check: fixed windows show a gap, moving ones do not."""

import json
import os
import time

import pytest

from src.analysis import memorization
from src.core import rundir
from src.training import trainer

from .conftest import MICRO, train_settings


def test_settings_are_saved_with_the_run(tiny_run):
  path = os.path.join(tiny_run['out'], rundir.SETTINGS)
  saved = json.load(open(path))['train']
  assert saved['windows'] == 'moving' and saved['steps'] == 4
  s = memorization.run_settings(tiny_run['out'])
  assert s['out-dir'] == tiny_run['out'] and s['seed'] == 0


def _train(out, windows):
  settings = train_settings(
    out,
    steps=200,
    **{
      'eval-every': 200,
      'checkpoint-every': 200,
      'eval-fraction': 0.0,
      'windows': windows,
    },
  )
  trainer.train(
    settings,
    gin_bindings=MICRO
    + (
      'ReformerLM.dropout = 0.0',
      'lr_schedule.peak = 0.01',
      # Trax's start for the axial positions (std 1.0, sqrt(d_model) times
      # the tokens' at d_model 32), where memorizing by position is
      # strongest: the windows must prevent it even then. (At the tokens'
      # scale the fixed-window gap is smaller: 1.21x a token off.)
      'positions.axial_init_scale = 5.656854',
    ),
    log=lambda line: None,
  )
  return memorization.window_losses(str(out), last_steps=8)


def test_fixed_windows_are_memorized_by_position_moving_ones_are_not(
  tmp_path,
):
  t0 = time.time()
  fixed = _train(tmp_path / 'fixed', 'fixed')
  moving = _train(tmp_path / 'moving', 'moving')
  print(f'fixed {fixed}\nmoving {moving}\n{time.time() - t0:.0f} s')
  # The same tiny model, the same data and steps: with fixed windows the
  # text is learned where it sat (moved by a token it scores far worse);
  # with moving windows moving it changes little.
  gap = {k: fixed[k] / fixed[0] for k in (1, 7)}
  moved = {k: moving[k] / moving[0] for k in (1, 7)}
  for k in (1, 7):
    assert gap[k] > 1.5 * moved[k], (fixed, moving)
  assert max(moved.values()) < 1.3, moving
  with pytest.raises(Exception, match='settings.json: missing'):
    memorization.run_settings(str(tmp_path))
