"""The house's rules: imports run downhill, and importing `src` does nothing.

`src`'s packages form layers (listed in src/__init__.py and the README's
"Project layout"); a module may import its own package and the packages
below it, never one above, and no two modules import each other in a
circle.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from .conftest import ROOT

LAYERS = [
  'core',
  'runtime',
  'config',
  'data',
  'model',
  'storage',
  'inference',
  'training',
  'analysis',
  'apps',
]


def _modules():
  """{dotted module name: path} for every module under src/."""
  out = {}
  for folder, _, files in os.walk(os.path.join(ROOT, 'src')):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, ROOT)[: -len('.py')].split(os.sep)
        if rel[-1] == '__init__':
          rel = rel[:-1]
        out['.'.join(rel)] = path
  return out


def _imports(path: str, modules) -> set[str]:
  """The src modules `path` imports, at any depth (lazy imports too)."""
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if not node.module.startswith('src'):
        continue
      for alias in node.names:
        name = f'{node.module}.{alias.name}'
        found.add(name if name in modules else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith('src'))
  return found


def _layer(module: str) -> int | None:
  parts = module.split('.')
  return LAYERS.index(parts[1]) if len(parts) > 1 else None


def test_every_package_is_a_known_layer():
  packages = {m.split('.')[1] for m in _modules() if m.count('.') >= 1}
  assert packages == set(LAYERS)


def test_imports_run_downhill():
  modules = _modules()
  uphill = []
  for module, path in modules.items():
    own = _layer(module)
    for target in _imports(path, modules):
      there = _layer(target)
      if own is not None and (there is None or there > own):
        uphill.append(f'{module} imports {target}')
  assert uphill == []


def test_no_import_cycles():
  modules = _modules()
  graph = {m: _imports(p, modules) & set(modules) for m, p in modules.items()}
  # A package's __init__ is imported with each of its modules; leave it out.
  graph = {m: {t for t in ts if t != m} for m, ts in graph.items()}
  done, path = set(), []

  def visit(m):
    if m in path:
      raise AssertionError('import cycle: ' + ' -> '.join(path + [m]))
    if m in done:
      return
    path.append(m)
    for t in sorted(graph[m]):
      visit(t)
    path.pop()
    done.add(m)

  for m in sorted(graph):
    visit(m)


def test_importing_src_has_no_side_effects():
  """Every package, and the command-line modules, import without Trax,
  JAX or TensorFlow and without touching the environment; only
  `src.runtime.bootstrap()` does that."""
  code = (
    'import os, sys\n'
    'before = dict(os.environ)\n'
    'import src, src.core, src.runtime, src.config, src.data, src.model\n'
    'import src.storage, src.inference, src.training, src.analysis, src.apps\n'
    'import src.runtime.trax_patches\n'
    'from src.data import chatformat, corpus, tokenizer, windows\n'
    '# The command lines import Trax only after bootstrap():\n'
    'import src.apps.cli, src.apps.convert, src.apps.export\n'
    'heavy = [m for m in ("trax", "jax", "tensorflow") if m in sys.modules]\n'
    'print(heavy, dict(os.environ) == before)\n'
  )
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  out = subprocess.run(
    [sys.executable, '-c', code],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == '[] True'
