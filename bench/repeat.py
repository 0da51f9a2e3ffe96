"""Repeat after me: does a model trained the README way copy what was said?

  python bench/repeat.py WORK_DIR [--steps 5000] [--attention lsh,full]
      [--conversations 3000] [--words 400] [--held-out 30] [--bind GIN]...

1. Writes training data in the line format: conversations of four turns
   "Repeat after me: <3-8 words>" -> the same words, the words drawn from
   `--words` distinct dictionary words (the lowercase words of the English
   ChatterBot corpus, installed with the requirements), and `--held-out`
   six-word lists that are never trained on.
2. Trains with `train.py` exactly as the README's quick start does
   (gin/tiny.gin, vocabulary 1000, batch 4, no dropout, peak rate 0.004,
   warmup 100), `--steps` steps: `lsh` is the shipped gin/tiny.gin (a
   local block, a directed LSH block, a local block), `lsh-first` the
   order before (LSH, local, local), `lsh-only` directed LSH in
   every block, `lsh-shared` Trax's LSH in every block (the design
   before), `local-shared` the shipped blocks with Trax's LSH, `full` full
   attention. `--bind` adds gin bindings to every run.
3. Asks each held-out list through `evaluate.py` (piped, greedy,
   `/reset` before each) and counts exact repeats.

Prints a markdown table; results in WORK_DIR/repeat.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402

ATTENTION = {
  'lsh': [],  # As shipped: a local block, a directed LSH block, a local block.
  **common.VARIANTS,  # lsh-first, lsh-only, lsh-shared, local-shared.
  'full': [
    'ReformerLM.attention_type = @SelfAttention',
    'SelfAttention.chunk_len = None',
    'SelfAttention.n_chunks_before = 0',
  ],
}
QUICK_START = [
  '--vocab-size', '1000', '--batch-size', '4', '--eval-batches', '8',
  '--bind', 'ReformerLM.dropout = 0.0',
  '--bind', 'lr_schedule.peak = 0.004',
  '--bind', 'lr_schedule.warmup_steps = 100',
]  # fmt: skip


def dictionary(n: int, seed: int = 0) -> list[str]:
  """`n` distinct lowercase words (3-9 letters) of the ChatterBot corpus."""
  words = sorted(common.chatterbot_words(9))
  if len(words) < n:
    raise SystemExit(f'error: --words {n}: the corpus has {len(words)}')
  rng = np.random.default_rng(seed)
  return sorted(rng.choice(words, n, replace=False).tolist())


def make_data(work: str, args) -> list[str]:
  """Writes WORK/data/repeat.txt; returns the held-out six-word lists."""
  words = dictionary(args.words)
  rng = np.random.default_rng(1)
  held = set()
  while len(held) < args.held_out:
    held.add(' '.join(rng.choice(words, 6, replace=False)))
  lines = []
  for _ in range(args.conversations):
    for _ in range(4):
      k = int(rng.integers(3, 9))
      said = ' '.join(rng.choice(words, k, replace=False))
      if said in held:
        continue
      lines += [
        f'Repeat after me: {said}',
        f'|aigenerationstart| {said} |endofgeneration|',
      ]
    lines.append('')
  os.makedirs(os.path.join(work, 'data'), exist_ok=True)
  with open(os.path.join(work, 'data', 'repeat.txt'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  return sorted(held)


def train(work: str, attention: str, steps: int, extra=()) -> float:
  out = os.path.join(work, f'run-{attention}')
  cmd = [
    sys.executable, 'train.py', '--data', os.path.join(work, 'data'),
    '--gin', 'gin/tiny.gin', '--out-dir', out, '--steps', str(steps),
    '--eval-every', str(max(steps // 5, 1)),
    '--checkpoint-every', str(max(steps // 5, 1)), *QUICK_START,
  ]  # fmt: skip
  for b in [*ATTENTION[attention], *extra]:
    cmd += ['--bind', b]
  t0 = time.time()
  subprocess.run(cmd, cwd=ROOT, check=True)
  return time.time() - t0


def ask(run: str, lists: list[str]) -> list[str]:
  """Greedy replies to "Repeat after me: <list>", one conversation each."""
  lines = []
  for said in lists:
    lines += ['/reset', f'Repeat after me: {said}']
  out = subprocess.run(
    [sys.executable, 'evaluate.py', '--model-dir', run, '--temperature', '0'],
    cwd=ROOT,
    input='\n'.join(lines) + '\n',
    capture_output=True,
    text=True,
    check=True,
  )
  replies = [
    r
    for r in out.stdout.splitlines()
    if r.strip() and r.strip() != '(new conversation)'
  ]
  return replies[-len(lists) :]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('work')
  parser.add_argument('--steps', type=int, default=5000)
  parser.add_argument('--attention', default='lsh,full')
  parser.add_argument('--conversations', type=int, default=3000)
  parser.add_argument('--words', type=int, default=400)
  parser.add_argument('--held-out', type=int, default=30)
  parser.add_argument(
    '--bind', action='append', default=[], help='more gin, every run'
  )
  args = parser.parse_args(argv)
  work = os.path.abspath(args.work)
  held = make_data(work, args)
  report = {'args': vars(args), 'runs': {}}
  for attention in args.attention.split(','):
    if attention not in ATTENTION:
      raise SystemExit(
        f'error: --attention {attention!r}: one of {list(ATTENTION)}'
      )
    seconds = train(work, attention, args.steps, args.bind)
    replies = ask(os.path.join(work, f'run-{attention}'), held)
    exact = sum(r.strip() == s for r, s in zip(replies, held))
    report['runs'][attention] = {
      'exact': exact,
      'of': len(held),
      'seconds': round(seconds),
      'replies': dict(zip(held, replies)),
    }
    with open(os.path.join(work, 'repeat.json'), 'w') as f:
      json.dump(report, f, indent=2)
  print('| attention | exact repeats of held-out 6-word lists | train time |')
  print('|-|-|-|')
  for name, r in report['runs'].items():
    print(f'| {name} | {r["exact"]}/{r["of"]} | {r["seconds"]} s |')
  return 0


if __name__ == '__main__':
  main()
