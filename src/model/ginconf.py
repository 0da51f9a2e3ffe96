"""Gin: the one place configurables are registered, and gin file handling.

Gin files bind Trax's own configurables (`ReformerLM`, `LSHSelfAttention`,
`trax.optimizers.Adam`, ...) and ours, registered here:

- `lr_schedule`: warmup then rsqrt / cosine / linear / constant decay
  (`src.model.reformer.lr_schedule`; `total_steps` comes from the run settings).
- `optimizer.kind`: which Trax optimizer class to use.
- `output_loss.chunk_size`: positions whose logits exist at once.
- `positions.axial_init_scale`: how large the axial position embeddings
  start, relative to the token embeddings.
- `lsh.directed`: LSH attention scores with a directed term as well
  (`src.model.reformer.lsh`, `src.runtime.trax_patches.fast_lsh`).
- `residual.zero_feed_forward`, `residual.zero_attention`: each block's
  feed-forward output (attention output) starts at zero
  (`src.model.reformer.residual`).

`mode` and `vocab_size` are never bound in gin: the scripts pass them.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import tokenize

import trax

import gin
from src.config import safegin
from src.core import files, rundir
from src.core.errors import UserError
from src.model import reformer

lr_schedule = gin.external_configurable(
  reformer.lr_schedule, module='jade', denylist=['total_steps']
)
optimizer = gin.external_configurable(reformer.optimizer, module='jade')
output_loss = gin.external_configurable(reformer.output_loss, module='jade')
positions = gin.external_configurable(reformer.positions, module='jade')
lsh = gin.external_configurable(reformer.lsh, module='jade')
residual = gin.external_configurable(reformer.residual, module='jade')

MODEL_GIN = rundir.MODEL_GIN  # The run's bindings, saved in out-dir.
OPERATIVE_GIN = rundir.OPERATIVE_GIN  # What the run actually used.


@dataclasses.dataclass(frozen=True)
class GinSetup:
  """A parsed gin configuration.

  Attributes:
    path: The gin file.
    text: Gin's normalized listing of every binding (compared on resume).
    model: ReformerLM settings, defaults filled in.
    attention: Settings of the long-range attention layer (LSH where the
      model has any), defaults filled in.
    attention_name: That layer's class name.
    layer_attention: Each decoder block's attention class name, in order
      (`ReformerLM.attention_type` may be one class or a list that Trax
      cycles through the blocks).
    local: Settings of the `SelfAttention` blocks of a mixed model (a list
      of local and LSH attention), else None.
    directed: `lsh.directed`: the LSH layers have a directed score term
      (and its weights); pass it to `model.reformer_lm`.
  """

  path: str
  text: str
  model: dict
  attention: dict
  attention_name: str
  layer_attention: tuple = ()
  local: dict | None = None
  directed: bool = False

  @property
  def max_len(self) -> int:
    return int(self.model['max_len'])

  @property
  def attention_text(self) -> str:
    """The attention in words, for logs and model cards."""
    lsh = self.attention_name == 'LSHSelfAttention'
    name = self.attention_name + (
      ' (directed)' if self.directed and lsh else ''
    )
    if self.local is None:
      return name
    order = ', '.join(
      'LSH' if k == 'LSHSelfAttention' else 'local'
      for k in self.layer_attention
    )
    return (
      f'blocks {order} (LSH: {name}; local: SelfAttention, chunk '
      f'{self.local["chunk_len"]})'
    )


def _one_line(e: Exception) -> str:
  return ' '.join(str(e).split())


def _parse(text: str, where: str, line_numbers: bool = True):
  """`gin.parse_config(text)`; errors become one `UserError` line."""
  try:
    gin.parse_config(text)
  except (
    ValueError,
    SyntaxError,
    KeyError,
    TypeError,
    NameError,
    AttributeError,
    ImportError,
    tokenize.TokenError,
  ) as e:
    gin.clear_config()
    message = _one_line(e)
    pattern = r' ?In (?:file "[^"]*"|bindings string),? line (\d+)'
    found = re.search(pattern, message)
    line = getattr(e, 'lineno', None) or (found and found.group(1))
    message = re.sub(pattern + '.*$', '', message).rstrip('. ')
    if line and line_numbers:
      where = f'{where}:{line}'
    raise UserError(
      f'{where}: {message}; check the spelling against gin/reformer_32k.gin'
    ) from None


# Configurables that define the model's weights and computation (a
# pretrained model's settings); the rest (optimizer, schedule, chunked
# loss) belong to a training run.
MODEL_CONFIGURABLES = frozenset(
  {'ReformerLM', 'lsh', 'jade.lsh'} | safegin._ATTENTION
)  # lsh.directed changes the weights.


def model_bindings(text: str, where: str) -> str:
  """The model's bindings (`MODEL_CONFIGURABLES`) of a gin text, checked
  as data; optimizer and schedule bindings are left out."""
  kept = [
    body
    for name, body in safegin.statements(text, where)
    if name in MODEL_CONFIGURABLES
  ]
  return '\n'.join(kept) + '\n'


MAX_GIN_BYTES = 1024 * 1024  # A saved model.gin is a few hundred bytes.


def read_saved(path: str) -> str:
  """A `model.gin` from a run or model folder: a regular file of at most
  MAX_GIN_BYTES, UTF-8, newlines as text mode reads them."""
  try:
    text = files.read_regular(path, MAX_GIN_BYTES).decode('utf-8')
  except UnicodeDecodeError as e:
    raise UserError(
      f'{path}: cannot be read ({_one_line(e)}); copy the folder again'
    ) from None
  return text.replace('\r\n', '\n').replace('\r', '\n')


def parse(
  path: str, bindings: tuple[str, ...] = (), base: tuple[str, str] = None
) -> GinSetup:
  """Parses a gin file (clearing earlier gin state) and checks it.

  Args:
    path: The gin file.
    bindings: Extra bindings ("ReformerLM.n_layers = 2") applied after it.
    base: `(text, where)` of bindings read before the file (a pretrained
      model's settings when fine-tuning); the file and `bindings` may
      override them.

  Raises:
    UserError: a missing file, a gin syntax error or unknown name, or a
      setting Trax would silently get wrong.
  """
  if not os.path.isfile(path):
    raise UserError(
      f'gin file {path!r} not found; set "gin" in config.json '
      '(or --gin) to a file in gin/'
    )
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(
      f'{path}: cannot be read ({_one_line(e)}); save it as UTF-8 text'
    ) from None
  return parse_text(text, path, bindings, base)


def parse_text(
  text: str,
  path: str,
  bindings: tuple[str, ...] = (),
  base: tuple[str, str] = None,
) -> GinSetup:
  """`parse` for gin text already read (`path` names it in messages)."""
  # Read as data first: no import, include or call ever reaches gin.
  safegin.check(text, path)
  for binding in bindings:
    safegin.check(binding, '--bind')
  gin.clear_config()
  if base is not None:
    safegin.check(*base)
    _parse(*base)
  _parse(text, path)
  for binding in bindings:
    _parse(binding, f'--bind "{binding}"', line_numbers=False)
  try:
    bound = gin.get_bindings('trax.models.ReformerLM')
  except ValueError:
    bound = {}
  if not bound:
    gin.clear_config()
    raise UserError(
      f'{path}: binds no ReformerLM settings, so Trax would build its '
      'default model; start from gin/tiny.gin or gin/reformer_32k.gin'
    )
  model_settings = {**reformer._defaults(trax.models.ReformerLM), **bound}
  model_settings['_bound'] = tuple(bound)
  kinds = reformer.attention_kinds(model_settings, path)
  settings = {}
  for cls in kinds:
    if not inspect.isclass(cls):
      reformer.check_types(model_settings, {}, path)  # Names what is wrong.
    settings[cls.__name__] = reformer._defaults(cls)
    try:
      settings[cls.__name__].update(gin.get_bindings(cls.__name__))
    except (ValueError, TypeError, AttributeError):
      pass
  reformer.check_types(model_settings, settings, path)
  main = next((c for c in kinds if 'LSH' in c.__name__), kinds[0])
  attention = settings[main.__name__]
  name = reformer.check_settings(model_settings, attention, main, path)
  local = None
  if len({c.__name__ for c in kinds}) > 1:
    local = settings.get('SelfAttention')
    reformer.check_local(model_settings, local, path)
  n_layers = int(model_settings['n_layers'])
  per_layer = tuple(kinds[i % len(kinds)].__name__ for i in range(n_layers))
  return GinSetup(
    path,
    gin.config_str(),
    model_settings,
    attention,
    name,
    per_layer,
    local,
    bool(lsh()),
  )


def add_bindings(bindings) -> None:
  """Adds code-made bindings to the parsed config (no clearing, no checks)."""
  with gin.unlock_config():
    gin.parse_config(list(bindings))


def saved_text(out_dir: str) -> str | None:
  p = os.path.join(out_dir, MODEL_GIN)
  if not os.path.lexists(p):
    return None
  return read_saved(p)


def check_same_as_saved(setup: GinSetup, out_dir: str):
  """A run resumes only with the gin it was started with."""
  saved = saved_text(out_dir)
  if saved is None or saved == setup.text:
    return
  old, new = saved.splitlines(), setup.text.splitlines()
  diff = next(
    (f'saved "{a}" vs now "{b}"' for a, b in zip(old, new) if a != b),
    'different number of settings',
  )
  raise UserError(
    f'{os.path.join(out_dir, MODEL_GIN)}: this run was trained with other '
    f'model settings than {setup.path} ({diff}); use the same gin file '
    'to resume, or a new out-dir to start over'
  )


def fresh_model(vocab_size: int):
  """The model a run from scratch trains (`mode` 'train'), with every
  gin-bound setting of how it starts: `positions.axial_init_scale`,
  `lsh.directed`, `residual`. Initialized by its trainer."""
  return reformer.reformer_lm(
    vocab_size, 'train', positions(), lsh(), zero_outputs=residual()
  )


def operative_text() -> str:
  return gin.operative_config_str()


def lr_peak() -> float:
  """The configured peak learning rate (the optimizer starts there; advice
  in messages)."""
  try:
    return float(gin.query_parameter('lr_schedule.peak'))
  except ValueError:
    return float(reformer._defaults(reformer.lr_schedule)['peak'])
