"""Long-range recall: does the model use what was said thousands of tokens ago?

  python bench/recall.py WORK_DIR [--context 4096] [--steps 2000]
      [--batch 2] [--attention lsh,full] [--samples 20]
      [--loss ai|answers] [--asks N] [--spread TOKENS] [--distances D,...]
      [--bind GIN]... [--score-only] [--smoke]

The task, built from real dialogue (ChatterBot English, all categories):
the user states a fact drawn at random, of six kinds (a name, a number, a
code word, a color, a city, a dog's name: "The code word is river."), the
AI acknowledges it, other real conversations follow, and later the user
asks for it ("What is the code word?") and the AI answers the bare value.

1. Writes a training set: long conversations (up to the context) in which
   every kind is stated once and asked once at a random later point, so a
   window holds several examples of the skill at distances from a few
   tokens to the context (`make_training_conversation`; `--spread`
   shortens them, so questions come within that many tokens of the fact).
2. Trains the tiny model (gin/tiny.gin) at `--context` tokens, with LSH
   attention and, for comparison, full attention (`SelfAttention`, the same
   size, the same steps); loss on the AI turns (`--loss answers`: only on
   the answers, the other AI turns are `|noloss|` context).
3. Scores answers on fresh samples (one fact, then filler, then the
   question) by distance in tokens (measured with the run's tokenizer), for
   1, 2 and 4 hashes at sampling time (LSH), and a no-fact baseline (the
   statement left out: what guessing scores).

Prints a markdown table for BENCHMARKS.md; for each distance: the share of
exact greedy answers; the probability the model gives the stated value
(found the fact; chance is 1/20 to 1/26 where every value starts with its
own piece, more where values share first pieces: the no-fact column is
the control); and in brackets the probability
on the asked kind's values (understood the question, which is right
there). Results in WORK_DIR/recall.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import train  # noqa: E402
from src.analysis import recall as task  # noqa: E402


def filler_conversations(work: str):
  from src.apps import convert
  from src.data import chatformat

  folder = os.path.join(work, 'chatterbot')
  if not os.path.isdir(folder):
    convert.main(['chatterbot', 'english', folder, '--trim'])
  return chatformat.read_data(folder)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('work')
  parser.add_argument('--context', type=int, default=4096)
  parser.add_argument('--steps', type=int, default=2000)
  parser.add_argument('--train-samples', type=int, default=3000)
  parser.add_argument('--attention', default='lsh,full')
  parser.add_argument('--samples', type=int, default=20)
  parser.add_argument('--batch', type=int, default=2)
  parser.add_argument(
    '--bind',
    action='append',
    default=[],
    help='an extra gin binding for training (repeatable)',
  )
  parser.add_argument(
    '--loss',
    choices=('ai', 'answers'),
    default='ai',
    help='train on every AI turn, or only on the answers (the other AI '
    "turns are context: '|noloss|')",
  )
  parser.add_argument(
    '--asks',
    type=int,
    default=1,
    help='times each kind is asked in a training conversation',
  )
  parser.add_argument(
    '--spread',
    type=int,
    help='tokens of filler in a training conversation (default: the '
    'context less 256): a small value puts each question within that many '
    'tokens of its fact',
  )
  parser.add_argument(
    '--distances',
    help='comma-separated distances to score (default: 256, 1024, 2048, '
    '3072, 6144 below the context less 512, and that)',
  )
  parser.add_argument(
    '--score-only',
    action='store_true',
    help='score the runs already in WORK_DIR (run-lsh, run-full) again',
  )
  parser.add_argument('--smoke', action='store_true')
  args = parser.parse_args(argv)
  if args.smoke:
    args.context, args.steps, args.train_samples, args.samples = 512, 4, 40, 2
  os.makedirs(args.work, exist_ok=True)
  filler = filler_conversations(args.work)
  data = os.path.join(args.work, 'recall-train.txt')
  # The questions and statements take the rest of the context.
  room = args.spread or args.context - 256
  asked = task.write_training_set(
    data, filler, args.train_samples, room, loss=args.loss, asks=args.asks
  )
  print(
    f'training set: {args.train_samples} conversations, {len(asked)} '
    f'questions, distances (estimated) median {np.median(asked):.0f}, '
    f'90th percentile {np.percentile(asked, 90):.0f}',
    flush=True,
  )
  # Scored up to half a typical conversation short of the context, so a
  # sample's context fits whole.
  longest = args.context - 512
  distances = [d for d in (256, 1024, 2048, 3072, 6144) if d < longest]
  distances = [*distances, longest] if longest > 0 else [args.context // 4]
  if args.distances:
    distances = [int(d) for d in args.distances.split(',')]
  report = {
    'context': args.context,
    'steps': args.steps,
    'batch': args.batch,
    'loss': args.loss,
    'asks': args.asks,
    'spread': room,
    'bindings': args.bind,
    'runs': {},
  }
  earlier = {}
  if args.score_only and os.path.exists(os.path.join(args.work, 'recall.json')):
    with open(os.path.join(args.work, 'recall.json')) as f:
      before = json.load(f)
    for name, r in before.get('runs', {}).items():
      key = 'run-full' if name == 'full' else 'run-lsh'
      earlier[key] = r.get('train_seconds', 0) or earlier.get(key, 0)
    # How the runs were trained is what the earlier report says.
    for k in ('steps', 'batch', 'loss', 'asks', 'spread', 'bindings'):
      if k in before:
        report[k] = before[k]
  for attention in args.attention.split(','):
    if args.score_only:  # Keeps the training time measured before.
      run = os.path.join(args.work, f'run-{attention}')
      seconds = earlier.get(f'run-{attention}', 0)
    else:
      run, seconds = train(
        args.work,
        data,
        args.context,
        attention,
        args.steps,
        args.batch,
        args.bind,
      )
    hashes = (1, 2, 4) if attention == 'lsh' else (None,)
    for h in hashes:
      name = attention if h is None else f'lsh, {h} hash(es)'
      report['runs'][name] = {
        'train_seconds': round(seconds),
        'by_distance': task.score(run, filler, distances, args.samples, h),
      }
      print(json.dumps({name: report['runs'][name]}), flush=True)
  with open(os.path.join(args.work, 'recall.json'), 'w') as f:
    json.dump(report, f, indent=2)
  print('\n'.join(task.table(report, distances)))
  return 0


if __name__ == '__main__':
  from src import runtime

  runtime.bootstrap()
  main()
