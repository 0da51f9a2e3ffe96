"""The benchmark scripts run end to end in smoke mode (slow: -m slow)."""

import importlib.util
import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.slow
def test_train_speed_smoke():
  contenders = ['jade', 'full']
  if importlib.util.find_spec('reformer_pytorch'):
    contenders.append('peer')
  result = subprocess.run(
    [sys.executable, 'bench/train_speed.py', '--smoke', '--contenders']
    + contenders,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  for name in contenders:
    assert f'| {name} | 1024 | 500 | ' in result.stdout


@pytest.mark.slow
def test_prepare_corpus_smoke(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      'bench/prepare_corpus.py',
      '--gigabytes',
      '0.003',
      '--files',
      '2',
      '--dir',
      str(tmp_path),
      '--vocab-size',
      '300',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'hit=True' in result.stdout
