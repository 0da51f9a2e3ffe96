"""Training a long-context model on windows shorter than its context
(`train.window`, issue 50): windows at random offsets of the position
grid, evaluation by position at the window's length, resume, accumulation,
fine-tuning, the pre-flight; the model then reads its whole context."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from src.core.errors import UserError
from src.inference import decoding, generate, sampling
from src.model import ginconf, positions, preflight, reformer
from src.storage import eventfile
from src.training import plan, trainer

from .conftest import MICRO, finetune_settings, train_settings


@pytest.fixture(scope='module')
def short_run(tmp_path_factory):
  """The MICRO model (a 128-token context) trained 4 steps on 32-token
  windows."""
  out = tmp_path_factory.mktemp('short') / 'out'
  lines = []
  settings = train_settings(out, window=32, steps=4, **{'eval-every': 2})
  loop = trainer.train(settings, gin_bindings=MICRO, log=lines.append)
  return {'out': str(out), 'loop': loop, 'log': lines}


def test_short_windows_train_at_random_offsets_of_the_grid(short_run):
  loop, lines = short_run['loop'], short_run['log']
  assert loop.step == 4
  assert any('context 128 tokens (trained on windows of 32' in x for x in lines)
  axial = [
    layer
    for layer in reformer.all_layers(loop.model)
    if isinstance(layer, positions.AxialPositions)
  ]
  assert axial and all(a._offset == 'random' for a in axial)
  # Evaluated by position up to the window (no range past it).
  tags = eventfile.scalars(
    os.path.join(short_run['out'], 'eval'), 64, 100, print
  )
  ranges = [t for t in tags if t.startswith('metrics/loss at')]
  assert 'metrics/loss at 8-32' in ranges
  assert not any(t.endswith('-128') for t in ranges)
  # Long held-out conversations read at the whole context, at the last
  # step (the fourth evaluation would be another): loss up to 128.
  assert 'full context/loss at 32-128' in tags
  assert list(tags['full context/loss at 32-128']) == [4]
  assert tags['full context/loss at 32-128'][4] > 0
  # The model keeps its whole context: 128 tokens in model.gin.
  gin_text = open(os.path.join(short_run['out'], 'model.gin')).read()
  assert 'ReformerLM.max_len = 128' in gin_text


def test_the_model_reads_its_whole_context_after_short_windows(short_run):
  decoder = decoding.Decoder.load(short_run['out'])
  assert decoder.max_len == 128
  context = generate.Context(decoder)
  long_message = ' '.join(['hello there'] * 30)  # Past the 32-token window.
  logits = context.ask(long_message, 8)
  assert context.used() > 64 and np.isfinite(np.asarray(logits)).all()
  ids = generate.reply(
    context,
    'And you?',
    sampling.SamplingSettings(max_new_tokens=4),
    np.random.default_rng(0),
  )
  assert ids is not None


def test_a_batch_holds_windows_of_the_window_length(short_run, tmp_path):
  settings = train_settings(
    tmp_path / 'p',
    window=32,
    splice=0.5,
    **{'batch-size': 2, 'accumulate-steps': 2},
  )
  run = plan.prepare(settings, MICRO, log=lambda line: None)
  assert run.train_batches.splice == 0.5 and not run.eval_batches.splice
  inputs, targets, weights = run.train_batches.batch(3)
  assert inputs.shape == targets.shape == weights.shape == (2, 32)
  assert run.window == 32 and run.eval_batches.batch(0)[0].shape == (2, 32)
  # Accumulation: two micro-batches of one 32-token window train.
  loop = trainer.train(settings, gin_bindings=MICRO, log=lambda line: None)
  assert loop.step == settings['steps']


def test_resume_needs_the_same_window(short_run, copy_of):
  out = copy_of(short_run['out'])
  loop = trainer.train(
    train_settings(out, window=32, steps=6, **{'eval-every': 100}),
    gin_bindings=MICRO,
    log=lambda line: None,
  )
  assert loop.step == 6
  before = sorted(os.listdir(out))
  with pytest.raises(UserError, match='trained on windows of 32 tokens'):
    trainer.train(train_settings(out, window=64, steps=8), gin_bindings=MICRO)
  with pytest.raises(UserError, match='trained on windows of 32 tokens'):
    trainer.train(train_settings(out, steps=8), gin_bindings=MICRO)
  assert sorted(os.listdir(out)) == before


@pytest.mark.parametrize(
  'window, match',
  [
    (256, 'longer than the model.s context'),
    (40, r'must be a multiple of (LSHSelfAttention|SelfAttention)\.chunk_len'),
  ],
)
def test_a_window_the_model_cannot_take_is_one_line(tmp_path, window, match):
  with pytest.raises(UserError, match=match) as e:
    trainer.train(
      train_settings(tmp_path / 'w', window=window), gin_bindings=MICRO
    )
  assert '\n' not in str(e.value)
  assert not os.path.exists(tmp_path / 'w')


def test_the_preflight_counts_the_window_not_the_context():
  setup = ginconf.parse(
    os.path.join(os.path.dirname(__file__), '..', 'gin', 'reformer_32k.gin')
  )
  whole = preflight.estimate(setup, 500, 1, 256)
  short = preflight.estimate(setup, 500, 1, 256, length=1024)
  assert short.activations < whole.activations / 16
  assert short.weights == whole.weights  # The same 32k model.
  assert preflight.step_flops(setup, 500, 1, 1024) < (
    preflight.step_flops(setup, 500, 1) / 16
  )


def test_a_fine_tune_trains_on_short_windows(exported, tmp_path):
  out = tmp_path / 'ft'
  loop = trainer.train(
    finetune_settings(str(out), exported['dir'], steps=1, window=32),
    log=lambda line: None,
  )
  assert loop.step == 1
  weights = jax.tree_util.tree_leaves(loop.model.weights)
  assert all(np.isfinite(np.asarray(w)).all() for w in weights)
