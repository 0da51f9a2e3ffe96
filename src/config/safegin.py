"""Gin settings read as data: nothing in a gin file can run code.

Gin is a small language: besides bindings (`ReformerLM.d_model = 512`) it
has `import` (imports any Python module), `include` (reads another file),
`from __gin__ import dynamic_registration` (makes any function a
configurable) and `@name()` (calls a configurable while the config is
built). A model folder's `model.gin` comes from whoever made the model, so
before gin sees a file (or a `--bind`), `check` accepts only:

- bindings `Name.param = value` of the configurables Jade V8 uses
  (`CONFIGURABLES`; a `trax.models.`/`trax.layers.`/`trax.optimizers.`/
  `jade.` module prefix is allowed; no `scope/`);
- values that are Python literals (numbers, strings, True/False/None,
  tuples, lists, dicts of them) or references `@Name` to the classes in
  `REFERENCES`, never called (`@Name()`);
- comments and blank lines.

Everything else (`import`, `include`, `from`, macros `%X`, unknown names,
calls) is refused with `file:line` and the fix, before gin runs.
"""

from __future__ import annotations

import ast
import io
import tokenize

from src.core import files
from src.core.errors import UserError

_ATTENTION = {'LSHSelfAttention', 'SelfAttention', 'PureLSHSelfAttention'}
# Our attention classes (src/model/attention.py, smeared.py): referenced;
# their settings keep Trax's names (ContextLSHSelfAttention adds its spans).
_OUR_ATTENTION = {
  'LocalSelfAttention',
  'FastLSHSelfAttention',
  'DirectedLSHSelfAttention',
  'SmearedLocalSelfAttention',
  'SmearedDirectedLSHSelfAttention',
  'ContextLSHSelfAttention',
}
_OPTIMIZERS = {'Adam', 'Adafactor', 'SGD', 'Momentum', 'RMSProp', 'SM3'}
ACTIVATIONS = frozenset(
  {
    'Relu',
    'Gelu',
    'FastGelu',
    'Tanh',
    'Sigmoid',
    'Swish',
    'LeakyRelu',
    'Elu',
    'Selu',
  }
)
# Configurables a binding may name (the part before the last dot).
CONFIGURABLES = frozenset(
  {
    'ReformerLM',
    'lr_schedule',
    'optimizer',
    'output_loss',
    'output_layer',
    'positions',
    'precision',  # precision.products: training's products' type.
    'lsh',  # lsh.directed: model.gin files saved before the classes.
    'residual',
    'smear',
    'reversible',
    'chat',  # chat.n_hashes: how a finished model reads a conversation.
    'ContextLSHSelfAttention',  # query_span, key_span: its own settings.
  }
  | _ATTENTION
  | _OPTIMIZERS
)
# Classes a value may reference with `@` (each also with its module
# prefix): activations, attention layers, optimizers.
REFERENCES = frozenset(ACTIVATIONS | _ATTENTION | _OUR_ATTENTION | _OPTIMIZERS)
PREFIXES = ('', 'trax.models.', 'trax.layers.', 'trax.optimizers.', 'jade.')

_FIX = 'a gin file here may only bind settings (see gin/tiny.gin)'


def _known(dotted: str, names: frozenset) -> bool:
  return any(
    dotted.startswith(p) and dotted[len(p) :] in names for p in PREFIXES
  )


def _logical_lines(text: str, where: str):
  """Yields `(line number, [tokens])` per statement, comments dropped."""
  skip = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT}
  current: list[tokenize.TokenInfo] = []
  try:
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if tok.type in skip:
        continue
      if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
        if current:
          yield current[0].start[0], current
        current = []
        continue
      if tok.type == tokenize.ERRORTOKEN and not tok.string.strip():
        continue
      current.append(tok)
  except (tokenize.TokenError, SyntaxError, IndentationError) as e:
    line = getattr(e, 'lineno', None) or (e.args[1][0] if e.args else '?')
    raise UserError(
      f'{where}:{line}: not a gin binding (unbalanced brackets or quotes); '
      f'{_FIX}'
    ) from None


def _dotted(tokens, i):
  """Reads `a.b.c` from tokens[i]; returns (text, next index)."""
  parts = []
  while i < len(tokens) and tokens[i].type == tokenize.NAME:
    parts.append(tokens[i].string)
    i += 1
    if i < len(tokens) and tokens[i].string == '.':
      i += 1
    else:
      break
  return '.'.join(parts), i


def _check_statement(line: int, tokens, where: str):
  first = tokens[0].string
  at = f'{where}:{line}'
  if first in ('import', 'include', 'from'):
    raise UserError(
      f'{at}: "{first}" is not allowed: gin files are read as data and '
      f'never import, include or register code; {_FIX}'
    )
  selector, i = _dotted(tokens, 0)
  if i < len(tokens) and tokens[i].string == '/':
    raise UserError(f'{at}: gin scopes ("{first}/...") are not used; {_FIX}')
  if i >= len(tokens) or tokens[i].string != '=':
    raise UserError(f'{at}: expected "Name.setting = value"; {_FIX}')
  if '.' not in selector:
    raise UserError(
      f'{at}: macros ("{selector} = ...") are not allowed; write the value '
      f'into each binding instead'
    )
  configurable = selector.rsplit('.', 1)[0]
  if not _known(configurable, CONFIGURABLES):
    raise UserError(
      f'{at}: "{configurable}" is not a setting of a Jade V8 model '
      f'(known: {", ".join(sorted(CONFIGURABLES))})'
    )
  value = []
  i += 1
  if i >= len(tokens):
    raise UserError(f'{at}: "{selector} =" has no value')
  while i < len(tokens):
    tok = tokens[i]
    if tok.string == '%':
      raise UserError(
        f'{at}: macros ("%...") are not allowed; write the value itself'
      )
    if tok.string == '@':
      name, i = _dotted(tokens, i + 1)
      if not _known(name, REFERENCES):
        raise UserError(
          f'{at}: "@{name}" is not allowed; a value may reference only '
          f'{", ".join(sorted(REFERENCES))}'
        )
      if i < len(tokens) and tokens[i].string == '(':
        raise UserError(
          f'{at}: "@{name}()" calls code while the config is read; write '
          f'"@{name}" (a reference) instead'
        )
      value.append(repr('@' + name))
      continue
    value.append(tok.string)
    i += 1
  try:
    ast.literal_eval(' '.join(value))
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    raise UserError(
      f'{at}: the value of "{selector}" is not a literal (a number, string, '
      f'True/False/None, a tuple or list of them, or "@Name"); {_FIX}'
    ) from None


def check(text: str, where: str) -> None:
  """Refuses anything but plain bindings (see the module docstring).

  Args:
    text: Gin file contents or one binding.
    where: The file name (or `--bind`) for messages.

  Raises:
    UserError: naming `where:line` and the fix.
  """
  for line, tokens in _logical_lines(text, where):
    _check_statement(line, tokens, where)


def statements(text: str, where: str) -> list[tuple[str, str]]:
  """`(configurable, statement text)` per binding of a checked text, e.g.
  `('ReformerLM', 'ReformerLM.d_model = 128')`."""
  check(text, where)
  lines = text.split('\n')
  found = []
  for _, tokens in _logical_lines(text, where):
    selector, _ = _dotted(tokens, 0)
    first, last = tokens[0].start[0], tokens[-1].end[0]
    body = '\n'.join(lines[first - 1 : last])
    found.append((selector.rsplit('.', 1)[0].rsplit('.', 1)[-1], body))
  return found


def last_value(text: str, where: str, name: str):
  """The value of the last binding of `name` (e.g. `precision.products`,
  under any allowed module prefix) in a checked text, if it is a literal;
  None where the text binds none."""
  value = None
  for _, body in statements(text, where):
    selector, _, literal = body.partition('=')
    if _known(selector.strip(), frozenset({name})):
      try:
        value = ast.literal_eval(literal.strip())
      except (ValueError, SyntaxError):
        value = None
  return value


def bound_value(path: str, bindings, name: str):
  """The literal that the gin file `path`, then `bindings`, last bind to
  `name`; None where none does, or where they cannot be read or checked
  (the run's own parse then says why)."""
  texts = [(b, '--bind') for b in bindings]
  try:
    texts.insert(0, (files.read_text(path, 'text'), path))
  except (UserError, TypeError):
    pass
  value = None
  for text, where in texts:
    try:
      found = last_value(text, where, name)
    except UserError:
      continue
    value = value if found is None else found
  return value
