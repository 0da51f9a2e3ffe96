"""The model's settings checked before anything is built: every
ReformerLM and attention setting has its type and range, and the
combinations Trax would silently get wrong are refused with one line."""

from __future__ import annotations

import inspect

import numpy as np

from src.config import safegin
from src.core.errors import UserError


def _defaults(fn) -> dict:
  """Keyword defaults of a function, or of a class's `__init__`: and where
  that `__init__` passes `**kwargs` on to its base's, the base's too (the
  nearer class's default wins)."""
  if not inspect.isclass(fn):
    return _signature_defaults(getattr(fn, '__wrapped__', fn))[0]
  found = {}
  for cls in fn.__mro__:
    if '__init__' not in vars(cls):
      continue
    own, passes_on = _signature_defaults(vars(cls)['__init__'])
    found = {**own, **found}
    if not passes_on:
      break
  return found


def _signature_defaults(fn) -> tuple[dict, bool]:
  """`fn`'s keyword defaults, and whether it takes `**kwargs`."""
  params = inspect.signature(fn).parameters.values()
  empty, var = inspect.Parameter.empty, inspect.Parameter.VAR_KEYWORD
  defaults = {p.name: p.default for p in params if p.default is not empty}
  return defaults, any(p.kind is var for p in params)


def attention_kinds(model: dict, where: str) -> list:
  """The attention classes of `ReformerLM.attention_type`, as a list.

  Trax cycles a list through the decoder blocks (block i gets entry
  `i % len`), so `n_layers` must be a multiple of its length.
  """
  kinds = model['attention_type']
  if not isinstance(kinds, (list, tuple)):
    return [kinds]
  kinds = list(kinds)
  if not kinds or int(model['n_layers']) % len(kinds):
    raise UserError(
      f'{where}: ReformerLM.n_layers {model["n_layers"]} must be a multiple '
      f'of the {len(kinds)} entries of ReformerLM.attention_type (Trax '
      'cycles the list through the blocks)'
    )
  return kinds


def check_local(model: dict, local: dict | None, where: str):
  """A mixed model's `SelfAttention` blocks must be local (chunked).

  Unchunked, they would hold the whole context's scores, which the
  32k model cannot afford, and the mix would no longer be a Reformer.
  """
  chunk = (local or {}).get('chunk_len')
  if not chunk:
    raise UserError(
      f'{where}: ReformerLM.attention_type mixes attention kinds, so bind '
      '"SelfAttention.chunk_len" (e.g. 64): the SelfAttention blocks are '
      'the local ones, attending within their chunk and the one before'
    )
  if int(model['max_len']) % int(chunk):
    raise UserError(
      f'{where}: max_len {model["max_len"]} must be a multiple of '
      f'SelfAttention.chunk_len {chunk}'
    )
  if local.get('n_chunks_after'):
    raise UserError(
      f'{where}: SelfAttention.n_chunks_after must be 0 in a causal '
      'language model (it would look ahead)'
    )


# ---- Types and ranges of the model settings --------------------------------
#
# A model.gin may come from someone else: every setting is checked for its
# type and range before anything is built, so a bad value is one line, not
# a traceback or an allocation that takes the machine's memory.

_INT, _FRACTION, _PROBABILITY, _BOOL = 'int', 'fraction', 'probability', 'bool'
MAX_LEN = 1 << 20  # Tokens of context.
# Ranges many settings share.
_LENGTH = (_INT, 1, MAX_LEN)  # A number of tokens.
_SPAN = (_INT, 0, MAX_LEN)  # A number of tokens, or 0.
_RATE = (_FRACTION, 0, 1)  # A dropout rate.
_FLAG = (_BOOL, 0, 1)
_MODEL_RANGES = {
  'd_model': (_INT, 1, 16384),
  'd_ff': (_INT, 1, 65536),
  'd_attention_key': (_INT, 1, 4096),
  'd_attention_value': (_INT, 1, 4096),
  'n_layers': (_INT, 1, 128),
  'n_heads': (_INT, 1, 256),
  'max_len': _LENGTH,
  'dropout': _RATE,
  'pos_start_from_zero_prob': (_PROBABILITY, 0, 1),
  'pos_max_offset_to_add': _SPAN,
  'ff_use_sru': (_INT, 0, 64),
  'ff_chunk_size': _SPAN,
  'ff_sparsity': (_INT, 0, 65536),
  'attention_chunk_size': _SPAN,
}
MOST_HASH_ROUNDS = 64  # LSH hash rounds, in training or in a chat.
_ATTENTION_RANGES = {
  'chunk_len': _LENGTH,
  'n_chunks_before': (_INT, 0, 64),
  'n_chunks_after': (_INT, 0, 64),
  'n_hashes': (_INT, 1, MOST_HASH_ROUNDS),
  'predict_mem_len': _LENGTH,
  'predict_drop_len': _LENGTH,
  'attention_dropout': _RATE,
  'output_dropout': _RATE,
  'max_length_for_buckets': _LENGTH,
  'n_parallel_heads': (_INT, 1, 256),
  'causal': _FLAG,
  'masked': _FLAG,
  'bias': _FLAG,
  'use_python_loop': _FLAG,
  'use_reference_code': _FLAG,
}
_ATTENTION_CLASSES = {
  'LSHSelfAttention',
  'SelfAttention',
  'LocalSelfAttention',
  'FastLSHSelfAttention',
  'DirectedLSHSelfAttention',
  'SmearedLocalSelfAttention',
  'SmearedDirectedLSHSelfAttention',
  'ContextLSHSelfAttention',
}


def _bad(where: str, name: str, value, want: str):
  shown = '@' + value.__name__ if callable(value) else repr(value)
  shown = shown if len(shown) <= 40 else shown[:37] + '...'
  return UserError(f'{where}: {name} = {shown} must be {want}')


def _check_value(where: str, name: str, value, rule):
  kind, low, high = rule
  if value is None:
    return
  if kind == _BOOL:
    if not isinstance(value, bool):
      raise _bad(where, name, value, 'True or False')
    return
  if kind == _INT:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or not low <= value <= high:
      raise _bad(where, name, value, f'a whole number from {low} to {high}')
    return
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if kind == _PROBABILITY:
    if not ok or not low <= value <= high:
      raise _bad(where, name, value, f'a number from {low} to {high}')
    return
  if not ok or not low <= value < high:
    raise _bad(where, name, value, f'a number from {low} to below {high}')


def _ints(where, name, value, low, high, length=(1, 8)):
  if isinstance(value, (list, tuple)) and not value:
    return  # An empty tuple: no axial positions.
  if not isinstance(value, (list, tuple)) or not (
    length[0] <= len(value) <= length[1]
  ):
    raise _bad(
      where, name, value, f'a tuple of {length[0]}-{length[1]} numbers'
    )
  for v in value:
    _check_value(where, name, v, (_INT, low, high))


def _class_name(value) -> str | None:
  """The name of a class or function a setting references (`@Name`)."""
  return getattr(value, '__name__', None) if callable(value) else None


def check_types(model: dict, attention: dict[str, dict], where: str):
  """Every model setting has its type and range, before anything is built.

  Args:
    model: ReformerLM keyword settings (defaults filled in).
    attention: Settings of each attention class used, by class name.
    where: The gin file, for messages.
  """
  for key, rule in _MODEL_RANGES.items():
    _check_value(where, f'ReformerLM.{key}', model.get(key), rule)
  kinds = model.get('attention_type')
  kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
  if not 1 <= len(kinds) <= 16 or any(
    _class_name(k) not in _ATTENTION_CLASSES for k in kinds
  ):
    raise _bad(
      where,
      'ReformerLM.attention_type',
      model.get('attention_type'),
      '@LocalSelfAttention, @DirectedLSHSelfAttention or a list of them',
    )
  if _class_name(model.get('ff_activation')) not in safegin.ACTIVATIONS:
    raise _bad(
      where,
      'ReformerLM.ff_activation',
      model.get('ff_activation'),
      f'one of {", ".join("@" + a for a in sorted(safegin.ACTIVATIONS))}',
    )
  if model.get('pos_type') not in (None, 'axial', 'fixed-base', 'infinite'):
    raise _bad(where, 'ReformerLM.pos_type', model.get('pos_type'), "'axial'")
  for key in ('pos_axial_shape', 'pos_d_axial_embs'):
    if model.get(key) is not None:
      _ints(where, f'ReformerLM.{key}', model[key], 1, MAX_LEN)
  for cls, settings in attention.items():
    for key, rule in _ATTENTION_RANGES.items():
      _check_value(where, f'{cls}.{key}', settings.get(key), rule)
    mixed = len({_class_name(k) for k in kinds}) > 1  # See check_local.
    if (
      not mixed
      and settings.get('chunk_len') is None
      and (settings.get('n_chunks_before') or settings.get('n_chunks_after'))
    ):
      raise UserError(
        f'{where}: {cls}.chunk_len is None (full attention) but '
        f'{cls}.n_chunks_before is {settings.get("n_chunks_before")}; add '
        f'"{cls}.n_chunks_before = 0" (chunks before mean local attention)'
      )
    buckets = settings.get('n_buckets')
    if buckets is not None:
      if isinstance(buckets, (list, tuple)):
        _ints(where, f'{cls}.n_buckets', buckets, 2, 1 << 16, (1, 4))
      else:
        _check_value(where, f'{cls}.n_buckets', buckets, (_INT, 2, 1 << 16))


def check_settings(model: dict, attention: dict, attention_type, where: str):
  """Rejects settings that Trax would silently get wrong.

  Args:
    model: ReformerLM keyword settings (defaults filled in).
    attention: Settings of the attention layer (defaults filled in).
    attention_type: The attention layer class.
    where: The gin file, for messages.
  """
  for key in ('vocab_size', 'mode'):
    if key in model.get('_bound', ()):
      what = (
        'comes from the tokenizer'
        if key == 'vocab_size'
        else 'is chosen by the scripts (train/eval/predict)'
      )
      raise UserError(f'{where}: remove "ReformerLM.{key}": it {what}')
  max_len, d_model = model['max_len'], model['d_model']
  axial = tuple(model.get('pos_axial_shape') or ())
  if axial and model.get('pos_type') != 'axial':
    raise UserError(
      f'{where}: ReformerLM.pos_axial_shape is set but '
      "ReformerLM.pos_type is not 'axial', so Trax would "
      'ignore it; add "ReformerLM.pos_type = \'axial\'"'
    )
  if model.get('pos_type') == 'axial':
    if not axial or int(np.prod(axial)) != max_len:
      raise UserError(
        f'{where}: ReformerLM.pos_axial_shape {axial} must '
        f'multiply to max_len {max_len}'
      )
    embs = tuple(model.get('pos_d_axial_embs') or ())
    if len(embs) != len(axial) or sum(embs) != d_model:
      raise UserError(
        f'{where}: ReformerLM.pos_d_axial_embs {embs} must have '
        f'{len(axial)} entries summing to d_model {d_model}'
      )
  name = getattr(attention_type, '__name__', str(attention_type))
  if 'LSH' in name:
    chunk_len, n_buckets = attention['chunk_len'], attention['n_buckets']
    if n_buckets is None:
      raise UserError(
        f'{where}: set "LSHSelfAttention.n_buckets" (e.g. '
        f'{max(2, max_len // chunk_len)}); left unset, '
        'Trax hashes the one-token predict step into a different number '
        'of buckets than training used'
      )
    for n in n_buckets if isinstance(n_buckets, (list, tuple)) else [n_buckets]:
      if n < 2 or n % 2:
        raise UserError(
          f'{where}: LSHSelfAttention.n_buckets {n_buckets} '
          'must be even (or a list of even factors)'
        )
    if max_len % chunk_len:
      raise UserError(
        f'{where}: max_len {max_len} must be a multiple of '
        f'LSHSelfAttention.chunk_len {chunk_len}'
      )
  return name
