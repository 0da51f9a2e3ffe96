"""Does fine-tuning a pretrained model pay? Fine-tune vs from scratch.

  python bench/finetune.py [WORK_DIR] [--pretrain-steps 1500] [--steps 300]

1. Pretrain the tiny model (gin/tiny.gin) on ChatterBot English without
   three of its categories (greetings, conversations, emotion), then
   export it (`python -m src.apps.export`).
2. The three categories are the "personal" data: every 10th conversation
   of each is held out (the same conversations for every run).
3. Train on the personal data for `--steps` steps two ways: from scratch
   (gin/tiny.gin, random weights) and with `--init-from` the export
   (gin/finetune.gin). Both use the pretrained tokenizer, so their
   nats/token compare directly; bits/char are reported too.
4. Train from scratch for `--pretrain-steps` steps, evaluating every 50,
   to find how many steps from scratch need to reach the fine-tuned loss.

Prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PERSONAL = ('greetings', 'conversations', 'emotion')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_data(work: str):
  """pretrain/, personal/ and held-out/ line-format folders."""
  from src.apps import convert
  from src.data import chatformat

  folders = {
    n: os.path.join(work, n) for n in ('all', 'pretrain', 'personal', 'held')
  }
  if not os.path.isdir(folders['all']):
    convert.main(['chatterbot', 'english', folders['all'], '--trim'])
  for n in ('pretrain', 'personal', 'held'):
    shutil.rmtree(folders[n], ignore_errors=True)
    os.makedirs(folders[n])
  for name in sorted(os.listdir(folders['all'])):
    src = os.path.join(folders['all'], name)
    if os.path.splitext(name)[0] not in PERSONAL:
      shutil.copy(src, folders['pretrain'])
      continue
    convs = chatformat.read_file(src)
    train = [c for i, c in enumerate(convs) if i % 10 != 9]
    held = [c for i, c in enumerate(convs) if i % 10 == 9]
    for folder, part in (('personal', train), ('held', held)):
      with open(os.path.join(folders[folder], name), 'w') as f:
        f.write('\n\n'.join(chatformat.format_conversation(c) for c in part))
        f.write('\n')
  return folders


def run(out, data, gin, steps, held, eval_every, **extra):
  from src.config import jsonconfig
  from src.training import trainer

  values = {
    'out-dir': out,
    'data': data,
    'gin': os.path.join(ROOT, 'gin', gin),
    'steps': steps,
    'eval-every': eval_every,
    'eval-batches': 16,
    'checkpoint-every': steps,
    'eval-data': held,
    'vocab-size': 1000,
    **extra,
  }
  start = time.time()
  trainer.train(jsonconfig.from_values('train', values), log=lambda line: None)
  return time.time() - start


def eval_curve(out):
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(os.path.join(out, 'eval'))
  acc.Reload()
  return [(e.step, e.value) for e in acc.Scalars('metrics/loss')]


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument('work', nargs='?', default='runs/bench-finetune')
  parser.add_argument('--pretrain-steps', type=int, default=1500)
  parser.add_argument('--steps', type=int, default=300)
  args = parser.parse_args(argv)
  from src.data import tokenizer
  from src.inference import scoring
  from src.storage import export

  work = args.work
  os.makedirs(work, exist_ok=True)
  d = make_data(work)
  pre, exp = os.path.join(work, 'pretrained'), os.path.join(work, 'export')
  times = {}
  if not os.path.isdir(pre):
    times['pretrain'] = run(
      pre,
      d['pretrain'],
      'tiny.gin',
      args.pretrain_steps,
      None,
      500,
      **{'eval-fraction': 0.05},
    )
  if not os.path.isdir(exp):
    export.export(pre, exp)
  results = {}
  for name, gin, steps in (
    ('fine-tuned', 'finetune.gin', args.steps),
    ('scratch', 'tiny.gin', args.steps),
    ('scratch-long', 'tiny.gin', args.pretrain_steps),
  ):
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    extra = {}
    if name == 'fine-tuned':
      extra['init-from'] = exp
    else:  # The pretrained tokenizer, so that losses compare per token.
      os.makedirs(out)
      tok = tokenizer.load(exp)
      info = tokenizer.read_info(exp)
      tokenizer.save(out, tokenizer.adopt(tok, info, os.path.abspath(exp)))
    times[name] = run(out, d['personal'], gin, steps, d['held'], 50, **extra)
    r = scoring.evaluate(out, d['held'], show_progress=False)
    results[name] = (r, eval_curve(out))
  tuned = results['fine-tuned'][0]['loss']
  reached = next(
    (
      step
      for step, loss in results['scratch-long'][1]
      if loss <= results['fine-tuned'][1][-1][1]
    ),
    None,
  )
  print(
    '| run | steps | held-out loss (nats/token) | perplexity | bits/char '
    '| wall |\n|-|-|-|-|-|-|'
  )
  for name, steps in (
    ('fine-tuned', args.steps),
    ('scratch', args.steps),
    ('scratch-long', args.pretrain_steps),
  ):
    r = results[name][0]
    print(
      f'| {name} | {steps} | {r["loss"]:.3f} | {r["perplexity"]:.2f} | '
      f'{r["bits_per_char"]:.3f} | {times[name]:.0f} s |'
    )
  r0 = results['scratch'][0]['loss']
  print(
    f'\nfine-tuned vs scratch at {args.steps} steps: {tuned:.3f} vs {r0:.3f} '
    f'nats/token ({100 * (tuned - r0) / r0:+.1f}%). From scratch, the '
    f"eval-line loss first reached the fine-tuned run's final eval-line "
    f'loss ({results["fine-tuned"][1][-1][1]:.3f}) at step '
    + (str(reached) if reached else f'> {args.pretrain_steps} (never)')
    + '.'
  )
  print('scratch-long eval curve:', results['scratch-long'][1])
  print('fine-tuned eval curve:', results['fine-tuned'][1])
  if 'pretrain' in times:
    print(f'pretraining: {times["pretrain"]:.0f} s')
  return 0


if __name__ == '__main__':
  from src import runtime

  runtime.bootstrap()
  sys.exit(main())
