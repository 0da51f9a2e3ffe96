"""Does fine-tuning work? Facts learned, forgetting and held-out loss.

  python bench/finetune.py [WORK_DIR] [--pretrained RUN_DIR]
      [--data data/persona] [--runs fine-tuned,no-replay,scratch]
      [--bind GIN ...] [--flag 'TRAIN_FLAG VALUE' ...]
      [--measure MODEL_DIR]

1. The pretrained model: `--pretrained RUN_DIR` (e.g. the quick start's
   runs/demo), or else the README's pretraining command (the quick
   start's, with dropout 0.1) is run into WORK/pretrained. It is
   exported (`python -m src.apps.export`).
2. The user's chats: `--data` (default data/persona: a dozen facts about
   one person, Robin, each asked three ways, 40 conversations). `persona.FACTS`
   below also asks each fact a fourth way that is never trained on; as
   conversations, those paraphrases are the held-out data.
3. Fine-tuned: the README's recipe, `train.py --init-from` the export
   with gin/finetune.gin, `--epochs 80` and `--replay` the pretraining
   data; no-replay: the same without replay; scratch: the same data,
   steps and tokenizer from random weights (gin/tiny.gin and the quick
   start's learning flags). `--bind`/`--flag` are added to every run.
4. Each model, and the pretrained one, answers greedily from a fresh
   context:
   - facts: the first way each fact is asked (the walkthrough's 12
     questions), all trained ways, and the paraphrases; a hit names the
     fact (`chat_quality.knows`);
   - everyday openers ("Hello", "Good morning!", "How are you?", "Thank
     you!"): sensible when the reply ends, has no loop and >= 90% of its
     words are dictionary words (the words of the whole ChatterBot English
     corpus and of the user's data);
   - forgetting: the pretrained model's own training prompts
     (`bench/chat_quality.py` on its data): how many still get their
     trained answer;
   - held-out loss on the paraphrase conversations.
Prints markdown tables for BENCHMARKS.md and every reply.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from src.analysis import persona  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (keywords naming the fact, the prompts data/persona trains on, a
# paraphrase it never sees, the paraphrase's answer for the held-out loss).
OWN_PROMPTS = 200  # Of the pretrained model's training prompts.

# The README's fine-tuning recipe (with --replay the pretraining data).
RECIPE = ['--epochs', '80']

QUICK_START = [
  '--gin',
  'gin/tiny.gin',
  '--vocab-size',
  '1000',
  '--batch-size',
  '4',
  '--bind',
  'ReformerLM.dropout = 0.0',
  '--bind',
  'lr_schedule.peak = 0.004',
  '--bind',
  'lr_schedule.warmup_steps = 100',
]


# The README's pretraining recipe: the quick start's, with dropout.
PRETRAIN = [*QUICK_START[:7], 'ReformerLM.dropout = 0.1', *QUICK_START[8:]]


def train(args: list[str], log: str) -> float:
  """Runs train.py (as a user would) with `args`; returns the wall time."""
  start = time.time()
  with open(log, 'w') as f:
    subprocess.run(
      [sys.executable, os.path.join(ROOT, 'train.py'), *args],
      check=True,
      stdout=f,
      stderr=subprocess.STDOUT,
      cwd=ROOT,
    )
  return time.time() - start


def write_paraphrases(folder: str) -> str:
  """The paraphrase conversations (held-out data); returns the file."""
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, 'paraphrases.txt')
  with open(path, 'w') as f:
    for _, _, question, answer in persona.FACTS:
      f.write(f'{question}\n|aigenerationstart| {answer} |endofgeneration|\n\n')
  return path


def measure(model_dir: str, words: set[str], own):
  """The facts, everyday and forgetting figures of one model (`own`: the
  pretrained model's prompts, as `chat_quality.training_prompts` gives
  them)."""
  from src.analysis import chat_quality as cq
  from src.inference import decoding

  decoder = decoding.Decoder.load(model_dir)
  out = {'step': decoder.step}
  for name, prompts in (
    ('first', [f[1][0] for f in persona.FACTS]),
    ('trained', [p for f in persona.FACTS for p in f[1]]),
    ('paraphrased', [f[2] for f in persona.FACTS]),
  ):
    keys = [
      f[0] for f in persona.FACTS for _ in (f[1] if name == 'trained' else [0])
    ]
    replies = cq.greedy_replies(decoder, prompts)
    out[name] = [
      (p, r, cq.knows(r, k)) for p, (r, _), k in zip(prompts, replies, keys)
    ]
  out['everyday'] = cq.everyday(decoder, words)
  out['own'] = cq.trained_answers(decoder, *own)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('work', nargs='?', default='runs/bench-finetune')
  parser.add_argument('--pretrained', default=None)
  parser.add_argument('--data', default=os.path.join(ROOT, 'data', 'persona'))
  parser.add_argument('--bind', action='append', default=[])
  parser.add_argument(
    '--flag', action='append', default=[], help='Passed to train.py.'
  )
  parser.add_argument(
    '--runs',
    default='fine-tuned,no-replay,scratch',
    help='Which of fine-tuned, no-replay and scratch to train.',
  )
  parser.add_argument(
    '--measure',
    metavar='MODEL_DIR',
    help='Only measure this fine-tuned model (against --pretrained).',
  )
  args = parser.parse_args(argv)
  from src.analysis import chat_quality as cq
  from src.analysis import memorization
  from src.apps import convert
  from src.data import tokenizer
  from src.inference import scoring
  from src.storage import export

  work = os.path.abspath(args.work)
  os.makedirs(work, exist_ok=True)
  held = write_paraphrases(os.path.join(work, 'held'))
  times = {}
  pre = args.pretrained or os.path.join(work, 'pretrained')
  pre_data = os.path.join(work, 'smalltalk')
  if args.pretrained is None and not os.path.isdir(pre):
    convert.main(
      [
        'chatterbot',
        'english',
        pre_data,
        '--trim',
        '--skip',
        'coding,computers,tech_support,trivia',
      ]
    )
    times['pretrain'] = train(
      ['--data', pre_data, '--out-dir', pre, '--steps', '3500', *PRETRAIN],
      os.path.join(work, 'pretrain.log'),
    )
  exp = os.path.join(work, 'export')
  if not os.path.isdir(exp):
    export.export(pre, exp)
  all_english = os.path.join(work, 'chatterbot-english')
  if not os.path.isdir(all_english):
    convert.main(['chatterbot', 'english', all_english, '--trim'])
  words = cq.dictionary(all_english, args.data)
  own = cq.training_prompts(memorization.split(pre)[0], OWN_PROMPTS)
  results = {'pretrained': measure(pre, words, own)}
  if args.measure:
    results[args.measure] = measure(args.measure, words, own)
    report(results, times)
    return 0
  replay = os.path.join(ROOT, memorization.run_settings(pre)['data'])
  recipe = ['--init-from', exp, '--gin', 'gin/finetune.gin', *RECIPE]
  runs = {
    'fine-tuned': recipe + ['--replay', replay],
    'no-replay': recipe,
    'scratch': QUICK_START,  # Batch 4, no dropout.
  }
  extra = [x for b in args.bind for x in ('--bind', b)]
  extra += [x for f in args.flag for x in f.split(' ', 1)]
  for name in args.runs.split(','):
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    how = runs[name]
    if name == 'scratch':  # The pretrained tokenizer: losses compare.
      os.makedirs(out)
      tok, info = tokenizer.load(exp), tokenizer.read_info(exp)
      tokenizer.save(out, tokenizer.adopt(tok, info, exp))
      steps = results.get('fine-tuned', {}).get('step', 500)
      how = how + ['--steps', str(steps)]
    times[name] = train(
      ['--data', args.data, '--out-dir', out, '--eval-data', held]
      + how
      + extra,
      os.path.join(work, f'{name}.log'),
    )
    results[name] = measure(out, words, own)
    results[name]['loss'] = scoring.evaluate(out, held, show_progress=False)[
      'loss'
    ]
  report(results, times)
  return 0


def report(results: dict, times: dict) -> None:
  def count(r, key):
    return f'{sum(hit for *_, hit in r[key])}/{len(r[key])}'

  print(
    '| model | steps | facts: the 12 questions | all 36 trained ways '
    '| 12 paraphrases | everyday openers sensible | pretrained prompts '
    'still answered | held-out loss | wall |\n|-|-|-|-|-|-|-|-|-|'
  )
  for name, r in results.items():
    loss = f'{r["loss"]:.3f}' if 'loss' in r else '-'
    wall = f'{times[name]:.0f} s' if name in times else '-'
    print(
      f'| {name} | {r["step"]} | {count(r, "first")} | {count(r, "trained")} '
      f'| {count(r, "paraphrased")} | {count(r, "everyday")} | '
      f'{count(r, "own")} | {loss} | {wall} |'
    )
  for name, r in results.items():
    print(f'\n{name}:')
    for key in ('first', 'paraphrased'):
      for p, reply, hit in r[key]:
        print(f'  you> {p}\n  jade> {reply}    [{"ok" if hit else "MISS"}]')
    for p, reply, share, ok in r['everyday']:
      print(
        f'  you> {p}\n  jade> {reply}    [{100 * share:.0f}% English, '
        f'{"sensible" if ok else "NOT sensible"}]'
      )
  if 'pretrain' in times:
    print(f'\npretraining: {times["pretrain"]:.0f} s')


if __name__ == '__main__':
  from src import runtime

  runtime.bootstrap()
  sys.exit(main())
