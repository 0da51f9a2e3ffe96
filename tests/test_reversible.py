"""`reversible.kept_blocks`: the last blocks keep their activations, with
the reversible stack's gradients and fewer products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trax import layers as tl

from src.core.errors import UserError
from src.model import ginconf, reformer

from .conftest import MICRO, TINY_GIN

# The walkthrough's kinds of layer: smeared local and context LSH blocks,
# feed-forwards in chunks (a rematerialized scan in Trax's stack).
WALKTHROUGH = (
  'ReformerLM.attention_type = [@SmearedLocalSelfAttention, '
  '@ContextLSHSelfAttention, @SmearedLocalSelfAttention]',
  'ReformerLM.ff_chunk_size = 64',
)


def _step(kept, extra):
  """(value, output, weight gradients, products in the compiled step) of
  a sum of the micro model's logits (dropout on: the same masks)."""
  ginconf.parse(TINY_GIN, (*MICRO, *extra, f'reversible.kept_blocks = {kept}'))
  lm = ginconf.fresh_model(300)
  lm.init(tl.ShapeDtype((2, 128), np.int32), rng=jax.random.PRNGKey(0))
  weights, state = lm.weights, lm.state
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(0, 300, (2, 128)), jnp.int32)
  cotangent = jnp.asarray(rng.normal(size=(2, 128, 300)), jnp.float32)

  def loss(w):
    out, _ = lm.pure_fn(x, w, state, jax.random.PRNGKey(3))
    return jnp.sum(out * cotangent), out

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  products = step.lower(weights).as_text().count('dot_general')
  (value, out), grads = step(weights)
  return value, out, jax.tree.leaves(grads), products


@pytest.mark.parametrize('extra', [(), WALKTHROUGH], ids=['tiny', 'walk'])
def test_kept_blocks_have_the_stacks_gradients_with_fewer_products(extra):
  """The last blocks differentiated from their own activations (1 of 3,
  then all) give the reversible stack's output and weight gradients
  (within 2e-5 of the largest), in a step with fewer products: their
  forward no longer runs again in the backward pass."""
  value, out, grads, products = _step(0, extra)
  fewer = products
  for kept in (1, 3):
    v, o, g, p = _step(kept, extra)
    np.testing.assert_allclose(v, value, rtol=1e-5)
    np.testing.assert_allclose(o, out, atol=1e-5)
    assert len(g) == len(grads)
    for a, b in zip(g, grads):
      scale = float(jnp.max(jnp.abs(b))) + 1e-12
      assert float(jnp.max(jnp.abs(a - b))) <= 2e-5 * scale
    assert p < fewer, (kept, p, fewer)
    fewer = p


def test_kept_blocks_are_a_training_setting_checked_against_the_blocks():
  """Only a training model gets the kept stack (evaluation and chat run
  forward only); more blocks than the model has keep them all; not a
  whole number is one line naming the setting."""

  def stack(mode, kept):
    ginconf.parse(TINY_GIN, (*MICRO, f'reversible.kept_blocks = {kept}'))
    lm = ginconf.model(300, mode)
    (found,) = [
      x for x in reformer.all_layers(lm) if isinstance(x, tl.ReversibleSerial)
    ]
    return found

  one, every = stack('train', 1), stack('train', 7)  # 4 sublayers a block.
  assert (one._first_kept, every._first_kept) == (8, 0)
  assert [type(x).__name__ for x in one.sublayers[8:]] == [
    'PlainHalfResidual',
    'ReversibleSelect',
    'PlainHalfResidual',
    'ReversibleSelect',
  ]
  assert type(stack('train', 0)) is tl.ReversibleSerial
  assert type(stack('eval', 1)) is tl.ReversibleSerial
  assert type(stack('predict', 3)) is tl.ReversibleSerial
  for bad in (-1, 'True', 1.5, "'all'"):
    with pytest.raises(UserError, match='reversible.kept_blocks = '):
      stack('train', bad)


def test_a_run_resumes_with_other_kept_blocks(tmp_path):
  """`reversible.kept_blocks` is how training runs, not the model: a run
  saved with one value resumes with another; any model setting that
  differs is still refused."""

  def setup(*bindings):
    return ginconf.parse(TINY_GIN, (*MICRO, *bindings))

  saved = setup('reversible.kept_blocks = 0').text
  assert 'reversible.kept_blocks = 0' in saved
  (tmp_path / ginconf.MODEL_GIN).write_text(saved)
  ginconf.check_same_as_saved(setup('reversible.kept_blocks = 3'), tmp_path)
  ginconf.check_same_as_saved(setup(), tmp_path)
  with pytest.raises(UserError, match='other model settings'):
    other = setup('reversible.kept_blocks = 3', 'ReformerLM.d_ff = 32')
    ginconf.check_same_as_saved(other, tmp_path)
