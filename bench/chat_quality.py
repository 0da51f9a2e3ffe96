"""Does the model chat? Greedy replies to training and held-out prompts.

  python bench/chat_quality.py RUN_DIR [DATA] [--prompts 200] [--markdown]

(a) Training prompts: the first user turn of each training conversation
    (DATA: the run's own data by default, without its held-out
    conversations), answered greedily from a fresh context; a hit is a
    reply equal (case, spacing and final punctuation aside) to one of the
    answers that prompt has in the data.
(b) Held-out prompts: the first user turn of each held-out conversation;
    the share of replies that end with the end marker within 64 tokens and
    the share with a loop (a word 4-gram that occurs twice).
Prints the figures and a sample transcript (`--markdown`: as a table for
BENCHMARKS.md).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from src.analysis.chat_quality import measure, summary  # noqa: E402


def main(argv=None):
  parser = common.run_parser(__doc__)
  parser.add_argument('--prompts', type=int, default=200)
  parser.add_argument('--show', type=int, default=8)
  parser.add_argument('--markdown', action='store_true')
  args = parser.parse_args(argv)
  m = measure(args.run_dir, args.data, args.prompts)
  print('\n'.join(summary(m)))
  samples, held_samples = m['samples'], m['held_samples']
  if args.markdown:
    print('\n| prompt (training) | reply | trained answer |\n|-|-|-|')
    for p, r, a, hit in samples[: args.show]:
      print(f'| {p} | {r} {"✓" if hit else ""} | {a} |')
    print('\n| prompt (held out) | reply |\n|-|-|')
    for p, r in held_samples[: args.show]:
      print(f'| {p} | {r} |')
  else:
    for p, r, a, hit in samples[: args.show]:
      print(f'  you> {p}\n  jade> {r}    [{"hit" if hit else a}]')
    for p, r in held_samples[: args.show]:
      print(f'  you> {p}\n  jade> {r}    [held out]')
  return 0


if __name__ == '__main__':
  from src import runtime

  runtime.bootstrap()
  from src.apps.cli import run_main

  sys.exit(run_main(main))
