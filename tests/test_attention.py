"""Jade V8's attention classes (src/model/attention.py) against Trax's own:
the one-token LSH step (bucket index, or prefix sums) is bit-identical to
Trax's sorting step; hashing and the training forward give Trax's buckets,
outputs and gradients."""

import re
import types

import jax
import numpy as np
import pytest
import trax
from jax import numpy as jnp
from trax.layers.research import efficient_attention as ea

from src.inference.decoding import Decoder
from src.model import (
  attention,
  decode_index,
  decode_keys,
  decode_select,
  ginconf,
  kernels,
  lsh_hash,
  reformer,
)

from .conftest import MICRO, TINY_GIN


def decode(parallel_heads, n_tokens=40, extra=(), cls='FastLSHSelfAttention'):
  decoder = _decoder(parallel_heads, extra, cls)
  rng = np.random.default_rng(0)
  # Past the 64-token window, so the selection really drops positions.
  return np.stack(
    [decoder.feed([int(t)]) for t in rng.integers(3, 60, n_tokens)]
  )


def _decoder(parallel_heads, extra=(), cls='FastLSHSelfAttention', types=None):
  ginconf.parse(
    TINY_GIN,
    MICRO
    + tuple(extra)
    + (
      # Plain LSH in every block (Trax's class has no local window and no
      # directed term): ours, or Trax's own.
      f'ReformerLM.attention_type = {types or "@" + cls}',
      'LSHSelfAttention.n_hashes = 2',
      f'LSHSelfAttention.n_parallel_heads = {parallel_heads}',
    ),
  )
  layer = ginconf.model(60, 'predict')
  layer.rng = jax.random.PRNGKey(1)
  layer.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  return Decoder(layer, 128)


@pytest.mark.parametrize('parallel_heads', [1, 2])
def test_same_logits_as_trax_sort(parallel_heads):
  fast = decode(parallel_heads)
  slow = decode(parallel_heads, cls='LSHSelfAttention')
  np.testing.assert_array_equal(fast, slow)


@pytest.mark.parametrize('parallel_heads', [1, 2])
def test_same_logits_as_trax_sort_past_the_window(parallel_heads):
  """A memory much longer than the window of recent positions the index
  step also reads (3 x 8 candidates here), with 2 hash rounds: the older
  positions of the token's buckets come from the bucket index alone.

  Equal up to float rounding: the same candidates, summed in another
  order. Bit for bit on an AVX-512 Xeon; on an AVX2 Zen 3 the two orders
  round apart by up to 1.7e-6; other candidates (Trax's decode with
  chunks of 8) move the logits by 0.18 in the median, up to 1.6.
  """
  small = (
    'LSHSelfAttention.chunk_len = 4',
    'LSHSelfAttention.n_chunks_before = 0',
  )
  fast = decode(parallel_heads, n_tokens=120, extra=small)
  slow = decode(
    parallel_heads, n_tokens=120, extra=small, cls='LSHSelfAttention'
  )
  np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-5)


def test_compiled_step_reads_no_memory_sized_sort():
  """A token's step sorts only its few candidates (from the bucket index),
  never an array as long as the memory (Trax's step sorts the whole
  memory per head; `select_kv` ranked it in one pass)."""
  mem = 1024
  ginconf.parse(
    TINY_GIN,
    MICRO
    + (
      f'LSHSelfAttention.predict_mem_len = {mem}',
      f'SelfAttention.predict_mem_len = {mem}',
    ),
  )
  layer = ginconf.model(60, 'predict')
  layer.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  d = Decoder(layer, 128)
  hlo = (
    jax.jit(d._pure_step)
    .lower(d.weights, d.state, np.zeros((1, 1), np.int32), d._rng)
    .as_text(dialect='hlo')
  )
  sorts = re.findall(r'\[([\d,]*)\]\S* sort\(', hlo)
  assert sorts  # The candidates are sorted...
  for dims in sorts:  # ...and nothing as long as the memory.
    assert all(int(n) < mem for n in dims.split(',') if n), dims


def test_bucket_index_selects_what_the_sort_keeps():
  """`select_indexed` (the index's O(n_keep) candidates) gives exactly
  `select_kv`'s positions, for 1 and 2 hash rounds, at every fill level
  from empty to full, with an index rebuilt after a block and then
  extended token by token."""
  rng = np.random.default_rng(0)
  for rounds, mem, n_buckets, n_keep in (
    (1, 256, 8, 32),
    (2, 300, 4, 64),
    (2, 96, 16, 128),  # n_keep above the memory: all of it.
  ):
    # Numbered as Trax's hash_vectors does: round r's start at r * n.
    offsets = (np.arange(rounds) * n_buckets).astype(np.int32)
    buckets = np.zeros((rounds, mem), np.int32)
    block = int(rng.integers(1, mem // 2))
    buckets[:, :block] = rng.integers(0, n_buckets, (rounds, block))
    buckets[:, :block] += offsets[:, None]
    ring, counts = (
      np.array(a)
      for a in decode_index.rebuilt_index(
        jnp.asarray(buckets), block, n_buckets, n_keep
      )
    )
    for q in range(block, mem):
      own = rng.integers(0, n_buckets, rounds).astype(np.int32)
      qb = own + offsets
      buckets[:, q] = qb
      for h in range(rounds):
        ring[h, own[h], counts[h, own[h]] % n_keep] = q
        counts[h, own[h]] += 1
      keep = min(n_keep, mem)
      want = decode_select.select_kv(
        jnp.asarray((buckets == qb[:, None]).any(0)), q, keep
      )
      got = decode_select.select_indexed(
        jnp.asarray(buckets),
        jnp.asarray(qb),
        jnp.asarray(ring[np.arange(rounds), own]),
        q,
        keep,
      )
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_keep_mask_marks_what_the_sort_keeps():
  """`keep_mask` (a wide layer's candidates as a mask over its memory)
  marks exactly the positions at or before the query that `select_kv`
  keeps, at every position (the memory's last too), for 1 and 2 hash
  rounds, with the memory longer and shorter than what is kept, and one
  position longer."""
  rng = np.random.default_rng(0)
  cases = ((1, 64, 4, 8), (2, 100, 4, 16), (2, 40, 2, 64), (2, 40, 2, 39))
  for rounds, mem, n_buckets, n_keep in cases:
    offsets = (np.arange(rounds) * n_buckets)[:, None]
    for q in range(mem):
      buckets = np.zeros((rounds, mem), np.int32)
      buckets[:, :q] = rng.integers(0, n_buckets, (rounds, q)) + offsets
      qb = (rng.integers(0, n_buckets, rounds) + offsets[:, 0]).astype(np.int32)
      buckets[:, q] = qb
      keep = min(n_keep, mem)
      valid = jnp.asarray((buckets == qb[:, None]).any(0))
      want = np.asarray(decode_select.select_kv(valid, q, keep))
      got = decode_select.keep_mask(
        jnp.asarray(buckets), jnp.asarray(qb), q, keep
      )
      assert set(np.flatnonzero(np.asarray(got))) == {
        int(p) for p in want if p <= q
      }, (rounds, mem, q)


def test_a_wide_layer_reads_its_candidates_from_the_whole_cache(monkeypatch):
  """A layer with many candidates (`decode_select.reads_memory`: a wide
  reading, few buckets and long chunks) reads them as a mask over its whole
  key cache, without a sort or a gather: the same logits as Trax's sorting
  step to rounding (2 hash rounds, past the window), blocks at any
  position the same as tokens, and blocks not sized by its chunk."""
  monkeypatch.setattr(decode_select, 'WIDE_MIN', 64)  # MICRO's 2 x 16 x 2.
  wide = decode(2, n_tokens=120)
  trax_sort = decode(2, n_tokens=120, cls='LSHSelfAttention')
  np.testing.assert_allclose(wide, trax_sort, atol=1e-5, rtol=1e-5)
  assert (wide.argmax(-1) == trax_sort.argmax(-1)).all()
  d = _decoder(2)
  hlo = (
    jax.jit(d._pure_step)
    .lower(d.weights, d.state, np.zeros((1, 1), np.int32), d._rng)
    .as_text(dialect='hlo')
  )
  assert ' sort(' not in hlo  # The indexed step sorts its candidates.
  ids = [int(t) for t in np.random.default_rng(2).integers(3, 60, 110)]
  by_token = [d.feed(ids, blocks=False), d.feed([7])]
  d.reset()
  d.feed(ids[:5], blocks=False)
  by_block = [d.feed(ids[5:], blocks=True), d.feed([7])]
  np.testing.assert_allclose(by_block, by_token, atol=1e-5, rtol=1e-5)
  longer = ('LSHSelfAttention.chunk_len = 128',)
  assert _decoder(2, longer).block == 64  # No local layer here: 64.
  monkeypatch.setattr(decode_select, 'WIDE_MIN', 10**9)  # Gathered:
  assert _decoder(2, longer).block == 128  # a multiple of the chunk.


def test_a_wide_layer_reads_only_the_cache_a_block_can_reach(monkeypatch):
  """A wide layer's block reads the shortest prefix of its key cache
  holding every position it ranks (`decode_keys.PREFIX_SHARES`: here 8,
  32 and 128 of 128): the logits of reads that end in each (blocks, and
  tokens after them) are those of reading the whole cache, to rounding,
  and the same prefix is taken again at the same positions."""
  monkeypatch.setattr(decode_select, 'WIDE_MIN', 64)
  ids = [int(t) for t in np.random.default_rng(3).integers(3, 60, 100)]

  def reads():
    d = _decoder(2)
    out = [d.feed(ids[:4], blocks=False), d.feed(ids[4:20], blocks=True)]
    out += [d.feed(ids[20:90], blocks=True), d.feed(ids[90:], blocks=False)]
    return np.stack(out)

  prefixed = reads()
  np.testing.assert_array_equal(reads(), prefixed)
  monkeypatch.setattr(decode_keys, 'PREFIX_SHARES', (1,))
  whole = reads()
  np.testing.assert_allclose(prefixed, whole, atol=1e-5, rtol=1e-5)
  assert (prefixed.argmax(-1) == whole.argmax(-1)).all()


def test_the_best_far_keys_are_those_a_sort_ranks_first():
  """`decode_keys.best_far` keeps every key within `_far_from` positions
  of its query and, of those further back, exactly the `_far_keys` a sort
  ranks best, their scores as they were; the others masked as Trax masks.
  The same keys whether read in place (the whole key cache: key i at
  position i) or gathered in any order (a narrow layer's candidates)."""
  rng = np.random.default_rng(5)
  dots = rng.standard_normal((6, 50)).astype(np.float32)
  positions = np.arange(44, 50)
  order = np.stack([rng.permutation(50) for _ in positions])
  for n, beyond in ((1, 8), (3, 20), (5, 0), (40, 30)):
    layer = types.SimpleNamespace(_far_keys=n, _far_from=beyond)
    got = np.asarray(
      decode_keys.best_far(
        layer, jnp.asarray(dots), positions[:, None], np.arange(50)[None, :]
      )
    )
    gathered = np.asarray(
      decode_keys.best_far(
        layer,
        jnp.asarray(np.take_along_axis(dots, order, 1)),
        positions[:, None],
        order,
      )
    )
    for row, p in enumerate(positions):
      far = np.flatnonzero(np.arange(50) < p - beyond)
      best = far[np.argsort(-dots[row, far])[:n]]
      kept = np.flatnonzero(got[row] > -1e8)
      assert set(kept) == (set(range(50)) - set(far)) | set(best), (n, p)
      np.testing.assert_array_equal(got[row, kept], dots[row, kept])
      assert (got[row] <= -1e8).sum() == len(far) - len(best)
      np.testing.assert_array_equal(gathered[row], got[row, order[row]])


@pytest.mark.parametrize('whole', [False, True])
def test_a_chat_reads_its_best_far_keys(whole, monkeypatch):
  """A layer told to read its far keys (`read_far`, `chat.far_keys`)
  ranks them among the keys it reads, its gathered candidates or (a wide
  layer, `whole`) its whole key cache: with every far key kept it reads
  as without, to rounding; with 2 kept beyond 8 tokens the positions up
  to 8 read as before and later ones differ; tokens and blocks read the
  same."""
  if whole:
    monkeypatch.setattr(decode_select, 'WIDE_MIN', 1)
  ids = [int(t) for t in np.random.default_rng(6).integers(3, 60, 100)]

  def reads(far=None, blocks=False):
    d = _decoder(2)
    for layer in reformer.lsh_layers(d.model):
      if far:
        layer.read_far(*far)
      assert decode_select.reads_memory(layer, layer._predict_mem_len) == whole
    if not blocks:
      return np.stack([d.feed([t]) for t in ids])
    d.feed(ids[:5], blocks=False)  # Blocks at any position: 5...
    return np.stack([d.feed(ids[5:50], blocks=True), d.feed(ids[50:])])

  plain = reads()
  np.testing.assert_allclose(reads((128, 8)), plain, atol=1e-5, rtol=1e-5)
  two = reads((2, 8))
  np.testing.assert_allclose(two[:9], plain[:9], atol=1e-5, rtol=1e-5)
  assert np.abs(two[40:] - plain[40:]).max() > 1e-2
  np.testing.assert_allclose(
    reads((2, 8), blocks=True), two[[49, 99]], atol=1e-5, rtol=1e-5
  )


def test_a_start_block_holds_whole_lsh_chunks(monkeypatch):
  """A start block (read as training reads a window) is a whole number of
  LSH chunks, also where blocks are shorter than a chunk (a wide layer)."""
  monkeypatch.setattr(decode_select, 'WIDE_MIN', 64)
  mixed = '[@LocalSelfAttention, @FastLSHSelfAttention, @LocalSelfAttention]'
  d = _decoder(1, ('LSHSelfAttention.chunk_len = 64',), types=mixed)
  assert (d.block, d.min_start) == (32, 1024)  # tiny.gin's local 32.
  d.min_start = 32  # As a test reads short starts.
  assert d.start_part(100, exact=False) == 64  # Not 96.
  logits = d.feed(list(range(3, 102)), exact=False)
  assert d.start == 64 and np.isfinite(logits).all()


def test_scanned_buckets_are_trax_argmax_buckets():
  """`bucket_ids`'s scan over the rotations (long inputs) picks exactly
  Trax's `argmax(concatenate([r, -r]))`, ties (all-zero vectors, repeated
  rows) included, for 1 and 2 hash rounds and bucket counts whose halves
  are not a multiple of the scan's group; and `FastLSHSelfAttention`'s
  `hash_vectors` gives Trax's buckets for the same rng."""
  rng = np.random.default_rng(0)
  for n_hashes, n_buckets, length in (
    (1, 512, 300),
    (2, 12, 257),
    (2, 16, 600),
  ):
    vecs = rng.standard_normal((length, 8)).astype(np.float32)
    vecs[:5] = 0.0  # Every rotated value ties.
    vecs[5:9] = vecs[9]  # Equal vectors.
    turns = lsh_hash.draw_rotations(
      jax.random.PRNGKey(n_buckets), 8, n_hashes, n_buckets
    )
    rotated = np.einsum('tf,hbf->htb', vecs, np.asarray(turns))
    want = np.argmax(np.concatenate([rotated, -rotated], -1), -1)
    assert length >= lsh_hash.SCAN_FROM
    got = np.asarray(lsh_hash.bucket_ids(jnp.asarray(vecs), turns))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    scanned = lsh_hash.scanned_ids(jnp.asarray(vecs), turns)
    np.testing.assert_array_equal(np.asarray(scanned), want)
    if kernels.available():  # The CPU kernel, and the scan where it cannot run.
      fused = lsh_hash.fused_ids(jnp.asarray(vecs), turns)
      np.testing.assert_array_equal(np.asarray(fused), want)
    layer = _lsh_layer(attention.FastLSHSelfAttention, n_hashes, n_buckets)
    ours = layer.hash_vectors(jnp.asarray(vecs), jax.random.PRNGKey(7))
    trax_ = ea.LSHSelfAttention.hash_vectors(
      layer, jnp.asarray(vecs), jax.random.PRNGKey(7)
    )
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(trax_))


def test_the_hash_kernel_gives_the_scans_buckets_under_vmap():
  """The CPU kernel's buckets (`lsh_hash.fused_ids`) are the scan's for
  heads under `vmap` (leading dimensions on both inputs, or on the vectors
  only), lengths that fill no tile (16 positions) and rotation counts
  that fill no micro-tile (6 or 8 rotations), d 64 as the models hash."""
  if not kernels.available():
    pytest.skip('the CPU kernels cannot be built here')
  rng = np.random.default_rng(1)
  vecs = jnp.asarray(rng.standard_normal((3, 1037, 64)), jnp.float32)
  for n_hashes, n_buckets in ((1, 512), (2, 38)):
    keys = jax.random.split(jax.random.PRNGKey(n_buckets), 3)
    draw = lsh_hash.draw_rotations
    turns = jnp.stack([draw(k, 64, n_hashes, n_buckets) for k in keys])
    fused = jax.jit(jax.vmap(lsh_hash.fused_ids))(vecs, turns)
    scanned = jax.vmap(lsh_hash.scanned_ids)(vecs, turns)
    assert fused.shape == (3, n_hashes, 1037) and fused.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(scanned))
    shared = jax.vmap(lsh_hash.fused_ids, in_axes=(0, None))(vecs, turns[0])
    np.testing.assert_array_equal(np.asarray(shared[0]), np.asarray(fused[0]))
    assert int(jnp.max(fused)) < n_buckets and int(jnp.min(fused)) >= 0


def _lsh_layer(cls, n_hashes, n_buckets):
  return cls(
    n_heads=1,
    d_qk=8,
    d_v=8,
    causal=True,
    chunk_len=16,
    n_chunks_before=1,
    n_hashes=n_hashes,
    n_buckets=n_buckets,
    mode='train',
    attention_dropout=0.0,
    output_dropout=0.0,
  )


@pytest.mark.parametrize('n_hashes', [1, 2])
def test_training_forward_is_traxs(n_hashes, monkeypatch):
  """`FastLSHSelfAttention`'s forward (scanned hashing, keys sorted alone,
  permutations inverted by scatter and gather) gives Trax's LSH forward's
  outputs, new state and gradients exactly (both through Trax's `attend`:
  the fused kernel's sums differ by rounding, pinned in
  tests/test_chunk_attention.py)."""
  monkeypatch.setenv('JADE_CHUNK_KERNEL', 'off')
  length, d = 256, 16
  ours_layer = _lsh_layer(attention.FastLSHSelfAttention, n_hashes, 8)
  trax_layer = _lsh_layer(ea.LSHSelfAttention, n_hashes, 8)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((length, d)))
  x = x.astype(jnp.float32)
  w = tuple(
    jnp.asarray(np.random.default_rng(i).standard_normal(s), jnp.float32)
    for i, s in enumerate([(d, 8), (d, 8), (8, d)])
  )
  state = (jnp.zeros(n_hashes * length, jnp.int32), jax.random.PRNGKey(3))
  rng = jax.random.PRNGKey(5)

  def run(layer):
    def loss(x, w):
      out, new = layer.forward_unbatched(
        x, weights=w, state=state, rng=rng, update_state=True
      )
      return jnp.sum(out * jnp.cos(out)), (out, new)

    (_, (out, new)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(
      x, w
    )
    return out, new, grads

  ours = run(ours_layer)
  trax_ = run(trax_layer)
  for a, b in zip(
    jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(trax_)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
