"""Several processes vs one: what splitting a run across processes costs.

  python bench/scaling.py [WORK_DIR] [--steps 60] [--models tiny,mid]

On this machine's cores, trains the same model the same number of steps
three ways and reports tokens per second (steps after the 20th; the first
include compilation):
  - 1 process x 1 device, batch 1 (one device's rate, for reference);
  - 1 process x 2 devices, batch 2 (the local all-reduce);
  - 2 processes x 1 device, batch 2 (the same work; gradients all-reduced
    between the processes through gloo over TCP on localhost).
The two-device rows use the same cores for the same work, so their ratio is
what crossing a process boundary costs here. Process 0 reports its own
tokens; the processes take equal shares of each batch, so the run's rate is
twice that.

Then, for gin/reformer_32k.gin, the bytes each step all-reduces (float32
gradients, one per weight) and what a ring all-reduce sends per device for
some pod sizes, so a user can estimate a pod slice.

Prints markdown for BENCHMARKS.md and writes bench/scaling_results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {
  # The quick start's model: small steps, the all-reduce weighs most.
  'tiny': ('gin/tiny.gin', []),
  # 4 layers, d_model 256, 4k context: the gradient-accumulation bench's.
  'mid': (
    'gin/tiny.gin',
    [
      'ReformerLM.max_len=4096',
      'ReformerLM.pos_axial_shape=(64,64)',
      'ReformerLM.d_model=256',
      'ReformerLM.d_ff=1024',
      'ReformerLM.n_layers=4',
      'ReformerLM.attention_type='
      '[@DirectedLSHSelfAttention, @LocalSelfAttention]',
      'ReformerLM.n_heads=4',
      'ReformerLM.pos_d_axial_embs=(128,128)',
      'LSHSelfAttention.chunk_len=64',
      'LSHSelfAttention.n_buckets=64',
      'LSHSelfAttention.predict_mem_len=4096',
      'LSHSelfAttention.predict_drop_len=64',
    ],
  ),
}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def args_for(model: str, out: str, steps: int, batch: int) -> list[str]:
  gin, binds = MODELS[model]
  args = [
    os.path.join(ROOT, 'train.py'),
    '--data',
    os.path.join(ROOT, 'data', 'chatterbot-english'),
    '--gin',
    os.path.join(ROOT, gin),
    '--out-dir',
    out,
    '--steps',
    str(steps),
    '--vocab-size',
    '1000',
    '--batch-size',
    str(batch),
    '--eval-every',
    str(steps * 10),
    '--checkpoint-every',
    str(steps * 10),
    '--log-every',
    '5',
    '--sample-prompts',
    '[]',
  ]
  for b in binds:
    args += ['--bind', b]
  return args


def launch(args, devices: int, cwd: str):
  env = {
    **os.environ,
    'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}',
  }
  os.makedirs(cwd, exist_ok=True)
  return subprocess.Popen(
    [sys.executable, *args],
    cwd=cwd,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def tokens_per_second(out: str, after: int) -> float:
  """Mean of the run's `running/tokens_per_second` after step `after`."""
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(os.path.join(out, 'train'))
  acc.Reload()
  values = [
    e.value for e in acc.Scalars('running/tokens_per_second') if e.step > after
  ]
  return sum(values) / len(values)


def run(kind: str, model: str, work: str, steps: int) -> dict:
  folder = os.path.join(work, f'{model}-{kind}')
  out = os.path.join(folder, 'run')
  start = time.time()
  if kind == '2x1':
    port = free_port()
    procs = [
      launch(
        args_for(model, out, steps, 2)
        + [
          '--coordinator',
          f'127.0.0.1:{port}',
          '--num-processes',
          '2',
          '--process-id',
          str(i),
        ],
        1,
        os.path.join(folder, f'p{i}'),
      )
      for i in (0, 1)
    ]
    processes = 2
  else:
    devices = int(kind.split('x')[1])
    procs = [launch(args_for(model, out, steps, devices), devices, folder)]
    processes = 1
  for p in procs:
    _, err = p.communicate()
    if p.returncode:
      raise SystemExit(f'{model} {kind} failed:\n{err[-3000:]}')
  rate = tokens_per_second(out, 20) * processes
  return {
    'model': model,
    'layout': kind,
    'tokens_per_second': round(rate, 1),
    'wall_seconds': round(time.time() - start, 1),
  }


def all_reduce_volume(vocab: int = 500) -> dict:
  """Weights of gin/reformer_32k.gin and the bytes a step all-reduces."""
  import jax
  import numpy as np
  import trax

  from src.model import ginconf

  setup = ginconf.parse(os.path.join(ROOT, 'gin', 'reformer_32k.gin'))
  layer = ginconf.model(vocab, 'train')
  signature = trax.shapes.ShapeDtype((1, setup.max_len), np.int32)
  shapes = jax.tree_util.tree_leaves(
    layer.weights_and_state_signature(signature, unsafe=True)[0]
  )
  n = int(sum(np.prod(s.shape) for s in shapes))
  grad_bytes = 4 * n
  ring = {
    str(d): round(2 * (d - 1) / d * grad_bytes / 2**20, 2)
    for d in (2, 8, 32, 256)
  }
  return {
    'vocab': vocab,
    'weights': n,
    'gradient_mb': round(grad_bytes / 2**20, 2),
    'ring_mb_sent_per_device': ring,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('work', nargs='?', default='/tmp/jade-scaling')
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--models', default='tiny,mid')
  args = parser.parse_args(argv)
  rows = []
  for m in args.models.split(','):
    for kind in ('1x1', '1x2', '2x1'):
      rows.append(run(kind, m, args.work, args.steps))
      print(json.dumps(rows[-1]), flush=True)
  volume = [all_reduce_volume(500), all_reduce_volume(32000)]
  result = {'rows': rows, 'all_reduce': volume, 'steps': args.steps}
  with open(os.path.join(ROOT, 'bench', 'scaling_results.json'), 'w') as f:
    json.dump(result, f, indent=2)
    f.write('\n')
  print('| model | layout | tokens/s | vs 1 process x 2 devices |')
  print('|-|-|-|-|')
  for r in rows:
    base = next(
      x for x in rows if x['model'] == r['model'] and x['layout'] == '1x2'
    )
    ratio = r['tokens_per_second'] / base['tokens_per_second']
    print(
      f'| {r["model"]} | {r["layout"]} | {r["tokens_per_second"]:.0f} | '
      f'{ratio:.2f}x |'
    )
  for v in volume:
    print(
      f'reformer_32k.gin, vocab {v["vocab"]}: {v["weights"]:,} weights, '
      f'{v["gradient_mb"]} MB of gradients per step; ring all-reduce sends '
      f'per device (MB): {v["ring_mb_sent_per_device"]}'
    )


if __name__ == '__main__':
  from src import runtime

  runtime.bootstrap()
  main()
