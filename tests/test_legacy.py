"""Run folders and exports made before the attention classes still resume,
chat and fine-tune.

Until then a model.gin named Trax's classes (`@SelfAttention`,
`@LSHSelfAttention`) and `lsh.directed = True`, and Jade V8 changed Trax's
classes in place; today gin/*.gin name `@LocalSelfAttention` and
`@DirectedLSHSelfAttention` (src/model/attention.py), and
`ginconf.translate_legacy` reads the old texts. tests/data/
model_before_classes.gin is the model.gin of a quick-start run (python
train.py --quickstart) made before the change.
"""

import os
import shutil

import pytest

from src.apps import chat
from src.inference import decoding, sampling
from src.model import ginconf
from src.storage import modelfolder
from src.training import trainer

from .conftest import (
  FINETUNE_GIN,
  MICRO,
  TINY_GIN,
  finetune_settings,
  reseal_export,
)

BEFORE = os.path.join(
  os.path.dirname(__file__), 'data', 'model_before_classes.gin'
)


def as_before(text: str) -> str:
  """A model.gin of today written as a run wrote it before the classes."""
  text = text.replace('@DirectedLSHSelfAttention', '@LSHSelfAttention')
  text = text.replace('@LocalSelfAttention', '@SelfAttention')
  header = '# Parameters for lsh:\n# ' + '=' * 78 + '\nlsh.directed = True\n\n'
  at = text.find('# Parameters for LSHSelfAttention:')
  return text[:at] + header + text[at:] if at >= 0 else text + '\n' + header


def test_a_model_gin_from_before_reads_as_todays_tiny_gin():
  """The old quick start's model.gin is, translated, exactly the model
  today's gin/tiny.gin gives with the same two bindings (training-only
  settings such as `reversible.kept_blocks` aside): a resume compares equal,
  and the layers are the directed LSH between two local blocks."""
  with open(BEFORE, encoding='utf-8') as f:
    old = f.read()
  assert 'lsh.directed = True' in old and '@LSHSelfAttention' in old
  translated = ginconf.translate_legacy(old)
  assert 'lsh' not in translated.replace('LSHSelfAttention', '')
  before = ginconf.parse_text(old, BEFORE)
  today = ginconf.parse(
    TINY_GIN, ('lr_schedule.peak = 0.004', 'lr_schedule.warmup_steps = 100')
  )
  same = {
    tuple(ginconf.resume_bindings(t))
    for t in (before.text, today.text, translated)
  }
  assert len(same) == 1
  assert before.directed and today.directed
  assert before.layer_attention == (
    'SelfAttention',
    'LSHSelfAttention',
    'SelfAttention',
  )
  # A text that never bound lsh.directed is left as it is.
  plain = 'ReformerLM.attention_type = @SelfAttention\n'
  assert ginconf.translate_legacy(plain) == plain
  undirected = plain.replace('@Self', '@LSHSelf') + 'lsh.directed = False\n'
  assert ginconf.translate_legacy(undirected) == (
    'ReformerLM.attention_type = @FastLSHSelfAttention\n'
  )


def test_an_old_run_resumes_and_its_export_chats_and_fine_tunes(
  tiny_run, exported, tmp_path
):
  run = str(tmp_path / 'run')
  shutil.copytree(tiny_run['out'], run)
  gin_path = os.path.join(run, 'model.gin')
  with open(gin_path, encoding='utf-8') as f:
    today = f.read()
  assert '@DirectedLSHSelfAttention' in today
  with open(gin_path, 'w', encoding='utf-8') as f:
    f.write(as_before(today))
  # The resume check: the old text is the same settings as tiny.gin's.
  setup = ginconf.parse(TINY_GIN, MICRO)
  ginconf.check_same_as_saved(setup, run)

  model = str(tmp_path / 'export')
  shutil.copytree(exported['dir'], model)
  with open(os.path.join(model, 'model.gin'), encoding='utf-8') as f:
    text = f.read()
  with open(os.path.join(model, 'model.gin'), 'w', encoding='utf-8') as f:
    f.write(as_before(text))
  reseal_export(model, 'model.gin')
  modelfolder.verify_export(model)

  decoder = decoding.Decoder.load(model)
  settings = sampling.SamplingSettings(max_new_tokens=4, seed=1)
  reply = chat.ChatSession(decoder, settings).reply('Hello!')
  assert isinstance(reply, str)

  out = str(tmp_path / 'ft')
  lines = []
  trainer.train(finetune_settings(out, model, steps=1), log=lines.append)
  assert os.path.isfile(os.path.join(out, 'model.gin'))
  with open(os.path.join(out, 'model.gin'), encoding='utf-8') as f:
    assert '@DirectedLSHSelfAttention' in f.read()


@pytest.mark.parametrize('value', ['True', 'False'])
def test_translation_is_one_place_for_every_gin_text(value):
  """Old-style bindings given with --bind are read the same way."""
  setup = ginconf.parse(
    TINY_GIN,
    (
      'ReformerLM.attention_type = '
      '[@SelfAttention, @LSHSelfAttention, @SelfAttention]',
      f'lsh.directed = {value}',
    ),
  )
  assert setup.directed == (value == 'True')


def test_the_last_lsh_directed_decides_for_every_text():
  """`lsh.directed` was one setting for the whole config: a binding given
  after a base text that bound it otherwise decides for the base's
  attention classes too."""
  with open(BEFORE, encoding='utf-8') as f:
    base = f.read()
  assert 'lsh.directed = True' in base and '@LSHSelfAttention' in base
  undirected = ginconf.parse(
    FINETUNE_GIN, ('lsh.directed = False',), base=(base, BEFORE)
  )
  assert not undirected.directed
  assert ginconf.parse(FINETUNE_GIN, base=(base, BEFORE)).directed
