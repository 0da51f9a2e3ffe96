"""Does the model learn from content? A copy task, by position encoding.

  python bench/positions.py WORK_DIR [--steps 600] [--eval-every N]
      [--variants trax,tokens,fixed] [--attention full,lsh] [--bind GIN]...

Each training conversation is six turns of "Repeat river." answered by
"river" (the word drawn at random from the 143 values of bench/recall.py),
so the answer is the word three tokens back: the simplest use of context
there is. The tiny model (gin/tiny.gin, context 128, no dropout, batch 8)
is trained on it once per variant and attention (`--attention`): `full`
(every position in view), `lsh` (as shipped: a local block, a directed LSH
block with chunk 64 and 2 buckets, a local block), or one of
`bench/common.py`'s VARIANTS (`lsh-first`, `lsh-only`, `lsh-shared`,
`local-shared`):

- `trax`: axial positions drawn as Trax draws them (std 1.0, that is
  `positions.axial_init_scale = sqrt(d_model)`),
- `tokens`: axial positions at the token embeddings' scale (scale 1.0, the
  default),
- `fixed`: Trax's fixed sinusoidal positions (`pos_type = 'fixed-base'`),
- `shared-qk`: queries and keys shared in `SelfAttention` (as LSH does);
  with `--attention full`, the mechanism without the hashing.

Prints, per variant, the held-out loss on the AI turns at each evaluation.
Chance: the word is a guess among 143 and the end marker is certain, so a
model that ignores the word scores about ln(143) / 2 = 2.48; one that
copies it scores near 0. Results in WORK_DIR/positions.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402
from src.analysis import recall  # noqa: E402

D_MODEL = 128  # gin/tiny.gin's.
VARIANTS = {
  'trax': [f'positions.axial_init_scale = {math.sqrt(D_MODEL)}'],
  'tokens': ['positions.axial_init_scale = 1.0'],
  'fixed': [
    "ReformerLM.pos_type = 'fixed-base'",
    'ReformerLM.pos_axial_shape = None',
  ],
  # Full attention whose queries are its keys (as in LSH): the mechanism
  # without the hashing.
  'shared-qk': ['SelfAttention.share_qk = True'],
}


def eval_curve(run_dir) -> dict:
  """`{step: held-out loss}` from the run's TensorBoard events."""
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(os.path.join(run_dir, 'eval'))
  acc.Reload()
  return {e.step: e.value for e in acc.Scalars('metrics/loss')}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('work')
  parser.add_argument('--steps', type=int, default=600)
  parser.add_argument('--variants', default='trax,tokens,fixed')
  parser.add_argument('--attention', default='full,lsh')
  parser.add_argument(
    '--eval-every', type=int, default=None, help='steps (default: steps/4)'
  )
  parser.add_argument(
    '--bind',
    action='append',
    default=[],
    help='a gin binding added to every run, e.g. '
    '"residual.zero_feed_forward = False"',
  )
  args = parser.parse_args(argv)
  from src.data import chatformat

  os.makedirs(args.work, exist_ok=True)
  data = os.path.join(args.work, 'echo.txt')
  with open(data, 'w', encoding='utf-8') as f:
    f.write(
      recall.to_text(recall.echo_conversations(3000), chatformat.Markers())
    )
    f.write('\n')
  report = {'steps': args.steps, 'runs': {}}
  for attention in args.attention.split(','):
    for name in args.variants.split(','):
      if name not in VARIANTS:
        raise SystemExit(
          f'error: --variants: {name!r} is not one of {list(VARIANTS)}'
        )
      # The recall bench's training: tiny.gin at 128 tokens, loss on the
      # AI turns, vocabulary 1000; the variant's bindings on top.
      run, seconds = common.train(
        os.path.join(args.work, name),
        data,
        128,
        attention,
        args.steps,
        batch=8,
        binds=VARIANTS[name] + args.bind,
        eval_every=args.eval_every,
      )
      curve = eval_curve(run)
      report['runs'][f'{attention}, {name}'] = {
        'eval_loss': curve,
        'seconds': round(seconds),
      }
  with open(os.path.join(args.work, 'positions.json'), 'w') as f:
    json.dump(report, f, indent=2)
  steps = sorted({s for r in report['runs'].values() for s in r['eval_loss']})
  print(
    '| attention, positions | ' + ' | '.join(f'step {s}' for s in steps) + ' |'
  )
  print('|-|' + '-|' * len(steps))
  for name, r in report['runs'].items():
    cells = [f'{r["eval_loss"].get(s, float("nan")):.2f}' for s in steps]
    print(f'| {name} | ' + ' | '.join(cells) + ' |')
  return 0


if __name__ == '__main__':
  from src import runtime

  runtime.bootstrap()
  main()
