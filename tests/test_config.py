"""Config strictness, and every bad input: one line, exit 2, out-dir kept."""

import glob
import hashlib
import json
import os

import pytest

import train
from src.apps.cli import run_main
from src.config import jsonconfig
from src.core.errors import UserError

from .conftest import DATA, MICRO, ROOT, TINY_GIN, train_settings

S, E = '|aigenerationstart|', '|endofgeneration|'


def write_config(tmp_path, train_section, name='config.json', raw=None):
  p = tmp_path / name
  p.write_text(
    raw if raw is not None else json.dumps({'train': train_section}),
    encoding='utf-8',
  )
  return str(p)


def test_values_convert_to_the_defaults_type(tmp_path):
  path = write_config(
    tmp_path, {'steps': 10.0, 'eval-fraction': 0, 'tpu-ip': None}
  )
  s = jsonconfig.read_section(
    path, 'train', {'seed': '7', 'collapse-repeats': 'true'}
  )
  assert s['steps'] == 10 and isinstance(s['steps'], int)
  assert s['eval-fraction'] == 0.0 and isinstance(s['eval-fraction'], float)
  assert s['seed'] == 7 and s['collapse-repeats'] is True
  assert s['out-dir'] == 'train'  # Defaults fill the rest.


@pytest.mark.parametrize(
  'section, raw, expected',
  [
    ({'stpes': 5}, None, 'unknown key "train.stpes"; did you mean "steps"?'),
    ({'steps': 'many'}, None, "train.steps: 'many' is not an integer"),
    ({'steps': True}, None, 'train.steps: true is not an integer'),
    ({'collapse-repeats': 'x'}, None, "'x' is not true or false"),
    ({'data': 3}, None, 'train.data: 3 is not a string'),
    (None, '{"train": {"steps": 5,}}', 'config.json:1:23: not valid JSON'),
    (None, '[1, 2]', 'the top level must be an object'),
    (None, '{"trian": {}}', "unknown section 'trian'"),
  ],
)
def test_config_errors_name_file_and_key(tmp_path, section, raw, expected):
  path = write_config(tmp_path, section, raw=raw)
  with pytest.raises(UserError) as info:
    jsonconfig.read_section(path, 'train', {})
  assert expected in str(info.value)
  assert str(info.value).startswith(path)


def test_command_line_override_type_error():
  with pytest.raises(UserError, match="--steps: 'ten' is not an integer"):
    jsonconfig.from_values('train', {})
    jsonconfig.read_section(None, 'train', {'steps': 'ten'})


def test_missing_config_file_is_an_error_only_when_named(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert jsonconfig.read_section(None, 'train', {})['steps'] == 20000
  with pytest.raises(
    UserError, match='no such config file; copy config.EXAMPLE.json'
  ):
    jsonconfig.read_section(str(tmp_path / 'nope.json'), 'train', {})


def test_example_config_has_every_key():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'config.EXAMPLE.json')) as f:
    example = json.load(f)
  assert set(example['train']) == set(jsonconfig.TRAIN_KEYS)
  assert set(example['eval']) == set(jsonconfig.EVAL_KEYS)
  for section in ('train', 'eval'):
    jsonconfig.read_section(
      os.path.join(root, 'config.EXAMPLE.json'), section, {}
    )


def snapshot(folder):
  """Every file's relative path, size and content hash."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      p = os.path.join(root, name)
      with open(p, 'rb') as f:
        out[os.path.relpath(p, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


def bad_gin(tmp_path):
  text = (
    open(TINY_GIN).read().replace('ReformerLM.n_heads', 'ReformerLM.n_head')
  )
  p = tmp_path / 'typo.gin'
  p.write_text(text)
  return str(p)


def bad_data(tmp_path):
  d = tmp_path / 'bad_data'
  d.mkdir()
  (d / 'a.txt').write_text(f'hello\n{S} hi there\n', encoding='utf-8')
  return str(d)


@pytest.mark.parametrize(
  'case',
  [
    'missing-config',
    'malformed-config',
    'unknown-key',
    'wrong-type',
    'missing-data',
    'broken-data',
    'gin-typo',
    'other-gin-than-saved',
  ],
)
def test_bad_input_one_line_nonzero_exit_out_dir_untouched(
  case, tiny_run, copy_of, tmp_path, capsys
):
  out = copy_of(tiny_run['out'])
  before = snapshot(out)
  base = {
    'out-dir': out,
    'data': DATA,
    'gin': TINY_GIN,
    'steps': 100,
    'vocab-size': 300,
  }
  args = []
  if case == 'missing-config':
    args = ['--config', str(tmp_path / 'config.json')]
    expected = 'no such config file'
  elif case == 'malformed-config':
    args = ['--config', write_config(tmp_path, None, raw='{"train": {')]
    expected = 'not valid JSON'
  elif case == 'unknown-key':
    args = ['--config', write_config(tmp_path, {**base, 'out_dir': 'x'})]
    expected = 'unknown key "train.out_dir"; did you mean "out-dir"?'
  elif case == 'wrong-type':
    args = ['--config', write_config(tmp_path, {**base, 'steps': '10k'})]
    expected = "train.steps: '10k' is not an integer"
  elif case == 'missing-data':
    args = ['--config', write_config(tmp_path, {**base, 'data': 'nodata'})]
    expected = "data 'nodata': no such file or folder"
  elif case == 'broken-data':
    args = [
      '--config',
      write_config(tmp_path, {**base, 'data': bad_data(tmp_path)}),
    ]
    expected = 'a.txt:2: "|aigenerationstart|" has no "|endofgeneration|"'
  elif case == 'gin-typo':
    args = [
      '--config',
      write_config(tmp_path, {**base, 'gin': bad_gin(tmp_path)}),
    ]
    line = [
      i
      for i, t in enumerate(open(TINY_GIN), 1)
      if t.startswith('ReformerLM.n_heads')
    ][0]
    expected = (
      f"typo.gin:{line}: Configurable 'ReformerLM' doesn't have a "
      "parameter named 'n_head'; check the spelling"
    )
  else:
    args = ['--config', write_config(tmp_path, base)]
    expected = 'this run was trained with other model settings'
  if case != 'other-gin-than-saved':
    for b in MICRO:
      args += ['--bind', b]
  capsys.readouterr()
  code = run_main(lambda: train.main(args))
  captured = capsys.readouterr()
  err_lines = captured.err.strip().splitlines()
  assert code == 2
  assert len(err_lines) == 1, captured.err
  assert err_lines[0].startswith('error: ')
  assert expected in err_lines[0]
  assert snapshot(out) == before


def test_config_structure_errors(tmp_path):
  path = tmp_path / 'c.json'
  path.write_text('{"eval": {"model-dir": "x"}}')
  with pytest.raises(UserError, match='no "train" section'):
    jsonconfig.read_section(str(path), 'train', {})
  assert jsonconfig.read_section(str(path), 'eval', {})['model-dir'] == 'x'
  path.write_text('{"train": {"steps": 1, "steps": 2}}')
  with pytest.raises(UserError, match='"steps" is given twice'):
    jsonconfig.read_section(str(path), 'train', {})


def test_empty_gin_seed_and_tokenizer_damage(tmp_path, tiny_run, copy_of):
  from src.data import tokenizer
  from src.model import ginconf
  from src.training import plan

  empty = tmp_path / 'empty.gin'
  empty.write_text('# nothing\n')
  with pytest.raises(UserError, match='binds no ReformerLM settings'):
    ginconf.parse(str(empty))
  with pytest.raises(UserError, match='train.seed -1 must be between'):
    plan.prepare(train_settings(tmp_path / 'o', seed=-1))
  with pytest.raises(UserError, match='train.splice 1.5 must be between'):
    plan.prepare(train_settings(tmp_path / 'o', splice=1.5))
  assert not (tmp_path / 'o').exists()
  missing = {'eval-data': str(tmp_path / 'nope')}
  with pytest.raises(UserError, match="eval-data '.*nope': no such"):
    plan.prepare(train_settings(tmp_path / 'o', **missing))
  assert not (tmp_path / 'o').exists()
  folder = copy_of(tiny_run['out'])
  with open(os.path.join(folder, tokenizer.MODEL_FILE), 'wb') as f:
    f.write(b'not a model')
  with pytest.raises(UserError, match='tokenizer.model: damaged'):
    tokenizer.load(folder)
  os.remove(os.path.join(folder, tokenizer.INFO_FILE))
  with pytest.raises(UserError, match='tokenizer.json: missing'):
    tokenizer.load(folder)


def test_every_preset_reads_strictly_and_its_model_parses():
  """Each preset is read as train.py reads it; a preset that trains from
  scratch names a gin file whose model parses with its bindings."""
  from src.model import ginconf

  presets = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.json')))
  assert len(presets) >= 8
  for path in presets:
    s = jsonconfig.read_section(path, 'train', {})
    jsonconfig.read_section(path, 'eval', {})
    gin = os.path.join(ROOT, s['gin'])
    assert os.path.isfile(gin), path
    if not s['init-from']:
      ginconf.parse(gin, tuple(s['gin-bindings']))


def test_the_long_recipe_presets_chain():
  """README's long-conversation block: each run fine-tunes the one before
  on the same data and practice, and the last is the one it chats with."""
  from bench.long_recall import RECIPE  # The README's presets, in order.

  sections = [
    jsonconfig.read_section(os.path.join(ROOT, path), 'train', {})
    for path in RECIPE
  ]
  assert not sections[0]['init-from']
  for before, after in zip(sections, sections[1:]):
    assert after['init-from'] == before['out-dir']
    assert after['window'] >= before['window']
  shared = {(s['data'], s['replay'], s['replay-share']) for s in sections}
  assert len(shared) == 1
  assert sections[0]['replay'] and sections[0]['replay-share'] == 0.5
  last = os.path.join(ROOT, RECIPE[-1])
  assert jsonconfig.read_section(last, 'eval', {})['model-dir'] == 'runs/long'
  assert sections[-1]['out-dir'] == 'runs/long'
  readme = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read()
  for path in RECIPE:
    assert f'python train.py --config {path} --data' in readme
