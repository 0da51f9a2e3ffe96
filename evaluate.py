"""Chat with a trained Jade V8 model, or measure its perplexity.

python evaluate.py                      # interactive chat (model-dir from
                                        # config.json "eval", default train)
python evaluate.py --prompt "Hello!"    # one reply, then exit
echo "Hi" | python evaluate.py          # each input line is a user turn,
                                        # each reply one line (|br| inside)
python evaluate.py --perplexity data/   # loss/perplexity on held-out files
python evaluate.py --serve              # OpenAI-compatible API and a chat
                                        # page on http://127.0.0.1:8000
"""

import sys


def main(argv=None):
  from src.apps import evaluate

  return evaluate.main(argv)


if __name__ == '__main__':
  from src.apps.cli import run_main

  sys.exit(run_main(main))
