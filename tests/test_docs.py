"""Docs that cannot drift: every `python ...` command in a fenced block of
README.md and docs/*.md is parsed with its program's real arguments, and
every file of the project it names must exist, so a renamed flag, preset
or script fails here."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shlex

import pytest

from .conftest import ROOT

SHELLS = ('', 'sh', 'bash', 'shell', 'console')
# Folders of the project itself: a path into one of them must exist (a
# path under data/, runs/ or exports/ is made by an earlier command).
PROJECT = ('gin/', 'configs/', 'examples/', 'bench/', 'tests/', 'docs/')
OTHER_MODULES = ('pytest', 'pip', 'venv')


def blocks(path: str):
  """`(line number, text)` of each shell line in `path`'s fenced blocks,
  continuation lines joined."""
  lines = open(path, encoding='utf-8').read().splitlines()
  inside, kind, pending, start = False, '', '', 0
  for number, line in enumerate(lines, 1):
    fence = re.match(r'^\s*```(\w*)', line)
    if fence:
      inside, kind = (not inside), fence.group(1)
      continue
    if not inside or kind not in SHELLS:
      continue
    text = line.strip()
    if text.startswith('$ '):
      text = text[2:]
    if not pending:
      start = number
    if text.endswith('\\'):
      pending += text[:-1] + ' '
      continue
    yield start, pending + text
    pending = ''


def commands(text: str) -> list[list[str]]:
  """The `python ...` commands of one shell line (pipes and `&&` split;
  leading VAR=value words dropped)."""
  if text.startswith('#') or 'python' not in text:
    return []
  try:
    words = shlex.split(text, comments=True)
  except ValueError:
    return [['<unparsable>', text]]
  found, current = [], []
  for word in [*words, '&&']:
    if word in ('&&', '||', '|', ';'):
      while current and re.match(r'^\w+=', current[0]):
        current.pop(0)
      if current and current[0] in ('python', 'python3'):
        found.append(current[1:])
      current = []
    else:
      current.append(word)
  return found


def _parse(parse, argv) -> str | None:
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
      parse(argv)
  except SystemExit as e:
    if e.code not in (0, None):
      said = err.getvalue().strip().splitlines()
      return said[-1] if said else str(e.code)
  return None


def _train(argv):
  import train
  from src.config import jsonconfig

  args = train.parse_args(argv)
  if args.config and not os.path.isfile(os.path.join(ROOT, args.config)):
    raise SystemExit(f'no such config {args.config}')
  jsonconfig.from_args(args, 'train')


def _program(argv):
  """`(what, parse)` for a python command line's program."""
  from src.apps import convert, evaluate, export

  if argv[:1] == ['-m']:
    module, rest = argv[1], argv[2:]
  else:
    module, rest = argv[0], argv[1:]
  parsers = {
    'train.py': _train,
    'evaluate.py': evaluate.parse_args,
    'convert.py': lambda a: convert.parser().parse_args(a),
    'src.apps.convert': lambda a: convert.parser().parse_args(a),
    'export.py': lambda a: export.parser().parse_args(a),
    'src.apps.export': lambda a: export.parser().parse_args(a),
  }
  if module in parsers:
    return module, parsers[module], rest
  if module in OTHER_MODULES:
    return module, None, []
  path = module if module.endswith('.py') else module.replace('.', '/') + '.py'
  if not os.path.isfile(os.path.join(ROOT, path)):
    package = os.path.join(ROOT, module.replace('.', '/'), '__main__.py')
    if not os.path.isfile(package):
      return module, 'missing', rest
  return module, None, rest


def problems_of(text: str) -> list[str]:
  """What is wrong with the `python` commands of one shell line."""
  found = []
  for argv in commands(text):
    if not argv or argv[0] == '<unparsable>':
      found.append(f'cannot be read as a shell command: {text!r}')
      continue
    module, parse, rest = _program(argv)
    if parse == 'missing':
      found.append(f'{module}: no such script or module')
      continue
    for word in rest:
      value = word.split('=', 1)[-1]
      if value.startswith(PROJECT) and not glob.glob(
        os.path.join(ROOT, value)  # A shell pattern must match a file.
      ):
        found.append(f'{value}: no such file in the project')
    if parse is not None:
      problem = _parse(parse, rest)
      if problem:
        found.append(f'python {module}: {problem}')
  return found


DOCS = [os.path.join(ROOT, 'README.md')] + sorted(
  glob.glob(os.path.join(ROOT, 'docs', '*.md'))
)


@pytest.mark.parametrize('path', DOCS, ids=os.path.basename)
def test_every_command_in_the_docs_parses(path, monkeypatch):
  monkeypatch.chdir(ROOT)  # config.json is read from the working folder.
  if os.path.exists(os.path.join(ROOT, 'config.json')):
    pytest.skip('a config.json in the checkout would change what is read')
  bad, seen = [], 0
  for number, text in blocks(path):
    seen += len(commands(text))
    bad += [
      f'{os.path.basename(path)}:{number}: {p}' for p in problems_of(text)
    ]
  assert not bad, '\n'.join(bad)
  if path.endswith('README.md'):
    assert seen >= 10


def test_a_renamed_flag_or_missing_file_fails(monkeypatch):
  monkeypatch.chdir(ROOT)
  assert problems_of('python train.py --config configs/quickstart.json') == []
  (problem,) = problems_of('python train.py --stepz 5')
  assert 'unrecognized arguments: --stepz' in problem
  assert 'no such file' in problems_of('python train.py --gin gin/nope.gin')[0]
  assert 'no such config' in problems_of('python train.py --config x.json')[0]
  assert problems_of('python evaluate.py --model-dir runs/demo --tempo 0')
  assert problems_of('python export.py runs/a exports/b --nmae x')
  assert problems_of('python bench/no_such_bench.py')
  assert problems_of('echo hi | python convert.py whatsap a.txt out') != []
  assert problems_of('JADE_VERBOSE=1 python evaluate.py --prompt Hi') == []
