"""The top_k one-token LSH step is bit-identical to Trax's sorting step."""

import jax
import numpy as np
import pytest
import trax

from src.inference.decoding import Decoder
from src.model import ginconf, reformer
from src.runtime.trax_patches import fast_lsh

from .conftest import MICRO, TINY_GIN


def decode(parallel_heads, n_tokens=40):
  ginconf.parse(
    TINY_GIN,
    MICRO
    + (
      # Trax's step is plain LSH in every block: no local blocks (whose
      # window fast_lsh keeps) and no directed term.
      'ReformerLM.attention_type = @LSHSelfAttention',
      'lsh.directed = False',
      'LSHSelfAttention.n_hashes = 2',
      f'LSHSelfAttention.n_parallel_heads = {parallel_heads}',
    ),
  )
  layer = reformer.reformer_lm(60, 'predict', directed=ginconf.lsh())
  layer.rng = jax.random.PRNGKey(1)
  layer.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  decoder = Decoder(layer, 128)
  rng = np.random.default_rng(0)
  # Past the 64-token window, so the selection really drops positions.
  return np.stack(
    [decoder.feed([int(t)]) for t in rng.integers(3, 60, n_tokens)]
  )


@pytest.mark.parametrize('parallel_heads', [1, 2])
def test_same_logits_as_trax_sort(parallel_heads):
  fast = decode(parallel_heads)
  fast_lsh.uninstall()
  try:
    slow = decode(parallel_heads)
  finally:
    fast_lsh.install()
  np.testing.assert_array_equal(fast, slow)


def test_compiled_step_has_no_sort():
  ginconf.parse(TINY_GIN, MICRO)
  layer = reformer.reformer_lm(60, 'predict', directed=ginconf.lsh())
  layer.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  d = Decoder(layer, 128)
  hlo = (
    jax.jit(d._pure_step)
    .lower(d.weights, d.state, np.zeros((1, 1), np.int32), d._rng)
    .as_text()
  )
  assert 'stablehlo.sort' not in hlo
