"""The shortlist output layer (`output_layer.shortlist`,
`src/model/shortlist.py`, `src/model/softmax.py`): its probabilities,
its chunked training loss and gradients, the builder and a run that
trains, resumes and chats with it."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trax
from trax import layers as tl

from src.core.errors import UserError
from src.model import ginconf, losses, preflight, reformer, shortlist, softmax
from src.storage import checkpoints, modelfolder

from .conftest import (
  EXACT_LSH,
  MICRO,
  TINY_GIN,
  assert_chat_reads_as_eval,
  train_settings,
)


def _weights(rng, d=16, size=10, width=4, vocab=50):
  """A shortlist layer's `(Kh, P, Kt)`, `(bh, bt)`, drawn."""

  def draw(*shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)

  kernels = (draw(d, size + 1), draw(d, width), draw(width, vocab - size))
  return kernels, (draw(size + 1), draw(vocab - size))


def test_every_piece_gets_the_trees_probability():
  """A shortlist piece's probability is its head softmax's; a rarer
  piece's the "rarer piece" class's times its own among the rarer ones,
  scored from the narrow projection: they sum to 1."""
  rng = np.random.default_rng(0)
  kernels, biases = _weights(rng)
  h = jnp.asarray(rng.normal(size=(3, 16)), jnp.float32)
  got = softmax.shortlist_log_probs(h, kernels, biases)
  assert got.shape == (3, 50)
  np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, rtol=1e-5)
  kh, p, kt = kernels
  head = jax.nn.softmax(h @ kh + biases[0])
  tail = jax.nn.softmax((h @ p) @ kt + biases[1])
  np.testing.assert_allclose(np.exp(got[:, :10]), head[:, :10], rtol=1e-5)
  np.testing.assert_allclose(
    np.exp(got[:, 10:]), head[:, 10:] * tail, rtol=1e-4, atol=1e-7
  )


def test_the_chunked_loss_and_its_gradients_are_the_log_probs():
  """Training's loss (chunk by chunk, the gradient made in the forward
  pass, rows not a multiple of the chunk, weight-0 rows) and every
  gradient equal autodiff of the weighted cross-entropy on the full
  log-probabilities; evaluation's accuracy is their argmax's."""
  rng = np.random.default_rng(1)
  kernels, biases = _weights(rng)
  x = jnp.asarray(rng.normal(size=(2, 13, 16)), jnp.float32)
  t = jnp.asarray(rng.integers(0, 50, (2, 13)), jnp.int32)
  w = jnp.asarray(rng.integers(0, 2, (2, 13)), jnp.float32)

  def full(x, kernels, biases):
    lp = softmax.shortlist_log_probs(x, kernels, biases)
    nll = -jnp.take_along_axis(lp, t[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * w) / jnp.sum(w)

  def chunked(x, kernels, biases):
    return losses.chunked_cross_entropy(x, kernels, biases, t, w, 4)

  want, g_want = jax.value_and_grad(full, (0, 1, 2))(x, kernels, biases)
  got, g_got = jax.value_and_grad(chunked, (0, 1, 2))(x, kernels, biases)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, gw in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    assert g.shape == gw.shape
    scale = float(np.abs(gw).max())
    np.testing.assert_allclose(g, gw, rtol=1e-4, atol=2e-6 * scale)
  loss, accuracy = losses.chunked_cross_entropy(
    x, kernels, biases, t, w, 4, with_accuracy=True
  )
  lp = softmax.shortlist_log_probs(x, kernels, biases)
  hit = np.asarray(jnp.argmax(lp, -1) == t, np.float32)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(accuracy, (hit * w).sum() / w.sum(), rtol=1e-6)


def test_training_counts_a_hit_where_the_tree_names_the_target():
  """The running accuracy's hits: a shortlist target is hit where its
  head logit is the largest; a rarer one where the "rarer piece" class
  is and its own tail logit is the largest among the rarer pieces."""
  d, size, width, vocab = 4, 3, 4, 7
  kh = np.zeros((d, size + 1), np.float32)
  kt = np.zeros((width, vocab - size), np.float32)
  p = np.eye(d, width, dtype=np.float32)
  kh[0, 1] = kh[1, size] = kt[2, 2] = kt[3, 0] = 5.0
  x = np.zeros((6, d), np.float32)
  x[0, 0] = 1  # Head piece 1 wins.
  x[1, 1] = x[1, 2] = 1  # The rarer class, then rare piece 2 (id 5).
  x[2, 1] = x[2, 3] = 1  # The rarer class, then rare piece 0 (id 3).
  x[3:] = x[:3]
  t = np.array([1, 5, 5, 2, 6, 3], np.int32)  # Hit, hit, miss x3, hit.
  w = np.ones(6, np.float32)
  biases = (np.zeros(size + 1, np.float32), np.zeros(vocab - size, np.float32))
  _, hits, total = losses.chunked_cross_entropy(
    x[None], (kh, p, kt), biases, t[None], w[None], 4, with_hits=True
  )
  assert (float(hits), float(total)) == (3.0, 6.0)


def test_the_builder_puts_the_layer_where_the_vocabulary_is_larger():
  """`output_layer.shortlist` replaces Trax's output Dense where the
  vocabulary has rarer pieces, and leaves it at a vocabulary no larger;
  the weights the pre-flight counts are the model's; the chunked
  training model passes the layer's weights on (the model's own
  structure) and its loss and gradients are Trax's loss on the model's
  log-probabilities."""
  binding = ('output_layer.shortlist = 12',)
  setup = ginconf.parse(TINY_GIN, binding)
  assert setup.output.shortlist == 12
  small = ginconf.init_model(13, 'eval', 64, seed=0)
  assert not isinstance(small.sublayers[-1], shortlist.ShortlistOutput)
  m = ginconf.init_model(40, 'eval', 64, seed=0)
  assert isinstance(m.sublayers[-1], shortlist.ShortlistOutput)
  kh, bh, p, kt, bt = m.weights[-1]
  assert (kh.shape, p.shape, kt.shape) == ((256, 13), (256, 64), (64, 28))
  exact = reformer.count_params(m)
  assert abs(preflight.count_weights(setup, 40) - exact) < 0.2 * exact
  head = preflight.count_weights(setup, 40) - preflight.count_weights(
    ginconf.parse(TINY_GIN), 40
  )
  assert head == (256 * 13 + 13 + 256 * 64 + 64 * 28 + 28) - (256 * 40 + 40)
  rng = np.random.default_rng(2)
  x = np.asarray(rng.integers(1, 40, (2, 64)), np.int32)
  mask = np.asarray(rng.integers(0, 2, (2, 64)), np.float32)
  fused = losses.chunked_model(m, 16)
  full = tl.Serial(m, tl.WeightedCategoryCrossEntropy())
  key = jax.random.PRNGKey(0)

  def loss_of(layer, w, st):
    return layer.pure_fn((x, x, mask), w, st, key)[0]

  want, g_want = jax.value_and_grad(loss_of, 1)(
    full, (m.weights, ()), (m.state, ())
  )
  got, g_got = jax.value_and_grad(loss_of, 1)(fused, fused.weights, fused.state)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  g_want, g_got = jax.tree.leaves(g_want[0]), jax.tree.leaves(g_got[0])
  assert [g.shape for g in g_got] == [g.shape for g in g_want]
  for g, gw in zip(g_got, g_want):
    scale = float(np.abs(gw).max())
    np.testing.assert_allclose(g, gw, rtol=1e-4, atol=2e-6 * scale)


@pytest.mark.parametrize(
  'binding, says',
  [
    ('output_layer.shortlist = -1', 'output_layer.shortlist = -1'),
    ('output_layer.shortlist = True', 'output_layer.shortlist = True'),
    ('output_layer.width = 2.5', 'output_layer.width = 2.5'),
    ("output_layer.tied = 'only'", 'two output layers'),
    ('output_layer.shortlist = 0', 'set output_layer.shortlist too'),
  ],
)
def test_bad_shortlist_settings_are_one_clear_line(binding, says):
  bindings = ('output_layer.shortlist = 8', binding)
  if 'shortlist' in binding:
    bindings = (binding, 'output_layer.width = 16')
  with pytest.raises(UserError, match=says):
    ginconf.parse(TINY_GIN, bindings)


def test_a_shortlist_model_trains_resumes_and_chats_what_it_trains(tmp_path):
  """A run trains with the layer, saves it with the model, resumes, and
  the chat reads what it trained: token by token and as a block = the
  eval forward pass (log-probabilities)."""
  from src.training import trainer

  binding = 'output_layer.shortlist = 100'
  out = tmp_path / 'short'
  for steps in (2, 3):
    trainer.train(
      train_settings(out, steps=steps, **{'eval-every': steps}),
      gin_bindings=(*MICRO, binding),
      log=lambda line: None,
    )
  assert binding in (out / 'model.gin').read_text()
  assert modelfolder.load(str(out), 'model-dir', 'train it').step == 3
  ginconf.parse(
    os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin'),
    MICRO + (binding,) + EXACT_LSH,
  )
  flat = modelfolder.read_weights(str(out))[0]
  full_model = ginconf.model(300, 'eval')
  checkpoints.set_weights(
    str(out), full_model, trax.shapes.ShapeDtype((1, 128), np.int32), flat
  )
  assert isinstance(full_model.sublayers[-1], shortlist.ShortlistOutput)
  ids = [int(i) for i in np.random.default_rng(3).integers(3, 300, 60)]
  x = np.zeros((1, 128), np.int32)
  x[0, :60] = ids
  w, st = full_model.weights, full_model.state
  whole = np.asarray(full_model.pure_fn(x, w, st, jax.random.PRNGKey(0))[0])
  np.testing.assert_allclose(np.exp(whole[0]).sum(-1), 1.0, rtol=1e-4)
  assert_chat_reads_as_eval(out, flat, ids, whole)


@pytest.mark.parametrize(
  'vocab, bindings, saved, added',
  [
    (8000, (), None, ('output_layer.shortlist = 2048',)),
    (7999, (), None, ()),
    (32000, ('output_layer.shortlist = 0',), None, ()),
    (32000, ('output_layer.tied = True',), None, ()),
    # A run resumes with the output layer it started with.
    (32000, (), 'ReformerLM.n_layers = 1\n', ()),
    (
      500,
      (),
      'output_layer.shortlist = 2048\n',
      ('output_layer.shortlist = 2048',),
    ),
  ],
)
def test_a_new_run_at_thousands_of_pieces_gets_a_shortlist(
  tmp_path, vocab, bindings, saved, added
):
  from src.training import plan

  if saved is not None:
    (tmp_path / 'model.gin').write_text(saved)
  s = train_settings(tmp_path, **{'vocab-size': vocab})
  setup = ginconf.parse(TINY_GIN, MICRO + bindings)
  assert plan._output_choice(s, setup, None) == added
  # A fine-tune takes its pretrained model's output layer.
  assert plan._output_choice(s, setup, ('', 'pretrained')) == ()


def test_a_run_started_without_a_shortlist_resumes_without_one(
  tmp_path, monkeypatch
):
  """A run started before the default (or below its vocabulary) resumes
  as it started; a new run gets the layer, says so, and saves it."""
  from src.training import trainer

  out, fresh, lines = tmp_path / 'old', tmp_path / 'new', []
  monkeypatch.setattr(shortlist, 'AUTO_FROM', 10**6)
  trainer.train(train_settings(out, steps=2), MICRO, log=lines.append)
  monkeypatch.setattr(shortlist, 'AUTO_FROM', 300)
  monkeypatch.setattr(shortlist, 'AUTO_SIZE', 100)
  trainer.train(train_settings(out, steps=3), MICRO, log=lines.append)
  assert 'shortlist' not in (out / 'model.gin').read_text()
  assert not any('the most used' in x for x in lines)
  trainer.train(train_settings(fresh, steps=2), MICRO, log=lines.append)
  assert 'output_layer.shortlist = 100' in (fresh / 'model.gin').read_text()
  assert sum('output_layer.shortlist = 100 (the most' in x for x in lines) == 1
  loaded = modelfolder.load(str(fresh), 'model-dir', 'train it')
  assert loaded.setup.output.shortlist == 100
