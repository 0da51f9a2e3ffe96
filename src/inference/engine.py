"""The inference engine: a conversation's decoder state, its reuse, and a
reply streamed token by token.

`stream_reply` is the streamed reply: the chat REPL (`src.apps.chat`) and
the server (`src.apps.serve`) stream through it (new text as it displays,
stop strings held back until they cannot match, cancellation between
tokens). Training samples and `chat_quality` take whole replies from
`generate.fresh_replies`; every reply's tokens come from the one token
loop, `generate.generate`. `Conversations` keeps the conversations a
server has read (a `Slot` each, `--slots` of them) and reads each
request's conversation at the cost of its new tokens where it can,
exactly as a fresh read would where the reply must be reproducible.
Nothing here knows HTTP: what a request asks that cannot fit is
`Refused`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import threading

import numpy as np

from src.data import chatformat
from src.inference import decoding, generate, sampling
from src.inference.decoding import Decoder

# Characters one token stands for at most (sentencepiece's pieces are up
# to 16, the markers are single tokens of about 20): a text longer than
# this times a room cannot fit in it, and is not tokenized to find out.
MAX_PIECE_CHARS = 64


# Bytes of the messages, texts and token lists `Conversations` keeps
# (`_turn`), as `_entry_bytes` counts them: several long conversations.
TOKENIZED_BYTES = 16 << 20


class Refused(ValueError):
  """A request the context cannot hold (`param`: the field to fix)."""

  def __init__(self, message: str, param: str | None = 'messages'):
    super().__init__(message)
    self.param = param


@dataclasses.dataclass
class Request:
  """A conversation to answer: its messages, the last one the user's."""

  messages: list[tuple[str, str]]  # (chatformat role, content), in order.
  settings: sampling.SamplingSettings
  seed: int | None = None
  stop: list[str] = dataclasses.field(default_factory=list)
  # Report each reply token's log-probability and this many alternatives
  # (`sampling.top_logprobs`); None: not reported.
  logprobs: int | None = None


@dataclasses.dataclass
class Reply:
  ids: list[int]  # The tokens generated (the context holds them).
  text: str  # As displayed, cut at the first stop string.
  finish_reason: str  # 'stop' (the model ended it, or a stop string), or
  # 'length' (max_new_tokens, or cancelled).
  cancelled: bool
  cut: bool = False  # Cut at a stop string (the context holds more).


def stream_reply(
  context: generate.Context,
  logits,
  settings: sampling.SamplingSettings,
  rng,
  *,
  stop=lambda: False,
  stops=(),
  emit=None,
  one_line: bool = False,
  observe=None,
  ends: list | None = None,
) -> Reply:
  """Generates a reply after `context.ask` (its first `logits`) and adds it
  to the context.

  Args:
    stop: Called between tokens; True ends the reply (a client gone,
      Ctrl-C).
    stops: Stop strings: the reply ends before the first one it shows.
    emit: Receives each new piece of the reply's text as it displays
      (held back while it could still begin a stop string); after a
      cancelled reply nothing more is sent.
    one_line: Display line breaks as the line-break marker.
    observe: See `generate.generate` (each token and its logits).
    ends: Receives, for each token, where its text ends in the reply's
      text (before any stop string cut), before `emit` sees that text.
  """
  tok = context.decoder.tokenizer
  hold = max((len(s) for s in stops), default=1) - 1
  ids: list[int] = []
  text, shown, finish, at = '', '', 'length', None
  tokens = generate.generate(
    context, logits, settings, rng, stop=stop, observe=observe
  )
  with contextlib.closing(tokens):  # Its last token fed however it ends.
    for token in tokens:
      ids.append(token)
      text = generate.display(tok, ids, one_line)
      if ends is not None:
        ends.append(len(text))
      at = stop_at(text, stops)
      if at is not None:
        text, finish = text[:at], 'stop'
        break
      # What cannot be the start of a stop string yet.
      shown = _send(emit, shown, text[: len(text) - hold])
    else:
      if len(ids) < settings.max_new_tokens and not stop():
        finish = 'stop'  # The model ended its reply.
  context.answer(ids)
  cancelled = bool(stop())
  if not cancelled:
    _send(emit, shown, text)
  return Reply(ids, text, finish, cancelled, cut=at is not None)


def stop_at(text: str, stops) -> int | None:
  """Where the first of `stops` begins in `text`, if any does."""
  found = [text.find(s) for s in stops if s in text]
  return min(found) if found else None


def _send(emit, shown: str, text: str) -> str:
  """Emits what `text` adds to `shown`; returns the text shown now."""
  if text.startswith(shown) and len(text) > len(shown):
    if emit is not None:
      emit(text[len(shown) :])
    return text
  return shown


def _entry_bytes(content: str, turn: generate.Turn) -> int:
  """What one kept message costs in memory: its key and text as Python
  strings, its token list and an int object a token (an upper bound)."""
  return (
    sys.getsizeof(content)
    + sys.getsizeof(turn.text)
    + sys.getsizeof(turn.ids)
    + 32 * len(turn.ids)
    + 200  # The dict entry, the tuple key, the Turn.
  )


class _Logprobs:
  """The log-probability of each reply token and its `top` most likely
  alternatives (OpenAI's `logprobs.content` entries), and an `emit` that
  hands each text piece on with the entries of the tokens it completes."""

  def __init__(self, tok, top: int | None, emit):
    self.tok, self.top, self.downstream = tok, top or 0, emit
    self.wanted = top is not None
    self.entries, self.ends, self.sent, self.shown = [], [], 0, 0

  def _piece(self, token: int) -> dict:
    if token == self.tok.line_break_id:
      text = '\n'
    else:
      text = self.tok.sp.id_to_piece(int(token)).replace('\u2581', ' ')
    return {'token': text, 'bytes': list(text.encode('utf-8'))}

  def observe(self, token: int, logits):
    logprobs, order = sampling.top_logprobs(logits, self.top)
    self.entries.append(
      {
        **self._piece(token),
        'logprob': float(logprobs[token]),
        'top_logprobs': [
          {**self._piece(i), 'logprob': float(logprobs[i])} for i in order
        ],
      }
    )

  def within(self, length: int) -> list[dict] | None:
    """The entries of the tokens whose text ends within `length`
    characters (a stop string's tokens are not part of the reply)."""
    if not self.wanted:
      return None
    return [e for e, end in zip(self.entries, self.ends) if end <= length]

  def emit(self, text: str):
    self.shown += len(text)
    upto = self.sent
    while upto < len(self.ends) and self.ends[upto] <= self.shown:
      upto += 1
    done, self.sent = self.entries[self.sent : upto], upto
    if self.downstream is not None:
      self.downstream(text, done)


@dataclasses.dataclass
class Slot:
  """One conversation the model keeps (`--slots` of them at most): what
  its client knows, what the context read, and its decoder state, in the
  decoder while it is the live one (`held` None) or moved out with it."""

  context: generate.Context  # The turns it read.
  # The conversation as its client knows it (each message it sent, each
  # reply as it saw it), for the reuse of unseeded sampling.
  conversation: list = dataclasses.field(default_factory=list)
  held: decoding.Held | None = None  # Moved out of the decoder, not copied.


class Conversations:
  """The model and the conversations it keeps: the live `Slot` (in the
  decoder) and up to `max_slots - 1` parked ones, each with its own
  decoder state.

  A reply that must be reproducible (temperature 0, or a seed) is computed
  from the state a fresh server would read: the request is tokenized as
  its text reads, the kept state whose tokens share the longest prefix
  with it is rewound to its `mark` (what a fresh read of those tokens
  gives, exactly) and the rest read as blocks (`_reuse`); so such a
  follow-up's reply is the one a fresh server gives, and costs the tokens
  since the mark (the last reply, the new message, less than a block
  before them). Unseeded sampling, which no one can reproduce, extends a
  kept state whose tokens (or text) are the client's without rewinding.
  """

  def __init__(self, decoder: Decoder, max_slots: int = 1):
    self.decoder = decoder
    self.tok = decoder.tokenizer
    self.max_slots = max_slots  # `--slots`.
    self.live = Slot(generate.Context(decoder))
    self.parked: list[Slot] = []  # Least recently used first.
    # Messages tokenized lately (`_turn`), least recently used first.
    self._tokenized: collections.OrderedDict = collections.OrderedDict()
    self._cached_bytes = 0

  @property
  def context(self) -> generate.Context:
    """The live conversation's context (what the decoder's state read)."""
    return self.live.context

  @property
  def conversation(self) -> list:
    """The live conversation as its client knows it."""
    return self.live.conversation

  def slots(self) -> list[Slot]:
    """Every kept conversation, the live one first."""
    return [self.live] + self.parked

  def _park(self):
    """Parks the live slot (its state moved out: the decoder then starts a
    fresh one), dropping the least recently used beyond `max_slots`."""
    if self.context.used() and self.max_slots > 1:
      self.live.held = self.decoder.take()
      self.parked.append(self.live)
      del self.parked[: max(0, len(self.parked) - (self.max_slots - 1))]
      self.live = Slot(generate.Context(self.decoder))
    self.reset()

  def _unpark(self, slot: Slot):
    """Makes the parked `slot` the live one (the live one parked first)."""
    self.parked.remove(slot)
    self._park()
    self.decoder.put(slot.held)
    slot.held = None
    self.live = slot

  def _take_text(self, earlier) -> bool:
    """Makes the kept conversation whose client saw exactly `earlier` the
    live one; whether there is one."""
    for slot in self.slots():
      if slot.conversation and slot.conversation == earlier:
        if slot is not self.live:
          self._unpark(slot)
        return True
    return False

  def _choose(self, want: list[int], exact: bool):
    """Makes live the kept conversation that keeps the most of the
    request's tokens `want` (the live one first on a tie); parks the live
    one when another is better, or when none fits and it is not empty."""
    best, most = self.live, 0
    for slot in self.slots():
      n = self._kept(slot, want, exact)
      if n > most:
        best, most = slot, n
    if best is not self.live:
      self._unpark(best)
    elif not most and self.max_slots > 1:
      self._park()  # Keep it for its owner; this one starts afresh.

  def _turn(self, role: str, content: str) -> generate.Turn:
    """A message as the context holds it, tokenized once: a client sends
    its whole conversation every turn (a message's tokens are a function
    of its text, so reading them from `_tokenized` changes nothing)."""
    key = (role, content)
    if key in self._tokenized:
      self._tokenized.move_to_end(key)  # The most recently used last.
      return self._tokenized[key]
    text, ids = self.context.user_ids(content)
    if role == chatformat.AI:
      ids = [self.tok.ai_start_id] + ids + [self.tok.ai_end_id]
    turn = self._tokenized[key] = generate.Turn(role, text, ids)
    self._cached_bytes += _entry_bytes(content, turn)
    while self._cached_bytes > TOKENIZED_BYTES:
      (_, old), gone = self._tokenized.popitem(last=False)
      self._cached_bytes -= _entry_bytes(old, gone)
    return turn

  def _fitting(self, earlier, needed: int) -> list[generate.Turn]:
    """The newest of `earlier` that can fit beside `needed` tokens, each
    tokenized once, newest first until the context is full: a long
    conversation costs what fits, not what was sent (a message of more
    characters than MAX_PIECE_CHARS times the room is never tokenized)."""
    room = self.context.budget() - needed
    turns: list[generate.Turn] = []
    for role, content in reversed(earlier):
      if room <= 0 or len(content) > MAX_PIECE_CHARS * (room + 2):
        break
      turn = self._turn(role, content)
      room -= len(turn.ids)
      turns.append(turn)
    return turns[::-1]

  def prepare(self, job: Request):
    """Makes the context hold `job`'s conversation up to its last message
    and asks that one.

    Returns:
      `(logits, reused, dropped)`: the logits for the reply's first token,
      how many context tokens were kept from the conversation before, and
      how many old turns were dropped to make room.
    """
    earlier, (_, last) = job.messages[:-1], job.messages[-1]
    room = self.context.room(job.settings.max_new_tokens)
    if len(last) > MAX_PIECE_CHARS * (room + 2):  # Never tokenized.
      raise Refused(
        f'the last message is {len(last):,} characters, more than the '
        f'context of {self.decoder.max_len} tokens can hold besides a reply '
        f'of max_tokens={job.settings.max_new_tokens}',
        'messages',
      )
    last_text, last_ids = self.context.user_ids(last)
    if not last_ids:
      raise Refused('the last message is empty', 'messages')
    if len(last_ids) > room:
      raise Refused(
        f'the last message is {len(last_ids)} tokens; the context of '
        f'{self.decoder.max_len} tokens holds at most {room} besides a '
        f'reply of max_tokens={job.settings.max_new_tokens}',
        'messages',
      )
    # A reply that must be reproducible (greedy, or seeded) is computed
    # exactly as a fresh read would; unseeded sampling reuses a kept
    # conversation whose text is the client's, without tokenizing it.
    exact = (
      job.seed is not None
      or job.settings.temperature < sampling.MIN_TEMPERATURE
    )
    if not exact and self._take_text(earlier):
      reused, dropped = self.context.used(), 0  # The text is what it read.
      logits = self.context.ask(last, job.settings.max_new_tokens)
    else:
      needed = len(last_ids) + 2 + job.settings.max_new_tokens
      turns = self.context.keep_last(self._fitting(earlier, needed), needed)
      dropped = len(earlier) - len(turns)
      # The question and the AI start marker are read with the rest, in
      # one read: a later follow-up then keeps them (see `_reuse`).
      turns.append(generate.Turn(chatformat.USER, last_text, last_ids))
      want = self.context.ids(turns) + [self.tok.ai_start_id]
      self._choose(want, exact)
      reused, logits = self._reuse(turns, want, exact)
      if not reused:
        self.context.reset()
        self.context.turns = turns
        logits = self.context.feed(want, exact)
    self.live.conversation = list(earlier) + [(chatformat.USER, last)]
    return logits, reused, dropped

  def _reuse(self, turns: list[generate.Turn], want, exact: bool):
    """Makes the decoder's state hold `want` (the tokens of `turns`, and
    the AI start marker if they end on a question) by keeping what it can
    of what it read (`_kept`) and reading the rest as a fresh read would.

    Returns:
      `(kept, logits)`: the decoder positions kept and the logits after
      `want`; `(0, None)` when nothing could be kept (then nothing moved).
    """
    d = self.decoder
    kept = self._kept(self.live, want, exact)
    if not kept:
      return 0, None
    if kept < len(self.context.ids()):  # Back to the mark: a fresh read's
      d.rewind()  # state.
    self.context.turns = list(turns)
    logits = d.feed(want[kept:], blocks=True) if len(want) > kept else None
    return kept + generate.LEAD, logits

  def _kept(self, slot: Slot, want, exact: bool) -> int:
    """How many of the tokens `want` the state of `slot` keeps (it read
    `slot.context.ids()`; it is a fresh read's state up to decoder position
    `mark`, after a start block of `start`): all it read if that begins
    `want` and the reply need not be exact, else up to the mark if the
    two agree that far and a fresh read of `want` takes the same start
    block, else 0."""
    have = slot.context.ids()
    state = slot.held or self.decoder  # Where its start and mark are.
    if not have or not want:
      return 0
    if not exact and want[: len(have)] == have:
      return len(have)
    if self.decoder.start_part(generate.LEAD + len(want)) != state.start:
      return 0
    at_mark = state.mark - generate.LEAD  # In the context's tokens.
    # At least one token is read after it (its logits start the reply; a
    # request sent again can end exactly at the mark).
    same = 0 < at_mark < len(want) and have[:at_mark] == want[:at_mark]
    return at_mark if same else 0

  def run(self, job: Request, cancel: threading.Event, emit=None) -> dict:
    """Generates the reply of `job` (in a worker thread).

    `emit(text)` receives each new piece of the reply's text as it is
    generated (stop strings held back until they cannot match).

    Returns:
      `{'text', 'finish_reason', 'prompt_tokens', 'completion_tokens',
      'reused_tokens', 'dropped_turns'}`.
    """
    try:
      logits, reused, dropped = self.prepare(job)
    except BaseException:
      self.reset()
      raise
    prompt_tokens = self.context.used()
    rng = np.random.default_rng(job.seed)  # No seed: fresh entropy.
    probs = _Logprobs(self.decoder.tokenizer, job.logprobs, emit)
    try:
      reply = stream_reply(
        self.context,
        logits,
        job.settings,
        rng,
        stop=cancel.is_set,
        stops=job.stop,
        emit=probs.emit if job.logprobs is not None else emit,
        observe=probs.observe if job.logprobs is not None else None,
        ends=probs.ends if job.logprobs is not None else None,
      )
      self.live.conversation.append((chatformat.AI, reply.text))
    except BaseException:
      self.reset()
      raise
    if reply.cut:
      # Cut at a stop string: the decoder read tokens the client never
      # sees, so no later request may continue from this state.
      self.reset()
    return {
      'text': reply.text,
      'finish_reason': reply.finish_reason,
      'prompt_tokens': prompt_tokens,
      'completion_tokens': len(reply.ids),
      'reused_tokens': reused,
      'dropped_turns': dropped,
      # Each token of `text` with its log-probability (when asked for).
      'logprobs': probs.within(len(reply.text)),
    }

  def reset(self):
    """A fresh live conversation (the parked ones are kept)."""
    self.context.reset()
    self.live.conversation = []
