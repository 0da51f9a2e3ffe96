"""The fused chunk attention (src/model/chunk_attention.py and .cc) against
Trax's `efficient_attention.attend`: the same outputs, log-sum-exps and
gradients within float tolerance, for every mask, window and shape the
layers use; Trax's `attend` where the kernel does not apply; the layers'
training forward equal either way; a kernel error is the call's error."""

import functools
import json
import os
import pathlib
import shutil
import stat

import jax
import numpy as np
import pytest
import trax
from jax import numpy as jnp
from trax.layers.research import efficient_attention as ea

from src.model import attention, chunk_attention, kernels, precision, smeared

from .conftest import run_script

TOL = 1e-5


@pytest.fixture
def always(monkeypatch):
  """The kernel for calls of any size (tests' shapes fit in cache)."""

  if not (shutil.which('c++') or shutil.which('g++')):
    pytest.skip("no C++ compiler here: Trax's attend runs (tested below)")
  monkeypatch.setattr(chunk_attention, 'MIN_SCORES', 0)
  monkeypatch.delenv('JADE_CHUNK_KERNEL', raising=False)
  assert kernels.ready(), 'the kernels did not build here'


def _mask(flags):
  return functools.partial(
    ea.mask_self_attention,
    causal=bool(flags & 1),
    exclude_self=bool(flags & 2),
    masked=bool(flags & 4),
  )


def _both(case, seed=0, bf16=False):
  """`[(out, lse, value, grads)]` of Trax's `attend` and ours for `case`:
  (shared keys, mask flags, length, chunk, chunks before, width); `bf16`:
  with bfloat16 products (`src.model.precision`)."""
  wrap = precision.bfloat16_products if bf16 else lambda fn: fn
  shared, flags, n, chunk, before, d = case
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  k = None if shared else jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((n, d + 8)), jnp.float32)
  # LSH reads positions in bucket order; a local layer in order.
  q_info = jnp.asarray(rng.permutation(n), jnp.int32) if shared else None
  kv_info = None
  if flags & 4:  # Padding: Trax's negative key positions.
    pad = np.where(rng.random(n) < 0.2, -1, 1)
    kv_info = jnp.asarray(np.arange(n) * pad, jnp.int32)
  results = []
  for attend in (ea.attend, chunk_attention.attend):

    def run(q, k, v, attend=attend):
      return attend(
        q, k, v, q_chunk_len=chunk, kv_chunk_len=None if k is None else chunk,
        n_chunks_before=before, mask_fn=_mask(flags), q_info=q_info,
        kv_info=kv_info,
      )  # fmt: skip

    def loss(*args, run=run):
      o, lse = run(*args) if not shared else run(args[0], None, args[1])
      return jnp.sum(o * jnp.sin(o)) + jnp.sum(jnp.cos(lse))

    args = (q, v) if shared else (q, k, v)
    grad = jax.value_and_grad(loss, tuple(range(len(args))))
    value, grads = jax.jit(wrap(grad))(*args)
    o, lse = (
      jax.jit(wrap(run))(q, k, v)
      if not shared
      else jax.jit(wrap(lambda q, v: run(q, None, v)))(q, v)
    )
    results.append((o, lse, value, grads))
  return results


def _close(a, b, tol=TOL):
  scale = float(jnp.max(jnp.abs(a))) + 1e-9
  return float(jnp.max(jnp.abs(a - b))) / scale < tol


@pytest.mark.parametrize(
  'case',
  [
    (True, 3, 512, 64, 1, 32),  # LSH: shared keys, causal, no self.
    (True, 3, 2560, 64, 1, 64),  # Several groups of chunks.
    (True, 3, 256, 64, 0, 32),  # No chunk before.
    (False, 1, 256, 32, 1, 16),  # Local: own keys, causal.
    (False, 5, 1184, 32, 2, 24),  # Padding masked; two chunks before.
    (False, 7, 144, 48, 1, 20),  # Widths off the vector size.
    (True, 3, 2048, 256, 1, 32),  # Rows in blocks within a chunk.
    (False, 1, 4096, 512, 1, 32),
    (False, 1, 1200, 100, 2, 16),  # A chunk not a multiple of the blocks.
  ],
)
def test_the_kernel_gives_traxs_outputs_and_gradients(always, case):
  (o1, l1, v1, g1), (o2, l2, v2, g2) = _both(case)
  assert _close(o1, o2) and _close(l1, l2)
  assert abs(float(v1) - float(v2)) <= TOL * abs(float(v1))
  assert all(_close(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize(
  'case',
  [
    (True, 3, 512, 64, 1, 32),
    (False, 5, 1184, 32, 2, 24),
    (False, 7, 150, 25, 1, 15),  # Odd chunks and widths: pairs end in 0.
  ],
)
def test_bfloat16_products_are_xlas_bfloat16_products(always, case):
  """Under `precision.products = 'bfloat16'` the kernel's five products
  read bfloat16 inputs, as XLA's bfloat16 products of Trax's `attend` do:
  the same values within the bfloat16 roundings that flip (~1e-4), where
  float32 is ~5e-3 away. Built without AVX512-BF16, the kernel stays
  float32."""
  (o1, l1, v1, g1), (o2, l2, v2, g2) = _both(case, bf16=True)
  float32 = _both(case)[1]
  if not kernels.native_bf16():
    assert all(np.array_equal(a, b) for a, b in zip(g2, float32[3]))
    return
  assert _close(o1, o2, 5e-4) and _close(l1, l2, 5e-4)
  assert all(_close(a, b, 5e-4) for a, b in zip(g1, g2))
  assert not all(_close(a, b, 1e-3) for a, b in zip(g2, float32[3]))


def test_under_vmap_each_head_reads_its_own_positions(always):
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((3, 512, 32)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((3, 512, 32)), jnp.float32)
  info = jnp.asarray(np.stack([rng.permutation(512) for _ in range(3)]))
  outs = []
  for attend in (ea.attend, chunk_attention.attend):
    run = jax.vmap(
      lambda q, v, i, attend=attend: attend(
        q,
        None,
        v,
        q_chunk_len=64,
        n_chunks_before=1,
        mask_fn=_mask(3),
        q_info=i,
      )  # fmt: skip
    )
    outs.append(jax.jit(run)(q, v, info))
  assert _close(outs[0][0], outs[1][0]) and _close(outs[0][1], outs[1][1])


def _bucketed(rng, n, buckets):
  """Positions (one-based) in LSH's order: by a random bucket, then by
  position, so each chunk's keys ascend within a bucket."""
  bucket = rng.integers(0, buckets, n)
  return np.lexsort((np.arange(n), bucket)).astype(np.int32) + 1


@pytest.mark.parametrize('bf16', [False, True])
def test_skipping_tiles_the_mask_zeroes_changes_no_bit(always, bf16):
  """The kernel skips tiles of keys that come after every query of a pass
  (probability 0 under the causal mask): outputs and gradients equal, bit
  for bit, those of scoring every tile, with LSH's bucketed order, a local
  layer's, and rows whose every key is masked (scored in full)."""
  rng = np.random.default_rng(3)
  n, d = 1024, 32
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q, k, v = normal(2, n, d), normal(2, n, d), normal(2, n, d + 8)
  bucketed = jnp.asarray(np.stack([_bucketed(rng, n, 4) for _ in '01']))
  in_order = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32), (2, n))
  padded = in_order.at[:, :64].multiply(-1)  # Chunk 0: every key masked.
  calls = [(bucketed, bucketed, 64, 1, 3), (in_order, in_order, 128, 1, 1)]
  calls += [(in_order, padded, 64, 1, 5), (bucketed, bucketed, 256, 0, 3)]
  flag = chunk_attention._BF16 if bf16 else 0
  for qi, ki, chunk, before, flags in calls:
    results = []
    for every in (0, chunk_attention._EVERY_TILE):
      fl = flags | flag | every

      def run(q, k, v, qi=qi, ki=ki, chunk=chunk, before=before, fl=fl):
        one = lambda *a: chunk_attention.fused(*a, chunk, before, fl)  # noqa: E731
        return jax.vmap(one)(q, k, v, qi, ki)

      out, back = jax.vjp(run, q, k, v)
      results.append((*out, *back((jnp.sin(out[0]), jnp.cos(out[1])))))
    for a, b in zip(*results):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.isfinite(np.asarray(results[0][0])))


def _count_trax(monkeypatch):
  calls = []
  real = ea.attend

  def counted(*a, **kw):
    calls.append(kw.get('dropout'))
    return real(*a, **kw)

  monkeypatch.setattr(ea, 'attend', counted)
  return calls


def test_where_the_kernel_does_not_apply_traxs_attend_runs(always, monkeypatch):
  calls = _count_trax(monkeypatch)
  q = jnp.ones((256, 16), jnp.float32)
  kw = dict(q_chunk_len=32, n_chunks_before=1, mask_fn=_mask(3))
  chunk_attention.attend(q, None, q, **kw)
  assert calls == []  # The kernel.
  chunk_attention.attend(q, None, q, dropout=0.1, rng=jax.random.key(0), **kw)
  chunk_attention.attend(q, None, q, **{**kw, 'mask_fn': lambda d, q, k: d})
  chunk_attention.attend(q, None, q, n_chunks_after=1, **kw)
  chunk_attention.attend(q.astype(jnp.bfloat16), None, q, **kw)
  monkeypatch.setattr(chunk_attention, 'MIN_SCORES', 1 << 30)
  chunk_attention.attend(q, None, q, **kw)  # Small: fits in cache.
  monkeypatch.setattr(chunk_attention, 'MIN_SCORES', 0)
  monkeypatch.setenv('JADE_CHUNK_KERNEL', 'off')
  chunk_attention.attend(q, None, q, **kw)
  assert len(calls) == 6


def test_a_bad_call_is_the_calls_error_not_a_crash(always):
  q = jnp.ones((100, 16), jnp.float32)
  info = jnp.arange(1, 101, dtype=jnp.int32)
  with pytest.raises(Exception, match='chunking'):
    jax.block_until_ready(chunk_attention.fused(q, q, q, info, info, 32, 1, 3))
  with pytest.raises(Exception, match='shapes differ'):
    jax.block_until_ready(
      chunk_attention.fused(q, q[:64], q[:64], info, info, 4, 1, 3)
    )


def _layer_run(layer_cls, x, **settings):
  layer = layer_cls(
    n_heads=2, d_qk=16, d_v=16, causal=True, mode='train', **settings
  )
  layer.init(trax.shapes.signature(x), rng=jax.random.key(0))
  weights, state = layer.weights, layer.state

  def loss(weights, x):
    out, _ = layer.pure_fn(x, weights, state, jax.random.key(1))
    return jnp.sum(out * out)

  return jax.jit(jax.value_and_grad(loss, (0, 1)))(weights, x)


@pytest.mark.parametrize(
  'layer_cls, settings',
  [
    (attention.LocalSelfAttention, dict(chunk_len=32, n_chunks_before=1)),
    (smeared.SmearedLocalSelfAttention, dict(chunk_len=32, n_chunks_before=1)),
    (
      attention.DirectedLSHSelfAttention,
      dict(chunk_len=32, n_chunks_before=1, n_hashes=2, n_buckets=4),
    ),
  ],
)
def test_a_layers_training_forward_is_the_same_either_way(
  always, monkeypatch, layer_cls, settings
):
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 128, 32)))
  x = x.astype(jnp.float32)
  calls = _count_trax(monkeypatch)
  (value, grads) = _layer_run(layer_cls, x, **settings)
  assert calls == []  # Every attend of the layer took the kernel.
  monkeypatch.setenv('JADE_CHUNK_KERNEL', 'off')
  (value_trax, grads_trax) = _layer_run(layer_cls, x, **settings)
  assert calls  # Trax's.
  assert abs(float(value) - float(value_trax)) <= TOL * abs(float(value_trax))
  flat, flat_trax = (jax.tree_util.tree_leaves(g) for g in (grads, grads_trax))
  assert all(_close(a, b, 1e-4) for a, b in zip(flat, flat_trax))


_PROBE = """
import json, os, sys
sys.path.insert(0, os.getcwd())
from src import runtime
runtime.bootstrap()
import jax.numpy as jnp
from trax.layers.research import efficient_attention as ea
from src.model import chunk_attention as ca, kernels
ca.MIN_SCORES = 0
q = jnp.ones((256, 16), jnp.float32)
used = kernels.ready()
out = ca.attend(q, None, q, q_chunk_len=32, n_chunks_before=1)[0]
ref = ea.attend(q, None, q, q_chunk_len=32, n_chunks_before=1)[0]
print(json.dumps({'used': used, 'same': float(jnp.max(jnp.abs(out - ref)))}))
"""


def _probe(**env):
  done = run_script(
    ['-c', _PROBE], env={'JADE_VERBOSE': '1', **env}, timeout=300
  )
  assert done.returncode == 0, done.stderr[-2000:]
  return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_the_kernel_is_built_once_into_the_private_cache_folder(
  safe_dir, always
):
  cache = pathlib.Path(safe_dir) / 'cache'
  found, _ = _probe(JADE_COMPILE_CACHE=str(cache))
  assert found['used'] and found['same'] < 1e-5
  (folder,) = (cache / 'kernels').iterdir()
  (library,) = folder.iterdir()
  assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
  built = library.stat().st_mtime_ns
  found, _ = _probe(JADE_COMPILE_CACHE=str(cache))
  assert found['used'] and library.stat().st_mtime_ns == built  # Reused.


def test_without_a_compiler_traxs_attend_runs_with_one_note(tmp_path):
  # The cache off: a fresh temporary folder, so the kernel must be built.
  found, err = _probe(
    JADE_COMPILE_CACHE='off',
    PATH=str(tmp_path),  # No c++ here.
  )
  assert not found['used'] and found['same'] == 0.0
  assert 'the CPU kernels are not used (no C++ compiler' in err
  # A compiler that fails (one of the sources side by side): the same.
  fake = tmp_path / 'c++'
  fake.write_text('#!/bin/sh\necho "jade test: no such header" >&2\nexit 1\n')
  fake.chmod(0o700)
  found, err = _probe(JADE_COMPILE_CACHE='off', PATH=str(tmp_path))
  assert not found['used'] and found['same'] == 0.0
  assert 'the compiler failed: jade test: no such header' in err
  if shutil.which('c++') or shutil.which('g++'):
    found, _ = _probe(JADE_COMPILE_CACHE='off')  # Built, used.
    assert found['used'] and found['same'] < 1e-5


@pytest.mark.parametrize(
  'kernel, skip, mode, skips',
  [
    (' off', ' OFF ', 'off', False),
    ('Always ', 'on', 'always', True),
    ('anything', 'no', 'on', True),
  ],
)
def test_the_switches_read_as_jade_kernels_does(
  monkeypatch, kernel, skip, mode, skips
):
  """`JADE_CHUNK_KERNEL` and `JADE_CHUNK_SKIP` read case and spaces as
  `JADE_KERNELS` does (" off" turned nothing off before)."""
  monkeypatch.setenv('JADE_CHUNK_KERNEL', kernel)
  monkeypatch.setenv('JADE_CHUNK_SKIP', skip)
  assert chunk_attention.kernel_mode() == mode
  assert chunk_attention.skips_dead_tiles() is skips


def test_jade_amx_off_builds_a_library_of_its_own_without_amx(monkeypatch):
  """The kernel's bfloat16 products run on AMX where the CPU has it
  (`kernels.amx()`, this process's library); `JADE_AMX=off` names a
  library of its own, built without AMX's instructions."""
  if not kernels.ready():
    pytest.skip('no C++ compiler here: the kernels are not built')
  cpuinfo = pathlib.Path('/proc/cpuinfo')  # Linux's; AMX is used on Linux.
  flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
  assert kernels.amx() is ('amx_bf16' in flags and kernels.native_bf16())
  name = kernels._library_name()
  monkeypatch.setenv('JADE_AMX', ' OFF ')
  assert kernels.amx_off() and '-mno-amx-tile' in kernels._options()
  assert kernels._library_name() != name
  monkeypatch.setenv('JADE_AMX', 'on')
  assert kernels._library_name() == name
