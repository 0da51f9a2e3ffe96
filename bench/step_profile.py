"""Where a training step of bench/train_speed.py's model goes, part by part.

  python bench/step_profile.py                       # 32k, vocabulary 500
  python bench/step_profile.py --vocab 32000 --step-seconds 15.2

Builds the benchmark model of `bench/train_speed.py` (the same gin
bindings, `jade_bindings`), takes its own layers and weights out of the
Trax model and times each part alone under `jax.jit` (best of `--reps`):

- in one LSH attention layer (its heads at once, under `vmap`, as the
  benchmark model runs them: `n_parallel_heads` covers them): the
  query/key and value projections, the hashing,
  the sort and the gathers into bucket order (`gather_rows`' kernel where
  it runs), the chunked attention (`attend`: scores, softmax, scores x
  values; the fused kernel where it runs), the unsort, the output
  projection (the heads' summed in one product, `heads.project`);
- one whole attention branch (layer norm + the LSH layer, all heads) and
  one feed-forward branch (layer norm + the chunked feed-forward), as the
  reversible block calls them;
- the embeddings and axial positions, the output layer and its loss
  (`losses.chunked_cross_entropy`), Adam's update of every weight.

Each part's forward alone (`fwd`) and its forward + backward (`vjp`). In a
reversible step a block's branch runs its forward once going forward and
again, with its backward, going back: its share of a step is `layers x
(fwd + vjp)`; the embeddings and the output layer run `vjp` once. The
rate is the part's FLOPs (matrix products only, counted below) over its
time, against the measured matmul peak (bench/train_speed.py). With
`--step-seconds` (a step measured by train_speed.py) the rest (Trax's
loop, the reversible bookkeeping, copies) is the difference.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import CHUNK, D_FF, D_HEAD, HEADS, LAYERS, D  # noqa: E402
from bench.train_speed import cpu_name, jade_bindings, matmul_peak  # noqa: E402
from src import runtime  # noqa: E402

runtime.bootstrap()  # XLA flags, quiet logs, the Trax patches: first.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# How a part runs in a step: once (its forward and backward), in every
# reversible block (forward, then forward again with the backward), or
# inside such a part (shown alone, counted in its part).
ONCE, REVERSIBLE, INSIDE = 'once', 'reversible', 'inside'


def best_time(fn, args, reps):
  jax.block_until_ready(fn(*args))
  best = float('inf')
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best


def fwd_and_vjp(fn, args, reps, wrt=None):
  """(forward seconds, forward + backward seconds) of `fn(*args)`, the
  gradient taken w.r.t. the float arguments (or the positions in `wrt`).
  The backward's cotangents are random and passed in as arguments: with
  ones (a constant), XLA folds a linear part's backward into sums and the
  forward + backward of a projection timed less than its forward."""
  wrt = (
    wrt
    if wrt is not None
    else [
      i
      for i, a in enumerate(args)
      if not (hasattr(a, 'dtype') and jnp.issubdtype(a.dtype, jnp.integer))
    ]
  )

  def forward(*free, a):
    full = list(a)
    for i, f in zip(wrt, free):
      full[i] = f
    out = fn(*full)
    return [x for x in jax.tree.leaves(out) if x.dtype == jnp.float32]

  shapes = jax.eval_shape(lambda *a: forward(*[a[i] for i in wrt], a=a), *args)
  keys = jax.random.split(jax.random.PRNGKey(1), len(shapes))
  cotangents = [jax.random.normal(k, o.shape) for k, o in zip(keys, shapes)]

  def with_grad(args, cotangents):
    free = [args[i] for i in wrt]
    _, pull = jax.vjp(lambda *f: forward(*f, a=args), *free)
    return pull(cotangents)

  return best_time(jax.jit(fn), args, reps), best_time(
    jax.jit(with_grad), (args, cotangents), reps
  )


def build(length, vocab):
  from src.model import ginconf

  ginconf.parse(
    os.path.join(ROOT, 'gin', 'tiny.gin'), tuple(jade_bindings(length))
  )
  return ginconf.init_model(vocab, 'train', length)


def head_parts(layer, weights, x, reps):
  """Rows of one LSH layer's parts, all heads at once as Trax runs them
  (`vmap` over the heads): (name, fwd s, vjp s, FLOPs fwd)."""
  from trax.layers.research import efficient_attention as ea

  from src.model import attention, chunk_attention, gather_rows, lsh_hash

  n, buckets_n = x.shape[0], x.shape[0] // CHUNK
  wq, wv, wo = (layer.weight(weights, r) for r in ('q', 'v', 'o'))
  keys = jax.random.split(jax.random.PRNGKey(0), HEADS)
  turns = jax.vmap(lambda k: lsh_hash.draw_rotations(k, D_HEAD, 1, buckets_n))(
    keys
  )

  def each(fn, *axes):
    return jax.vmap(fn, in_axes=axes or 0)

  def project(x, wq, wv):
    return x @ wq, x @ wv

  def hashing(q, turns):
    return lsh_hash.hash_rounds(q, turns, buckets_n)

  def sort(buckets):
    sticker, undo = attention._sort_order(buckets, n, 1)
    return sticker % n, sticker, undo

  def gather(q, v, st):
    return gather_rows.take_rows(q, st), gather_rows.take_rows(v, st)

  def attend(sq, sv, st):  # The step's: the fused kernel where it runs.
    return chunk_attention.attend(
      sq,
      k=None,
      v=sv,
      q_chunk_len=CHUNK,
      n_chunks_before=1,
      n_chunks_after=0,
      mask_fn=functools.partial(
        ea.mask_self_attention, causal=True, exclude_self=True, masked=False
      ),
      q_info=st,
      kv_info=None,
      dropout=0.0,
      rng=None,
    )

  def unsort(so, slogits, undo, sticker):
    return attention._unsorted(so, slogits, undo, sticker, 1, n)

  def output(o, wo):  # All heads in one product (src/model/heads.py).
    return jnp.einsum('hnd,hde->ne', o, wo)

  q, v = each(project, None, 0, 0)(x, wq, wv)
  buckets = each(hashing)(q, turns)
  st, sticker, undo = each(sort)(buckets)
  sq, sv = each(gather)(q, v, st)
  so, slogits = each(attend)(sq, sv, st)
  o = each(unsort)(so, slogits, undo, sticker)
  rows = [
    (
      'projections q/k, v',
      each(project, None, 0, 0),
      (x, wq, wv),
      [0, 1, 2],
      2 * 2 * n * D * D_HEAD,
    ),
    (
      'hashing (rotations, bucket ids)',
      each(hashing),
      (q, turns),
      [],
      2 * n * D_HEAD * (buckets_n // 2),
    ),
    ('sort (keys) + undo (scatter)', each(sort), (buckets,), [], 0),
    ('gathers into bucket order', each(gather), (q, v, st), [0, 1], 0),
    (
      'chunked attention (attend)',
      each(attend),
      (sq, sv, st),
      [0, 1],
      2 * 2 * n * D_HEAD * 2 * CHUNK,
    ),
    (
      'unsort (gathers back)',
      each(unsort),
      (so, slogits, undo, sticker),
      [0, 1],
      0,
    ),
    (
      'output projection (heads summed)',
      output,
      (o, wo),
      [0, 1],
      2 * n * D_HEAD * D,
    ),
  ]
  out = []
  for name, fn, args, wrt, flops in rows:
    if not wrt:  # No gradient flows through it: the same in both passes.
      f = best_time(jax.jit(fn), args, reps)
      out.append((name, f, f, HEADS * flops))
    else:
      out.append((name, *fwd_and_vjp(fn, args, reps, wrt), HEADS * flops))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--length', type=int, default=32768)
  parser.add_argument('--vocab', type=int, default=500)
  parser.add_argument('--reps', type=int, default=3)
  parser.add_argument('--step-seconds', type=float, default=None)
  args = parser.parse_args()
  from trax import layers as tl

  from src.model import losses, reformer

  n, vocab = args.length, args.vocab
  peak = matmul_peak()
  model = build(n, vocab)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(1, n, D)) / np.sqrt(D), jnp.float32)
  lsh = reformer.lsh_layers(model)[0]
  blocks = [
    node
    for node in reformer.all_layers(model)
    if isinstance(node, tl.ReversibleHalfResidual)
  ]
  attn_branch, ff_branch = blocks[0], blocks[1]
  table = []

  for name, f, g, flops in head_parts(lsh, lsh.weights, x[0], args.reps):
    # Inside the attention branch: shown, not added to the total.
    table.append((f'LSH layer: {name}', f, g, flops, LAYERS, INSIDE))

  def branch(layer):
    def fn(x, w):
      return layer.pure_fn((x, x), w, layer.state, jax.random.PRNGKey(0))[0]

    return fn

  for name, layer, flops in (
    (
      'attention branch (LN + LSH, 4 heads)',
      attn_branch,
      HEADS * (2 * 3 * n * D * D_HEAD + 2 * 2 * n * D_HEAD * 2 * CHUNK),
    ),
    ('feed-forward branch (LN + chunked FF)', ff_branch, 2 * 2 * n * D * D_FF),
  ):
    f, g = fwd_and_vjp(branch(layer), (x, layer.weights), args.reps)
    table.append((name, f, g, flops, LAYERS, REVERSIBLE))

  emb = model.sublayers[1]
  ids = jnp.asarray(rng.integers(1, vocab, (1, n)), jnp.int32)
  f, g = fwd_and_vjp(
    lambda w: emb.pure_fn(ids, w, emb.state, None)[0], (emb.weights,), args.reps
  )
  table.append(('token embedding', f, g, 0, 1, ONCE))
  pos = model.sublayers[3]
  f, g = fwd_and_vjp(
    lambda x, w: pos.pure_fn(x, w, pos.state, jax.random.PRNGKey(0))[0],
    (x, pos.weights),
    args.reps,
  )
  table.append(('axial positions', f, g, 0, 1, ONCE))
  # Trax's ReformerLM concatenates the two residual halves before its
  # output layer: it reads 2 x d_model features.
  halves = jnp.concatenate([x, x], -1)
  kernel = jnp.asarray(
    rng.normal(size=(2 * D, vocab)) / np.sqrt(2 * D), jnp.float32
  )
  bias = jnp.zeros([vocab], jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, (1, n)), jnp.int32)
  weights = jnp.ones((1, n), jnp.float32)

  def loss(x, kernel, bias):
    return losses.chunked_cross_entropy(
      x, kernel, bias, targets, weights, 512, with_hits=True
    )[0]

  f, g = fwd_and_vjp(loss, (halves, kernel, bias), args.reps)
  table.append(
    (
      f'output layer + loss (vocab {vocab}, chunks of 512)',
      f,
      g,
      2 * n * 2 * D * vocab,
      1,
      ONCE,
    )
  )
  report(table, model, n, vocab, peak, args)


def adam_seconds(model, reps):
  import trax

  opt = trax.optimizers.Adam(1e-4)
  w = model.weights
  opt.tree_init(w)
  slots, params = opt.slots, opt.opt_params
  step = jax.jit(lambda w, g, s: opt.tree_update(1, g, w, s, params))
  return best_time(step, (w, w, slots), reps)


def report(table, model, n, vocab, peak, args):
  print(
    f'{cpu_name()}; matmul peak {peak:.0f} GFLOP/s; '
    f'length {n}, vocabulary {vocab}'
  )
  print(
    '| part | fwd ms | fwd+bwd ms | x per step | s per step | '
    'FLOPs per step (G) | GFLOP/s | % of peak |'
  )
  print('|---|---:|---:|---:|---:|---:|---:|---:|')
  total = 0.0
  for name, f, g, flops, times, kind in table:
    reversible = kind != ONCE
    # Reversible: forward, then forward again with the backward; the
    # forward's FLOPs x 4 (forward twice, backward twice as many).
    seconds = times * (f + g) if reversible else times * g
    work = times * flops * (4 if reversible else 3)
    rate = work / seconds / 1e9 if work else 0
    if kind != INSIDE:
      total += seconds
    print(
      f'| {name} | {1000 * f:.1f} | {1000 * g:.1f} | {times} | {seconds:.2f} | '
      f'{work / 1e9:.0f} | {rate:.0f} | {100 * rate / peak:.0f}% |'
    )
  adam = adam_seconds(model, args.reps)
  total += adam
  print(
    f'| Adam update (all weights) | | {1000 * adam:.1f} | 1 | '
    f'{adam:.2f} | | | |'
  )
  print(f'| **parts together** | | | | **{total:.2f}** | | | |')
  if args.step_seconds:
    rest = args.step_seconds - total
    print(
      f'| rest of the measured {args.step_seconds:.2f} s step (loop, '
      f'reversible bookkeeping, copies) | | | | {rest:.2f} | | | |'
    )


if __name__ == '__main__':
  main()
