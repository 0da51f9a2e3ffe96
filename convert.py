"""Your chats into the line format: `python convert.py FORMAT INPUT... OUT`
(WhatsApp, Telegram, Discord, Messenger, Instagram exports and datasets;
`python convert.py --help` lists them). The same as `python -m
src.apps.convert`."""

import sys

if __name__ == '__main__':
  from src.apps.cli import run_main
  from src.apps.convert import main

  sys.exit(run_main(main))
