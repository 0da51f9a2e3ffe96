"""`python export.py RUN_DIR OUT_DIR [--step N]` (or `python -m
src.apps.export`): a weights-only export
(see `src.storage.export`)."""

from __future__ import annotations

import argparse
import sys

from src import runtime


def parser() -> argparse.ArgumentParser:
  """The command line of `python export.py`."""
  parser = argparse.ArgumentParser(
    prog='python export.py',
    description='A shareable, weights-only copy of a training run.',
  )
  parser.add_argument('run_dir', help='a training out-dir')
  parser.add_argument('out_dir', help='a new folder for the export')
  parser.add_argument(
    '--step',
    type=int,
    default=None,
    help='export the kept checkpoint of this step (default: the latest)',
  )
  parser.add_argument(
    '--dataset',
    action='append',
    default=[],
    metavar='NAME',
    help='a dataset the model was trained on, for the model card (repeat '
    'for several)',
  )
  parser.add_argument(
    '--license',
    default=None,
    metavar='ID',
    help='the license of the weights for the model card (e.g. apache-2.0)',
  )
  parser.add_argument(
    '--name',
    default=None,
    help="the model's name, the model card's title (default: "
    '"Jade V8 chat model"; never the folder\'s name, which may name a '
    'person)',
  )
  return parser


def main(argv=None):
  args = parser().parse_args(argv)
  runtime.bootstrap()  # Before Trax is imported (by src.storage.export).
  from src.storage import export

  export.export(
    args.run_dir,
    args.out_dir,
    args.step,
    datasets=tuple(args.dataset),
    license=args.license,
    name=args.name,
  )
  return 0


if __name__ == '__main__':
  from src.apps.cli import run_main

  sys.exit(run_main(main))
