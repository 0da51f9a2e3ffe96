"""Chunked attention fused for the CPU: Trax's `efficient_attention.attend`
(same arguments, same results within float rounding), computed a few query
rows of a chunk at a time, in cache, by a compiled XLA FFI kernel
(`chunk_attention.cc`).

XLA's CPU backend runs Trax's `attend` as whole-length passes: the chunk
products (at ~15% of the matmul rate), then the masks, the log-sum-exp,
the exponentials and the adjacent-chunk copies, each over arrays the size
of every score of the layer (BENCHMARKS.md "A 32k step on an AVX-512 Zen
4": 2.16 of a 7.45 s step). The kernel reads each chunk's queries, keys
and values once, keeps their scores in cache, and spreads the work over
XLA's own threads; its gradient is a second kernel that recomputes the
scores (as a fused attention does) instead of keeping them
(BENCHMARKS.md "A fused chunk attention").

Under the causal mask a tile of keys that come after every query of a
pass has probabilities of exactly 0; sorted by bucket, then position, LSH
chunks end in many (20-48% of the walkthrough's runs). The kernel skips
them in all seven of its products: the same sums, bit for bit
(`JADE_CHUNK_SKIP=off` scores them, to measure; BENCHMARKS.md "Skipping
the key tiles the mask zeroes").

`attend` takes the kernel where it applies (XLA's CPU backend, float32,
Trax's `mask_self_attention`, no chunks after, no attention dropout, a
call of `MIN_SCORES` scores or more: a chat's few rows, where a call
costs more than its work) and Trax's own `attend` everywhere else (a GPU
or TPU, dropout), so a model's numbers never depend on which ran beyond
float rounding. `JADE_CHUNK_KERNEL=off` keeps Trax's everywhere;
`=always` takes the kernel for every call it applies to.

Under `precision.products = 'bfloat16'` the training step's rewrite
(`src.model.precision`) sets the calls' bfloat16 flag
(`with_bfloat16_products`): where the kernels were built for AVX512-BF16
(`kernels.native_bf16()`) the kernel's five products then read bfloat16
inputs and sum in float32, as XLA's bfloat16 products of Trax's `attend`
do (the same values within the roundings that flip).

The kernel is built and loaded with the project's other CPU kernels
(`src.model.kernels`); without a compiler (or where the library cannot be
loaded) Trax's `attend` runs, and `JADE_VERBOSE=1` says why in one line.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from trax.layers.research import efficient_attention as ea

from src.model import kernels, layer_norm
from src.runtime import switches

_CAUSAL, _EXCLUDE_SELF, _MASKED = 1, 2, 4
_BF16 = 8  # Products of bfloat16 inputs (where the CPU has AVX512-BF16).
# Score every tile of keys, even those the causal mask gives probability 0
# (which the kernel skips: the same results, bit for bit; tests compare):
# `JADE_CHUNK_SKIP=off`, to measure what skipping saves.
_EVERY_TILE = 16
_TARGETS = ('jade_chunk_attention_forward', 'jade_chunk_attention_backward')
# Scores of a call (queries x keys a query reads) below which Trax's
# `attend` runs. The kernel is faster from the walkthrough's smallest
# training calls up (a local layer's 256 rows x 64 keys: run 1's step
# 1.2-1.4x, in float32 and bfloat16, on an AVX-512 Zen 4; BENCHMARKS.md
# "Every attention call through the kernel"); 2^20, as before, kept
# every call of runs 1 and 2 and every local layer with XLA.
MIN_SCORES = 1 << 14


def kernel_mode() -> str:
  """`JADE_CHUNK_KERNEL`: 'on' (the default: calls of `MIN_SCORES` or more),
  'off' (Trax's `attend` everywhere) or 'always' (every call it applies
  to, however small: how the test suite can run every layer through it)."""
  mode = os.environ.get('JADE_CHUNK_KERNEL', 'on').strip().lower()
  return mode if mode in ('off', 'always') else 'on'


def _mask_flags(mask_fn) -> int | None:
  """The kernel's mask bits for Trax's `mask_self_attention` (a partial of
  it, as Trax's layers and ours make), None for any other mask."""
  if not isinstance(mask_fn, functools.partial) or mask_fn.args:
    return None
  if mask_fn.func is not ea.mask_self_attention:
    return None
  kw = {'causal': True, 'exclude_self': True, 'masked': False}
  if set(mask_fn.keywords) - set(kw):
    return None
  kw.update(mask_fn.keywords)
  return (
    _CAUSAL * bool(kw['causal'])
    + _EXCLUDE_SELF * bool(kw['exclude_self'])
    + _MASKED * bool(kw['masked'])
  )


def with_bfloat16_products(params: dict) -> dict | None:
  """The parameters of a jaxpr's `ffi_call` of this kernel (forward or
  backward) with its products reading bfloat16 inputs, summed in float32
  (`precision.products = 'bfloat16'`: the kernel computes so where it was
  built for AVX512-BF16, in float32 elsewhere); None for any other call."""
  if params.get('target_name') not in _TARGETS:
    return None
  attributes = tuple(
    (name, np.int64(value | _BF16) if name == 'flags' else value)
    for name, value in params['attributes']
  )
  return {**params, 'attributes': attributes}


def _call(target, outputs, *args, chunk, before, flags):
  return jax.ffi.ffi_call(target, outputs, vmap_method='broadcast_all')(
    *args, chunk=np.int64(chunk), before=np.int64(before), flags=np.int64(flags)
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def fused(q, k, v, qi, ki, chunk, before, flags):
  """`(out, logsumexp)` of chunked attention: `q`, `k` `[..., n, d]` (keys
  scaled as Trax's `attend` scales them), `v` `[..., n, dv]`, `qi`, `ki`
  `[..., n]` int32 positions as Trax's `attend` masks them (one-based)."""
  out = jax.ShapeDtypeStruct(v.shape, jnp.float32)
  lse = jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)
  return tuple(
    _call(
      'jade_chunk_attention_forward', (out, lse), q, k, v, qi, ki,
      chunk=chunk, before=before, flags=flags,
    )
  )  # fmt: skip


class _Saved(NamedTuple):
  """What the backward kernel reads of a forward call."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  qi: jax.Array
  ki: jax.Array
  o: jax.Array
  lse: jax.Array


def _fused_forward(q, k, v, qi, ki, chunk, before, flags):
  o, lse = fused(q, k, v, qi, ki, chunk, before, flags)
  return (o, lse), _Saved(q, k, v, qi, ki, o, lse)


def _fused_backward(chunk, before, flags, saved: _Saved, grads):
  go, glse = grads
  gq, gk, gv = _call(
    'jade_chunk_attention_backward',
    tuple(
      jax.ShapeDtypeStruct(x.shape, jnp.float32)
      for x in (saved.q, saved.k, saved.v)
    ),
    saved.q, saved.k, saved.v, saved.o, saved.lse, go, glse, saved.qi,
    saved.ki, chunk=chunk, before=before, flags=flags,
  )  # fmt: skip
  return gq, gk, gv, None, None


fused.defvjp(_fused_forward, _fused_backward)


def _fusable(q, k, v, chunk, kv_chunk, before, after, flags, dropout) -> bool:
  arrays = [q, v] + ([] if k is None else [k])
  return (
    flags is not None
    and chunk is not None
    and kv_chunk in (None, chunk)
    and after == 0
    and not dropout
    and all(a.dtype == jnp.float32 for a in arrays)
    and q.shape[-2] == v.shape[-2]
    and q.shape[-2] % chunk == 0
    and (k is None or k.shape[-2] == q.shape[-2])
    and takes(q.shape[-2], chunk, before)
  )


def takes(rows: int, chunk: int, before: int) -> bool:
  """Whether a call of `rows` queries in chunks of `chunk`, each reading
  `before` chunks back, runs the kernel here (its size, `JADE_CHUNK_KERNEL`,
  XLA's CPU backend and the kernels built), given the rest of what it
  needs (float32, Trax's mask, no dropout): what the pre-flight's time
  estimate counts at the kernel's rate (`src.model.preflight`)."""
  mode = kernel_mode()
  return (
    mode != 'off'
    and (mode == 'always' or rows * chunk * (before + 1) >= MIN_SCORES)
    and kernels.available()
  )


def skips_dead_tiles() -> bool:
  """Whether the kernel skips the key tiles the causal mask zeroes (unless
  `JADE_CHUNK_SKIP=off`): the call's flag and the pre-flight's count."""
  return not switches.off('JADE_CHUNK_SKIP')


def live_share(
  length: int,
  chunk: int,
  before: int,
  n_hashes: int = 1,
  n_buckets: int = 0,
  bf16: bool = False,
) -> float:
  """The share of key tiles the kernel scores in a causal call on windows
  of `length` tokens, chunks of `chunk` sorted rows each reading `before`
  chunks back; the others it skips (their keys all come after every query
  of a pass). Counted on one window sorted as LSH sorts it (by hash round,
  bucket, then position), with each round's `n_buckets` buckets drawn at
  random (`n_buckets = 0`: by position, a local layer): 0.81, 0.57 and
  0.52 for the walkthrough's LSH layers in runs 1, 3 and 4 with AVX2's
  passes of 48 rows, where the kernel found 20.1%, 40.6% and 47.5% of
  the tiles dead on trained buckets (BENCHMARKS.md "Skipping the key
  tiles the mask zeroes"). 1.0 where nothing is skipped
  (`JADE_CHUNK_SKIP=off`, no kernel). `bf16`: the call's products are
  bfloat16 (on AMX a pass takes more rows, so more tiles are live)."""
  if not skips_dead_tiles() or not kernels.ready():
    return 1.0
  rng = np.random.default_rng(0)
  at = np.tile(np.arange(length), n_hashes)
  if n_buckets:
    rounds = np.repeat(np.arange(n_hashes), length)
    at = at[np.lexsort((at, rng.integers(0, n_buckets, at.size), rounds))]
  if at.size % chunk:
    return 1.0  # Not a call the kernel takes.
  at = at.reshape(-1, chunk)
  tiles = np.minimum.reduceat(at, np.arange(0, chunk, 16), axis=1)
  rows = kernels.pass_rows(chunk, (before + 1) * chunk, bf16)
  last = np.maximum.reduceat(at, np.arange(0, chunk, rows), axis=1)
  live = [np.roll(tiles, back, 0)[:, None] <= last[..., None] for back in
          range(before + 1)]  # fmt: skip
  return float(np.mean(live))


def attend(
  q, k=None, v=None, q_chunk_len=None, kv_chunk_len=None,
  n_chunks_before=0, n_chunks_after=0, mask_fn=None, q_info=None,
  kv_info=None, dropout=0.0, rng=None,
):  # fmt: skip
  """Trax's `efficient_attention.attend`: `(out [n, dv], logsumexp [n])`,
  by the fused kernel where it applies (module docstring)."""
  flags = _mask_flags(mask_fn)
  if v is None or not _fusable(
    q,
    k,
    v,
    q_chunk_len,
    kv_chunk_len,
    n_chunks_before,
    n_chunks_after,
    flags,
    dropout,
  ):
    return ea.attend(
      q, k, v, q_chunk_len=q_chunk_len, kv_chunk_len=kv_chunk_len,
      n_chunks_before=n_chunks_before, n_chunks_after=n_chunks_after,
      mask_fn=mask_fn, q_info=q_info, kv_info=kv_info, dropout=dropout,
      rng=rng,
    )  # fmt: skip
  # Positions one-based, as Trax's `attend` makes them (keys: the queries'
  # where they share them; `_fusable` checked keys and queries are as many).
  in_order = jnp.arange(1, q.shape[-2] + 1, dtype=jnp.int32)
  qi = in_order if q_info is None else q_info + 1
  ki = (in_order if k is not None else qi) if kv_info is None else kv_info + 1
  if k is None and layer_norm.rows_fusable(q):  # Shared, by the kernel.
    k = layer_norm.unit_rows(q, 1 / math.sqrt(q.shape[-1]))
  else:
    if k is None:  # Shared queries and keys, as Trax's.
      k = ea.length_normalized(q)
    k = k / jnp.sqrt(jnp.asarray(k.shape[-1], k.dtype))
  qi = jnp.broadcast_to(qi.astype(jnp.int32), q.shape[:-1])
  ki = jnp.broadcast_to(ki.astype(jnp.int32), k.shape[:-1])
  if not skips_dead_tiles():
    flags |= _EVERY_TILE
  return fused(q, k, v, qi, ki, q_chunk_len, n_chunks_before, flags)
