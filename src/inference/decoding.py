"""Incremental decoding: a predict-mode ReformerLM compiled once per session.

`Decoder` loads a run folder (tokenizer, `model.gin`, checkpoint) or an
export (`src.storage.export`: `model.safetensors` instead of a checkpoint)
and keeps the model's predict-mode state (LSH attention memory and key
cache, position counters) between calls, so each generated token costs one
step of one token, and a message (or a whole conversation) is read in
blocks of tokens at any position (`src.model.decode_block`). The step and
the block are jitted once each and their state buffers are donated, so the
memories are updated in place instead of copied every token.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import trax
from trax import layers as tl

from src.core.errors import UserError
from src.data import tokenizer
from src.model import (
  attention,
  decode_cache,
  decode_select,
  decode_state,
  ginconf,
  reformer,
)
from src.model.positions import AxialPositions
from src.storage import checkpoints, modelfolder

MODEL_DIR_FIX = (
  'point --model-dir (or "eval": {"model-dir": ...} in config.json) at a '
  'training out-dir or an export'
)


def predict_bindings(n_heads: int) -> list[str]:
  """Gin bindings for decoding (they change speed, not results).

  Training computes one head at a time to save memory
  (`n_parallel_heads = 1`). A one-token step is tiny, and running all heads
  together is ~1.5x faster (bench/decode_speed.py: 11.5 -> 7.8 ms/token).
  Local (`SelfAttention`) layers too: one head at a time, their step was
  a loop of 8 small products per layer for gin/reformer_32k.gin.
  """
  return [
    f'{name}.n_parallel_heads = {int(n_heads)}'
    for name in ('LSHSelfAttention', 'SelfAttention')
  ]


def attention_bindings(setup: ginconf.GinSetup) -> list[str]:
  """Predict mode keeps a memory of past keys and values; Trax's
  `SelfAttention` (full, or the local blocks of a mixed model) has no size
  for it unless bound, and then fails with an assertion. Give it the whole
  context (a local block's step still reads only its window)."""
  if 'SelfAttention' not in setup.layer_attention:
    return []
  settings = setup.local if setup.local is not None else setup.attention
  found = []
  if settings.get('predict_mem_len') is None:
    found.append(f'SelfAttention.predict_mem_len = {setup.max_len}')
  if settings.get('predict_drop_len') is None:
    found.append(
      f'SelfAttention.predict_drop_len = {max(1, setup.max_len // 4)}'
    )
  return found


def load_run(model_dir: str, mode: str, bindings=()):
  """A run's gin setup, tokenizer and a `mode` model with its weights.

  Every reader of a finished run (chat, perplexity) loads through here
  (the folder itself is read by `modelfolder.load`, once).

  Returns:
    `(setup, tokenizer, layer, step)`: the layer initialized for batch 1 and
    the checkpoint's training step.
  """
  model, layer = load_model(model_dir, mode, bindings)
  return model.setup, model.tok, layer, model.step


def load_model(model_dir: str, mode: str, bindings=()):
  """`(model folder, layer)`: `load_run`'s, with the whole
  `modelfolder.ModelFolder` read."""
  what = f'model-dir {model_dir!r}'
  model = modelfolder.load(model_dir, what, MODEL_DIR_FIX, bindings)
  setup = model.setup
  if mode == 'predict':
    ginconf.add_bindings(
      predict_bindings(setup.model['n_heads']) + attention_bindings(setup)
    )
  chat = setup.chat
  if chat.n_hashes and not any('.n_hashes' in b for b in bindings):
    # The model's own chat reading (`chat.n_hashes`), unless the caller's.
    ginconf.add_bindings([f'LSHSelfAttention.n_hashes = {chat.n_hashes}'])
  layer = ginconf.model(model.tok.vocab_size, mode)
  if mode == 'predict' and chat.far_keys:
    _read_far(layer, chat, what)
  length = 1 if mode == 'predict' else setup.max_len
  signature = trax.shapes.ShapeDtype((1, length), np.int32)
  checkpoints.set_weights(model_dir, layer, signature, model.flat)
  return model, layer


def _read_far(layer, chat, what: str) -> None:
  """Each LSH layer of the predict-mode `layer` reads only the
  `chat.far_keys` best of its keys beyond `chat.far_from` tokens back."""
  for lsh in reformer.lsh_layers(layer):
    if not hasattr(lsh, 'read_far'):
      raise UserError(
        f"{what}: chat.far_keys needs the project's LSH classes "
        f"({type(lsh).__name__} is Trax's own); bind "
        '@FastLSHSelfAttention in ReformerLM.attention_type, or '
        'chat.far_keys = 0'
      )
    lsh.read_far(chat.far_keys, chat.far_from)


def _turned_weights(model, lsh, local) -> list[bool]:
  """Which of `model`'s weights (flattened) the decoder keeps turned,
  `[d_model, n_heads, d]` instead of Trax's `[n_heads, d_model, d]`.

  A one-token step multiplies one row (or a local window) shared by all
  heads with every head's projection; XLA does that as one product with a
  `[d_model, n_heads * d]` matrix and, given Trax's layout, transposed
  each such weight at every token: 15 copies of 1 MB per token of a
  gin/reformer_32k.gin model, ~7 of its 25 ms. These are the local layers'
  projections and the directed LSH query projection `w_a`; an LSH layer's
  other projections multiply each head's own candidates, for which Trax's
  layout is the right one.
  """
  turned = set()
  for layer in local:
    for w in jax.tree_util.tree_leaves(layer.weights):
      if w.ndim == 3 and w.shape[1] > w.shape[2]:  # Not the output's.
        turned.add(id(w))
  for layer in lsh:
    if isinstance(layer, attention.DirectedLSHSelfAttention):  # w_a.
      turned.add(id(layer.weight(layer.weights, 'a')))
  return [id(w) in turned for w in jax.tree_util.tree_leaves(model.weights)]


def block_size(model, max_len: int) -> int:
  """Tokens the decoder reads as one block (`decode_block`), or 0 when
  this model's layers cannot read blocks (then tokens go one at a time).

  A multiple of every attention layer's chunk length that divides the
  context (blocks fall on a fixed grid, see `Decoder.feed`) and is short
  enough that a block's own earlier tokens are in each of its tokens' LSH
  window (`decode_block.lsh_block`). An LSH layer whose tokens read the
  whole key cache (`decode_select.reads_memory`: few buckets, long
  chunks) sets neither: each of its tokens reads its own positions at
  any block length, and a block of its chunk (4,096) would be a costly
  read for a message of a few words."""
  lsh = reformer.lsh_layers(model)
  local = reformer.local_layers(model)
  attention_layers = [  # Every layer with a predict-mode memory.
    node
    for node in reformer.all_layers(model)
    if hasattr(node, '_predict_mem_len')
  ]
  positions = [
    node
    for node in reformer.all_layers(model)
    if isinstance(node, (tl.PositionalEncoding, tl.AxialPositionalEncoding))
  ]
  if any(
    not isinstance(node, attention._Ours) or not node._reads_blocks()
    for node in attention_layers
  ) or any(not isinstance(node, AxialPositions) for node in positions):
    return 0
  narrow = [
    layer
    for layer in lsh
    if not decode_select.reads_memory(layer, layer._predict_mem_len)
  ]
  size = math.lcm(*[layer._chunk_len for layer in narrow + local] or [64])
  limit = min(
    [2 * decode_select.keep_count(layer) - 1 for layer in narrow] or [size]
  )
  if size > limit or max_len % size:
    return 0
  return size


# Tokens from which a read at position 0 starts with one long block, read
# as Trax reads a context's start (`Decoder.feed`). A multiple of it.
MIN_START = 1024
# Shorter pieces are cheaper one token at a time (bench/serve.py's model
# at 4k: 2 tokens 6.6 ms as a block, 4.3 alone; 4 tokens 4.2 and 5.2).
MIN_PIECE = 4


@dataclasses.dataclass
class Held:
  """A conversation's decoder state, moved out of the decoder (`take`)."""

  state: object
  position: int
  start: int
  mark: int
  saved: list | None


class Decoder:
  """A trained model in predict mode with its running state.

  Attributes:
    tokenizer: The run's tokenizer.
    max_len: The model's context length.
    position: Tokens fed since the last reset.
    block: Tokens read as one block (0: one token at a time).
    start: Tokens the state read as one start block at position 0.
    mark: The state is exactly a fresh read's up to this position (a
      multiple of `block`) for a read of the same `start`; `rewind` goes
      back to it.
    traces: How many times the step function was traced (compiled).
  """

  def __init__(self, predict_model, max_len: int, tok=None, step: int = 0):
    """Wraps an initialized predict-mode model.

    Args:
      predict_model: A `ReformerLM(mode='predict')` with weights set.
      max_len: Its context length.
      tok: The run's tokenizer (None for benchmarks).
      step: The checkpoint's training step (shown to the user).
    """
    self.model = predict_model
    self.max_len = max_len
    lsh = reformer.lsh_layers(predict_model)
    local = reformer.local_layers(predict_model)
    for layer in lsh + local:
      # feed() never lets the context outgrow the memory.
      decode_cache.never_roll(layer)
      if layer._predict_mem_len < max_len:
        name = type(layer).__name__
        raise UserError(
          f'{name}.predict_mem_len {layer._predict_mem_len} is '
          f'below max_len {max_len}; set it to {max_len} in model.gin'
        )
    self._mem_len = min(
      [layer._predict_mem_len for layer in lsh + local] or [max_len]
    )
    self.tokenizer = tok
    self.step = step
    self.curves = None  # Where the model's training curves are, in words.
    self._turned = _turned_weights(predict_model, lsh, local)
    self.weights = predict_model.weights
    # The decoder passes its own state; the layer's is not read.
    predict_model.state = self._keep_fresh_state(predict_model.state)
    self._rng = jax.random.PRNGKey(0)
    self.traces = 0
    self._step_fn = jax.jit(self._pure_step, donate_argnums=(1,))
    # A block: the model without its output layer, then the output layer
    # on the last real position only, so `[length, vocab]` logits never
    # exist. One compilation per block length (`padded`: at most three)
    # and per start block length (multiples of `min_start` or `block`).
    *body, self._head = predict_model.sublayers
    self._body = trax.layers.Serial(*body)
    self._readers = {  # The layers a block's arguments go to.
      id(node)
      for node in reformer.all_layers(predict_model)
      if node in lsh + local or isinstance(node, AxialPositions)
    }
    self.block = block_size(predict_model, max_len)
    self._block_fn = jax.jit(self._pure_block, donate_argnums=(1,))
    self._start_fn = jax.jit(self._pure_start, donate_argnums=(1,))
    # A start block is read as training reads a window: whole LSH chunks.
    self._start_grain = math.lcm(*[layer._chunk_len for layer in lsh] or [1])
    self.min_start = math.lcm(MIN_START, self._start_grain)
    self.reset()

  def _keep_fresh_state(self, state):
    """Keeps what a fresh `state` is (`reset` makes it) and what `rewind`
    restores; returns the state's shapes, for the model to hold."""
    leaves, self._state_tree = jax.tree_util.tree_flatten(state)
    # What `rewind` restores: all but the memories indexed by position
    # (written only at or after the position, so kept as they are).
    self._positional = [
      _by_position(np.shape(leaf), self._mem_len) for leaf in leaves
    ]
    # A fresh state: its memories are zeros, made at `reset` (a 32k model's
    # are ~1 GB: kept once, by the live state, not also as a template).
    self._fresh = [
      jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
      if by and not np.any(leaf)
      else np.array(leaf)
      for leaf, by in zip(leaves, self._positional)
    ]
    return jax.tree_util.tree_unflatten(
      self._state_tree,
      [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in self._fresh],
    )

  @classmethod
  def load(
    cls,
    model_dir: str,
    n_hashes: int | None = None,
    far_keys: int | None = None,
  ) -> Decoder:
    """Loads a run folder: tokenizer, saved gin, latest checkpoint; the
    hash rounds and the far keys (`chat.far_keys`) it reads with, unless
    given."""
    bindings = []
    if n_hashes is not None:
      bindings.append(f'LSHSelfAttention.n_hashes = {int(n_hashes)}')
    if far_keys is not None:
      bindings.append(f'chat.far_keys = {int(far_keys)}')
    model, layer = load_model(model_dir, 'predict', bindings)
    decoder = cls(layer, model.setup.max_len, model.tok, model.step)
    decoder.curves = model.curves_at
    return decoder

  @property
  def weights(self):
    """The model's weights, as the step takes them (see `_turned_weights`);
    set them as the model has them."""
    return self._weights

  @weights.setter
  def weights(self, weights):
    leaves, tree = jax.tree_util.tree_flatten(weights)
    if len(leaves) != len(self._turned):
      raise ValueError(
        f'{len(leaves)} weight arrays given; this model has {len(self._turned)}'
      )
    self._tree = tree
    self._weights = tuple(
      jax.device_put(np.transpose(np.asarray(w), (1, 0, 2))) if turned else w
      for w, turned in zip(leaves, self._turned)
    )

  def _model_weights(self, weights):
    """The weights as the model has them (inside the jitted step, where
    undoing the turn costs nothing: XLA reads the turned array as is)."""
    return jax.tree_util.tree_unflatten(
      self._tree,
      [
        jax.numpy.transpose(w, (1, 0, 2)) if turned else w
        for w, turned in zip(weights, self._turned)
      ],
    )

  def _pure_step(self, weights, state, tokens, rng):
    self.traces += 1  # Runs only while tracing: counts compilations.
    weights = self._model_weights(weights)
    logits, state = self.model.pure_fn(tokens, weights, state, rng)
    return logits[0, -1], state

  def _pure_block(self, weights, state, tokens, n, rng):
    return self._through(weights, state, tokens, n, rng, start=False)

  def _pure_start(self, weights, state, tokens, rng):
    n = tokens.shape[1]
    return self._through(weights, state, tokens, n, rng, start=True)

  def _through(self, weights, state, tokens, n, rng, start):
    """A block through the model: the output layer on its last real
    position only, so the `[length, vocab]` logits never exist."""
    self.traces += 1
    weights = self._model_weights(weights)
    *body_weights, head_weights = weights
    *body_state, head_state = state
    # Each reader layer gets the block's real length and kind with its
    # state, as its call's argument (`decode_state.BlockRead`).
    body_state = decode_state.wrap_readers(
      self._body, tuple(body_state), self._readers, n, start
    )
    x, body_state = self._body.pure_fn(
      tokens, tuple(body_weights), body_state, rng, use_cache=True
    )
    # A tied model's body also passes the embedding's matrix on.
    x, *passed = x if isinstance(x, tuple) else (x,)
    last = jax.lax.dynamic_slice_in_dim(x, n - 1, 1, axis=1)
    logits, head_state = self._head.pure_fn(
      (last, *passed) if passed else last,
      head_weights,
      head_state,
      rng,
      use_cache=True,
    )
    return logits[0, -1], (*body_state, head_state)

  def reset(self):
    """Forgets the conversation: a fresh state, position 0."""
    self.state = jax.tree_util.tree_unflatten(
      self._state_tree,
      [
        jax.numpy.zeros(x.shape, x.dtype)
        if isinstance(x, jax.ShapeDtypeStruct)
        else jax.numpy.asarray(x)
        for x in self._fresh
      ],
    )
    self.position = 0
    self.start = 0
    self.mark = 0
    self._saved = None  # What `rewind` restores (None: nothing to undo).

  def take(self) -> Held:
    """Moves the conversation out (its state is moved, not copied); the
    decoder starts a fresh one."""
    held = Held(self.state, self.position, self.start, self.mark, self._saved)
    self.reset()
    return held

  def put(self, held: Held):
    """Makes `held` (from `take`) the decoder's conversation again."""
    self.state, self.position, self.start = (
      held.state,
      held.position,
      held.start,
    )
    self.mark, self._saved = held.mark, held.saved

  def start_part(self, n: int, exact: bool = True) -> int:
    """How many of `n` tokens read at position 0 (the pad included) a
    fresh read takes as its start block (see `feed`): a multiple of
    `min_start`, or (not `exact`) of `block` and the LSH chunks."""
    if not self.block or n < self.min_start:
      return 0
    unit = self.min_start if exact else math.lcm(self.block, self._start_grain)
    return n // unit * unit

  def rewind(self):
    """Goes back to `mark`: the state is then exactly what a fresh read of
    the first `mark` tokens gives."""
    if self._saved is None:
      return
    leaves, tree = jax.tree_util.tree_flatten(self.state)
    leaves = [
      now if kept is None else kept for now, kept in zip(leaves, self._saved)
    ]
    self.state = jax.tree_util.tree_unflatten(tree, leaves)
    self.position, self._saved = self.mark, None

  def _leave_mark(self):
    """Keeps what `rewind` needs before the state moves past `mark` in a
    way a fresh read would not (a token alone, a partial block)."""
    if self.position == self.mark and self._saved is None:
      leaves = jax.tree_util.tree_leaves(self.state)
      small = [x for x, by in zip(leaves, self._positional) if not by]
      copies = iter(_copies(small))  # One call: a dispatch per array cost
      self._saved = [  # ~0.1 ms each.
        None if by else next(copies) for by in self._positional
      ]

  def _step(self, token_id: int):
    self._leave_mark()
    token = np.array([[token_id]], np.int32)
    logits, self.state = self._step_fn(
      self.weights, self.state, token, self._rng
    )
    self.position += 1
    return logits

  def _read_block(self, ids):
    """Reads `ids` (at most `block`, not past the grid cell) as a block."""
    if len(ids) == self.block and self.position == self.mark:
      self.mark += self.block  # Exactly as a fresh read reads it.
    else:
      self._leave_mark()
    tokens = np.zeros((1, self.padded(len(ids))), np.int32)
    tokens[0, : len(ids)] = ids
    n = np.int32(len(ids))
    logits, self.state = self._block_fn(
      self.weights, self.state, tokens, n, self._rng
    )
    self.position += len(ids)
    return logits

  def padded(self, n: int) -> int:
    """The length of the block that reads a piece of `n` tokens: `block`,
    or a half or a quarter of it for a short piece (each length is one
    compilation; a block costs about its length, padding included)."""
    size = self.block
    while size % 2 == 0 and size // 2 >= max(n, 8):
      if size <= self.block // 4:
        break
      size //= 2
    return size

  def _read_start(self, ids, n: int):
    """Reads the first `n` of `ids` as a start block at position 0."""
    tokens = np.asarray(ids[:n], np.int32)[None, :]
    logits, self.state = self._start_fn(
      self.weights, self.state, tokens, self._rng
    )
    self.position = self.start = self.mark = n
    return logits

  def feed(
    self, ids, blocks: bool | None = None, exact: bool = True
  ) -> np.ndarray:
    """Feeds tokens; returns the logits after the last.

    Tokens are read as blocks of `block` tokens on a fixed grid of
    positions (`decode_block`: each token attends to what it would attend
    to fed alone, all at once): a piece up to the next multiple of
    `block`, then whole blocks, then the rest. By default a piece of fewer
    than MIN_PIECE tokens goes one token at a time (cheaper); with
    `blocks=True` every piece is a block (a read that must equal a fresh
    read's), with `blocks=False` every token is a step.

    A long read at position 0 first takes the longest multiple of
    `min_start` tokens (1024; of `block` if not `exact`) in one start
    block, read as Trax reads a context's start (as training reads a
    window: ~10x cheaper per token than blocks). A fresh read of a
    conversation and a kept state of the same `start` rewound to `mark`
    and given the rest read the same blocks, so their states (and
    replies) are identical (`rewind`).

    Args:
      ids: Token ids to append to the context.
      blocks: Every piece as a block (True), none (False), or those of
        MIN_PIECE tokens or more (None).
      exact: Take the start block a fresh read of exact replies takes.

    Returns:
      `[vocab] float32` logits for the next token.
    """
    ids = list(ids)
    if not ids:
      raise ValueError('feed() needs at least one token')
    if self.position == 0:
      # Training shifts inputs right: position 0 always sees the pad id.
      ids = [tokenizer.PAD_ID] + ids
    if self.position + len(ids) > self.max_len:
      raise UserError(
        f'context full: {self.position} + {len(ids)} tokens exceed '
        f'{self.max_len}'
      )
    logits = None
    start = self.start_part(len(ids), exact) if self.position == 0 else 0
    if blocks is not False and start:
      logits, ids = self._read_start(ids, start), ids[start:]
    while ids:
      if blocks is False or not self.block:
        logits, ids = self._step(ids[0]), ids[1:]
        continue
      room = self.block - self.position % self.block
      piece, ids = ids[:room], ids[room:]
      fits = self.position + self.padded(len(piece)) <= self._mem_len
      if fits and (blocks or len(piece) >= MIN_PIECE):
        logits = self._read_block(piece)
      else:  # Cheaper one at a time, or a block would run past the memory.
        for i in piece:
          logits = self._step(i)
    return np.asarray(logits)


@jax.jit
def _copies(arrays):
  """New buffers with the values of `arrays` (a list)."""
  return [jax.numpy.copy(a) for a in arrays]


def _by_position(shape, mem_len: int) -> bool:
  """Whether a state array is a memory indexed by position (`[batch or
  heads, mem, ...]` inputs or key cache, `[heads, n_hashes * mem]`
  buckets): written only at or after the position, so `rewind` keeps it."""
  if len(shape) == 3:
    return shape[1] == mem_len
  return len(shape) == 2 and shape[1] >= mem_len and shape[1] % mem_len == 0
