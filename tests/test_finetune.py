"""Fine-tuning (init-from) and the weights-only export."""

import hashlib
import json
import os
import pickle
import re
import shutil

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from src.core import safe_pickle
from src.core.errors import UserError
from src.data import chatformat, tokenizer
from src.inference import decoding
from src.storage import export, modelfolder, snapshots
from src.training import finetune, trainer

from .conftest import (
  DATA,
  MICRO,
  ROOT,
  finetune_settings,
  reseal_export,
  train_settings,
)


def flat_weights(layer):
  return [np.asarray(w) for w in jax.tree_util.tree_leaves(layer.weights)]


@pytest.fixture(scope='module')
def finetuned(exported, tmp_path_factory):
  """A fine-tune run from the export with learning rate 0 and replay:
  after its one step the weights must still be the export's."""
  out = str(tmp_path_factory.mktemp('ft') / 'out')
  lines = []
  settings = finetune_settings(
    out, exported['dir'], steps=1, **{'vocab-size': 500}
  )
  # vocab-size 500 was given explicitly and differs: refused first.
  with pytest.raises(UserError, match=r'train.vocab-size is 500 but the'):
    trainer.train(settings, log=lines.append)
  assert not os.path.exists(out)
  settings = finetune_settings(
    out, exported['dir'], steps=1, replay=os.path.join(ROOT, 'data', 'persona')
  )
  settings = settings.__class__(
    {**settings.values}, settings.source, settings.given - {'vocab-size'}
  )
  loop = trainer.train(
    settings, gin_bindings=('lr_schedule.peak = 0.0',), log=lines.append
  )
  return {'out': out, 'loop': loop, 'log': lines}


def test_export_holds_weights_only_and_reports_its_size(exported, tiny_run):
  names = set(os.listdir(exported['dir']))
  assert names == {
    'model.safetensors',
    'tokenizer.model',
    'tokenizer.json',
    'model.gin',
    'export.json',
    'README.md',
    'curves.json',
    'loss.png',
  }
  info = json.load(open(os.path.join(exported['dir'], 'export.json')))
  assert info['step'] == 4 and info['context_length'] == 128
  assert info['vocab_size'] == 300 and info['n_arrays'] > 10
  assert info['held_out_loss'] > 0 and info['tokens_trained_on'] > 0
  assert info['versions']['trax'] == '1.4.1'
  gin_text = open(os.path.join(exported['dir'], 'model.gin')).read()
  assert 'ReformerLM.d_model = 32' in gin_text and 'Adam' not in gin_text
  assert (
    'python evaluate.py --model-dir'
    in open(os.path.join(exported['dir'], 'README.md')).read()
  )
  size_line, data_line = exported['log']
  assert 'MB (the checkpoint is' in size_line
  assert 'trained on:' in data_line and 'no path' in data_line
  size = os.path.getsize(os.path.join(exported['dir'], 'model.safetensors'))
  slots = os.path.getsize(
    os.path.join(tiny_run['out'], 'model.opt_slots0.npy.gz')
  )
  assert size < slots  # No optimizer slots (twice the weights) inside.
  with pytest.raises(UserError, match='exists; choose a new folder'):
    export.export(tiny_run['out'], exported['dir'])
  with pytest.raises(UserError, match='no intact checkpoint of step 3'):
    export.export(tiny_run['out'], exported['dir'] + '-x', step=3)


def test_export_gives_the_runs_logits_without_unpickling(
  exported, tiny_run, monkeypatch
):
  tokens = np.arange(128, dtype=np.int32).reshape(1, 128) % 300
  _, _, run_model, run_step = decoding.load_run(tiny_run['out'], 'eval')
  run_logits = np.asarray(run_model(tokens))

  def no_pickle(*args, **kwargs):
    raise AssertionError('pickle used while loading an export')

  for name in ('load', 'loads', 'Unpickler'):
    monkeypatch.setattr(pickle, name, no_pickle)
  monkeypatch.setattr(safe_pickle, 'SafeUnpickler', no_pickle)
  monkeypatch.setattr(snapshots, 'read_pickle', no_pickle)
  _, _, exp_model, exp_step = decoding.load_run(exported['dir'], 'eval')
  exp_logits = np.asarray(exp_model(tokens))
  monkeypatch.undo()
  assert exp_step == run_step == 4
  np.testing.assert_array_equal(exp_logits, run_logits)


def test_damaged_export_is_refused(exported, tmp_path):
  bad = tmp_path / 'bad'
  shutil.copytree(exported['dir'], bad)
  weights = bad / 'model.safetensors'
  data = weights.read_bytes()
  weights.write_bytes(data[: len(data) // 2])
  with pytest.raises(UserError, match='damaged or truncated'):
    decoding.load_run(str(bad), 'eval')
  with pytest.raises(UserError, match='damaged or truncated'):
    trainer.train(finetune_settings(tmp_path / 'ft', str(bad)))
  assert not os.path.exists(tmp_path / 'ft')
  weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
  with pytest.raises(UserError, match='damaged or truncated'):
    decoding.load_run(str(bad), 'eval')


def test_finetune_takes_tokenizer_settings_and_weights(
  finetuned, exported, tiny_run
):
  out = finetuned['out']
  for name in ('tokenizer.model',):
    assert (
      open(os.path.join(out, name), 'rb').read()
      == open(os.path.join(tiny_run['out'], name), 'rb').read()
    )
  saved = open(os.path.join(out, 'model.gin')).read()
  assert 'ReformerLM.d_model = 32' in saved  # From the pretrained model.
  assert 'lr_schedule.warmup_steps = 50' in saved  # From finetune.gin.
  record = json.load(open(os.path.join(out, 'init.json')))
  assert record['path'] == os.path.abspath(exported['dir'])
  assert record['step'] == 4 and record['kind'] == 'export'
  assert record['weights_sha256'] == exported['info']['weights_sha256']
  log = '\n'.join(finetuned['log'])
  assert f'fine-tuned from {exported["dir"]} (export, step 4' in log
  assert 'unknown pieces: 0.00% of the tokens' in log
  assert 'replay: ' in log and '(40 conversations,' in log
  assert 'of it at random (50% of the epoch' in log
  # The step count and the optimizer start fresh; with learning rate 0
  # the one step left the pretrained weights as they were.
  loop = finetuned['loop']
  assert loop.step == 1 and snapshots.latest_step(out) == 1
  source, _ = modelfolder.read_weights(exported['dir'])
  mine = flat_weights(loop.model)
  assert len(mine) == len(source)
  for a, b in zip(mine, source):
    np.testing.assert_array_equal(a, b)
  acc = event_accumulator.EventAccumulator(os.path.join(out, 'train'))
  acc.Reload()
  assert 'init_from' in acc.Tags()['tensors']
  text = acc.Tensors('init_from')[0].tensor_proto.string_val[0]
  assert b'fine-tuned from' in text and b'step 4' in text


@pytest.mark.slow
def test_finetune_run_resumes_from_its_own_checkpoint(finetuned, copy_of):
  out = copy_of(finetuned['out'])
  lines = []
  settings = finetune_settings(out, '/nowhere/gone', steps=2)
  settings = settings.__class__(
    settings.values, settings.source, settings.given - {'vocab-size'}
  )
  loop = trainer.train(
    settings, gin_bindings=('lr_schedule.peak = 0.0',), log=lines.append
  )
  assert loop.step == 2
  log = '\n'.join(lines)
  assert 'resuming from the checkpoint at step 1' in log
  assert 'resuming from its own checkpoint' in log
  assert 'fine-tuned from' not in log


@pytest.mark.parametrize(
  'case', ['missing', 'no-checkpoint', 'settings', 'tokenizer', 'scratch']
)
def test_init_from_refusals(case, tiny_run, exported, tmp_path):
  source = exported['dir']
  bindings = ()
  out = tmp_path / 'ft'
  if case == 'missing':
    source, match = str(tmp_path / 'nope'), 'no such folder'
  elif case == 'no-checkpoint':
    os.makedirs(tmp_path / 'empty')
    source, match = str(tmp_path / 'empty'), 'no checkpoint in that folder'
  elif case == 'settings':
    bindings, match = ('ReformerLM.d_ff = 128',), r'sets ReformerLM.d_ff = 128'
  elif case == 'tokenizer':
    source = str(tmp_path / 'other')
    shutil.copytree(exported['dir'], source)
    info = json.load(open(os.path.join(source, 'export.json')))
    # A tokenizer of another size than the weights' embedding.
    markers = chatformat.Markers()
    proto = tokenizer.train(chatformat.read_data(DATA), 200, markers)
    tok = tokenizer.Tokenizer(proto, markers)
    tok.unsaved = (200, 'x')
    tokenizer.save(source, tok)
    assert info['vocab_size'] == 300
    # Signed as if exported so: the checksums alone would refuse it.
    for name in ('tokenizer.model', 'tokenizer.json'):
      data = open(os.path.join(source, name), 'rb').read()
      info['files'][name] = {
        'size': len(data),
        'sha256': hashlib.sha256(data).hexdigest(),
      }
    with open(os.path.join(source, 'export.json'), 'w') as f:
      json.dump(info, f)
    match = r'tokenizer has \d+ pieces but the weights. embedding has 300'
  else:  # A run from scratch cannot become a fine-tune run.
    out = tmp_path / 'scratch'
    shutil.copytree(tiny_run['out'], out)
    match = 'already holds a run trained from scratch'
  before = sorted(os.listdir(out)) if os.path.exists(out) else None
  settings = finetune_settings(out, source)
  settings = settings.__class__(
    settings.values, settings.source, settings.given - {'vocab-size'}
  )
  with pytest.raises(UserError, match=match):
    trainer.train(settings, gin_bindings=bindings, log=lambda line: None)
  after = sorted(os.listdir(out)) if os.path.exists(out) else None
  assert after == before


def test_a_finetune_may_read_the_attention_otherwise(exported, tmp_path):
  """How the attention reads (`finetune.READING`: chunks, hash rounds,
  buckets) may change in a fine-tune, as a curriculum reads longer windows
  with longer chunks: the run says so, trains, and its model.gin keeps the
  new reading (the chat reads it so); the weights' settings may not. How
  many slices are computed at once (`n_parallel_heads`) may differ too,
  unsaid: the same function."""
  out = str(tmp_path / 'ft')
  settings = finetune_settings(out, exported['dir'], steps=1)
  settings = settings.__class__(
    settings.values, settings.source, settings.given - {'vocab-size'}
  )
  lines = []
  wider = ('LSHSelfAttention.chunk_len = 32', 'LSHSelfAttention.n_hashes = 2')
  at_once = ('LSHSelfAttention.n_parallel_heads = 4',)
  loop = trainer.train(settings, gin_bindings=wider + at_once, log=lines.append)
  assert loop.step == 1
  said = [line for line in lines if 'reads its attention otherwise' in line]
  assert said == [
    'reads its attention otherwise than the pretrained model (same '
    'weights): LSHSelfAttention.chunk_len 16 -> 32, '
    'LSHSelfAttention.n_hashes 1 -> 2'
  ]
  saved = open(os.path.join(out, 'model.gin')).read()
  assert 'LSHSelfAttention.chunk_len = 32' in saved
  assert 'LSHSelfAttention.n_hashes = 2' in saved
  decoder = decoding.Decoder.load(out)
  assert decoder.block == 32 and np.isfinite(decoder.feed([5, 6])).all()


GROWN = (
  'ReformerLM.n_layers = 4',
  'ReformerLM.attention_type = [@SmearedLocalSelfAttention, '
  '@SmearedDirectedLSHSelfAttention]',
)


def test_a_finetune_grows_smeared_lsh_into_context_lsh(tmp_path):
  """A model trained with `SmearedDirectedLSHSelfAttention` fine-tunes as
  `ContextLSHSelfAttention` (bound in its place): the trained weights, the
  two new projections of each grown block (blocks 1 and 3: the list
  cycles) at zero, the same function at its first step; the run says so.
  Another change of class is refused as any model setting is."""
  source, out = str(tmp_path / 'src'), str(tmp_path / 'ft')
  trainer.train(
    train_settings(source, steps=1), MICRO + GROWN, log=lambda line: None
  )
  settings = finetune_settings(out, source, steps=1)
  settings = settings.__class__(
    settings.values, settings.source, settings.given - {'vocab-size'}
  )
  context = GROWN[1].replace('@SmearedDirected', '@Context')
  wrong = (
    GROWN[1]
    .replace('@SmearedLocal', '@ContextLSH')
    .replace('LocalSelfAttention', 'SelfAttention')
  )
  with pytest.raises(UserError, match=r'sets ReformerLM.attention_type'):
    trainer.train(settings, MICRO + (GROWN[0], wrong), log=lambda x: None)
  lines = []
  bindings = (*MICRO, GROWN[0], context, 'lr_schedule.peak = 0.0')
  loop = trainer.train(settings, bindings, log=lines.append)
  said = [line for line in lines if line.startswith('grows')]
  assert said == [
    'grows the pretrained model (its weights, the new ones at zero): '
    'SmearedDirectedLSHSelfAttention -> ContextLSHSelfAttention'
  ]
  before = modelfolder.read_weights(source)[0]
  after = flat_weights(loop.model)
  assert len(after) == len(before) + 4
  zeros = [i for i, w in enumerate(after) if not np.any(w)]
  kept = [w for i, w in enumerate(after) if i not in zeros]
  assert len(zeros) == 4 and len(kept) == len(before)
  assert all(np.array_equal(a, b) for a, b in zip(kept, before))
  tokens = [5, 6, 7, 8, 9, 10, 11]
  grown_logits = decoding.Decoder.load(out).feed(tokens)
  np.testing.assert_allclose(
    grown_logits, decoding.Decoder.load(source).feed(tokens), atol=2e-5
  )
  assert (
    'ContextLSHSelfAttention' in open(os.path.join(out, 'model.gin')).read()
  )


def test_a_finetune_grows_the_output_layer_into_a_tied_one(tmp_path):
  """`output_layer.tied = True` on a model trained without it: the trained
  weights, the copy map at zero (the same function at the first step),
  said in one line; its model.gin keeps it, and a tuned tied model then
  scores through it. Another change of the output layer (the halves, or
  tied 'only', which has no kernel to grow from) is refused."""
  source, out = str(tmp_path / 'src'), str(tmp_path / 'ft')
  trainer.train(train_settings(source, steps=1), MICRO, log=lambda x: None)
  settings = finetune_settings(out, source, steps=1)
  settings = settings.__class__(
    settings.values, settings.source, settings.given - {'vocab-size'}
  )
  mean = "output_layer.halves = 'mean'"
  only = "output_layer.tied = 'only'"  # No kernel of its own to grow from.
  for binding in (mean, only):
    with pytest.raises(UserError, match=r'sets output_layer .*remove the'):
      trainer.train(settings, (*MICRO, binding), log=lambda x: None)
  lines = []
  bindings = (*MICRO, 'output_layer.tied = True', 'lr_schedule.peak = 0.0')
  loop = trainer.train(settings, bindings, log=lines.append)
  assert [line for line in lines if line.startswith('grows')] == [
    'grows the pretrained model (its weights, the new ones at zero): '
    'output layer -> tied (output_layer.tied)'
  ]
  before = modelfolder.read_weights(source)[0]
  after = flat_weights(loop.model)
  assert len(after) == len(before) + 1 and not np.any(after[-1])
  assert after[-1].shape == (64, 32)  # Both halves x d_model.
  assert all(np.array_equal(a, b) for a, b in zip(after, before))
  tokens = [5, 6, 7, 8, 9, 10, 11]
  np.testing.assert_allclose(
    decoding.Decoder.load(out).feed(tokens),
    decoding.Decoder.load(source).feed(tokens),
    atol=2e-5,
  )
  assert 'output_layer.tied = True' in open(f'{out}/model.gin').read()


def test_unknown_pieces_are_counted():
  assert finetune.unknown_share(np.array([5, 2, 2, 7])) == 0.5
  assert finetune.unknown_share(np.array([], np.int32)) == 0.0


def test_set_weights_names_a_shape_mismatch(exported):
  flat, _ = modelfolder.read_weights(exported['dir'])
  flat[0] = flat[0][:-1]
  setup = finetune.load(exported['dir']).setup  # Parses its model.gin.
  with pytest.raises(UserError, match=r'weight array 0 has shape \(299, 32\)'):
    finetune.check_shapes('x', setup, 300, flat)


# ---- The curves of an export (issue 44).


def test_export_carries_curves_a_picture_and_front_matter(exported):
  from src.storage import curves

  folder = exported['dir']
  scalars = curves.read(os.path.join(folder, 'curves.json'))
  assert 'run' not in scalars  # No folder name travels (issue 56).
  assert scalars['eval']['metrics/loss'][-1][0] == 4  # Held-out, by step.
  assert scalars['train']['training/learning_rate']
  assert not any('sample' in tag for tag in scalars['train'])  # No texts.
  png = open(os.path.join(folder, 'loss.png'), 'rb').read()
  assert png.startswith(b'\x89PNG\r\n\x1a\n') and len(png) > 5000
  card = open(os.path.join(folder, 'README.md')).read()
  head, front, body = card.split('---\n', 2)
  assert head == '' and 'library_name: jade-v8' in front
  assert 'context_length: 128' in front and '- reformer' in front
  assert '![Training and held-out loss by step](loss.png)' in body
  assert '| held-out loss | ' in body
  listed = json.load(open(os.path.join(folder, 'export.json')))['files']
  assert {'curves.json', 'loss.png'} <= set(listed)


def test_card_front_matter_escapes_what_the_user_named():
  text = export.front_matter(
    {
      'context_length': 512,
      'datasets': ['mine\n---\nlicense: evil', 'a "b"'],
      'license': 'mit',
      'base_model': 'x: y',
    }
  )
  lines = text.splitlines()
  assert lines[0] == lines[-1] == '---' and lines.count('---') == 2
  assert '- "mine --- license: evil"' in lines and '- "a \\"b\\""' in lines
  assert 'base_model: "x: y"' in lines and 'license: "mit"' in lines


def test_finetuned_run_shows_the_pretrained_curves_beside_its_own(
  finetuned, exported
):
  folder = os.path.join(finetuned['out'], 'pretrained-model')
  assert any(
    'curves of model (the pretrained run)' in x for x in finetuned['log']
  )
  for part, tag in (
    ('train', 'training/learning_rate'),
    ('eval', 'metrics/loss'),
  ):
    acc = event_accumulator.EventAccumulator(os.path.join(folder, part))
    acc.Reload()
    steps = [e.step for e in acc.Scalars(tag)]
    assert steps and steps[-1] == 4, (part, tag, steps)
  # The run's own curves are beside them.
  assert os.path.isdir(os.path.join(finetuned['out'], 'train'))


def _crafted(exported, tmp_path, change):
  folder = str(tmp_path / 'model')
  shutil.copytree(exported['dir'], folder)
  change(folder)
  return folder


def _malformed(folder):
  with open(os.path.join(folder, 'curves.json'), 'w') as f:
    json.dump({'format': 'jade-v8-curves', 'train': {'loss': [[1, 'x']]}}, f)
  reseal_export(folder, 'curves.json')


def _huge(folder):
  meta_path = os.path.join(folder, 'export.json')
  meta = json.load(open(meta_path))
  meta['files']['curves.json']['size'] = 1 << 34
  json.dump(meta, open(meta_path, 'w'))
  os.truncate(os.path.join(folder, 'curves.json'), 1 << 34)


def _link(folder):
  os.remove(os.path.join(folder, 'curves.json'))
  os.symlink('/etc/passwd', os.path.join(folder, 'curves.json'))


def _picture_link(folder):
  os.remove(os.path.join(folder, 'loss.png'))
  os.symlink('/dev/zero', os.path.join(folder, 'loss.png'))


@pytest.mark.parametrize(
  'change, match',
  [
    (_malformed, 'curves.json: damaged .*bad point.*model itself is fine'),
    (_huge, 'curves.json: left out .*more than such a file holds'),
    (_link, 'curves.json: left out .*not a regular file'),
    (_picture_link, 'loss.png: left out .*not a regular file'),
  ],
)
def test_crafted_curves_are_one_line_and_the_model_loads(
  exported, tmp_path, capsys, change, match
):
  from src.storage import modelfolder

  folder = _crafted(exported, tmp_path, change)
  model = modelfolder.load(folder, 'model-dir', 'copy it again')
  assert model.kind == 'export'
  assert (model.curves is None) == (change is not _picture_link)
  err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
  assert len(err) == 1, err
  assert re.search(match, err[0]), err[0]


def test_curves_of_a_run_with_a_fifo_or_link_are_left_out(
  tiny_run, copy_of, capsys
):
  from src.storage import curves

  run = copy_of(tiny_run['out'])
  os.mkfifo(os.path.join(run, 'train', 'events.out.tfevents.0.fifo'))
  os.symlink('/dev/zero', os.path.join(run, 'eval', 'events.out.tfevents.1.x'))
  assert curves.collect(run) is None  # Never opened: no hang, no read.
  err = capsys.readouterr().err
  assert 'not a regular file' in err and 'is a link' in err
