"""Memorization check: do training windows score the same when moved?

  python bench/memorization.py RUN_DIR [DATA] [--last-steps 64] [--json]

Scores the windows of the run's last training steps (teacher-forced, no
dropout) at the offset they were trained at and moved by 1, 7 and 64
tokens along the stream, then the whole data folder as `evaluate.py
--perplexity` does, next to the final training loss. DATA defaults to the
run's own (its settings.json). Targets (issue 10): every shifted loss within
5% of the unshifted one; the data's loss at most 10% above the final
training loss.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def main(argv=None):
  parser = common.run_parser(__doc__)
  parser.add_argument('--last-steps', type=int, default=64)
  parser.add_argument('--json', action='store_true', help='print JSON')
  args = parser.parse_args(argv)
  from src.analysis import memorization

  result = memorization.measure(args.run_dir, args.data, args.last_steps)
  print(
    memorization.to_json(result) if args.json else memorization.summary(result)
  )
  return 0


if __name__ == '__main__':
  from src import runtime

  runtime.bootstrap()
  from src.apps.cli import run_main

  sys.exit(run_main(main))
