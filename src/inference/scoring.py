"""Scoring a model: the one teacher-forced forward pass, per-token losses,
and perplexity on held-out conversation files."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from tqdm import tqdm

from src.data import chatformat, windows
from src.inference.decoding import load_run
from src.model import losses


def forward_fn(layer, weights=None, state=None):
  """The teacher-forced forward pass every scorer uses, jitted once.

  Returns:
    `f(ids, rng=PRNGKey(0))`: `[batch, length] int32` token ids ->
    `[batch, length, vocab]` logits, with the layer's weights and state
    (or the ones given).
  """
  weights = layer.weights if weights is None else weights
  state = layer.state if state is None else state
  jitted = jax.jit(lambda x, rng: layer.pure_fn(x, weights, state, rng)[0])
  key = jax.random.PRNGKey(0)

  def forward(ids, rng=None):
    return jitted(ids, key if rng is None else rng)

  return forward


def token_losses(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Per-token cross-entropy (nats) of `[n, vocab]` logits."""
  logits = logits.astype(np.float64)
  top = logits.max(-1, keepdims=True)
  logz = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
  return logz - logits[np.arange(len(targets)), targets]


def evaluate(model_dir: str, data: str, show_progress: bool = True) -> dict:
  """Token-level loss, perplexity and bits per character on `data`.

  Every token counts: the stream is cut into `max_len` windows and the last,
  shorter one is padded (padding gets no weight), never dropped.

  Returns:
    dict with tokens, characters, loss (nats/token), perplexity,
    bits_per_char and `by_position`: `(range name, tokens, loss)` per
    range of context positions (`model.position_ranges`).
  """
  setup, tok, layer, _ = load_run(model_dir, 'eval')
  convs = chatformat.read_data(data, markers=tok.markers)
  stream = tok.encode_conversations(convs)
  n_chars = sum(
    len(t.text) + (2 if t.role == chatformat.AI else 1)
    for t in chatformat.iter_turns(convs)
  )
  max_len = setup.max_len
  forward = forward_fn(layer)
  total, count = 0.0, 0
  ranges = losses.position_ranges(max_len)
  by_range = np.zeros([len(ranges), 2])  # loss sum, tokens
  n_windows = -(-len(stream) // max_len)
  pieces = range(n_windows)
  if show_progress:
    name = os.path.basename(os.path.normpath(data))
    # disable=None: a bar on a terminal, nothing when stderr is redirected.
    pieces = tqdm(
      pieces,
      desc=f'perplexity {name}',
      unit='window',
      leave=False,
      disable=None,
    )
  for w in pieces:
    piece = stream[w * max_len : (w + 1) * max_len]
    ids = np.full([1, max_len], windows.PAD_ID, np.int32)
    ids[0, : len(piece)] = piece
    logits = np.asarray(forward(ids))[0, : len(piece)]
    token_loss = token_losses(logits, piece)
    total += float(token_loss.sum())
    count += len(piece)
    for k, (start, end) in enumerate(ranges):
      part = token_loss[start:end]
      by_range[k] += (part.sum(), len(part))
  loss = total / count
  return {
    'tokens': count,
    'characters': n_chars,
    'loss': loss,
    'perplexity': math.exp(loss),
    'bits_per_char': total / math.log(2) / max(n_chars, 1),
    'by_position': [
      (losses.range_name(*r), int(n), float(loss_sum / n))
      for r, (loss_sum, n) in zip(ranges, by_range)
      if n
    ],
  }
