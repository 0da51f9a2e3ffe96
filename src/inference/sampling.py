"""Choosing the next token from logits: a pure function of its inputs.

`SamplingSettings` holds the user's controls; `next_token` applies them in a
fixed order: repetition penalty, presence and frequency penalties (on the
reply's own tokens, as OpenAI defines them; `adjusted`), then temperature
(0 = greedy), top-k, top-p and a draw from the given NumPy generator
(`draw`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from src.core.errors import UserError

# Below this a temperature is greedy: dividing logits by 5e-324 gives
# infinities and NaN probabilities.
MIN_TEMPERATURE = 1e-4


@dataclasses.dataclass(kw_only=True)
class SamplingSettings:
  """Sampling controls (also settable with `/set NAME VALUE` in the REPL).

  Attributes:
    temperature: Divides the logits; 0 (or below MIN_TEMPERATURE, where
      dividing overflows) picks the most likely token.
    top_k: Keep only the k most likely tokens (0 = all).
    top_p: Keep the smallest set of tokens whose probability reaches p.
    repetition_penalty: Divide positive logits (multiply negative ones) of
      tokens seen in the last `repetition_window` tokens (1 = off).
    repetition_window: How many recent tokens the penalty looks at.
    presence_penalty: Subtracted from the logit of every token the reply
      has already used (-2 to 2; 0 = off; OpenAI's definition).
    frequency_penalty: Subtracted once per earlier use in the reply
      (-2 to 2; 0 = off).
    max_new_tokens: Longest reply, in tokens.
    seed: Seed of the random draws (a session is reproducible).
  """

  temperature: float = 0.8
  top_k: int = 40
  top_p: float = 0.95
  repetition_penalty: float = 1.1
  repetition_window: int = 64
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  max_new_tokens: int = 128
  seed: int = 0

  def set(self, name: str, value: str):
    """Sets a field from text, checking its type and range."""
    name = name.replace('-', '_')
    fields = {f.name: f for f in dataclasses.fields(self)}
    if name not in fields:
      raise UserError(
        f'unknown setting {name!r}; settings: {", ".join(fields)}'
      )
    kind = type(getattr(self, name))
    try:
      parsed = kind(float(value)) if kind is int else kind(value)
    except (ValueError, OverflowError):
      raise UserError(
        f'{name} needs a {kind.__name__}, not {value!r}'
      ) from None
    candidate = dataclasses.replace(self, **{name: parsed})
    candidate.check()
    setattr(self, name, parsed)

  def check(self):
    for name in (
      'temperature',
      'top_p',
      'repetition_penalty',
      'presence_penalty',
      'frequency_penalty',
    ):
      if not math.isfinite(getattr(self, name)):
        raise UserError(f'{name} must be a finite number')
    for name in ('presence_penalty', 'frequency_penalty'):
      if not -2 <= getattr(self, name) <= 2:
        raise UserError(f'{name} must be between -2 and 2')
    if self.temperature > 100 or self.repetition_penalty > 100:
      raise UserError('temperature and repetition_penalty go up to 100')
    if not 0 <= self.seed < 2**63:
      raise UserError('seed must be 0 or more (below 2**63)')
    if self.repetition_window > 1 << 20 or self.max_new_tokens > 1 << 20:
      raise UserError(
        'repetition_window and max_new_tokens go up to 1048576 (the '
        'context length bounds max_new_tokens further)'
      )
    if self.temperature < 0:
      raise UserError('temperature must be 0 (greedy) or more')
    if self.top_k < 0:
      raise UserError('top_k must be 0 (off) or more')
    if not 0 < self.top_p <= 1:
      raise UserError('top_p must be above 0 and at most 1')
    if self.repetition_penalty < 1:
      raise UserError('repetition_penalty must be 1 (off) or more')
    if self.repetition_window < 0 or self.max_new_tokens < 1:
      raise UserError(
        'repetition_window must be 0 or more, max_new_tokens at least 1'
      )


def apply_repetition_penalty(
  logits: np.ndarray, recent, penalty: float
) -> np.ndarray:
  """Makes recently seen tokens less likely (CTRL-style penalty)."""
  if penalty == 1.0 or len(recent) == 0:
    return logits
  logits = logits.copy()
  ids = np.unique(np.asarray(recent, np.int64))
  ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
  seen = logits[ids]
  logits[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
  return logits


def apply_presence_frequency(
  logits: np.ndarray, made, presence: float, frequency: float
) -> np.ndarray:
  """OpenAI's penalties: each token the reply `made` already holds loses
  `presence` once and `frequency` per use."""
  if (presence == 0 and frequency == 0) or len(made) == 0:
    return logits
  ids, counts = np.unique(np.asarray(made, np.int64), return_counts=True)
  keep = (ids >= 0) & (ids < logits.shape[-1])
  logits = logits.copy()
  logits[ids[keep]] -= presence + frequency * counts[keep]
  return logits


def adjusted(logits, settings: SamplingSettings, recent=(), made=()):
  """The logits after the penalties, before temperature and filtering:
  `[vocab] float64`."""
  logits = np.asarray(logits, np.float64).reshape(-1)
  window = settings.repetition_window
  recent = list(recent)[-window:] if window else []
  logits = apply_repetition_penalty(logits, recent, settings.repetition_penalty)
  return apply_presence_frequency(
    logits, made, settings.presence_penalty, settings.frequency_penalty
  )


def top_logprobs(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
  """`(log-probabilities [vocab], the k most likely ids)` of `adjusted`
  logits at temperature 1 (what a reply's `logprobs` report)."""
  finite = np.where(np.isfinite(logits), logits, -np.inf)
  top = np.max(finite)
  logprobs = finite - top - np.log(np.sum(np.exp(finite - top)))
  order = np.argsort(-logprobs, kind='stable')[:k]
  return logprobs, order


def filter_logits(
  logits: np.ndarray, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
  """Sets logits outside top-k / the top-p nucleus to -inf.

  Args:
    logits: `[vocab] float` logits.
    top_k: Keep the k largest (0 keeps all).
    top_p: Keep the most likely tokens until their probability reaches p;
      the most likely token is always kept.

  Returns:
    `[vocab] float` logits with the rest at -inf.
  """
  logits = np.asarray(logits, np.float64).copy()
  if 0 < top_k < logits.shape[-1]:
    kth = np.partition(logits, -top_k)[-top_k]
    logits[logits < kth] = -np.inf
  if top_p < 1.0:
    order = np.argsort(-logits, kind='stable')
    probs = np.exp(logits[order] - logits[order[0]])
    probs /= probs.sum()
    cumulative = np.cumsum(probs)
    keep = np.searchsorted(cumulative, top_p) + 1
    logits[order[keep:]] = -np.inf
  return logits


def next_token(
  logits,
  settings: SamplingSettings,
  rng: np.random.Generator,
  recent=(),
  made=(),
) -> int:
  """Picks the next token id: the penalties (`adjusted`), then `draw`.

  Args:
    logits: `[vocab]` logits of the next position.
    settings: The sampling controls.
    rng: Random generator (ignored when temperature is 0).
    recent: Recent token ids for the repetition penalty.
    made: The reply's tokens so far, for the presence and frequency
      penalties.

  Returns:
    The chosen id.
  """
  return draw(adjusted(logits, settings, recent, made), settings, rng)


def draw(logits, settings: SamplingSettings, rng: np.random.Generator) -> int:
  """The token drawn from `adjusted` logits: the most likely one at
  temperature 0, else one from the temperature's, top-k's and top-p's
  distribution."""
  if settings.temperature < MIN_TEMPERATURE:  # Tinier ones overflow.
    return int(np.argmax(logits))
  logits = filter_logits(
    logits / settings.temperature, settings.top_k, settings.top_p
  )
  probs = np.exp(logits - np.max(logits))
  probs /= probs.sum()
  return int(rng.choice(len(probs), p=probs))
