"""A training preset's step time under variants, interleaved.

  python bench/preset_steps.py configs/long-1-copy.json \\
    --data data/long-chats \\
    --variant 'kernel|' --variant 'xla|JADE_CHUNK_KERNEL=off' --rounds 2

Runs `train.py --config PRESET` for `--steps` steps (no evaluation) once
per variant per round, variants in turn (ABAB: this machine's speed drifts
by more than most changes), each in a fresh process into a fresh out-dir,
and prints the median and mean of each run's step times (steps after the
first `--skip`, each timed to its result: compilation and the data's
first batches excluded). A variant is `LABEL|ENV=VALUE ...|BINDING;...`:
environment settings and gin bindings (`--bind`) for that variant.

A fine-tune preset (`init-from`) needs its pretrained run: pass
`--init-from RUN`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = 'PRESET_STEPS'


def child(argv: list[str], skip: int):
  """train.py's run with each step timed to its result."""
  sys.path.insert(0, ROOT)
  import train
  from src import runtime

  args = train.parse_args(argv)
  runtime.bootstrap(bf16_products=True)
  import jax

  from src.config import jsonconfig
  from src.training import loop, trainer

  times = []
  step = loop.JadeLoop._run_one_step

  def timed(self, *a, **k):
    start = time.perf_counter()
    out = jax.block_until_ready(step(self, *a, **k))
    times.append(time.perf_counter() - start)
    return out

  loop.JadeLoop._run_one_step = timed
  trainer.train(jsonconfig.from_args(args, 'train'), gin_bindings=args.bind)
  kept = times[skip:] or times
  print(f'{MARK} {statistics.median(kept)} {statistics.mean(kept)} {len(kept)}')


def variant(text: str) -> tuple[str, dict, list[str]]:
  label, _, rest = text.partition('|')
  env_text, _, binds = rest.partition('|')
  env = dict(item.split('=', 1) for item in env_text.split() if '=' in item)
  return label, env, [b.strip() for b in binds.split(';') if b.strip()]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('preset')
  parser.add_argument('--data', required=True)
  parser.add_argument('--init-from', default=None)
  parser.add_argument('--steps', type=int, default=100)
  parser.add_argument('--skip', type=int, default=10)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--variant', action='append', required=True)
  if sys.argv[1:2] == ['--child']:  # --child SKIP TRAIN_ARGS...
    return child(sys.argv[3:], int(sys.argv[2]))
  args = parser.parse_args()
  variants = [variant(v) for v in args.variant]
  print(
    f'{args.preset}, {args.steps} steps a run (median, mean of steps '
    f'after {args.skip}):'
  )
  for r in range(args.rounds):
    for label, env, binds in variants:
      out = tempfile.mkdtemp(prefix='preset-steps-')
      shutil.rmtree(out)
      cmd = [
        sys.executable,
        os.path.abspath(__file__),
        '--child',
        str(args.skip),
        '--config',
        args.preset,
        '--data',
        args.data,
        '--out-dir',
        out,
        '--steps',
        str(args.steps),
        '--eval-every',
        str(10 * args.steps),
        '--checkpoint-every',
        str(10 * args.steps),
      ]
      if args.init_from:
        cmd += ['--init-from', args.init_from]
      for b in binds:
        cmd += ['--bind', b]
      try:
        done = subprocess.run(
          cmd,
          env={**os.environ, **env},
          cwd=ROOT,
          capture_output=True,
          text=True,
          check=False,
        )
      finally:
        shutil.rmtree(out, ignore_errors=True)
      lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
      if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        print(f'  round {r + 1} {label}: failed ({" ".join(tail)})')
        continue
      median, mean, n = lines[-1].split()[1:]
      print(
        f'  round {r + 1} {label}: {1000 * float(median):.1f} ms median, '
        f'{1000 * float(mean):.1f} mean ({n} steps)'
      )


if __name__ == '__main__':
  main()
