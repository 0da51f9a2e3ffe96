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


def load_bench(name):
  spec = importlib.util.spec_from_file_location(
    f'bench_{name}', f'{ROOT}/bench/{name}.py'
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_chat_quality_metrics():
  q = load_bench('chat_quality')
  assert q.normalize('  Hi  There!! ') == 'hi there'
  assert q.has_loop('we go round and we go round and on')
  assert not q.has_loop('we go round and round and round')
  from src import chatformat

  convs = chatformat.parse_text(
    'Hi\n|aigenerationstart|Hello there.|endofgeneration|\n\n'
    'Hi\n|aigenerationstart|Hey|endofgeneration|\n\n'
    '|aigenerationstart|I start.|endofgeneration|\n',
    'x.txt',
  )
  answers, shown = q.first_exchanges(convs)
  assert answers == {'Hi': {'hello there', 'hey'}} and shown['Hi'] == (
    'Hello there.'
  )


def test_chat_quality_scores_a_trained_model(tiny_run):
  """The figures on a tiny run (the metrics, not the targets): counts in
  range, a hit only where the reply equals a trained answer."""
  q = load_bench('chat_quality')
  m = q.measure(tiny_run['out'], n_prompts=4)
  assert m['n'] == 4 and 0 <= m['hits'] <= 4
  assert 0 <= m['ended'] <= m['n_held'] and 0 <= m['loops'] <= m['n_held']
  assert m['hits'] == sum(hit for *_, hit in m['samples'])
  from src import memorization

  answers, _ = q.first_exchanges(memorization.split(tiny_run['out'], None)[0])
  for prompt, reply, _, hit in m['samples']:
    assert hit == (q.normalize(reply) in answers[prompt])
  assert len(q.summary(m)) == 3
