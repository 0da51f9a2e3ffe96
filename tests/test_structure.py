"""The house's shape, checked: sizes, no side channels in the model floor,
named state instead of positional tuples, small constructors.

Each rule names the places that break it, so a failure says where to
look. The import rules are tests/test_layers.py.
"""

from __future__ import annotations

import ast
import os

from .conftest import ROOT

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 600
MAX_UNPACKED = 4  # Names one assignment may unpack in src/model, inference.
MAX_POSITIONAL = 5  # Constructor parameters, in src/apps and src/inference.


def _sources():
  """`(path relative to the root, parsed tree, text)` of every module in
  src/."""
  for folder, _, names in os.walk(os.path.join(ROOT, 'src')):
    for name in sorted(names):
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        text = open(path, encoding='utf-8').read()
        yield os.path.relpath(path, ROOT), ast.parse(text), text


def _in(rel: str, *packages: str) -> bool:
  return any(rel.startswith(f'src/{p}/') for p in packages)


def test_functions_and_modules_are_short():
  long = []
  for rel, tree, text in _sources():
    if text.count('\n') > MAX_MODULE_LINES:
      long.append(f'{rel}: {text.count(chr(10))} lines')
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long.append(f'{rel}:{node.lineno} {node.name}: {lines} lines')
  assert long == []


def _targets(node):
  if isinstance(node, ast.Assign):
    return node.targets
  if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
    return [node.target]
  if isinstance(node, ast.withitem) and node.optional_vars is not None:
    return [node.optional_vars]
  return []


def test_state_is_named_not_unpacked_by_position():
  """The decode state and other records are read by name: no assignment
  in src/model or src/inference unpacks more than MAX_UNPACKED names."""
  wide = []
  for rel, tree, _ in _sources():
    if not _in(rel, 'model', 'inference'):
      continue
    for node in ast.walk(tree):
      for target in _targets(node):
        if isinstance(target, (ast.Tuple, ast.List)):
          if len(target.elts) > MAX_UNPACKED:
            wide.append(f'{rel}:{target.lineno} ({len(target.elts)} names)')
  assert wide == []


def test_no_side_channels_in_the_model():
  """No class swapped under an object, no attribute set from outside its
  own class (a module global, another object's field) and no `setattr`
  in src/model: what a call needs, it is given."""
  found = []
  for rel, tree, _ in _sources():
    for node in ast.walk(tree):
      for target in _targets(node):
        if isinstance(target, ast.Attribute) and target.attr == '__class__':
          found.append(f'{rel}:{node.lineno} assigns __class__')
    if not _in(rel, 'model'):
      continue
    for func in ast.walk(tree):
      if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for node in ast.walk(func):
        if isinstance(node, ast.Call) and getattr(node.func, 'id', '') in (
          'setattr',
          'delattr',
        ):
          found.append(f'{rel}:{node.lineno} {node.func.id}')
        for target in _targets(node) + (
          [node.target] if isinstance(node, ast.AugAssign) else []
        ):
          if (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id not in ('self', 'cls')
          ):
            found.append(f'{rel}:{node.lineno} sets {ast.unparse(target)}')
  assert found == []


def test_weights_are_read_by_role():
  """Positional `weights[k]` (which array is `w_o`?) in one file at most:
  the one that names the roles (`attention.weight_roles`)."""
  files = set()
  for rel, tree, _ in _sources():
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, (ast.Name, ast.Attribute))
        and ast.unparse(node.value).split('.')[-1] == 'weights'
        and isinstance(node.slice, (ast.Constant, ast.UnaryOp))
      ):
        files.add(rel)
  assert len(files) <= 1, sorted(files)


def test_constructors_take_settings_not_long_argument_lists():
  wide = []
  for rel, tree, _ in _sources():
    if not _in(rel, 'apps', 'inference'):
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef) and node.name == '__init__':
        args = node.args
        positional = len(args.posonlyargs) + len(args.args) - 1  # self
        if positional > MAX_POSITIONAL:
          wide.append(f'{rel}:{node.lineno} ({positional} positional)')
  assert wide == []


def test_classes_built_with_few_positional_arguments():
  """What `test_constructors_take_settings_not_long_argument_lists` cannot
  see in the text: a dataclass's generated constructor (one with many
  fields is keyword-only)."""
  import importlib
  import inspect
  import pkgutil

  import src.apps
  import src.inference

  wide = []
  for package in (src.apps, src.inference):
    for info in pkgutil.iter_modules(package.__path__):
      module = importlib.import_module(f'{package.__name__}.{info.name}')
      for name, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
          continue
        try:
          params = inspect.signature(cls).parameters.values()
        except (TypeError, ValueError):
          continue
        kinds = (inspect.Parameter.POSITIONAL_ONLY,
                 inspect.Parameter.POSITIONAL_OR_KEYWORD)  # fmt: skip
        positional = [p for p in params if p.kind in kinds]
        if len(positional) > MAX_POSITIONAL:
          wide.append(f'{module.__name__}.{name} ({len(positional)})')
  assert wide == []


def test_our_attention_classes_are_named_alike_everywhere():
  """The attention classes of src/model/attention.py and smeared.py are
  listed in three places that cannot import each other's list (safegin
  sits below the model): each must name every one of them."""
  import inspect

  import gin
  from src.config import safegin
  from src.model import attention, ginconf, settings, smeared

  del ginconf  # Imported for its registrations.
  ours = {
    name
    for module in (attention, smeared)
    for name, cls in inspect.getmembers(module, inspect.isclass)
    if issubclass(cls, attention._Ours) and not name.startswith('_')
  }
  assert ours == safegin._OUR_ATTENTION
  assert ours <= settings._ATTENTION_CLASSES
  for name in ours:
    assert gin.config._REGISTRY.get_match(f'jade.{name}') is not None, name
