"""A training preset's step time under variants, interleaved.

  python bench/preset_steps.py configs/long-1-copy.json \\
    --data data/long-chats \\
    --variant 'kernel|' --variant 'xla|JADE_CHUNK_KERNEL=off' --rounds 2

Runs `train.py --config PRESET` for `--steps` steps (no evaluation) once
per variant per round, variants in turn (ABAB: this machine's speed drifts
by more than most changes), each in a fresh process into a fresh out-dir,
and prints the median and mean of each run's step times (steps after the
first `--skip`, each timed to its result: compilation and the data's
first batches excluded) and the median of its steps' minor page faults
(fresh memory the kernel maps and zeroes). A step is timed to its result,
so the Python work around it (Trax's loop and ours, tens of ms) adds to
it; `train.py` overlaps that work with the step before: run 2 on the Xeon
took 207.4 ms a step here and 175.6 ms by `train.py`'s progress line over
300 steps (BENCHMARKS.md "Sums over rows as products"). Each run
compiles anew (`JADE_COMPILE_CACHE=off`, unless `--cached`): a compile's
speed varies and a cached one would stand for all of a variant's rounds.
A variant is
`LABEL|ENV=VALUE ...|BINDING;...`: environment settings and gin bindings
(`--bind`) for that variant.

A fine-tune preset (`init-from`) needs its pretrained run: pass
`--init-from RUN`.

`--trace DIR`: each run also records a JAX profile of 10 steps after
`--skip` into DIR/LABEL-ROUND and prints where a step goes: the time XLA's
CPU threads spent in each operation (its own time, nested ones taken out;
a kernel's helper tasks on XLA's pool are not recorded, only the call),
the time a step had at least one operation running, the shares of its
time in which none, one, and two or more of XLA's threads ran one, and the
heaviest operations (their HLO names: `XLA_FLAGS=--xla_dump_to=...` names them).
A profiled run's step times include the profile's own cost. A matrix
product (`dot`) with Eigen is recorded only while it is handed to the
pool: its work runs after its event ends, as unnamed tasks, so products
read as a few microseconds and a step's "operation running" time leaves
them out (a step of run 2: 169 of 276 ms, where the process used 1.94
of 2 cores and `perf` found ~38% of the samples in the product kernels).
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
STEP = 'preset_steps.step'  # The profile's name for one timed step.
TRACED = 10  # Steps a `--trace` records.


def child(argv: list[str], skip: int, trace: str = ''):
  """train.py's run with each step timed to its result (and, with
  `trace`, steps `skip`..`skip + TRACED` profiled into that folder)."""
  sys.path.insert(0, ROOT)
  import train
  from src import runtime

  args = train.parse_args(argv)
  runtime.bootstrap(bf16_products=True)
  import jax

  from src.config import jsonconfig
  from src.training import loop, trainer

  times, faults = [], []
  step = loop.JadeLoop._run_one_step

  def timed(self, *a, **k):
    if trace and len(times) == skip:
      jax.profiler.start_trace(trace)
    start, first = time.perf_counter(), minor_faults()
    with jax.profiler.TraceAnnotation(STEP):
      out = jax.block_until_ready(step(self, *a, **k))
    times.append(time.perf_counter() - start)
    faults.append(minor_faults() - first)
    if trace and len(times) == skip + TRACED:
      jax.profiler.stop_trace()
    return out

  loop.JadeLoop._run_one_step = timed
  trainer.train(jsonconfig.from_args(args, 'train'), gin_bindings=args.bind)
  kept = times[skip:] or times
  faulted = statistics.median(faults[skip:] or faults)
  print(
    f'{MARK} {statistics.median(kept)} {statistics.mean(kept)} {len(kept)} '
    f'{faulted}'
  )


def minor_faults() -> int:
  """This process's minor page faults so far (fresh pages the kernel
  mapped and zeroed), or 0 where the system does not count them."""
  try:
    import resource
  except ImportError:  # Windows.
    return 0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def trace_summary(folder: str, top: int = 12) -> list[str]:
  """Lines saying where the traced steps went (module doc, `--trace`)."""
  import glob
  import gzip
  import json
  from collections import Counter, defaultdict

  files = glob.glob(
    os.path.join(folder, '**', '*.trace.json.gz'), recursive=True
  )
  if not files:
    return [f'  no profile in {folder}']
  with gzip.open(max(files, key=os.path.getmtime)) as f:
    events = json.load(f)['traceEvents']
  names = {
    (e['pid'], e['tid']): e['args']['name']
    for e in events
    if e.get('ph') == 'M' and e.get('name') == 'thread_name'
  }
  steps = [e for e in events if e.get('ph') == 'X' and e['name'] == STEP]
  ops = [
    e
    for e in events
    if e.get('ph') == 'X'
    and names.get((e.get('pid'), e.get('tid')), '').startswith('tf_XLA')
    and not e['name'].startswith(('ThunkExecutor', 'ThreadpoolListener'))
  ]
  by_thread = defaultdict(list)
  for e in ops:
    by_thread[e['pid'], e['tid']].append(e)
  own, spans = Counter(), []  # spans: each thread's outermost operations.
  for thread_ops in by_thread.values():
    stack = []  # Open operations on this thread, outermost first.
    for e in sorted(thread_ops, key=lambda e: (e['ts'], -e['dur'])):
      while stack and stack[-1]['ts'] + stack[-1]['dur'] <= e['ts']:
        stack.pop()
      if stack:
        own[stack[-1]['name']] -= e['dur']
      else:
        spans.append((e['ts'], e['ts'] + e['dur']))
      own[e['name']] += e['dur']
      stack.append(e)
  busy, end = 0.0, float('-inf')
  for start, stop in sorted(spans):  # The union of every operation's span.
    busy += max(0.0, stop - max(start, end))
    end = max(end, stop)
  n = max(1, len(steps))
  wall = sum(e['dur'] for e in steps) / n / 1000
  lines = [
    f'  profile of {len(steps)} steps: {wall:.1f} ms a step, an operation '
    f"running {busy / n / 1000:.1f} ms of it, operations' own time "
    f'{sum(own.values()) / n / 1000:.1f} ms (all threads; products '
    'left out: their work runs after their events)'
  ]
  shares = threads_busy(spans, steps)
  lines.append(
    f"  XLA's threads running an operation: none {shares[0]:.0%}, one "
    f"{shares[1]:.0%}, two or more {shares[2]:.0%} of the steps' time"
  )
  for name, us in own.most_common(top):
    lines.append(f'    {us / n / 1000:7.2f} ms  {name}')
  return lines


def threads_busy(spans, steps) -> list[float]:
  """The shares of the `steps`' time in which none, one, and two or more
  threads ran an operation; `spans`: every thread's outermost operations
  as `(start, stop)` (a thread's do not overlap)."""
  edges = sorted(
    [(start, 1) for start, _ in spans] + [(stop, -1) for _, stop in spans]
  )
  shares = [0.0, 0.0, 0.0]
  for step in steps:
    lo, hi = step['ts'], step['ts'] + step['dur']
    running, last = 0, lo
    for t, change in edges:
      if t > last:  # `last` starts at `lo`: an edge before it adds nothing.
        shares[min(running, 2)] += min(t, hi) - max(last, lo)
        last = t
      if t >= hi:
        break
      running += change
    if last < hi:
      shares[min(running, 2)] += hi - last
  total = sum(shares) or 1.0
  return [x / total for x in shares]


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
  parser.add_argument(
    '--trace', default='', help='also profile each run into this folder'
  )
  parser.add_argument(
    '--cached',
    action='store_true',
    help='let runs read the compilation cache (one compile a variant)',
  )
  if sys.argv[1:2] == ['--child']:  # --child SKIP TRACE TRAIN_ARGS...
    return child(sys.argv[4:], int(sys.argv[2]), sys.argv[3])
  args = parser.parse_args()
  variants = [variant(v) for v in args.variant]
  # Each run compiles its own programs: with the cache a variant's rounds
  # all run one compile, and two compiles of one program ran run 2's step
  # 1.11x apart on the Xeon (BENCHMARKS.md "Page faults and compiles").
  no_cache = {} if args.cached else {'JADE_COMPILE_CACHE': 'off'}
  print(
    f'{args.preset}, {args.steps} steps a run (median, mean of steps '
    f'after {args.skip}):'
  )
  for r in range(args.rounds):
    for label, env, binds in variants:
      trace = (
        os.path.abspath(os.path.join(args.trace, f'{label}-{r + 1}'))
        if args.trace
        else ''
      )
      out = tempfile.mkdtemp(prefix='preset-steps-')
      shutil.rmtree(out)
      cmd = [
        sys.executable,
        os.path.abspath(__file__),
        '--child',
        str(args.skip),
        trace,
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
          env={**os.environ, **no_cache, **env},
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
      median, mean, n, faulted = lines[-1].split()[1:]
      print(
        f'  round {r + 1} {label}: {1000 * float(median):.1f} ms median, '
        f'{1000 * float(mean):.1f} mean ({n} steps), '
        f'{float(faulted):.0f} page faults a step'
      )
      if trace:
        print('\n'.join(trace_summary(trace)))


if __name__ == '__main__':
  main()
