"""src/model/heads.py: a layer's pass over all heads and examples at once,
the output projection contracted over the heads in one product, gives
Trax's pass (each head projected, the heads summed): outputs, new state,
the inputs' and the weights' gradients, with output dropout too."""

import jax
import numpy as np
import pytest
import trax
from jax import numpy as jnp

from src.model import attention, heads, smeared


def _layer(cls, **kw):
  common = dict(
    n_heads=2, d_qk=8, d_v=8, causal=True, chunk_len=16, n_chunks_before=1,
    mode='train', attention_dropout=0.0, output_dropout=0.25,
    n_parallel_heads=None,
  )  # fmt: skip
  if issubclass(cls, attention.FastLSHSelfAttention):
    common.update(n_hashes=2, n_buckets=8)
  else:
    common.update(share_qk=False)
  return cls(**{**common, **kw})


def _both(layer, x, monkeypatch, made_for=None):
  """(heads' pass, Trax's pass) of `layer` on `x`: each the output, new
  state and gradients of a backward pass. `made_for`: the input the
  layer was initialized for (default `x`)."""
  made_for = x if made_for is None else made_for
  layer.init(trax.shapes.signature(made_for), rng=jax.random.PRNGKey(0))
  weights = jax.tree.map(
    lambda w: w + 0.1 * jax.random.normal(jax.random.PRNGKey(2), w.shape),
    layer.weights,
  )  # Output projections that start at zero would hide half the pass.
  first = x[0] if isinstance(x, list) else x
  ct = jax.random.normal(jax.random.PRNGKey(4), first.shape)
  rng = jax.random.PRNGKey(5)

  def run():
    return layer.forward_and_or_backward(
      x, weights, layer.state, rng, output_grad=ct
    )

  assert heads.applies(layer, x)
  ours = run()
  monkeypatch.setattr(heads, 'applies', lambda layer, inputs: False)
  return ours, run()


@pytest.mark.parametrize(
  'cls',
  [
    attention.FastLSHSelfAttention,
    attention.DirectedLSHSelfAttention,
    smeared.SmearedLocalSelfAttention,
    attention.LocalSelfAttention,
  ],
)
def test_all_heads_at_once_is_traxs_pass(cls, monkeypatch):
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, 16))
  ours, trax_ = _both(_layer(cls), x, monkeypatch)
  assert float(jnp.max(jnp.abs(ours[0]))) > 0.1  # The heads said something.
  assert len(jax.tree.leaves(ours)) == len(jax.tree.leaves(trax_))
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(trax_)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_a_micro_batch_smaller_than_the_state_is_traxs_pass(monkeypatch):
  """Accumulation's micro-batches and a device's share run a layer on
  fewer examples than its state (an LSH layer's buckets, kept for the
  backward pass) was made for: the pass reads and writes the state's
  first rows and keeps the rest, as Trax's pass does (it had reshaped the
  whole state, so the quick start's gin failed with accumulate-steps)."""
  layer = _layer(attention.DirectedLSHSelfAttention)
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 64, 16))
  big = jnp.zeros((3, 64, 16))
  ours, trax_ = _both(layer, x, monkeypatch, made_for=big)
  assert jax.tree.leaves(layer.state)[0].shape[0] == 6  # 3 examples x 2.
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(trax_)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_a_pass_of_some_heads_at_a_time_stays_traxs():
  layer = _layer(attention.FastLSHSelfAttention, n_parallel_heads=1)
  x = jnp.zeros((2, 64, 16))
  assert not heads.applies(layer, x)
  assert heads.applies(_layer(attention.FastLSHSelfAttention), x)
  assert heads.applies(
    _layer(attention.FastLSHSelfAttention, n_parallel_heads=4), x
  )
  assert not heads.applies(
    _layer(attention.LocalSelfAttention, share_qk=True), x
  )


def test_a_masked_layers_inputs_keep_their_kind(monkeypatch):
  """(x, mask) in a list: the gradients come back as Trax's do, a list
  with the mask's zeros, the padding masked alike."""
  layer = _layer(attention.FastLSHSelfAttention, masked=True)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, 16))
  mask = jnp.arange(64)[None, :] < jnp.array([[64], [40]])
  ours, trax_ = _both(layer, [x, mask], monkeypatch)
  assert type(ours[2]) is type(trax_[2]) is list
  assert jax.tree.structure(ours) == jax.tree.structure(trax_)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(trax_)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
