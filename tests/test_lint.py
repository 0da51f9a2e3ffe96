"""The one lint/format config (ruff, in pyproject.toml) holds for the tree."""

import subprocess
import sys

from .conftest import ROOT


def ruff(*args):
  return subprocess.run(
    [sys.executable, '-m', 'ruff', *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )


def test_ruff_check():
  result = ruff('check', '.')
  assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
  result = ruff('format', '--check', '.')
  assert result.returncode == 0, result.stdout + result.stderr
