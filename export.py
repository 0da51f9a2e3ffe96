"""A shareable, weights-only copy of a training run: `python export.py
RUN_DIR OUT_DIR [--name NAME]`. The same as `python -m src.apps.export`."""

import sys

if __name__ == '__main__':
  from src.apps.cli import run_main
  from src.apps.export import main

  sys.exit(run_main(main))
