"""Shared fixtures: sample data, a tokenizer trained here, one tiny run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from src import runtime  # noqa: E402

runtime.bootstrap()  # XLA flags, quiet logs, Trax patches: once, first.

from src.config import jsonconfig  # noqa: E402
from src.data import chatformat, tokenizer  # noqa: E402

DATA = os.path.join(ROOT, 'data', 'examples')
TINY_GIN = os.path.join(ROOT, 'gin', 'tiny.gin')
# Binds the tiny model even smaller so each step is a few milliseconds.
MICRO = (
  'ReformerLM.max_len = 128',
  'ReformerLM.pos_axial_shape = (8, 16)',
  'ReformerLM.d_model = 32',
  'ReformerLM.d_ff = 64',
  'ReformerLM.pos_d_axial_embs = (16, 16)',
  'LSHSelfAttention.chunk_len = 16',
  'LSHSelfAttention.n_buckets = 8',
  # One hash round (tiny.gin: 2) halves the LSH block's cost in the many
  # short runs; 2 rounds are trained by test_model's copy tests and
  # decoded by test_attention.
  'LSHSelfAttention.n_hashes = 1',
  'LSHSelfAttention.predict_mem_len = 128',
  'LSHSelfAttention.predict_drop_len = 32',
  'SelfAttention.predict_mem_len = 128',
  'SelfAttention.predict_drop_len = 32',
  'lr_schedule.warmup_steps = 2',
  # Random feed-forward outputs, as Trax starts them: the short shared runs
  # are compared token by token (decoder vs forward), which needs every
  # branch to add something. The shipped zero start: test_model.
  'residual.zero_feed_forward = False',
)

# LSH attention made exact for MICRO's 128-token window: two chunks of 64
# and the chunk before, one hash round, so every earlier position is in
# view whatever the hashing (with 2 rounds a chunk sees only a part).
EXACT_LSH = (
  'LSHSelfAttention.chunk_len = 64',
  'LSHSelfAttention.n_buckets = 2',
  'LSHSelfAttention.n_hashes = 1',
)


def micro_args(out, steps):
  """`train.py` arguments for the sample data and the MICRO model."""
  args = [
    'train.py',
    '--data',
    DATA,
    '--gin',
    TINY_GIN,
    '--out-dir',
    out,
    '--steps',
    str(steps),
    '--vocab-size',
    '300',
    '--eval-batches',
    '1',
  ]
  for b in MICRO:
    args += ['--bind', b]
  return args


def train_settings(out_dir, **overrides):
  """A `train` Section for the sample data and tiny gin, with overrides."""
  values = {
    'out-dir': str(out_dir),
    'data': DATA,
    'gin': TINY_GIN,
    'steps': 4,
    'eval-every': 2,
    'checkpoint-every': 2,
    'eval-batches': 1,
    'vocab-size': 300,
    'sample-prompts': [],  # Sampling during training: tested on tiny_run.
  }
  values.update(overrides)
  return jsonconfig.from_values('train', values)


@pytest.fixture(scope='session')
def conversations():
  return chatformat.read_data(DATA)


@pytest.fixture(scope='session')
def trained_tokenizer(conversations, tmp_path_factory):
  out = tmp_path_factory.mktemp('tok')
  return tokenizer.load_or_train(
    str(out), conversations, 300, chatformat.Markers()
  )


@pytest.fixture(scope='session')
def tiny_run(tmp_path_factory):
  """One short training run shared by the tests that read its outputs."""
  from src.training import trainer

  out = tmp_path_factory.mktemp('run') / 'out'
  lines = []
  settings = train_settings(
    out, **{'log-every': 2, 'sample-prompts': ['Hello!', 'Who | are you?']}
  )
  loop = trainer.train(settings, gin_bindings=MICRO, log=lines.append)
  return {'out': str(out), 'loop': loop, 'log': lines}


@pytest.fixture
def copy_of(tmp_path):
  def copy(src_dir):
    dst = tmp_path / 'copy'
    shutil.copytree(src_dir, dst)
    return str(dst)

  return copy


FINETUNE_GIN = os.path.join(ROOT, 'gin', 'finetune.gin')


def finetune_settings(out, source, **kw):
  values = {'init-from': source, 'gin': FINETUNE_GIN, 'steps': 2}
  values.update(kw)
  return train_settings(out, **values)


@pytest.fixture(scope='session')
def exported(tiny_run, tmp_path_factory):
  """A weights-only export of the shared tiny run."""
  from src.storage import export

  out = str(tmp_path_factory.mktemp('export') / 'model')
  lines = []
  info = export.export(tiny_run['out'], out, log=lines.append)
  return {'dir': out, 'info': info, 'log': lines}


def reseal_export(folder, name):
  """Updates export.json's entry of `name` to the file as it is now (a
  crafted export that is consistent with its own listing, so what reads
  behind the checksum is reached). A listing that is not an object, or
  lacks `name`, is left as it is."""
  import hashlib
  import json

  path = os.path.join(folder, 'export.json')
  with open(path) as f:
    meta = json.load(f)
  if isinstance(meta.get('files'), dict) and name in meta['files']:
    with open(os.path.join(folder, name), 'rb') as f:
      data = f.read()
    meta['files'][name] = {
      'size': len(data),
      'sha256': hashlib.sha256(data).hexdigest(),
    }
    with open(path, 'w') as f:
      json.dump(meta, f)


def json_values(scalar, max_leaves=8, list_size=3, key_size=8):
  """A hypothesis strategy: JSON-like values made of `scalar` (lists and
  objects of them, nested), for fuzzing what reads untrusted JSON."""
  from hypothesis import strategies as st

  return st.recursive(
    scalar,
    lambda inner: (
      st.lists(inner, max_size=list_size)
      | st.dictionaries(st.text(max_size=key_size), inner, max_size=3)
    ),
    max_leaves=max_leaves,
  )


def run_script(args, env=None, **kwargs):
  """`python ARGS` in the repository root, `env` over this environment;
  its output captured as text."""
  env = {**os.environ, **(env or {})}
  return subprocess.run(
    [sys.executable, *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    **kwargs,
  )


@pytest.fixture
def safe_dir():
  """A folder under the home folder (the test's own, 0700): /tmp, where
  pytest's folders are, is writable by everyone, so no cache goes there."""
  import tempfile

  from src.runtime import compile_cache

  home = os.path.expanduser('~')
  try:
    os.close(compile_cache.open_chain(home, []))
  except compile_cache.Unsafe as e:
    pytest.skip(f'the home folder is not private here ({e})')
  folder = tempfile.mkdtemp(dir=home, prefix='.jade-cache-test-')
  yield folder
  shutil.rmtree(folder, ignore_errors=True)


def assert_chat_reads_as_eval(out, flat, ids, whole):
  """The chat's decoder of run `out` (its predict model with the weights
  `flat`, context 128), fed `ids` token by token and then as blocks,
  gives the eval forward pass's `whole` (`[1, 128, vocab]`): the rows
  after each token, and the last row of the block."""
  import numpy as np
  import trax

  from src.inference import decoding
  from src.model import ginconf
  from src.storage import checkpoints

  predict = ginconf.model(whole.shape[-1], 'predict')
  one = trax.shapes.ShapeDtype((1, 1), np.int32)
  checkpoints.set_weights(str(out), predict, one, flat)
  d = decoding.Decoder(predict, 128)
  d.block = 10**9  # Token by token.
  by_token = [d.feed(ids[:1])] + [d.feed([t]) for t in ids[1:]]
  n = len(ids)
  np.testing.assert_allclose(
    np.stack(by_token), whole[0, 1 : n + 1], atol=2e-4, rtol=1e-4
  )
  d.reset()
  d.block = 16
  block = d.feed(ids)  # Blocks: the body, then the head on the last row.
  np.testing.assert_allclose(block, whole[0, n], atol=2e-4, rtol=1e-4)
