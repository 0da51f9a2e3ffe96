"""Each Trax 1.4.1 / today's-JAX fix in src.runtime.trax_patches, pinned by
a test.

Every test here exercises the broken path directly, so it fails if its fix
is removed from `src.runtime.trax_patches.install()`.
"""

import importlib
import inspect
import os
import subprocess
import sys
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trax
from trax import fastmath
from trax import layers as tl
from trax.layers import acceleration
from trax.supervised import training as trax_training

from src.model import ginconf
from src.runtime import trax_patches
from src.runtime.trax_patches import all_reduce, lazy_tensorflow

from .conftest import DATA, MICRO, ROOT, TINY_GIN


def test_all_fixes_applied_once():
  assert trax_patches.APPLIED == [
    'fast_trax_import',
    'cond_keyword_form',
    'stop_gradient_static',
    'host_count_alias',
    'device_put_replicated',
    'on_cpu_uncommitted',
    'tree_unflatten_arrays',
    'tensorflow_off_accelerators',
    'tensorflow_on_demand',
    'all_reduce_one_local_device',
    'all_reduce_in_one_buffer',
    'safe_checkpoint_reading',
    'loop_logs_to_absl',
  ]
  trax_patches.install()
  assert len(trax_patches.APPLIED) == 13


def test_fast_trax_import_assert_shape_skips_inspect_stack(monkeypatch):
  """assert_shape must not call inspect.stack (1 s per call at import)."""
  monkeypatch.setattr(
    inspect, 'stack', lambda *a, **k: pytest.fail('inspect.stack called')
  )

  module = importlib.import_module('trax.layers.assert_shape')

  @module.assert_shape('...a->...a')
  class Identity(tl.Layer):
    def forward(self, x):
      return x

  layer = Identity()
  line = inspect.getsourcelines(
    test_fast_trax_import_assert_shape_skips_inspect_stack
  )[1]  # noqa: E501
  message = layer._before_assert_fun._message
  assert message.startswith(f'Defined at {__file__}:')
  assert int(message.split(':')[1].split()[0]) > line
  x = np.ones((2, 3), np.float32)
  np.testing.assert_array_equal(layer(x), x)


def test_cond_keyword_form():
  def branch(pred):
    return fastmath.cond(
      pred=pred,
      true_operand=jnp.float32(2.0),
      true_fun=lambda x: x + 1,
      false_operand=jnp.float32(5.0),
      false_fun=lambda x: x - 1,
    )

  assert float(branch(True)) == 3.0
  assert float(jax.jit(branch)(False)) == 4.0
  # The positional form still works.
  assert int(fastmath.cond(True, lambda x: x, lambda x: -x, 3)) == 3


def test_stop_gradient_keeps_python_numbers_static():
  assert fastmath.stop_gradient(7) == 7
  assert type(fastmath.stop_gradient(7)) is int

  @jax.jit
  def head(x):
    return jax.lax.dynamic_slice_in_dim(x, 0, fastmath.stop_gradient(2))

  np.testing.assert_array_equal(head(jnp.arange(5)), [0, 1])
  grad = jax.grad(lambda x: fastmath.stop_gradient(x * 2.0) + x)(1.0)
  assert float(grad) == 1.0


def test_lsh_predict_mode_decodes():
  """One-token LSH steps use both fixes above (cond and stop_gradient)."""
  ginconf.parse(TINY_GIN, MICRO)
  predict = ginconf.init_model(50, 'predict', 128)
  predict.weights = jax.tree_util.tree_map(jnp.asarray, predict.weights)
  token = np.zeros((1, 1), np.int32)
  for _ in range(3):
    logits = predict(token)
    assert logits.shape == (1, 1, 50)
    assert np.all(np.isfinite(np.asarray(logits)))
    token = np.argmax(np.asarray(logits), -1).astype(np.int32)


def test_host_count_does_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert jax.host_count() == 1
    trax_training.init_host_and_devices(None, 0)


def test_replication_uses_device_put():
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    y = acceleration.for_n_devices(np.ones(3, np.float32), 2)
  assert y.shape == (jax.local_device_count(), 3)


def test_on_cpu_returns_uncommitted_host_arrays():
  x = {'a': jnp.ones(3), 'b': (jnp.zeros(2),)}
  y = tl.on_cpu(x)
  assert isinstance(y['a'], np.ndarray) and isinstance(y['b'][0], np.ndarray)
  assert trax.layers.on_cpu is acceleration.on_cpu


def test_one_local_device_all_reduces_when_processes_share_a_run():
  """Fix 11. Across real processes it is pinned by tests/test_distributed.py
  (two 1-device processes end with one model, equal to a 2-device run;
  without the fix each trains its own and the run refuses to finish). Here:
  Trax's trainer with one device takes the all-reduce path when JAX reports
  2 processes, and that path computes the same update (the sum over this
  one device is the identity)."""
  from trax.optimizers import trainer as trax_trainer

  assert (
    trax_trainer._accelerate_update_fn is all_reduce.accelerate_update_fn_compat
  )

  def step_weights(processes):
    model_ = tl.Serial(tl.Dense(4), tl.Dense(3))
    loss = tl.Serial(model_, tl.CrossEntropyLossWithLogSoftmax())
    x = np.ones((2, 5), np.float32)
    y = np.array([1, 2], np.int32)
    w = np.ones((2,), np.float32)
    loss.init(
      (jax.ShapeDtypeStruct(x.shape, x.dtype),)
      + (
        jax.ShapeDtypeStruct(y.shape, y.dtype),
        jax.ShapeDtypeStruct(w.shape, w.dtype),
      ),
      rng=jax.random.PRNGKey(0),
    )
    opt = trax.optimizers.SGD(0.1)
    opt.tree_init(loss.weights)
    with mock.patch.object(jax, 'process_count', lambda: processes):
      t = trax.optimizers.Trainer(loss, opt, n_devices=1)
    before = [np.asarray(a) for a in jax.tree_util.tree_leaves(loss.weights)]
    t.one_step((x, y, w), jax.random.PRNGKey(1), step=0)
    after = t.accelerated_model_with_loss.weights
    after = [np.asarray(a) for a in jax.tree_util.tree_leaves(after)]
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
    return after

  for a, b in zip(step_weights(1), step_weights(2), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_gradients_are_all_reduced_as_one_array_on_cpu():
  """Fix 12. Trax's trainer averages the gradients over its `pmap`'s
  'batch' axis through `_average_multidevice_gradients`: on CPU it is now
  one all-reduce of one flat array (Trax's was one all-reduce of a tuple
  of every weight's array, which XLA's CPU collectives send array by
  array), with the same numbers, shapes and dtypes."""
  import re

  from trax.optimizers import trainer as trax_trainer

  assert (
    trax_trainer._average_multidevice_gradients is all_reduce.average_gradients
  )
  rng = np.random.default_rng(0)
  tree = {
    'dense': (rng.standard_normal((1, 5, 3)), rng.standard_normal((1, 3))),
    'empty': (),
    'norm': [rng.standard_normal((1, 7))],
  }
  tree = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)

  def compiled(average):
    fn = jax.pmap(average, axis_name='batch')
    return fn(tree), fn.lower(tree).compile().as_text()

  ours, ours_hlo = compiled(all_reduce.average_gradients)
  trax_own, own_hlo = compiled(all_reduce._TRAX_AVERAGE[0])

  def reduced(hlo):  # The operands of each all-reduce.
    return [
      line.split(' all-reduce(')[1].split(')')[0].count('%')
      for line in hlo.splitlines()
      if re.search(r' all-reduce\(', line)
    ]

  assert reduced(ours_hlo) == [1]
  assert reduced(own_hlo) == [3]  # Trax's: a tuple, an array a weight.
  assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(
    trax_own
  )
  for a, b in zip(
    jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(trax_own)
  ):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


def test_tree_unflatten_with_array_leaves():
  tree = ((jnp.zeros(2), ()), [jnp.ones(1)])
  flat = [jnp.full(2, 7.0), jnp.full(1, 9.0)]
  new, rest = fastmath.tree_unflatten(flat, tree, copy_from_tree=[None, ()])
  assert rest == []
  np.testing.assert_array_equal(new[0][0], [7.0, 7.0])
  assert new[0][1] == () and isinstance(new[1], list)


def test_tensorflow_is_kept_off_accelerators():
  import tensorflow as tf

  with mock.patch.object(tf.config, 'set_visible_devices') as hide:
    lazy_tensorflow._hide_accelerators_from_tensorflow(tf)
  hide.assert_any_call([], 'GPU')
  hide.assert_any_call([], 'TPU')


RUN_THEN_REPORT = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
  runpy.run_path(sys.argv[0], run_name='__main__')
except SystemExit as exit:
  if exit.code:
    raise
from src.runtime.trax_patches import lazy_tensorflow
print('tensorflow loaded:', lazy_tensorflow.tensorflow_loaded())
"""


def _run_then_report(*args, code=RUN_THEN_REPORT):
  return subprocess.run(
    [sys.executable, '-c', code, *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )


def _events(folder):
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(folder)
  acc.Reload()
  return acc


def _two_steps(out: str, eval_every: int) -> list[str]:
  """`train.py`'s arguments for two steps of the tiny model into `out`."""
  args = ['train.py', '--data', DATA, '--gin', TINY_GIN, '--out-dir', out]
  args += ['--steps', '2', '--eval-every', str(eval_every)]
  args += ['--vocab-size', '300']
  for b in MICRO:
    args += ['--bind', b]
  return args


def test_training_and_chat_never_load_tensorflow(tmp_path):
  out = str(tmp_path / 'run')
  result = _run_then_report(*_two_steps(out, eval_every=1))
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'tensorflow loaded: False' in result.stdout
  chat = _run_then_report(
    'evaluate.py', '--model-dir', out, '--prompt', 'Hi', '--max-new-tokens', '3'
  )
  assert chat.returncode == 0, chat.stderr[-2000:]
  assert 'tensorflow loaded: False' in chat.stdout
  # The event files were still written, by the stand-in's SummaryWriter.
  train = _events(os.path.join(out, 'train'))
  assert [e.step for e in train.Scalars('metrics/loss')] == [1, 2]
  assert 'gin_config' in train.Tags()['tensors']
  gin_text = train.Tensors('gin_config')[0].tensor_proto.string_val[0]
  assert b'ReformerLM.n_layers' in gin_text
  assert _events(os.path.join(out, 'eval')).Scalars('metrics/loss')


NO_TENSORFLOW = (
  """
import importlib.abc, sys
ABSENT = ('tensorflow', 'tensorflow_datasets', 'tensorflow_text')
class Absent(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in ABSENT:  # As if never installed.
      raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, Absent())
"""
  + RUN_THEN_REPORT
  + """
try:
  lazy_tensorflow.load_on_demand('tensorflow')
except ModuleNotFoundError as e:
  print('on use:', e)
"""
)


def test_training_and_chat_run_where_tensorflow_is_not_installed(tmp_path):
  # A GPU box may hold JAX's CUDA wheels and no TensorFlow (the README
  # block ran so on an H200; BENCHMARKS.md "The walkthrough on a GPU").
  out = str(tmp_path / 'run')
  args = _two_steps(out, eval_every=2)
  result = _run_then_report(*args, code=NO_TENSORFLOW)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'done: step 2' in result.stdout
  assert 'on use: tensorflow is not installed' in result.stdout
  chat_args = ['evaluate.py', '--model-dir', out, '--prompt', 'Hi']
  chat_args += ['--max-new-tokens', '3']
  chat = _run_then_report(*chat_args, code=NO_TENSORFLOW)
  assert chat.returncode == 0, chat.stderr[-2000:]
  assert _events(os.path.join(out, 'train')).Scalars('metrics/loss')


USE_TENSORFLOW = """
import sys
import numpy as np
from src import runtime
runtime.bootstrap()
from src.runtime.trax_patches import lazy_tensorflow
import tensorflow as tf
from trax import fastmath, jaxboard
assert not lazy_tensorflow.tensorflow_loaded()
assert int(tf.constant(3).numpy()) == 3  # The real TensorFlow, loaded now.
assert lazy_tensorflow.tensorflow_loaded()
assert fastmath.backend('tensorflow-numpy')['name'] == 'tensorflow-numpy'
writer = jaxboard.SummaryWriter(sys.argv[1])
writer.scalar('number', 2.5, 1)
writer.image('picture', np.zeros((4, 4, 3)), 1)  # Trax's own method.
writer.close()
print('ok')
"""


def _python(code: str, *args):
  """`code` run by a fresh Python in the project folder."""
  command = [sys.executable, '-c', code, *args]
  return subprocess.run(
    command, cwd=ROOT, capture_output=True, text=True, timeout=300
  )


def test_tensorflow_loads_on_first_use(tmp_path):
  result = _python(USE_TENSORFLOW, str(tmp_path))
  assert result.stdout.strip() == 'ok', result.stderr[-2000:]
  events = _events(str(tmp_path))
  assert events.Scalars('number')[0].value == 2.5
  assert events.Images('picture')[0].width == 4


def test_local_gfile_renames_like_tensorflow(tmp_path):
  gfile = lazy_tensorflow._LocalGFile
  src, dst = str(tmp_path / 'a'), str(tmp_path / 'b')
  with gfile.GFile(src, 'w') as f:
    f.write('new')
  with gfile.GFile(dst, 'w') as f:
    f.write('old')
  with pytest.raises(FileExistsError):
    gfile.rename(src, dst)
  gfile.rename(src, dst, overwrite=True)
  assert not gfile.exists(src) and open(dst).read() == 'new'


LIGHT_IMPORT = """
import sys
from src import runtime
runtime.bootstrap(light=True)
import trax
heavy = ('trax.data', 'trax.supervised', 'trax.supervised.training')
print('before:', [m for m in heavy if m in sys.modules])
from trax.supervised import training
from trax.data import inputs
from trax import layers as tl
from src.runtime.trax_patches import checkpoint_io, loop_log
print('training patched:', training.unpickle_from_file
      is checkpoint_io._trax_unpickle_from_file,
      training._log is loop_log._log_without_stdout)
print('inputs patched:',
      inputs.load_data_counters is checkpoint_io._no_data_counters)
print('layers patched:', tl.np_from_file is checkpoint_io.np_from_file)
print('names:', trax.lr.multifactor is not None, callable(trax.AsKeras))
"""


def test_light_trax_import_patches_modules_as_they_are_imported():
  """`bootstrap(light=True)` (the chat, the server) leaves Trax's data
  pipeline and training loop unimported, and the safe checkpoint reading
  and quiet log fixes still hold once anything imports them."""
  result = _python(LIGHT_IMPORT)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'before: []' in result.stdout
  assert 'training patched: True True' in result.stdout
  assert 'inputs patched: True' in result.stdout
  assert 'layers patched: True' in result.stdout
  assert 'names: True True' in result.stdout
