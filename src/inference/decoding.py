"""Incremental decoding: a predict-mode ReformerLM compiled once per session.

`Decoder` loads a run folder (tokenizer, `model.gin`, checkpoint) or an
export (`src.storage.export`: `model.safetensors` instead of a checkpoint)
and keeps the model's predict-mode state (LSH attention memory, position
counters) between calls, so each new token costs one step of one token. The
step is jitted once and its state buffers are donated, so the attention
memory is updated in place instead of copied every token.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import trax

from src.core.errors import UserError
from src.data import tokenizer
from src.model import attention, decode_cache, ginconf, reformer
from src.storage import checkpoints, curves, modelfolder

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
  (the folder itself is read by `modelfolder.load`).

  Returns:
    `(setup, tokenizer, layer, step)`: the layer initialized for batch 1 and
    the checkpoint's training step.
  """
  what = f'model-dir {model_dir!r}'
  model = modelfolder.load(model_dir, what, MODEL_DIR_FIX, bindings)
  setup = model.setup
  if mode == 'predict':
    ginconf.add_bindings(
      predict_bindings(setup.model['n_heads']) + attention_bindings(setup)
    )
  layer = reformer.reformer_lm(model.tok.vocab_size, mode)
  length = 1 if mode == 'predict' else setup.max_len
  signature = trax.shapes.ShapeDtype((1, length), np.int32)
  checkpoints.set_weights(model_dir, layer, signature, model.flat)
  return setup, model.tok, layer, model.step


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
      turned.add(id(layer.weights[3]))
  return [id(w) in turned for w in jax.tree_util.tree_leaves(model.weights)]


MIN_BLOCK = 1024  # Tokens fed at position 0 from which a block is read.


class Decoder:
  """A trained model in predict mode with its running state.

  Attributes:
    tokenizer: The run's tokenizer.
    max_len: The model's context length.
    position: Tokens fed since the last reset.
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
    self.tokenizer = tok
    self.step = step
    self.curves = None  # Where the model's training curves are, in words.
    self._turned = _turned_weights(predict_model, lsh, local)
    self.weights = predict_model.weights
    self._fresh_state = jax.tree_util.tree_map(np.asarray, predict_model.state)
    self._rng = jax.random.PRNGKey(0)
    self.traces = 0
    self._step_fn = jax.jit(self._pure_step, donate_argnums=(1,))
    # Block reading at position 0 (see feed): the model without its output
    # layer, then the output layer on the last position only, so the
    # `[length, vocab]` logits never exist. One compilation per block
    # length; lengths are multiples of `block`.
    *body, self._head = predict_model.sublayers
    self._body = trax.layers.Serial(*body)
    # A block is read in chunks, as training reads a window: a multiple
    # of every attention layer's chunk length.
    self.block = math.lcm(*[layer._chunk_len for layer in lsh + local] or [64])
    # Shorter feeds go token by token: compiling a block length costs
    # seconds (bench/reread.py), about what 1k tokens cost one at a time.
    self.min_block = MIN_BLOCK
    self._block_fn = jax.jit(self._pure_block, donate_argnums=(1,))
    self.reset()

  @classmethod
  def load(cls, model_dir: str, n_hashes: int | None = None) -> Decoder:
    """Loads a run folder: tokenizer, saved gin, latest checkpoint."""
    bindings = []
    if n_hashes is not None:
      bindings.append(f'LSHSelfAttention.n_hashes = {int(n_hashes)}')
    setup, tok, layer, step = load_run(model_dir, 'predict', bindings)
    decoder = cls(layer, setup.max_len, tok, step)
    decoder.curves = curves.where(model_dir)
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

  def _pure_block(self, weights, state, tokens, rng):
    self.traces += 1
    weights = self._model_weights(weights)
    x, body_state = self._body.pure_fn(
      tokens, tuple(weights[:-1]), tuple(state[:-1]), rng, use_cache=True
    )
    logits, head_state = self._head.pure_fn(
      x[:, -1:], weights[-1], state[-1], rng, use_cache=True
    )
    return logits[0, -1], (*body_state, head_state)

  def reset(self):
    """Forgets the conversation: a fresh state, position 0."""
    self.state = jax.tree_util.tree_map(jax.numpy.asarray, self._fresh_state)
    self.position = 0
    self.block_read = 0  # Tokens the state read as one block at position 0.

  def block_part(self, n: int) -> int:
    """How many of `n` tokens fed at position 0 (the pad included) are
    read as one block (see `feed`); the rest go one at a time. A state
    equals a fresh read only if both read the same block."""
    return (n // self.block) * self.block if n >= self.min_block else 0

  def _step(self, token_id: int):
    token = np.array([[token_id]], np.int32)
    logits, self.state = self._step_fn(
      self.weights, self.state, token, self._rng
    )
    self.position += 1
    return logits

  def feed(self, ids) -> np.ndarray:
    """Feeds tokens; returns the logits after the last.

    At position 0 (`/load`, a re-read after dropping old turns), when at
    least `min_block` tokens come at once, Trax's predict mode takes a block
    in one call: the longest multiple of `block` (the LSH chunk length) goes
    at once, the rest one token at a time. Later tokens go one at a time.
    A block is read the way training reads a window (LSH buckets sorted
    over the whole block); one token at a time, each token attends to the
    candidates predict mode keeps for it. With exact attention both agree
    (tests/test_chat.py); with LSH both are approximations of it.

    Args:
      ids: Token ids to append to the context.

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
    n_block = self.block_part(len(ids)) if self.position == 0 else 0
    if n_block:
      self.block_read = n_block
      tokens = np.asarray(ids[:n_block], np.int32)[None, :]
      logits, self.state = self._block_fn(
        self.weights, self.state, tokens, self._rng
      )
      self.position += n_block
      ids = ids[n_block:]
    for i in ids:
      logits = self._step(i)
    return np.asarray(logits)
