"""Train a Jade V8 Reformer chat model: `python train.py [--config FILE]`.

Reads the `train` section of config.json (or --config); any setting can be
overridden on the command line (--steps 100). Model and optimizer settings
are in the gin file (--gin); --bind adds a gin binding.
"""

import argparse
import sys


def parse_args(argv=None):
  from src.config import jsonconfig

  parser = argparse.ArgumentParser(
    description='Train a Reformer chat model on your conversations.'
  )
  parser.add_argument(
    '--config',
    metavar='FILE',
    default=None,
    help='JSON config (default: ./config.json if present)',
  )
  parser.add_argument(
    '--bind',
    action='append',
    default=[],
    metavar='GIN',
    help='extra gin binding, e.g. "ReformerLM.n_layers=2"',
  )
  jsonconfig.add_arguments(parser, 'train')
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  from src import runtime
  from src.config import jsonconfig, safegin

  settings = jsonconfig.from_args(args, 'train')
  bindings = [*settings['gin-bindings'], *args.bind]
  products = safegin.bound_value(
    settings['gin'], bindings, 'precision.products'
  )
  runtime.bootstrap(bf16_products=products in ('bfloat16', 'auto'))
  from src.training import trainer

  trainer.train(settings, gin_bindings=args.bind)


if __name__ == '__main__':
  from src.apps.cli import run_main

  sys.exit(run_main(main))
