"""The fused read of a wide LSH layer's whole key cache
(src/model/memory_attention.py) against XLA's (`decode_keys.attend_memory`
with every key up to each query kept): the same attention, far keys and
ties at their cut included, for a token and for blocks at any position."""

import re
import types

import jax
import numpy as np
import pytest
from jax import numpy as jnp

from src.model import attention, decode_keys, kernels, memory_attention

pytestmark = pytest.mark.skipif(
  not kernels.available(), reason='the CPU kernels are not built here'
)

D, DV, MEM = 8, 8, 300


def _layer(far_keys, far_from):
  """What both reads ask of a directed LSH layer: the query row laid out
  as a key (`[q, 0, a]`, `a` standing in the inputs) and an identity
  output projection."""
  layer = types.SimpleNamespace(
    _d_qk=D, _d_v=DV, _far_keys=far_keys, _far_from=far_from
  )
  layer._memory_row = lambda q, x, w: jnp.concatenate(
    [q, jnp.zeros(q.shape[:-1] + (DV,)), x], -1
  )
  layer._memory_scores = types.MethodType(
    attention.FastLSHSelfAttention._memory_scores, layer
  )
  layer.weight = lambda w, name: w
  return layer


def _reads(layer, keys, q, x, positions, w_o=None):
  """`(fused, XLA's)` reads of one head: XLA's of the cache `keys`, the
  kernel's of a cache whose rows at `positions` are not yet written
  (here: noise; the call writes the queries' own keys there, as XLA's
  `write_keys`)."""
  w_o = jnp.eye(DV) if w_o is None else w_o
  keep = positions[:, None] >= jnp.arange(MEM)[None, :]
  want = decode_keys.attend_memory(layer, x, q, positions, keep, keys, w_o)
  fresh = keys[positions]
  noise = jax.random.normal(jax.random.PRNGKey(0), fresh.shape) * 1e3
  cache = keys.at[positions].set(noise)
  got, written = memory_attention.attend(
    layer, x[None], w_o[None], q[None, None], fresh[None, None], cache[None],
    positions,
  )  # fmt: skip
  np.testing.assert_array_equal(written[0], keys)
  return np.asarray(got[0]), np.asarray(want)


@pytest.mark.parametrize('far', [(0, 0), (1, 0), (3, 40), (8, 4), (256, 9)])
def test_the_fused_read_is_xlas(far):
  """Tokens and blocks of 5 and 32 at the memory's start, its end and
  between, with all far keys, the best 1, 3, 8 beyond 0, 40, 4 tokens, and
  more kept than there are: the outputs XLA's passes give, to rounding."""
  rng = np.random.default_rng(sum(far))
  keys = jnp.asarray(rng.standard_normal((MEM, 2 * D + DV)), jnp.float32)
  layer = _layer(*far)
  for length in (1, 5, 32):
    for start in (0, 1, 37, 150, MEM - length):
      q = jnp.asarray(rng.standard_normal((length, D)), jnp.float32)
      x = jnp.asarray(rng.standard_normal((length, D)), jnp.float32)
      positions = start + jnp.arange(length, dtype=jnp.int32)
      got, want = _reads(layer, keys, q, x, positions)
      np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_far_keys_tied_at_the_cut_are_all_read():
  """Far keys that score the same as the last one kept are all read, as
  `best_far` keeps them: here 3 distinct best scores among copies of a few
  keys, so the cut holds many keys; the values of every copy count."""
  rng = np.random.default_rng(1)
  few = rng.standard_normal((6, 2 * D + DV)).astype(np.float32)
  keys = few[rng.integers(0, 6, MEM)]
  keys[:, D : D + DV] = rng.standard_normal((MEM, DV))  # Values differ.
  layer = _layer(3, 16)
  q = jnp.asarray(rng.standard_normal((32, D)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((32, D)), jnp.float32)
  positions = 250 + jnp.arange(32, dtype=jnp.int32)
  got, want = _reads(layer, jnp.asarray(keys), q, x, positions)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_heads_and_examples_are_read_each_alone():
  """A layer's heads and examples (the kernel's tasks) each read their
  own keys and queries; the outputs are summed over heads."""
  rng = np.random.default_rng(2)
  layer = _layer(2, 8)
  width = 2 * D + DV
  keys = jnp.asarray(rng.standard_normal((6, MEM, width)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((2, 3, 32, D)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((2, 32, D)), jnp.float32)
  w_o = jnp.asarray(rng.standard_normal((3, DV, DV)), jnp.float32)
  positions = 100 + jnp.arange(32, dtype=jnp.int32)
  fresh = jnp.reshape(keys, (2, 3, MEM, width))[:, :, 100:132]
  got, written = memory_attention.attend(
    layer, x, w_o, q, fresh, keys, positions
  )
  np.testing.assert_array_equal(written, keys)
  for b in range(2):
    want = sum(
      _reads(layer, keys[3 * b + h], q[b, h], x[b], positions, w_o[h])[1]
      for h in range(3)
    )
    np.testing.assert_allclose(got[b], want, atol=5e-5, rtol=5e-5)


def test_a_chat_reads_through_the_kernel_as_without(monkeypatch):
  """A decoder whose directed LSH layers keep their whole memory (2
  rounds x 64 x 2 candidates of 128) reads it through the kernel (its
  step calls it): the logits of tokens and of blocks at any position are
  those of XLA's passes (`JADE_MEMORY_KERNEL=off`), to rounding, with
  every far key read and with the best 2 beyond 8 tokens."""
  from src.model import decode_select, reformer

  from .test_attention import _decoder

  monkeypatch.setattr(decode_select, 'WIDE_MIN', 64)
  ids = [int(t) for t in np.random.default_rng(7).integers(3, 60, 110)]

  def reads(far):
    wide = ('LSHSelfAttention.chunk_len = 64',)
    d = _decoder(2, wide, 'DirectedLSHSelfAttention')
    for layer in reformer.lsh_layers(d.model):
      layer.read_far(*far)
    by_token = np.stack([d.feed([t]) for t in ids[:60]])
    d.reset()
    d.feed(ids[:3], blocks=False)
    by_block = [d.feed(ids[3:47], blocks=True), d.feed(ids[47:], blocks=True)]
    return d, by_token, np.stack(by_block + [d.feed([9])])

  for far in ((0, 0), (2, 8)):
    d, token, block = reads(far)
    step = jax.jit(d._pure_step, donate_argnums=(1,))
    hlo = (
      step.lower(d.weights, d.state, np.zeros((1, 1), np.int32), d._rng)
      .compile()
      .as_text()
    )
    assert memory_attention.TARGET in hlo
    # The key cache flows through the call in place: never copied.
    caches = {
      ','.join(map(str, leaf.shape))
      for leaf in jax.tree_util.tree_leaves(d.state)
      if leaf.ndim == 3 and leaf.shape[:2] == (2, 128) and leaf.shape[2] > 32
    }
    assert caches and all(f'f32[{c}]' in hlo for c in caches)
    copies = re.findall(r'= f32\[([\d,]+)\]\S* copy\(', hlo)
    assert not caches & set(copies), copies
    monkeypatch.setenv('JADE_MEMORY_KERNEL', 'off')
    _, xla_token, xla_block = reads(far)
    monkeypatch.delenv('JADE_MEMORY_KERNEL')
    np.testing.assert_allclose(token, xla_token, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(block, xla_block, atol=1e-5, rtol=1e-5)
    assert (token.argmax(-1) == xla_token.argmax(-1)).all()
