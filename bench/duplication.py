"""The Reformer paper's duplication task, scaled to this machine.

  python bench/duplication.py WORK_DIR [--length 256] [--steps 2000]
      [--variants full,lsh,lsh-only,lsh-shared] [--layers 3] [--batch 8]
      [--train-hashes 2] [--eval-hashes 1,2,4,8] [--bind GIN]...
      [--task duplication|recall] [--pairs 63]

Kitaev et al. 2020 (Section 5, Table 2): sequences `0 w 0 w`, `w` a random
string of symbols 1..V-1; a model that predicts the second `w` must find,
for each of its symbols, the matching place in the first half: a lookup
by content and position over half the sequence. Accuracy is the share of
the second half's symbols predicted exactly (teacher-forced, greedy).

Each variant is our model (`src.model.reformer.reformer_lm` under
gin/tiny.gin plus the variant's bindings; d_model 128, 2 heads, 3
blocks), trained by Trax's own `Loop` with Trax's weighted cross-entropy
on the second half only:

- `full`: full attention (`SelfAttention`, separate queries and keys) in
  every block;
- `lsh`: as shipped (gin/tiny.gin): a local block (`SelfAttention`
  within 32-token chunks and the chunk before), a directed LSH block
  (`DirectedLSHSelfAttention`), a local block. The second `w` is `length / 2`
  tokens after the first, beyond the local blocks' reach: only the LSH
  block can copy it;
- `lsh-first`: the order shipped before (LSH, local, local);
- `lsh-only`: directed LSH in every block, `--train-hashes` hashes;
- `lsh-shared`: Trax's LSH as it is (shared queries and keys only) in
  every block.

`lsh-second` (local, LSH, local: the shipped order by name) and
`lsh-alternate` (LSH, local, LSH) place the LSH block after a local
one. `--task recall` trains the same variants on associative recall
instead (`recall_batches`: a value looked up by the key stated before
it; `--pairs` per sequence).

`--trax-alone` builds `trax.models.ReformerLM` directly instead (Trax's
own axial start; the same gin settings, Trax's Loop and loss).

LSH-trained models are evaluated with each of `--eval-hashes`, and
`lsh-shared` also with full attention over its shared queries and keys
(the paper's "full" column: `SelfAttention.share_qk = True` on the same
weights). Prints the learning
curve (held-out accuracy every `--steps / 10` steps) and the paper's
train x eval table; results in WORK_DIR/duplication.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402
from src.analysis import symbols  # noqa: E402

VOCAB = 128  # Symbols 1..127 and the separator 0, as in the paper.

# Kitaev et al. 2020, Table 2: accuracy on the duplication task (length
# 1024, 1 layer, d_model 256, 4 heads, 150k steps), rows: the attention
# the model was trained with; columns: the attention it was evaluated with.
PAPER = {
  'columns': ['full', 'LSH-8', 'LSH-4', 'LSH-2', 'LSH-1'],
  'rows': {
    'full attention': [100.0, 94.8, 92.5, 76.9, 52.5],
    'LSH-4': [0.8, 100.0, 99.9, 99.4, 91.9],
    'LSH-2': [0.8, 100.0, 99.9, 98.1, 86.8],
    'LSH-1': [0.8, 99.9, 99.6, 94.8, 77.9],
  },
}

LOCAL = [
  'SelfAttention.chunk_len = 32',
  'SelfAttention.n_chunks_before = 1',
]
VARIANTS = {
  'full': [
    'ReformerLM.attention_type = @SelfAttention',
    'SelfAttention.chunk_len = None',
    'SelfAttention.n_chunks_before = 0',
  ],
  # As shipped (gin/tiny.gin): local, directed LSH, local.
  'lsh': [*LOCAL],
  # The order shipped before "Local, LSH, local": LSH, local, local.
  'lsh-first': [*LOCAL, *common.VARIANTS['lsh-first']],
  # Directed LSH in every block.
  'lsh-only': common.VARIANTS['lsh-only'],
  # A local block first, then LSH, then local (= gin/tiny.gin now): LSH
  # can match what the first block gathered (the token before a value).
  'lsh-second': [
    *LOCAL,
    'ReformerLM.attention_type = '
    '[@LocalSelfAttention, @DirectedLSHSelfAttention, @LocalSelfAttention]',
  ],
  # LSH, local, LSH: the pattern of gin/reformer_32k.gin.
  'lsh-alternate': [
    *LOCAL,
    'ReformerLM.attention_type = [@DirectedLSHSelfAttention, '
    '@LocalSelfAttention, @DirectedLSHSelfAttention]',
  ],
  # Trax's LSH (shared queries and keys only) in every block.
  'lsh-shared': common.VARIANTS['lsh-shared'],
}


TASK = 'duplication'  # --task: 'duplication' or 'recall'.
PAIRS = 63  # --pairs: key/value pairs per recall sequence (at most 63).


def batches(rng, batch: int, length: int):
  """Endless `(inputs, targets, weights)` of `--task`'s sequences."""
  if TASK == 'recall':
    return symbols.recall_batches(rng, batch, length, PAIRS)
  return symbols.duplication_batches(rng, batch, length)


def model_bindings(length: int, layers, hashes: int) -> list[str]:
  side = 2 ** (int(np.log2(length)) // 2)
  return [
    f'ReformerLM.max_len = {length}',
    f'ReformerLM.pos_axial_shape = ({side}, {length // side})',
    *([f'ReformerLM.n_layers = {layers}'] if layers else []),
    'ReformerLM.dropout = 0.0',
    f'LSHSelfAttention.n_buckets = {max(2, length // 32)}',
    f'LSHSelfAttention.n_hashes = {hashes}',
    f'LSHSelfAttention.predict_mem_len = {length}',
  ]


TRAX_ALONE = False  # --trax-alone: Trax's ReformerLM as Trax builds it.


def build(mode: str, bindings: list[str]):
  """Our model under gin/tiny.gin plus `bindings` (no tokenizer: symbols);
  with `--trax-alone`, `trax.models.ReformerLM` itself (Trax's axial
  start, none of our model code)."""
  import trax

  from src.model import ginconf

  ginconf.parse(os.path.join(ROOT, 'gin', 'tiny.gin'), tuple(bindings))
  if TRAX_ALONE:
    return trax.models.ReformerLM(VOCAB, mode=mode)
  if mode == 'train':
    return ginconf.fresh_model(VOCAB)
  return ginconf.model(VOCAB, mode)


def accuracy(layer, weights, data, n_batches: int) -> float:
  """Share of weighted positions whose argmax is the target."""
  import jax

  from src.inference import scoring

  forward = scoring.forward_fn(layer, weights)
  right = total = 0.0
  for i in range(n_batches):
    x, y, w = next(data)
    logits = forward(x, jax.random.PRNGKey(i))
    guess = np.asarray(logits).argmax(-1)
    right += float(((guess == y) * w).sum())
    total += float(w.sum())
  return right / total


def evaluate(weights, base: list[str], attention: str, length: int, seed=7):
  """Accuracy of trained `weights` with another attention at eval time:
  'full' (shared queries/keys, every position in view) or 'lsh-N'."""
  import trax

  if attention == 'full':
    binds = base + VARIANTS['full'] + ['SelfAttention.share_qk = True']
  else:
    binds = base + [f'LSHSelfAttention.n_hashes = {int(attention[4:])}']
  layer = build('eval', binds)
  layer.init(trax.shapes.ShapeDtype((1, length), np.int32))
  data = batches(np.random.default_rng(seed), 8, length)
  return accuracy(layer, weights, data, 8)


def train(name, binds, args, log=print):
  """Trains one variant; returns (weights, curve {step: accuracy}, s)."""
  lm = build('train', binds)
  curve, seconds = symbols.train(
    lm,
    batches(np.random.default_rng(0), args.batch, args.length),
    batches(np.random.default_rng(1), args.batch, args.length),
    args.steps,
    args.rate,
    args.warmup,
    every=max(args.steps // 10, 1),
  )
  log(f'{name}: accuracy by step {curve}')
  return lm.weights, curve, seconds


def run_peer(args) -> dict:
  """The same task through reformer-pytorch's `ReformerLM` (run in the
  peer's own environment: `--peer-python`): LSH in every layer (its
  default; `n_local_attn_heads` 0), the same sizes, steps, batch, rate and
  warmup. Returns `{'curve': {step: accuracy}, 'seconds': s}`."""
  import torch
  from reformer_pytorch import ReformerLM

  torch.manual_seed(0)
  side = 2 ** (int(np.log2(args.length)) // 2)
  lm = ReformerLM(
    num_tokens=VOCAB,
    dim=128,  # gin/tiny.gin's sizes.
    depth=args.layers or 3,  # gin/tiny.gin's blocks.
    max_seq_len=args.length,
    heads=2,
    dim_head=32,
    bucket_size=32,
    n_hashes=args.train_hashes,
    ff_mult=2,
    causal=True,
    axial_position_emb=True,
    axial_position_shape=(side, args.length // side),
  )
  opt = torch.optim.Adam(lm.parameters(), lr=args.rate, betas=(0.9, 0.98))
  warm = lambda step: min(1.0, (step + 1) / max(args.warmup, 1))
  sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
  train = batches(np.random.default_rng(0), args.batch, args.length)
  every = max(args.steps // 10, 1)
  curve, t0 = {}, time.time()
  for step in range(1, args.steps + 1):
    x, y, w = (torch.from_numpy(a) for a in next(train))
    # Position i predicts token i from tokens < i (a zero first input).
    inp = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1).long()
    logits = lm(inp)
    nll = torch.nn.functional.cross_entropy(
      logits.reshape(-1, VOCAB), y.reshape(-1).long(), reduction='none'
    )
    loss = (nll * w.reshape(-1)).sum() / w.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
    opt.step()
    sched.step()
    if step % every == 0:
      lm.eval()
      held = batches(np.random.default_rng(1), args.batch, args.length)
      right = total = 0.0
      with torch.no_grad():
        for _ in range(4):
          x, y, w = next(held)
          inp = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], 1)
          guess = lm(torch.from_numpy(inp).long()).argmax(-1).numpy()
          right += float(((guess == y) * w).sum())
          total += float(w.sum())
      curve[step] = round(right / total, 4)
      print(f'peer: step {step} accuracy {curve[step]}', flush=True)
      lm.train()
  return {'curve': curve, 'seconds': round(time.time() - t0)}


def first_step_above(curve: dict, level: float):
  return next((s for s, a in sorted(curve.items()) if a and a >= level), None)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('work')
  parser.add_argument('--length', type=int, default=256)
  parser.add_argument('--steps', type=int, default=2000)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument(
    '--layers', type=int, default=None, help="blocks (gin/tiny.gin's)"
  )
  parser.add_argument('--rate', type=float, default=0.001)
  parser.add_argument('--warmup', type=int, default=200)
  parser.add_argument('--variants', default='full,lsh,lsh-only,lsh-shared')
  parser.add_argument('--train-hashes', type=int, default=2)
  parser.add_argument('--eval-hashes', default='1,2,4,8')
  parser.add_argument('--bind', action='append', default=[])
  parser.add_argument('--trax-alone', action='store_true')
  parser.add_argument(
    '--task',
    choices=['duplication', 'recall'],
    default='duplication',
    help='recall: associative recall (recall_batches) instead of 0w0w',
  )
  parser.add_argument(
    '--pairs', type=int, default=63, help='--task recall: pairs per sequence'
  )
  parser.add_argument(
    '--peer-python',
    help='a python with bench/requirements.txt: adds the reformer-pytorch row',
  )
  parser.add_argument('--as-peer', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.pairs < 1:
    parser.error(f'--pairs {args.pairs}: give at least 1 (at most 63 are used)')
  global TRAX_ALONE, TASK, PAIRS
  TRAX_ALONE = args.trax_alone
  TASK, PAIRS = args.task, args.pairs
  if args.as_peer:  # The child run by --peer-python: torch only.
    print('PEER ' + json.dumps(run_peer(args)))
    return 0
  from src import runtime

  runtime.bootstrap()

  os.makedirs(args.work, exist_ok=True)
  report = {'args': vars(args), 'paper': PAPER, 'runs': {}}
  for name in [v for v in args.variants.split(',') if v]:
    if name not in VARIANTS:
      raise SystemExit(
        f'error: --variants: {name!r} is not one of {list(VARIANTS)}'
      )
    base = model_bindings(args.length, args.layers, args.train_hashes)
    binds = base + VARIANTS[name] + args.bind
    weights, curve, seconds = train(name, binds, args)
    evals = {}
    if name == 'lsh-shared':  # The others have weights full attention lacks.
      evals['full'] = evaluate(weights, binds, 'full', args.length)
    if name != 'full':
      for h in args.eval_hashes.split(','):
        evals[f'LSH-{h}'] = evaluate(weights, binds, f'lsh-{h}', args.length)
    else:
      evals['full'] = curve[max(curve)]
    report['runs'][name] = {
      'curve': curve,
      'eval': {k: round(v, 4) for k, v in evals.items()},
      'seconds': round(seconds),
      'leaves_chance_at': first_step_above(curve, 0.1),
      'above_90_at': first_step_above(curve, 0.9),
    }
    with open(os.path.join(args.work, 'duplication.json'), 'w') as f:
      json.dump(report, f, indent=2)
  if args.peer_python:
    import subprocess

    argv_peer = [a for a in (argv or sys.argv[1:]) if a != args.peer_python]
    argv_peer = [a for a in argv_peer if a != '--peer-python']
    out = subprocess.run(
      [args.peer_python, os.path.abspath(__file__), *argv_peer, '--as-peer'],
      capture_output=True,
      text=True,
    )
    line = [x for x in out.stdout.splitlines() if x.startswith('PEER ')]
    if not line:
      raise SystemExit(f'error: the peer run failed:\n{out.stderr[-2000:]}')
    peer = json.loads(line[-1][5:])
    peer['curve'] = {int(k): v for k, v in peer['curve'].items()}
    last = peer['curve'][max(peer['curve'])]
    peer.update(
      eval={f'LSH-{args.train_hashes}': last},
      leaves_chance_at=first_step_above(peer['curve'], 0.1),
      above_90_at=first_step_above(peer['curve'], 0.9),
    )
    report['runs']['reformer-pytorch (LSH)'] = peer
    with open(os.path.join(args.work, 'duplication.json'), 'w') as f:
      json.dump(report, f, indent=2)
  cols = ['full'] + [f'LSH-{h}' for h in args.eval_hashes.split(',')]
  print('| trained with | ' + ' | '.join(cols) + ' | 90% at step |')
  print('|-|' + '-|' * (len(cols) + 1))
  for name, r in report['runs'].items():
    cells = [
      f'{100 * r["eval"][c]:.1f}' if c in r['eval'] else '-' for c in cols
    ]
    print(f'| {name} | ' + ' | '.join(cells) + f' | {r["above_90_at"]} |')
  return 0


if __name__ == '__main__':
  main()
