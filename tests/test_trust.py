"""A model folder or out-dir cannot run code: gin read as data. (A planted
data-counter pickle is tested in test_training.test_one_run_per_out_dir.)"""

import os
import re
import subprocess
import sys

import pytest

from src.config import safegin
from src.core.errors import UserError
from src.inference import decoding
from src.model import ginconf

from .conftest import ROOT

ATTACKS = {
  'import': (
    'from __gin__ import dynamic_registration\n'
    'import subprocess\n'
    "subprocess.getoutput.cmd = 'touch {mark}'\n"
    'ReformerLM.d_model = @subprocess.getoutput()\n',
    ':1: "from" is not allowed',
  ),
  'plain-import': ('import os\n', ':1: "import" is not allowed'),
  'include': ("include '{mark}.gin'\n", ':1: "include" is not allowed'),
  'call': (
    'ReformerLM.ff_activation = @trax.layers.Relu()\n',
    ':1: "@trax.layers.Relu()" calls code',
  ),
  'reference': (
    'ReformerLM.ff_activation = @trax.supervised.training.Loop\n',
    ':1: "@trax.supervised.training.Loop" is not allowed',
  ),
  'configurable': (
    '# A comment.\n\ntrax.data.TFDS.dataset_name = "x"\n',
    ':3: "trax.data.TFDS" is not a setting',
  ),
  'macro-use': ('ReformerLM.d_model = %WIDTH\n', ':1: macros'),
  'macro-def': ('WIDTH = 512\n', ':1: macros'),
  'scope': ('train/ReformerLM.d_model = 8\n', ':1: gin scopes'),
  'expression': (
    'ReformerLM.d_model = (lambda: 3)()\n',
    ':1: the value of "ReformerLM.d_model" is not a literal',
  ),
  'multi-line': (
    'ReformerLM.pos_axial_shape = (16,\n  32)\nimport os\n',
    ':3: "import" is not allowed',
  ),
}


@pytest.mark.parametrize('name', sorted(ATTACKS))
def test_gin_attacks_are_refused_before_gin_runs(name, tmp_path):
  mark = tmp_path / 'MARK'
  text, expected = ATTACKS[name]
  path = tmp_path / 'model.gin'
  path.write_text(text.format(mark=mark))
  with pytest.raises(UserError, match=re.escape(f'model.gin{expected}')):
    ginconf.parse(str(path))
  assert not mark.exists()


def test_shipped_and_saved_gin_files_are_accepted(tiny_run):
  for name in ('tiny.gin', 'reformer_32k.gin'):
    with open(os.path.join(ROOT, 'gin', name)) as f:
      safegin.check(f.read(), name)
  with open(os.path.join(tiny_run['out'], ginconf.MODEL_GIN)) as f:
    safegin.check(f.read(), 'model.gin')
  with pytest.raises(UserError, match='--bind:1: "import" is not allowed'):
    ginconf.parse(os.path.join(ROOT, 'gin', 'tiny.gin'), ('import os',))


def test_a_model_folder_with_a_code_running_gin_is_refused(tiny_run, copy_of):
  """The attack end to end: evaluate.py exits non-zero with one line, and
  the command in the planted model.gin never runs."""
  folder = copy_of(tiny_run['out'])
  mark = os.path.join(folder, 'PWNED')
  text = ATTACKS['import'][0].format(mark=mark)
  with open(os.path.join(folder, ginconf.MODEL_GIN), 'a') as f:
    f.write(text)
  with pytest.raises(UserError, match='is not allowed'):
    decoding.load_run(folder, 'eval')
  result = subprocess.run(
    [sys.executable, 'evaluate.py', '--model-dir', folder, '--prompt', 'hi'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode != 0
  assert 'is not allowed' in result.stderr
  assert 'Traceback' not in result.stderr
  assert not os.path.exists(mark)
