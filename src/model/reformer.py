"""The model, as plain functions: `reformer_lm` builds Trax's `ReformerLM`
with this project's attention classes (`src.model.attention`), axial
positions (`src.model.positions`) and start (`positions`, `residual`).

Nothing here knows about gin: `src.model.ginconf` registers these functions (and
Trax's own `ReformerLM`, `LSHSelfAttention`, optimizers) as configurables
and parses the gin files. `mode` and `vocab_size` always come from code.
The settings' checks are `src.model.settings`, the loss and metrics
`src.model.losses`, the schedule and optimizer `src.model.optim`.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import trax
from trax import layers as tl
from trax.layers import normalization
from trax.layers.research import efficient_attention as ea

from src.core.errors import UserError
from src.model import layer_norm, reversible, tied
from src.model import positions as axial
from src.model import shortlist as shortlist_lib


def positions(axial_init_scale: float = 1.0) -> float:
  """How the axial position embeddings start (gin: positions).

  Args:
    axial_init_scale: Their standard deviation at initialization, relative
      to the token embeddings' (Trax draws those with std 1/sqrt(d_model)).
      1.0: position and token start at the same scale. Trax's own start,
      std 1.0, is `sqrt(d_model)` here (11 at d_model 128, 23 at 512): the
      position then swamps the token in every layer's input, and a model
      learns little from content (BENCHMARKS.md, "The position swamps the
      token"). Only a run from scratch uses it: resumed and fine-tuned runs
      load their weights.

  Returns:
    The scale.
  """
  if not axial_init_scale > 0:
    raise UserError(
      f'positions.axial_init_scale = {axial_init_scale!r} must be above 0; '
      "fix it in the gin file (1.0: the token embeddings' scale)"
    )
  return float(axial_init_scale)


def residual(
  zero_feed_forward: bool = True, zero_attention: bool = False
) -> tuple[bool, bool]:
  """How each reversible block's two branches start (gin: residual).

  Args:
    zero_feed_forward: Each block's feed-forward output layer starts at
      zero, so at first a block adds only its attention and the next
      block's attention reads the embedding plus that, not an untrained
      feed-forward of it. Trax starts it random: the copy task's word
      three tokens back was then learned at step ~1750 (LSH first) instead
      of 500, and a held-out list was repeated exactly 29 times of 30
      instead of 30 (BENCHMARKS.md, "Blocks that start quiet").
    zero_attention: Each attention output projection starts at zero too,
      so every block starts as the identity (SkipInit). Measured: the copy
      task at step 250, but lists repeated 8 times of 30: not the default.

  Only a run from scratch uses them: resumed and fine-tuned runs load
  their weights.

  Returns:
    `(zero_attention, zero_feed_forward)`.
  """
  return bool(zero_attention), bool(zero_feed_forward)


# Each far key is one pass of a maximum over a query's keys
# (`decode_keys.best_far`).
MOST_FAR_KEYS = 64


@dataclasses.dataclass(frozen=True)
class ChatReading:
  """How a finished model reads a conversation (gin: `chat`)."""

  n_hashes: int = 0  # LSH hash rounds (0: as trained).
  far_keys: int = 0  # Keys read beyond `far_from` a query (0: all).
  far_from: int = 0  # Tokens back from which a key is far.


def _whole(name: str, value, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise UserError(
      f'chat.{name} = {value!r}: write a whole number of {what} in the gin file'
    )
  return value


def chat(n_hashes: int = 0, far_keys: int = 0, far_from: int = 0):
  """How a finished model reads a conversation (gin: chat): kept with the
  model (model.gin, exports), read by the chat and the server
  (`src.inference.decoding.load_model`), never by training.

  Args:
    n_hashes: LSH hash rounds the chat reads with; 0 reads as trained
      (`LSHSelfAttention.n_hashes`). A layer trained with few buckets
      keeps `n_hashes x` its chunks of candidates a token, so more rounds
      reach further back in a long conversation, at more cost (the
      long-conversation walkthrough's model: 3 of 6 words ~28k tokens
      back with 8, 0 with the 2 it trained with; BENCHMARKS.md "The
      long-conversation walkthrough, four runs"). `evaluate.py
      --n-hashes` overrides it.
    far_keys: of the keys more than `far_from` tokens before a query, an
      LSH layer's chat reads only the `far_keys` that score best (0: all
      it keeps). A model trained on windows of `far_from` tokens never
      spread a query over the thousands of keys further back, which a
      long conversation gives it: its lookup finds the word said once,
      and the rest, each weighing little, drown it (the walkthrough's
      model with 8: BENCHMARKS.md "The far keys a chat reads"). Every
      key within `far_from` is read as before. `evaluate.py --far-keys`
      overrides it.
    far_from: tokens back from which a key is far: the longest window
      the model trained on (the walkthrough's 4,096). Needed with
      `far_keys`.

  Returns:
    `ChatReading`.
  """
  reading = ChatReading(
    _whole('n_hashes', n_hashes, 'hash rounds (0: as trained)'),
    _whole('far_keys', far_keys, 'keys (0: all)'),
    _whole('far_from', far_from, 'tokens'),
  )
  if reading.far_keys and not reading.far_from:
    raise UserError(
      f'chat.far_keys = {far_keys} needs chat.far_from: bind it to the '
      'longest window the model trained on (e.g. chat.far_from = 4096)'
    )
  if reading.far_keys > MOST_FAR_KEYS:
    raise UserError(
      f'chat.far_keys = {far_keys}: at most {MOST_FAR_KEYS} (each is a '
      'pass over the keys); 0 reads them all'
    )
  return reading


def smear(aligned: bool = False) -> bool:
  """How the smeared attention layers start (gin: smear).

  Args:
    aligned: Each smeared layer's projection of the position before into
      its keys (`w_s`) starts equal to its query projection (the directed
      query `w_a` in LSH), so from the first step a query's score favours
      the positions that follow an earlier occurrence of its own token:
      the induction head that copying, and the lookup of something said
      once, are built on (BENCHMARKS.md "Smeared keys that start
      aligned"). It needs `@Smeared...` classes in
      `ReformerLM.attention_type`.

  Only a run from scratch uses it: resumed and fine-tuned runs load
  their weights.
  """
  return bool(aligned)


def _zeros(shape, rng):
  """A Trax initializer: zeros."""
  del rng
  return jnp.zeros(shape, jnp.float32)


def branch_outputs(lm) -> tuple[list, list]:
  """The layers whose output ends each block's two branches: the attention
  layers and the feed-forwards' last `Dense` (Trax's feed-forward is
  `LayerNorm, Dense, Dropout, activation, Dense, Dropout`)."""
  attention = [
    node
    for node in all_layers(lm)
    if isinstance(node, (ea.SelfAttention, ea.LSHSelfAttention))
  ]
  dense = []
  for node in all_layers(lm):
    subs = list(getattr(node, 'sublayers', ()) or ())
    if subs and isinstance(subs[0], normalization.LayerNorm):
      found = [s for s in subs if type(s).__name__ == 'Dense']
      dense += found[1:2] if len(found) == 2 else []
  return attention, dense


HALVES = ('concat', 'mean')


@dataclasses.dataclass(frozen=True)
class Output:
  """What the output layer reads (gin: `output_layer`)."""

  halves: str = 'concat'  # 'concat' (Trax's) or 'mean' of the two halves.
  tied: bool | str = False  # Also (True) or only ('only') scores tokens
  # through the token embedding.
  shortlist: int = 0  # Pieces scored from all features (0: every piece).
  width: int = 0  # Features the rarer pieces are scored from (0: 1/4).


def output_layer(
  halves: str = 'concat',
  tied: bool | str = False,
  shortlist: int = 0,
  width: int = 0,
) -> Output:
  """What the output layer reads (gin: output_layer).

  Args:
    halves: 'concat' (Trax's ReformerLM: both reversible halves, `2
      d_model` features, so the output layer has `2 d_model x vocab`
      weights) or 'mean' (their mean, `d_model` features, as
      reformer-pytorch does: half the output layer's weights and work,
      which dominate a step at a vocabulary of thousands of pieces).
    tied: True also scores each token through its embedding's vector
      (`src.model.tied`: a learned map of `h`, starting at 0, against the
      embedding): what a layer copies scores its token whether or not
      the token was often a training target. 'only' scores tokens
      through the embedding alone: no token has an output column of its
      own, with which training learns which tokens answers hold and
      holds down the others, a copied word never asked for in training
      among them (BENCHMARKS.md "An output read through the embedding
      alone").
    shortlist: 0 (Trax's output layer) or how many of the most used
      pieces (the lowest ids) are scored from all the features; the rest
      are scored through `width` of them (`src.model.shortlist`: at a
      vocabulary of thousands of pieces, a fraction of the work). A
      vocabulary no larger than the shortlist keeps Trax's layer. A new
      run asked for 8,000 pieces or more is bound 2048 by its trainer
      unless its gin chose (`shortlist.auto_size`).
    width: With a shortlist, the features the rarer pieces are scored
      from; 0 is a quarter of what the output layer reads.

  Returns:
    The choice.
  """
  if halves not in HALVES:
    raise UserError(
      f"output_layer.halves = {halves!r}: write 'concat' or 'mean' in the "
      'gin file'
    )
  if not isinstance(tied, bool) and tied != 'only':
    raise UserError(
      f"output_layer.tied = {tied!r}: write True, False or 'only' in the "
      'gin file'
    )
  _check_shortlist(shortlist, width, tied)
  return Output(halves, tied, shortlist, width)


def _check_shortlist(shortlist, width, tied):
  """`output_layer.shortlist` and `width` (see `output_layer`), or one
  line naming the setting and the fix."""
  for name, value in (('shortlist', shortlist), ('width', width)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise UserError(
        f'output_layer.{name} = {value!r}: write 0 (off) or a positive '
        'number of pieces (features) in the gin file'
      )
  if width and not shortlist:
    raise UserError(
      f'output_layer.width = {width} is the width of a shortlist output '
      'layer: set output_layer.shortlist too, or remove the width, in the '
      'gin file'
    )
  if shortlist and tied:
    raise UserError(
      'output_layer.shortlist and output_layer.tied are two output layers: '
      'set one of them in the gin file'
    )


def _mean_of_halves(a, b):
  return (a + b) * 0.5


def reformer_lm(
  vocab_size: int,
  mode: str,
  axial_init_scale: float | None = None,
  zero_outputs: tuple[bool, bool] = (False, False),
  offset: str = 'zero',
  output: Output = Output(),
  aligned: bool = False,
  kept: int = 0,
):
  """`trax.models.ReformerLM` with the gin-bound settings.

  `axial_init_scale` (see `positions`): where given, the axial position
  embeddings are drawn with std `axial_init_scale / sqrt(d_model)` when
  the model is initialized; None keeps Trax's initializer (std 1.0), which
  only matters for a model that is then initialized, not loaded.
  The attention classes are `ReformerLM.attention_type`'s
  (`src.model.attention`). `zero_outputs` (see `residual`): whether each
  block's attention output projections, and its feed-forward output
  layers, start at zero when the model is initialized. Its axial
  positions are `positions.AxialPositions` (any window of the grid);
  `offset` is where a training window starts on it ('zero' or 'random').
  `output`: see `output_layer`. `aligned` (see `smear`): the
  smeared layers' `w_s` start as their query projections. `kept`: see
  `reversible.settings`. Its layer norms are `layer_norm.LayerNorm`
  (Trax's, by a CPU kernel where it runs).
  """
  lm = trax.models.ReformerLM(vocab_size=vocab_size, mode=mode)
  _keep_last(lm, kept, mode == 'train')
  _read_output(lm, output, vocab_size)
  if any(zero_outputs):
    attention, dense = branch_outputs(lm)
    if not attention or len(attention) != len(dense):
      raise UserError(
        f'residual: found {len(attention)} attention and {len(dense)} '
        'feed-forward outputs, one of each per block wanted; it needs '
        "LSHSelfAttention or SelfAttention blocks with Trax's feed-forward; "
        'set residual.zero_feed_forward = False and '
        'residual.zero_attention = False in the gin file'
      )
    for layer in attention if zero_outputs[0] else ():
      if not hasattr(layer, 'start_at_zero'):
        raise UserError(
          f'residual.zero_attention needs the attention classes of '
          f"src/model/attention.py, not Trax's {type(layer).__name__}; "
          'name them in ReformerLM.attention_type'
        )
      layer.start_at_zero()
    for layer in dense if zero_outputs[1] else ():
      _replace(lm, layer, _zero_dense(layer))
  if aligned:
    _start_aligned(lm)
  _own_layers(lm, axial_init_scale, offset)
  return lm


def _own_layers(lm, axial_init_scale: float | None, offset: str):
  """Puts this project's axial positions and layer norms where `lm` has
  Trax's (see `reformer_lm`)."""
  for layer in all_layers(lm):
    if isinstance(layer, tl.AxialPositionalEncoding):
      init = None
      if axial_init_scale is not None:
        d_model = sum(layer._d_embs)
        init = tl.RandomNormalInitializer(axial_init_scale / math.sqrt(d_model))
      _replace(lm, layer, axial.AxialPositions.like(layer, offset, init))
    elif type(layer) is normalization.LayerNorm:  # Not gin's subclass.
      _replace(lm, layer, layer_norm.LayerNorm.like(layer))


def _keep_last(lm, blocks: int, training: bool):
  """`lm`'s reversible stack, in training, as a `reversible.KeptSerial`
  whose last `blocks` blocks (all, where it has fewer) keep their
  activations (checked by `reversible.settings`); none: Trax's stack."""
  (stack,) = [x for x in all_layers(lm) if isinstance(x, tl.ReversibleSerial)]
  n_blocks = sum(
    getattr(x, '_attention_layer', None) is not None for x in stack.sublayers
  )
  if blocks and training and n_blocks:
    per_block = len(stack.sublayers) // n_blocks
    kept = min(blocks, n_blocks) * per_block
    _replace(lm, stack, reversible.KeptSerial(stack.sublayers, kept))


def _start_aligned(lm):
  """`smear.aligned`: every smeared attention layer of `lm` starts
  aligned; a model with none is refused."""
  found = [x for x in all_layers(lm) if hasattr(x, 'start_aligned')]
  if not found:
    raise UserError(
      'smear.aligned = True needs smeared attention layers; name '
      '@SmearedLocalSelfAttention or @SmearedDirectedLSHSelfAttention in '
      'ReformerLM.attention_type, or set smear.aligned = False in the gin '
      'file'
    )
  for layer in found:
    layer.start_aligned()


def _read_output(lm, output: Output, vocab_size: int):
  """Builds `lm`'s output layer as `output` says (see `output_layer`)."""
  if output.halves == 'mean':
    (join,) = [s for s in lm.sublayers if isinstance(s, tl.Concatenate)]
    _replace(lm, join, tl.Fn('MeanOfHalves', _mean_of_halves))
  if output.tied:
    _tie(lm, output)
  if shortlist_lib.applies(output.shortlist, vocab_size):
    layer = shortlist_lib.ShortlistOutput(
      vocab_size, output.shortlist, output.width
    )
    _replace(lm, lm.sublayers[-1], layer)


def _tie(lm, output: Output):
  """Makes `lm` also score tokens through its token embedding
  (`src.model.tied`): its embedding passes its matrix on, its output
  layer reads it."""
  (embedding,) = [s for s in lm.sublayers if type(s) is tl.Embedding]
  vocab_size = embedding._vocab_size
  _replace(lm, embedding, tied.TiedEmbedding(vocab_size, embedding._d_feature))
  own = output.tied is True  # 'only': no column of a token's own.
  _replace(lm, lm.sublayers[-1], tied.TiedOutput(vocab_size, own))


def _zero_dense(layer):
  """Trax's `Dense` `layer` built again with a kernel that starts at zero."""
  return tl.Dense(
    layer._n_units,
    kernel_initializer=_zeros,
    bias_initializer=layer._bias_initializer,
    use_bias=layer._use_bias,
    use_bfloat16=layer._use_bfloat16,
  )


def _replace(root, old, new):
  """Puts `new` where `old` is among the sublayers of a layer in `root` (a
  model not initialized yet)."""
  for node in all_layers(root):
    subs = getattr(node, 'sublayers', None) or []
    for i, sub in enumerate(subs):
      if sub is old:
        subs[i] = new
        return
  raise ValueError(f'{type(old).__name__} is not inside the model')


def all_layers(layer) -> list:
  """`layer` and every layer inside it, depth first."""
  found = [layer]
  for sub in getattr(layer, 'sublayers', ()) or ():
    found += all_layers(sub)
  return found


def count_params(layer) -> int:
  """Number of weights in an initialized Trax layer."""
  leaves = [
    w for w in trax.fastmath.tree_flatten(layer.weights) if hasattr(w, 'size')
  ]
  return int(sum(w.size for w in leaves))


def lsh_layers(layer) -> list:
  """Every LSH attention layer inside `layer`."""
  return [
    node
    for node in all_layers(layer)
    if isinstance(node, (ea.LSHSelfAttention, ea.PureLSHSelfAttention))
  ]


def local_layers(layer) -> list:
  """Every chunked (local) `SelfAttention` layer inside `layer`."""
  return [
    node
    for node in all_layers(layer)
    if isinstance(node, ea.SelfAttention) and node._chunk_len
  ]
