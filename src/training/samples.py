"""The model answers a few prompts at each evaluation while it trains.

As the original did ("the model evaluates itself"): with the weights just
trained, a predict-mode copy of the model replies greedily to each prompt
in a fresh conversation, the same way `evaluate.py` would.
"""

from __future__ import annotations

import numpy as np
import trax

from src.inference import generate, sampling
from src.inference.decoding import Decoder, attention_bindings
from src.model import ginconf

MAX_NEW_TOKENS = 32


class SampleReplies:
  """Greedy replies to `prompts` with the weights given at each call."""

  def __init__(self, tok, setup: ginconf.GinSetup, prompts):
    """Builds (and compiles on first use) the predict-mode model; call
    after the training model exists, while the run's gin is parsed."""
    self.prompts = list(prompts)
    max_len = setup.max_len
    ginconf.add_bindings(attention_bindings(setup))
    layer = ginconf.model(tok.vocab_size, 'predict')
    layer.init(trax.shapes.ShapeDtype((1, 1), np.int32))
    self.decoder = Decoder(layer, max_len, tok)
    self.settings = sampling.SamplingSettings(
      temperature=0.0, max_new_tokens=min(MAX_NEW_TOKENS, max_len // 2)
    )
    self.context = generate.Context(self.decoder)

  def __call__(self, weights) -> list[tuple[str, str]]:
    """`(prompt, reply)` per prompt, with these (training) weights."""
    self.decoder.weights = weights
    replies = generate.fresh_replies(
      self.context, self.prompts, self.settings, one_line=True
    )
    return [(p, text) for p, (text, _) in zip(self.prompts, replies)]


def markdown(step: int, replies) -> str:
  """The replies as a table for TensorBoard's text tab."""
  rows = [f'Greedy replies at step {step}:', '', '| prompt | reply |', '|-|-|']
  for prompt, reply in replies:
    cells = [c.replace('|', '\\|') or '(empty)' for c in (prompt, reply)]
    rows.append(f'| {cells[0]} | {cells[1]} |')
  return '\n'.join(rows)
