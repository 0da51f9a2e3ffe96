"""Gin: the one place configurables are registered, and gin file handling.

Gin files bind Trax's own configurables (`ReformerLM`, `LSHSelfAttention`,
`trax.optimizers.Adam`, ...) and ours, registered here:

- the attention classes of `src.model.attention` (`@LocalSelfAttention`,
  `@DirectedLSHSelfAttention`, `@FastLSHSelfAttention` in
  `ReformerLM.attention_type`) and `src.model.smeared`; their settings
  keep Trax's names (`SelfAttention.chunk_len`,
  `LSHSelfAttention.n_hashes`), and `ContextLSHSelfAttention` adds its own
  (`query_span`, `key_span`).

- `lr_schedule`: warmup then rsqrt / cosine / linear / constant decay
  (`src.model.optim.lr_schedule`; `total_steps` comes from the run settings).
- `optimizer.kind`: which Trax optimizer class to use.
- `output_loss.chunk_size`: positions whose logits exist at once.
- `precision.products`: the type training's matrix products read (float32,
  or bfloat16 summed in float32; `src.model.precision`).
- `output_layer.halves`, `output_layer.tied`, `output_layer.shortlist`,
  `output_layer.width`: what the output layer reads of the two reversible
  halves, 'concat' (Trax) or 'mean', whether it scores tokens through the
  token embedding, and whether it scores the rarer pieces through a narrow
  projection (`src.model.reformer`, `src.model.shortlist`): part of the
  model, saved with it.
- `positions.axial_init_scale`: how large the axial position embeddings
  start, relative to the token embeddings.
- `lsh.directed` is gone: a model.gin saved before the classes is read
  through `translate_legacy`.
- `residual.zero_feed_forward`, `residual.zero_attention`: each block's
  feed-forward output (attention output) starts at zero
  (`src.model.reformer.residual`).
- `smear.aligned`: each smeared layer's key projection of the position
  before starts as its query projection (`src.model.reformer.smear`).

`mode` and `vocab_size` are never bound in gin: the scripts pass them.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import tokenize

import numpy as np
import trax

import gin
from src.config import safegin
from src.core import files, rundir
from src.core.errors import UserError
from src.model import (
  attention,
  losses,
  optim,
  reformer,
  reversible,
  settings,
  smeared,
)
from src.model import precision as precision_lib

lr_schedule = gin.external_configurable(
  optim.lr_schedule, module='jade', denylist=['total_steps']
)
optimizer = gin.external_configurable(optim.optimizer, module='jade')
output_loss = gin.external_configurable(losses.output_loss, module='jade')
positions = gin.external_configurable(reformer.positions, module='jade')
precision = gin.external_configurable(precision_lib.precision, module='jade')
for _cls in (
  attention.LocalSelfAttention,
  attention.FastLSHSelfAttention,
  attention.DirectedLSHSelfAttention,
  smeared.SmearedLocalSelfAttention,
  smeared.SmearedDirectedLSHSelfAttention,
  smeared.ContextLSHSelfAttention,
):
  gin.external_configurable(_cls, module='jade', denylist=['mode'])
residual = gin.external_configurable(reformer.residual, module='jade')
smear = gin.external_configurable(reformer.smear, module='jade')
kept_blocks = gin.external_configurable(
  reversible.settings, 'reversible', module='jade'
)
output_layer = gin.external_configurable(reformer.output_layer, module='jade')
chat = gin.external_configurable(reformer.chat, module='jade')

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
    directed: the LSH layers have a directed score term (and its weights:
      `DirectedLSHSelfAttention`).
    output: what the output layer reads (`output_layer`: `halves`,
      'concat' or 'mean', `tied`, `shortlist` and `width`).
    block_classes: Each decoder block's attention class as bound
      (`SmearedDirectedLSHSelfAttention`, where `layer_attention` names
      the Trax class whose settings it reads), for logs and model cards.
    chat: how a finished model's chat reads (`chat.n_hashes`: hash
      rounds, 0 as trained; `chat.far_keys`, `chat.far_from`: the keys
      it reads far back), `reformer.ChatReading`.
  """

  path: str
  text: str
  model: dict
  attention: dict
  attention_name: str
  layer_attention: tuple = ()
  local: dict | None = None
  directed: bool = False
  output: reformer.Output = reformer.Output()
  block_classes: tuple = ()
  chat: reformer.ChatReading = reformer.ChatReading()

  @property
  def max_len(self) -> int:
    return int(self.model['max_len'])

  @property
  def attention_text(self) -> str:
    """The attention in words, for logs and model cards: the classes as
    bound (`SmearedLocalSelfAttention`, not the Trax class whose settings
    it reads)."""
    pairs = list(zip(self.layer_attention, self.block_classes))
    lsh = next((c for s, c in pairs if s == 'LSHSelfAttention'), None)
    if self.local is None or not pairs:
      return (self.block_classes or (self.attention_name,))[0]
    local = next(c for s, c in pairs if s == 'SelfAttention')
    order = ', '.join(
      'LSH' if s == 'LSHSelfAttention' else 'local' for s, _ in pairs
    )
    return (
      f'blocks {order} (LSH: {lsh}; local: {local}, chunk '
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
# pretrained model's settings) and how its chat reads (`chat`); the rest
# (optimizer, schedule, chunked loss) belong to a training run.
MODEL_CONFIGURABLES = frozenset(
  {'ReformerLM', 'output_layer', 'chat'} | safegin._ATTENTION
)

_LEGACY_DIRECTED = re.compile(
  r'^[ \t]*(?:jade\.)?lsh\.directed[ \t]*=[ \t]*(\w+)[^\n]*(?:\n|$)', re.M
)


def translate_legacy(text: str, directed: str | None = None) -> str:
  """Gin text written before the attention classes, in today's names.

  Until then, a model named Trax's classes (`@SelfAttention`,
  `@LSHSelfAttention`) and `lsh.directed = True|False`, one setting for the
  whole config, and Jade V8 changed Trax's classes in place. A text read
  with `directed` ('True' or 'False': the value bound last across all the
  texts read together), or alone binding `lsh.directed`, gets
  `@LocalSelfAttention` for `@SelfAttention` and
  `@DirectedLSHSelfAttention` (directed) or `@FastLSHSelfAttention` for
  `@LSHSelfAttention`, and loses the `lsh.directed` binding (and its
  section header, in a saved model.gin): the same layers, weights and
  outputs. Any other text is returned as it is.
  """
  if directed is None:
    directed = _legacy_directed([text])
  if directed is None:
    return text
  lsh = (
    '@DirectedLSHSelfAttention'
    if directed == 'True'
    else '@FastLSHSelfAttention'
  )
  text = _LEGACY_DIRECTED.sub('', text)
  text = re.sub(r'# Parameters for lsh:\n# =+\n\n?', '', text)
  text = re.sub(r'@(?:trax\.layers\.)?LSHSelfAttention\b', lsh, text)
  return re.sub(
    r'@(?:trax\.layers\.)?SelfAttention\b', '@LocalSelfAttention', text
  )


def _legacy_directed(texts) -> str | None:
  """The last `lsh.directed` value bound in `texts` (in reading order)."""
  found = [v for t in texts for v in _LEGACY_DIRECTED.findall(t)]
  return found[-1] if found else None


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
  return translate_legacy(text.replace('\r\n', '\n').replace('\r', '\n'))


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
  return parse_text(files.read_text(path, 'text'), path, bindings, base)


def _class_settings(kinds, model_settings: dict, path: str) -> dict:
  """Each attention class's settings (Trax's defaults and the bindings
  under its gin name), by that name."""
  per_class = {}
  for cls in kinds:
    if not inspect.isclass(cls):
      settings.check_types(model_settings, {}, path)  # Names what is wrong.
    name = attention.settings_name(cls)  # Ours read Trax's bindings.
    per_class[name] = settings._defaults(cls)
    try:
      per_class[name].update(gin.get_bindings(name))
    except (ValueError, TypeError, AttributeError):
      pass
  return per_class


def _parse_checked(text: str, path: str, bindings, base) -> None:
  """Gin parses the base's, the file's and the command line's bindings in
  turn, each read as data first: no import, include or call ever reaches
  gin."""
  safegin.check(text, path)
  for binding in bindings:
    safegin.check(binding, '--bind')
  directed = _legacy_directed(
    ([base[0]] if base else []) + [text] + list(bindings)
  )
  text = translate_legacy(text, directed)
  bindings = tuple(translate_legacy(b, directed) for b in bindings)
  gin.clear_config()
  if base is not None:
    safegin.check(*base)
    base = (translate_legacy(base[0], directed), base[1])
    _parse(*base)
  _parse(text, path)
  for binding in bindings:
    _parse(binding, f'--bind "{binding}"', line_numbers=False)


def parse_text(
  text: str,
  path: str,
  bindings: tuple[str, ...] = (),
  base: tuple[str, str] = None,
) -> GinSetup:
  """`parse` for gin text already read (`path` names it in messages)."""
  _parse_checked(text, path, bindings, base)
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
  model_settings = {**settings._defaults(trax.models.ReformerLM), **bound}
  model_settings['_bound'] = tuple(bound)
  kinds = settings.attention_kinds(model_settings, path)
  per_class = _class_settings(kinds, model_settings, path)
  settings.check_types(model_settings, per_class, path)
  names = [attention.settings_name(c) for c in kinds]
  main = next((c for c in kinds if 'LSH' in c.__name__), kinds[0])
  attention_settings = per_class[attention.settings_name(main)]
  settings.check_settings(model_settings, attention_settings, main, path)
  local = None
  if len(set(names)) > 1:
    local = per_class.get('SelfAttention')
    settings.check_local(model_settings, local, path)
  blocks = [kinds[i % len(kinds)] for i in range(model_settings['n_layers'])]
  _checked(kept_blocks, path)  # Refused here, naming the file.
  return GinSetup(
    path,
    gin.config_str(),
    model_settings,
    attention_settings,
    attention.settings_name(main),
    tuple(attention.settings_name(c) for c in blocks),
    local,
    any(issubclass(c, attention.DirectedLSHSelfAttention) for c in kinds),
    _checked(output_layer, path),
    tuple(c.__name__ for c in blocks),
    _checked(chat, path),
  )


def _checked(configurable, path: str):
  """A configurable's value under the parsed bindings; a wrong one is one
  line that names the gin file."""
  try:
    return configurable()
  except UserError as e:
    gin.clear_config()
    raise UserError(f'{path}: {str(e).splitlines()[0]}') from None


def add_bindings(bindings) -> None:
  """Adds code-made bindings to the parsed config (no clearing, no checks)."""
  with gin.unlock_config():
    gin.parse_config(list(bindings))


def saved_text(out_dir: str) -> str | None:
  p = os.path.join(out_dir, MODEL_GIN)
  if not os.path.lexists(p):
    return None
  return read_saved(p)


def canonical(text: str) -> str:
  """Gin's listing with its continued lines joined (gin wraps a binding
  longer than 80 characters, so a renamed class can move a line break)."""
  return re.sub(r'\\\n[ \t]*', '', text)


# Settings of how training runs, not of the model: a run resumes with
# other values (`reversible.kept_blocks`: the same gradients).
TRAINING_ONLY = ('reversible.',)


def resume_bindings(text: str) -> list[str]:
  """What a resume compares of gin's listing `text`: its lines but gin's
  headers, blanks and the `TRAINING_ONLY` settings."""
  skip = ('#', *TRAINING_ONLY)
  lines = canonical(text).splitlines()
  return [x for x in lines if x.strip() and not x.startswith(skip)]


def check_same_as_saved(setup: GinSetup, out_dir: str):
  """A run resumes only with the model settings it was started with."""
  saved = saved_text(out_dir)
  if saved is None:
    return
  old, new = resume_bindings(saved), resume_bindings(setup.text)
  if old == new:
    return
  diff = next(
    (f'saved "{a}" vs now "{b}"' for a, b in zip(old, new) if a != b),
    'different number of settings',
  )
  raise UserError(
    f'{os.path.join(out_dir, MODEL_GIN)}: this run was trained with other '
    f'model settings than {setup.path} ({diff}); use the same gin file '
    'to resume, or a new out-dir to start over'
  )


def model(vocab_size: int, mode: str):
  """The parsed config's model (Trax's `ReformerLM` with this project's
  layers and `output_layer`), not initialized: the one builder every
  mode and tool uses."""
  return reformer.reformer_lm(
    vocab_size, mode, output=output_layer(), kept=kept_blocks()
  )


def fresh_model(vocab_size: int, offset: str = 'zero'):
  """The model a run trains (`mode` 'train'), with every gin-bound
  setting of how it starts: `positions.axial_init_scale`, `residual`,
  `smear`.
  Initialized by its trainer. `offset`: where its training windows start
  on the position grid ('random' for windows shorter than the context)."""
  return reformer.reformer_lm(
    vocab_size,
    'train',
    positions(),
    zero_outputs=residual(),
    offset=offset,
    output=output_layer(),
    aligned=smear(),
    kept=kept_blocks(),
  )


def init_model(
  vocab_size: int, mode: str, max_len: int, batch: int = 1, seed=None
):
  """`model`, initialized for a `[batch, max_len]` int32 input; with `seed`
  (an int) the same weights every time, else Trax's per-process draw."""
  built = model(vocab_size, mode)
  length = 1 if mode == 'predict' else max_len
  rng = None if seed is None else trax.fastmath.random.get_prng(seed)
  built.init(trax.shapes.ShapeDtype((batch, length), np.int32), rng=rng)
  return built


def operative_text() -> str:
  return gin.operative_config_str()


def lr_peak() -> float:
  """The configured peak learning rate (the optimizer starts there; advice
  in messages)."""
  try:
    return float(gin.query_parameter('lr_schedule.peak'))
  except ValueError:
    return float(settings._defaults(optim.lr_schedule)['peak'])
