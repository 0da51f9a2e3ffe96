"""Does a model of this project find a fact 4k-32k tokens back?

  python bench/far_recall.py WORK_DIR [--train-length 256] [--steps 3000]
      [--batch 8] [--facts 16] [--offset random|zero] [--rate 0.003]
      [--no-words] [--filler-weight 0.1] [--train-buckets N]
      [--lengths 256,1024,4096,16384,32768] [--eval-hashes 2,8]
      [--eval-buckets N] [--samples 16] [--seed N] [--bind GIN]...
      [--eval-only]

The task is `src/analysis/far_recall.py`'s: facts `v k` stated once,
filler, then `? k` asked; only the answers are scored (chance 1/32).

The filler is a text of words (`--no-words`: random symbols), and it
weighs `--filler-weight` in the training loss (the answers 1.0): that
teaches each position its previous symbol, the first half of the lookup.
Accuracy is always on the answers alone.

The model is gin/tiny.gin's (local, directed LSH, local; d_model 128) with
a 32,768-token position grid (`pos_axial_shape = (128, 256)`), trained on
windows of `--train-length` tokens (facts and questions at random places
in each window) placed at random offsets of the grid (`--offset random`;
`zero`: every window at positions 0..length-1, as training at max_len
does). LSH buckets scale with the length (one per 32 positions, the
chunk), in training and at each evaluation length; `--eval-buckets N`
evaluates with N buckets instead, each chunk `length / N` positions, and
`--train-buckets N` trains with N buckets (chunks of 32 still, unless the
window is longer than 32 N).

Then, for each length of `--lengths`, `--samples` sequences of that many
tokens with the facts at the start and the questions at the end (so the
distance is about the length) are scored with each of `--eval-hashes`
hash rounds, and once with the facts left out (the no-fact baseline).
Prints a table; results in WORK_DIR/far_recall.json, the trained weights
in WORK_DIR/far_recall_weights.npz (`--eval-only` re-scores them).
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

from src import runtime  # noqa: E402
from src.analysis import far_recall as task  # noqa: E402


def save(path: str, weights):
  import jax

  leaves = jax.tree_util.tree_leaves(weights)
  np.savez(path, *[np.asarray(x) for x in leaves])


def load(path: str) -> list:
  """The saved weights, as a flat list (`task.measure` shapes them)."""
  with np.load(path, allow_pickle=False) as f:
    return [f[f'arr_{i}'] for i in range(len(f.files))]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('work_dir')
  p.add_argument('--train-length', type=int, default=256)
  p.add_argument('--steps', type=int, default=3000)
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--facts', type=int, default=16)
  p.add_argument('--rate', type=float, default=0.003)
  p.add_argument('--offset', choices=('random', 'zero'), default='random')
  p.add_argument('--words', action=argparse.BooleanOptionalAction, default=True)
  p.add_argument('--filler-weight', type=float, default=0.1)
  p.add_argument('--train-hashes', type=int, default=2)
  p.add_argument('--lengths', default='256,1024,4096,16384,32768')
  p.add_argument('--eval-hashes', default='2,8')
  p.add_argument('--samples', type=int, default=16)
  p.add_argument('--train-buckets', type=int, default=None)
  p.add_argument('--eval-buckets', type=int, default=None)
  p.add_argument('--seed', type=int, default=None)
  p.add_argument('--bind', action='append', default=[])
  p.add_argument('--eval-only', action='store_true')
  args = p.parse_args(argv)
  runtime.bootstrap()
  os.makedirs(args.work_dir, exist_ok=True)
  path = os.path.join(args.work_dir, 'far_recall_weights.npz')
  out = os.path.join(args.work_dir, 'far_recall.json')
  results = {}
  if os.path.exists(out):
    with open(out, encoding='utf-8') as f:
      results = json.load(f)
  if not args.eval_only:
    weights, curve, seconds = task.train(
      length=args.train_length,
      steps=args.steps,
      batch=args.batch,
      facts=args.facts,
      rate=args.rate,
      offset=args.offset,
      words=args.words,
      filler_weight=args.filler_weight,
      hashes=args.train_hashes,
      buckets=args.train_buckets,
      extra=args.bind,
      log=lambda line: print(line, flush=True),
      seed=args.seed,
    )
    save(path, weights)
    results = {
      'args': vars(args),
      'curve': curve,
      'train_s': round(seconds),
      'eval': {},
    }
  results.setdefault('eval', {})
  weights = load(path)
  for length in [int(x) for x in args.lengths.split(',')]:
    for hashes in [int(x) for x in args.eval_hashes.split(',')]:
      t0 = time.time()
      found = task.measure(
        weights,
        length,
        hashes,
        facts=args.facts,
        samples=args.samples,
        words=args.words,
        buckets=args.eval_buckets,
        extra=args.bind,
      )
      found['seconds'] = round(time.time() - t0)
      print(f'length {length}, {hashes} hashes: {found}', flush=True)
      key = f'{length}/{hashes}' + (
        f'/b{args.eval_buckets}' if args.eval_buckets else ''
      )
      results['eval'][key] = found
      with open(out, 'w', encoding='utf-8') as f:
        json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
