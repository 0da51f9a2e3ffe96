"""A conversation in the model's context, and replies generated into it.

Two parts, neither of which knows of terminals, signals or servers (the
REPL in `src.apps.chat`, the training-time samples in
`src.training.samples` and the server all use them):

- `Context`: the turns a `Decoder` has read and the context budget. Each
  user turn is encoded as the training data encodes it (a line break
  becomes the line-break marker), followed by the AI start marker. Only
  new tokens are fed. When the next turn would not fit, the oldest turns
  are dropped (whole turns only) and the rest is read again once.
- `generate`: the reply's tokens, one at a time, each fed to the decoder
  before it is yielded; it ends at the AI end marker, EOS,
  `max_new_tokens` or when `stop()` says so.

A context starts the way a conversation starts in training. There, every
conversation follows the EOS that ends the one before it in the packed
stream, and windows fall at random offsets (`src.data.windows`), so "EOS,
then a user turn" is what a conversation start looks like to the model. A
chat context is therefore `[pad, EOS, first user turn, ...]`: the decoder
puts the pad (training shifts inputs right, so position 0 always sees it)
and the context the EOS (`START`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from src.core.errors import UserError
from src.data import chatformat, tokenizer
from src.inference import sampling
from src.inference.decoding import Decoder

# Fed before the first turn of every context (see the module docstring).
START = [tokenizer.EOS_ID]
# Decoder positions before a context's first turn: the decoder's pad and
# START. The one place that counts them.
LEAD = 1 + len(START)


@dataclasses.dataclass
class Turn:
  role: str  # chatformat.USER or chatformat.AI
  text: str  # With line-break markers, without AI markers.
  ids: list[int]  # As fed to the model (AI turns include both markers).


class Context:
  """The conversation a `Decoder` has read.

  Attributes:
    decoder: The model in predict mode.
    tok: Its tokenizer.
    turns: The turns in the context, oldest first.
    say: Called with a one-line notice (turns dropped, a message cut).
  """

  def __init__(self, decoder: Decoder, say: Callable[[str], None] = None):
    self.decoder = decoder
    self.tok = decoder.tokenizer
    self.turns: list[Turn] = []
    self.say = say or (lambda text: None)

  def reset(self):
    self.turns.clear()
    self.decoder.reset()

  def used(self) -> int:
    """Tokens in the context (the decoder's position)."""
    return self.decoder.position

  def ids(self, turns=None) -> list[int]:
    """The token ids of `turns` (default: all of them), in order."""
    return [i for t in (self.turns if turns is None else turns) for i in t.ids]

  def last_ids(self, n: int) -> list[int]:
    """The last `n` token ids of the turns (without listing them all)."""
    found: list[int] = []
    for turn in reversed(self.turns):
      if len(found) >= n:
        break
      found[:0] = turn.ids
    return found[-n:] if n > 0 else []

  def feed(self, ids, exact: bool = False):
    """Feeds `ids`, after the start of a context if it is empty; returns
    the logits after the last one.

    The one rule of every message read, by the REPL, `--prompt` and the
    server alike: every piece is a block (`Decoder.feed(blocks=True)`), so
    a read gives the same logits whoever reads it. `exact`: a long read at
    position 0 takes the start block a fresh read of an exact reply takes
    (multiples of 1024), so a kept state can be rewound to equal it."""
    if self.used() == 0:
      ids = START + list(ids)
    return self.decoder.feed(ids, blocks=True, exact=exact)

  def reread(self, turns: list[Turn]):
    """Makes `turns` the context: resets and reads them (in blocks; no
    later request compares its state with a fresh read's)."""
    self.turns = list(turns)
    self.decoder.reset()
    ids = self.ids()
    if ids:
      self.feed(ids)

  def recover(self):
    """Rebuilds the context from the finished turns after a reply was cut
    short (an interrupt while feeding, an error): an unanswered user
    message is dropped and the rest is read again."""
    while self.turns and self.turns[-1].role == chatformat.USER:
      self.turns.pop()
    self.reread(self.turns)

  def budget(self) -> int:
    """Tokens the turns may take in a context (besides pad and START)."""
    return self.decoder.max_len - LEAD

  def room(self, max_new_tokens: int) -> int:
    """The most tokens a user message may have in an empty context, with
    a reply of `max_new_tokens` (besides the message: pad, START, start
    marker, reply, end marker)."""
    return self.decoder.max_len - max_new_tokens - 2 - LEAD

  def keep_last(self, turns: list[Turn], needed: int) -> list[Turn]:
    """The last of `turns` that leave room for `needed` more tokens in a
    context, starting on a user turn where there are several."""
    kept = list(turns)
    total = sum(len(t.ids) for t in kept)  # Each turn counted once.
    while kept and total + needed > self.budget():
      total -= len(kept.pop(0).ids)
    while kept and kept[0].role != chatformat.USER and len(kept) > 1:
      kept.pop(0)  # Start the kept context on a user turn.
    return kept

  def make_room(self, needed: int):
    """Drops the oldest turns until `needed` more tokens fit; re-reads."""
    start = LEAD if self.used() == 0 else 0
    if self.used() + start + needed <= self.decoder.max_len:
      return
    kept = self.keep_last(self.turns, needed)
    dropped = len(self.turns) - len(kept)
    self.say(
      f'(context full: dropped the {dropped} oldest turn(s); re-reading '
      f'the last {len(self.ids(kept))} tokens)'
    )
    self.reread(kept)

  def user_ids(self, text: str) -> tuple[str, list[int]]:
    """Encodes a user message as the training data does (bytes that are
    not UTF-8, e.g. from a pipe, become U+FFFD or '?')."""
    text = text.encode('utf-8', 'replace').decode('utf-8')
    text = text.replace('\0', ' ')
    br = f' {self.tok.markers.line_break} '
    text = br.join(part.strip() for part in text.splitlines() if part.strip())
    return text, self.tok.encode(text)

  def ask(self, text: str, max_new_tokens: int):
    """Adds a user turn and the AI start marker, with room for a reply of
    `max_new_tokens`.

    Returns:
      The logits for the reply's first token, or None for an empty
      message.
    """
    text, ids = self.user_ids(text)
    if not ids:
      return None
    room = self.room(max_new_tokens)
    if len(ids) > room:
      self.say(
        f'(your message is {len(ids)} tokens; the context holds '
        f'{room} besides the reply, so only its last {room} are kept)'
      )
      ids = ids[-room:]
      text = self.tok.decode(ids)
    self.make_room(len(ids) + 1 + max_new_tokens + 1)
    self.turns.append(Turn(chatformat.USER, text, ids))
    # Read as the server reads a reply that must be reproducible, so
    # `evaluate.py --prompt` with a seed prints the API's seeded reply.
    return self.feed(ids + [self.tok.ai_start_id], exact=True)

  def answer(self, reply_ids: list[int]) -> str:
    """Closes the AI turn of `reply_ids` (fed already) as training data
    does, with the end marker; returns the reply's text."""
    self.decoder.feed([self.tok.ai_end_id])
    text = self.tok.decode(reply_ids).strip()
    ids = [self.tok.ai_start_id] + list(reply_ids) + [self.tok.ai_end_id]
    self.turns.append(Turn(chatformat.AI, text, ids))
    return text


def generate(
  context: Context,
  logits,
  settings: sampling.SamplingSettings,
  rng: np.random.Generator,
  stop: Callable[[], bool] = lambda: False,
  observe: Callable | None = None,
) -> Iterator[int]:
  """The reply's token ids after `logits` (from `Context.ask`).

  `observe(token, logits)`, when given, receives each drawn token with the
  logits it was drawn from, after the penalties (`sampling.adjusted`).

  Each token is yielded as soon as it is drawn (the client sees it a
  decoder step sooner) and fed to the decoder when the next one is asked
  for, or when the generator ends or is closed: once it is done, the
  context holds every token yielded (close it if you stop early:
  `contextlib.closing`). The AI end marker and EOS end the reply and are
  not yielded (`Context.answer` closes the turn).

  Raises:
    UserError: the model computes NaN/inf (broken weights).
  """
  tok = context.tok
  recent = context.last_ids(settings.repetition_window)
  banned = [tokenizer.PAD_ID, tok.ai_start_id]  # Never inside a reply.
  n, drawn, made = 0, None, []
  try:
    while n < settings.max_new_tokens and not stop():
      if drawn is not None:
        logits, drawn = context.decoder.feed([drawn]), None
      logits = np.array(logits, np.float64)
      if not np.isfinite(logits).all():
        raise UserError(
          'the model computes NaN/inf: its weights are broken (a training '
          'run that diverged?); retrain with a lower learning rate'
        )
      logits[banned] = -np.inf
      logits = sampling.adjusted(logits, settings, recent, made)
      token = sampling.draw(logits, settings, rng)
      if token in (tok.ai_end_id, tokenizer.EOS_ID):
        return
      if observe is not None:
        observe(token, logits)
      recent.append(token)
      made.append(token)
      n += 1
      drawn = token
      yield token
  finally:
    if drawn is not None:  # The context holds every token yielded.
      context.decoder.feed([drawn])


def reply(
  context: Context,
  text: str,
  settings: sampling.SamplingSettings,
  rng: np.random.Generator,
) -> list[int] | None:
  """A whole reply to the user message `text`, added to the context with
  it: the reply's token ids (None for an empty message)."""
  logits = context.ask(text, settings.max_new_tokens)
  if logits is None:
    return None
  ids = list(generate(context, logits, settings, rng))
  context.answer(ids)
  return ids


def fresh_replies(
  context: Context,
  prompts,
  settings: sampling.SamplingSettings,
  one_line: bool = False,
) -> list[tuple[str, bool]]:
  """Replies to `prompts`, each in a fresh conversation (the context is
  reset before each and after the last), as `evaluate.py --prompt` gives
  them; greedy at temperature 0.

  Returns:
    `[(reply text, ended)]`: the displayed reply and whether it ended
    (end marker) within `settings.max_new_tokens` tokens.
  """
  out = []
  for prompt in prompts:
    context.reset()
    ids = reply(context, prompt, settings, np.random.default_rng(0)) or []
    out.append(
      (
        display(context.tok, ids, one_line),
        len(ids) < settings.max_new_tokens,
      )
    )
  context.reset()
  return out


def display(tok: tokenizer.Tokenizer, ids, one_line: bool = False) -> str:
  """Reply tokens as text: line-break markers become line breaks, or with
  `one_line` the marker between spaces (one message per line)."""
  text = tok.decode(ids)
  br = tok.markers.line_break
  join = f' {br} ' if one_line else '\n'
  parts = [part.strip() for part in text.split(br)]
  return join.join(p for p in parts if p or not one_line).strip()
