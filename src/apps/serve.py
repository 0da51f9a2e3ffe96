"""An OpenAI-compatible chat server and a web chat page for one model.

  python evaluate.py --serve --model-dir runs/demo [--host 127.0.0.1]
      [--port 8000] [--api-key KEY] [--max-queue 16]

Routes: `GET /` (the chat page, `src/apps/web/index.html`), `GET /health`,
`GET /v1/models`, `POST /v1/chat/completions` (streamed as server-sent
events with `"stream": true`). Errors have OpenAI's shape, `{"error":
{"message", "type", "param", "code"}}`, with the matching status.

A conversation is rendered exactly as the REPL renders it
(`src.inference.generate.Context`): system messages are dropped (counted in
the `X-Jade-System-Dropped` header), each user message is one user turn,
each assistant message one AI turn between the markers; the last message
must be the user's. When a conversation no longer fits the context, its
oldest turns are dropped as in the REPL (counted in
`X-Jade-Dropped-Turns`); a last message that alone does not leave room
for the reply is refused (400, naming the limit).

One model serves one request at a time; up to `--max-queue` more wait
(beyond that: 503). The model keeps the conversation it read last: a
request that repeats it and adds a user message (what chat clients send
each turn) feeds only the new message (prefix reuse); any other is read
again as one block. A client that disconnects stops its generation at the
next token.

What it takes from a client is bounded: connections that send no request
are closed after IDLE_SECONDS, a body must arrive within BODY_SECONDS,
a conversation is tokenized only as far as it fits, every error (however
odd the input) has OpenAI's shape, and pages of other origins and foreign
Host names (DNS rebinding) are refused with 403.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import threading
import time
import uuid

import numpy as np

from src.core.errors import UserError
from src.data import chatformat
from src.inference import generate, sampling
from src.inference.decoding import Decoder

PAGE = os.path.join(os.path.dirname(__file__), 'web', 'index.html')
MAX_BODY = 4 * 1024 * 1024  # Bytes of one request body.
MAX_MESSAGES = 4096
BODY_SECONDS = 30  # A request body must arrive within this.
IDLE_SECONDS = 10  # A connection must send its request within this.
# Characters one token stands for at most (sentencepiece's pieces are up
# to 16, the markers are single tokens of about 20): a text longer than
# this times a room cannot fit in it, and is not tokenized to find out.
MAX_PIECE_CHARS = 64
ROLES = {'user': chatformat.USER, 'assistant': chatformat.AI}
DROPPED_ROLES = ('system', 'developer')
LOOPBACK_NAMES = {'localhost', '127.0.0.1', '::1'}


def _loopback(host: str) -> bool:
  return host.strip('[]').lower() in LOOPBACK_NAMES


class ApiError(Exception):
  """A request refused with `status` and an OpenAI-shaped error body."""

  def __init__(self, status: int, message: str, param=None, kind=None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.kind = kind or {
      400: 'invalid_request_error',
      401: 'authentication_error',
      404: 'not_found_error',
      503: 'server_busy',
    }.get(status, 'server_error')

  def body(self) -> dict:
    return {
      'error': {
        'message': self.message,
        'type': self.kind,
        'param': self.param,
        'code': None,
      }
    }


@dataclasses.dataclass
class Job:
  """One chat-completion request, checked."""

  messages: list[tuple[str, str]]  # (chatformat role, content), in order.
  settings: sampling.SamplingSettings
  seed: int | None
  stop: list[str]
  stream: bool
  dropped_system: int


def _number(body: dict, name: str, kind, default):
  value = body.get(name)
  if value is None:
    return default
  ok = (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and abs(value) < 2**53  # A 5000-digit integer is no setting.
  )
  if ok and kind is int:
    ok = float(value).is_integer()
  if not ok:
    shown = repr(value)[:40]
    raise ApiError(400, f'{name} must be a number, not {shown}', name)
  return kind(value)


def _content(message: dict, i: int) -> str:
  content = message.get('content')
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # Content parts: text only.
    texts = []
    for part in content:
      if not (isinstance(part, dict) and part.get('type') == 'text'):
        raise ApiError(
          400, 'only text content parts are supported', f'messages[{i}]'
        )
      texts.append(str(part.get('text', '')))
    return '\n'.join(texts)
  raise ApiError(400, 'content must be a string', f'messages[{i}].content')


def parse_job(
  body, model_id: str, max_len: int, defaults: sampling.SamplingSettings
) -> Job:
  """Checks a chat-completions body (what it leaves out is taken from
  `defaults`, the server's command line); raises `ApiError` (400, 404)."""
  if not isinstance(body, dict):
    raise ApiError(400, 'the body must be a JSON object')
  model = body.get('model', model_id)
  if model != model_id:
    raise ApiError(
      404,
      f'the model {model!r} does not exist; this server serves '
      f'{model_id!r} (GET /v1/models)',
      'model',
      'invalid_request_error',
    )
  raw = body.get('messages')
  if not isinstance(raw, list) or not raw:
    raise ApiError(400, 'messages must be a non-empty list', 'messages')
  if len(raw) > MAX_MESSAGES:
    raise ApiError(400, f'at most {MAX_MESSAGES} messages', 'messages')
  messages, dropped = [], 0
  for i, m in enumerate(raw):
    if not isinstance(m, dict):
      raise ApiError(400, 'each message must be an object', f'messages[{i}]')
    role = m.get('role')
    if role in DROPPED_ROLES:
      dropped += 1
      continue
    if not isinstance(role, str) or role not in ROLES:
      raise ApiError(
        400,
        f'role {str(role)[:40]!r} is not supported (user, assistant, system)',
        f'messages[{i}].role',
      )
    messages.append((ROLES[role], _content(m, i)))
  if not messages or messages[-1][0] != chatformat.USER:
    raise ApiError(400, 'the last message must be from the user', 'messages')
  n = _number(body, 'n', int, 1)
  if n != 1:
    raise ApiError(400, 'n must be 1: one reply per request', 'n')
  most = max_len // 2
  max_tokens = _number(
    body,
    'max_completion_tokens',
    int,
    _number(body, 'max_tokens', int, min(defaults.max_new_tokens, most)),
  )
  if not 1 <= max_tokens <= most:
    raise ApiError(
      400,
      f'max_tokens must be between 1 and {most} (half the context of '
      f'{max_len} tokens)',
      'max_tokens',
    )
  seed = body.get('seed')
  if seed is not None and (
    isinstance(seed, bool) or not isinstance(seed, int) or seed < 0
  ):
    raise ApiError(400, 'seed must be a whole number of 0 or more', 'seed')
  settings = sampling.SamplingSettings(
    temperature=_number(body, 'temperature', float, defaults.temperature),
    top_p=_number(body, 'top_p', float, defaults.top_p),
    top_k=_number(body, 'top_k', int, defaults.top_k),
    repetition_penalty=_number(
      body, 'repetition_penalty', float, defaults.repetition_penalty
    ),
    repetition_window=defaults.repetition_window,
    max_new_tokens=max_tokens,
    seed=seed or 0,
  )
  try:
    settings.check()
  except UserError as e:
    raise ApiError(400, str(e)) from None
  stop = body.get('stop')
  stop = [stop] if isinstance(stop, str) else stop or []
  if not (
    isinstance(stop, list)
    and len(stop) <= 4
    and all(isinstance(s, str) and s for s in stop)
  ):
    raise ApiError(400, 'stop must be a string or up to 4 strings', 'stop')
  stream = body.get('stream', False)
  if not isinstance(stream, bool):
    raise ApiError(400, 'stream must be true or false', 'stream')
  return Job(messages, settings, seed, stop, stream, dropped)


@dataclasses.dataclass
class _Parked:
  """A conversation kept out of the decoder: its state and what it read."""

  state: object  # The decoder's state (moved out, never copied).
  position: int
  block: int  # Tokens it read as one block at position 0.
  turns: list  # The context's turns.
  conversation: list  # The conversation as its client knows it.


class Slot:
  """The model and the one conversation it has read.

  A reply that must be reproducible (temperature 0, or a seed) is computed
  from the state a fresh server would read: the request is tokenized as
  its text reads, and the kept state is extended only when its tokens are
  a prefix of that and extending gives exactly the fresh read's state
  (`_reuse`); else the conversation is read again. So such a follow-up's
  reply is the one a fresh server gives, and a reply the model generated
  in pieces its text does not tokenize to (or cut by a stop string) is
  read again. Unseeded sampling, which no one can reproduce, reuses the
  kept state whenever the client's conversation is the one it read.
  """

  def __init__(self, decoder: Decoder, slots: int = 1):
    self.decoder = decoder
    self.tok = decoder.tokenizer
    self.context = generate.Context(decoder)
    # The conversation as the client knows it (each message it sent, each
    # reply as it saw it), for the reuse of unseeded sampling.
    self.conversation: list[tuple[str, str]] = []
    # Conversations kept besides the one in the decoder (`--slots` - 1),
    # least recently used first: each holds its own decoder state.
    self.slots = slots
    self.parked: list[_Parked] = []

  def _park(self):
    """Moves the decoder's conversation into `parked` (its state is moved,
    not copied: the decoder then starts a fresh one), dropping the least
    recently used beyond `slots`."""
    if self.context.used() and self.slots > 1:
      d = self.decoder
      self.parked.append(
        _Parked(
          d.state,
          d.position,
          d.block_read,
          list(self.context.turns),
          list(self.conversation),
        )
      )
      del self.parked[: max(0, len(self.parked) - (self.slots - 1))]
    self.reset()

  def _unpark(self, kept: _Parked):
    """Makes `kept` the decoder's conversation again (the current one
    parked first)."""
    self.parked.remove(kept)
    self._park()
    d = self.decoder
    d.state, d.position, d.block_read = kept.state, kept.position, kept.block
    self.context.turns = kept.turns
    self.conversation = kept.conversation

  def _take_text(self, earlier) -> bool:
    """Makes the kept conversation whose client saw exactly `earlier` the
    decoder's (the current one first); whether there is one."""
    if self.conversation and earlier == self.conversation:
      return True
    for kept in self.parked:
      if kept.conversation == earlier:
        self._unpark(kept)
        return True
    return False

  def _choose(self, want: list[int], exact: bool):
    """Moves into the decoder the kept conversation whose state extends to
    the request's tokens `want` with the most tokens reused (the current
    one first on a tie); parks the current one when another is better, or
    when none fits and it is not empty."""
    mine = self.context.ids()
    if not self._extends(mine, self.decoder.block_read, want, exact):
      mine = []
    best, most = None, len(mine)
    for kept in self.parked:
      ids = [i for t in kept.turns for i in t.ids]
      if len(ids) > most and self._extends(ids, kept.block, want, exact):
        best, most = kept, len(ids)
    if best is not None:
      self._unpark(best)
    elif not mine and self.slots > 1:
      self._park()  # Keep it for its owner; this one starts afresh.

  def _turn(self, role: str, content: str) -> generate.Turn:
    text, ids = self.context.user_ids(content)
    if role == chatformat.AI:
      ids = [self.tok.ai_start_id] + ids + [self.tok.ai_end_id]
    return generate.Turn(role, text, ids)

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

  def prepare(self, job: Job):
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
      raise ApiError(
        400,
        f'the last message is {len(last):,} characters, more than the '
        f'context of {self.decoder.max_len} tokens can hold besides a reply '
        f'of max_tokens={job.settings.max_new_tokens}',
        'messages',
      )
    _, last_ids = self.context.user_ids(last)
    if not last_ids:
      raise ApiError(400, 'the last message is empty', 'messages')
    if len(last_ids) > room:
      raise ApiError(
        400,
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
    else:
      needed = len(last_ids) + 2 + job.settings.max_new_tokens
      turns = self.context.keep_last(self._fitting(earlier, needed), needed)
      dropped = len(earlier) - len(turns)
      want = self.context.ids(turns)
      self._choose(want, exact)
      reused = self._reuse(turns, want, exact)
      if not reused:
        self.context.reread(turns)
    logits = self.context.ask(last, job.settings.max_new_tokens)
    self.conversation = list(earlier) + [(chatformat.USER, last)]
    return logits, reused, dropped

  def _reuse(self, turns: list[generate.Turn], want, exact: bool) -> int:
    """Extends the kept state to `turns` when its tokens are a prefix of
    theirs (as the request's text tokenizes) and, if `exact`, when that
    gives exactly the state a fresh read would (both read the same block
    at position 0; past MIN_BLOCK tokens a follow-up that crosses a block
    is read again); `want`: the tokens of `turns`. Returns the tokens
    reused, 0 when it cannot."""
    have = self.context.ids()
    if not self._extends(have, self.decoder.block_read, want, exact):
      return 0
    reused = self.context.used()
    self.context.turns = list(turns)
    if len(want) > len(have):
      self.decoder.feed(want[len(have) :])
    return reused

  def _extends(self, have: list[int], block: int, want, exact) -> bool:
    """Whether a state that read `have` (a block of `block` tokens at
    position 0) can be extended to the tokens `want` (see `_reuse`)."""
    if not have or not want or want[: len(have)] != have:
      return False
    first = 1 + len(generate.START) + len(want)  # A fresh read's first feed.
    return not exact or self.decoder.block_part(first) == block

  def run(self, job: Job, cancel: threading.Event, emit=None) -> dict:
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
    hold = max((len(s) for s in job.stop), default=1) - 1
    ids: list[int] = []
    text, shown, finish = '', '', 'length'
    try:
      for token in generate.generate(
        self.context, logits, job.settings, rng, stop=cancel.is_set
      ):
        ids.append(token)
        text = generate.display(self.tok, ids)
        cut = _stop_at(text, job.stop)
        if cut is not None:
          text, finish = text[:cut], 'stop'
          break
        # What cannot be the start of a stop string yet.
        shown = _send(emit, shown, text[: len(text) - hold])
      else:
        if len(ids) < job.settings.max_new_tokens and not cancel.is_set():
          finish = 'stop'  # The model ended its reply.
      self.context.answer(ids)
      self.conversation.append((chatformat.AI, text))
    except BaseException:
      self.reset()
      raise
    if not cancel.is_set():
      _send(emit, shown, text)
    return {
      'text': text,
      'finish_reason': finish,
      'prompt_tokens': prompt_tokens,
      'completion_tokens': len(ids),
      'reused_tokens': reused,
      'dropped_turns': dropped,
    }

  def reset(self):
    self.context.reset()
    self.conversation = []


def _stop_at(text: str, stops) -> int | None:
  found = [text.find(s) for s in stops if s in text]
  return min(found) if found else None


def _send(emit, shown: str, text: str) -> str:
  """Emits what `text` adds to `shown`; returns the text shown now."""
  if text.startswith(shown) and len(text) > len(shown):
    if emit is not None:
      emit(text[len(shown) :])
    return text
  return shown


class Server:
  """The model, its queue and the ASGI app."""

  def __init__(
    self,
    decoder: Decoder,
    model_id: str,
    api_key: str | None = None,
    max_queue: int = 16,
    defaults: sampling.SamplingSettings | None = None,
    host: str = '127.0.0.1',
    port: int = 8000,
    allow_origins: tuple[str, ...] = (),
    slots: int = 1,
    allow_hosts: tuple[str, ...] = (),
  ):
    self.slot = Slot(decoder, slots)
    self.host, self.port = host, port
    self.allow_origins = {o.rstrip('/').lower() for o in allow_origins}
    self.allow_hosts = {h.strip('[]').lower() for h in allow_hosts}
    self.defaults = defaults or sampling.SamplingSettings()
    self.model_id = model_id
    self.api_key = api_key
    self.max_queue = max_queue
    self.waiting = 0
    self.served = 0
    self.created = int(time.time())
    self._lock: asyncio.Lock | None = None

  # ---- the model, one request at a time

  def _check_queue(self):
    """A 503 when the model is busy and the queue full (checked before a
    stream's 200 too)."""
    if self._lock is None:
      self._lock = asyncio.Lock()
    if self._lock.locked() and self.waiting >= self.max_queue:
      raise ApiError(
        503,
        f'the server is busy ({self.waiting} requests waiting; '
        f'--max-queue {self.max_queue}); try again shortly',
      )

  async def _turn(self):
    self._check_queue()
    self.waiting += 1
    try:
      await self._lock.acquire()
    finally:
      self.waiting -= 1

  async def complete(self, job: Job) -> dict:
    """The whole reply (the lock is held until the model is free)."""
    import anyio

    await self._turn()
    cancel = threading.Event()
    try:
      return await anyio.to_thread.run_sync(self.slot.run, job, cancel)
    finally:
      cancel.set()
      self.served += 1
      self._lock.release()

  async def stream(self, job: Job):
    """Yields the reply's text pieces, then the result dict."""
    import anyio

    await self._turn()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def emit(text):
      loop.call_soon_threadsafe(queue.put_nowait, ('text', text))

    def work():
      try:
        result = self.slot.run(job, cancel, emit)
        loop.call_soon_threadsafe(queue.put_nowait, ('done', result))
      except BaseException as e:  # Reported to the client, never lost.
        loop.call_soon_threadsafe(queue.put_nowait, ('error', e))

    done = anyio.Event()

    async def runner():
      try:
        await anyio.to_thread.run_sync(work)
      finally:
        self.served += 1
        self._lock.release()
        done.set()

    task = asyncio.ensure_future(runner())
    try:
      while True:
        kind, value = await queue.get()
        if kind == 'error':
          raise value
        yield kind, value
        if kind == 'done':
          break
    finally:
      cancel.set()  # A client gone: stop at the next token.
      with anyio.CancelScope(shield=True):
        await done.wait()
      del task

  # ---- HTTP

  def app(self):
    from starlette.applications import Starlette
    from starlette.routing import Route

    inner = Starlette(
      routes=[
        Route('/', self.page),
        Route('/health', self.health),
        Route('/v1/models', self.models),
        Route('/v1/chat/completions', self.chat, methods=['POST']),
      ],
      exception_handlers={404: self.not_found, 405: self.not_allowed},
    )

    async def guarded(scope, receive, send):
      """Every HTTP request passes the origin and host check first."""
      if scope['type'] == 'http':
        from starlette.requests import Request

        try:
          self._check_origin(Request(scope))
        except ApiError as e:
          await self._error(e)(scope, receive, send)
          return
      await inner(scope, receive, send)

    return guarded

  @staticmethod
  def _error(e: ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)

  async def not_found(self, request, exc):
    return self._error(ApiError(404, f'no route {request.url.path}'))

  async def not_allowed(self, request, exc):
    return self._error(
      ApiError(405, f'{request.method} is not allowed on {request.url.path}')
    )

  def _check_key(self, request):
    if not self.api_key:
      return
    scheme, _, given = request.headers.get('authorization', '').partition(' ')
    if scheme.lower() != 'bearer' or not hmac.compare_digest(
      given.strip().encode(), self.api_key.encode()
    ):
      raise ApiError(
        401, 'wrong or missing API key (Authorization: Bearer KEY)'
      )

  def _check_origin(self, request):
    """Refuses (403) a request from a web page of another origin (any page
    could POST to a local server) and, on a loopback server, a Host that
    is not a loopback name (DNS rebinding: another site's name pointed at
    127.0.0.1)."""
    host = request.headers.get('host', '')
    name = host.rsplit(':', 1)[0] if not host.endswith(']') else host
    name = name.strip('[]').lower()
    known = name in LOOPBACK_NAMES or name in self.allow_hosts
    if _loopback(self.host) and not known:
      raise ApiError(
        403,
        f'Host {host[:80]!r} is not this server (a loopback server answers '
        'to localhost and 127.0.0.1, and to names given with --allow-host)',
        kind='permission_error',
      )
    origin = request.headers.get('origin')
    if origin is None:
      return
    origin = origin.rstrip('/').lower()
    if origin != f'http://{host}'.lower() and origin not in self.allow_origins:
      raise ApiError(
        403,
        f'requests from the page {origin[:80]!r} are not allowed; start the '
        'server with --allow-origin ORIGIN to allow them',
        kind='permission_error',
      )

  async def page(self, request):
    from starlette.responses import HTMLResponse

    with open(PAGE, encoding='utf-8') as f:
      return HTMLResponse(f.read())

  async def health(self, request):
    from starlette.responses import JSONResponse

    return JSONResponse(
      {
        'status': 'ok',
        'model': self.model_id,
        'busy': bool(self._lock and self._lock.locked()),
        'waiting': self.waiting,
        'served': self.served,
      }
    )

  def _model(self) -> dict:
    d = self.slot.decoder
    return {
      'id': self.model_id,
      'object': 'model',
      'created': self.created,
      'owned_by': 'jade-v8',
      'context_length': d.max_len,
      'vocab_size': d.tokenizer.vocab_size,
      'step': d.step,
      # Where the model's training curves are (a picture and scalars in
      # the model folder, or its TensorBoard logs), or None.
      'curves': getattr(d, 'curves', None),
    }

  async def models(self, request):
    from starlette.responses import JSONResponse

    try:
      self._check_key(request)
    except ApiError as e:
      return self._error(e)
    return JSONResponse({'object': 'list', 'data': [self._model()]})

  async def chat(self, request):
    from starlette.responses import JSONResponse, StreamingResponse

    try:
      self._check_key(request)
      data = await _read_body(request)
      try:
        body = json.loads(data)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f'the body is not JSON ({e})') from None
      except RecursionError:
        raise ApiError(400, 'the body is JSON nested too deeply') from None
      except ValueError as e:  # A number of thousands of digits.
        raise ApiError(
          400, f'the body is not JSON we read ({e})'[:200]
        ) from None
      job = parse_job(
        body, self.model_id, self.slot.decoder.max_len, self.defaults
      )
      ident = f'chatcmpl-{uuid.uuid4().hex[:24]}'
      headers = {'X-Jade-System-Dropped': str(job.dropped_system)}
      if not job.stream:
        r = await self.complete(job)
        headers['X-Jade-Dropped-Turns'] = str(r['dropped_turns'])
        headers['X-Jade-Reused-Tokens'] = str(r['reused_tokens'])
        return JSONResponse(self._completion(ident, r), headers=headers)
      self._check_queue()  # A full queue is a 503, not a 200 and an event.
    except ApiError as e:
      return self._error(e)
    except Exception as e:  # Never a plain 500: OpenAI's shape, one line.
      return self._error(_internal(e))
    return StreamingResponse(
      self._events(ident, job),
      media_type='text/event-stream',
      headers={**headers, 'Cache-Control': 'no-cache'},
    )

  def _completion(self, ident: str, r: dict) -> dict:
    return {
      'id': ident,
      'object': 'chat.completion',
      'created': int(time.time()),
      'model': self.model_id,
      'choices': [
        {
          'index': 0,
          'message': {'role': 'assistant', 'content': r['text']},
          'finish_reason': r['finish_reason'],
        }
      ],
      'usage': _usage(r),
    }

  def _chunk(self, ident: str, delta: dict, finish=None, usage=None) -> str:
    chunk = {
      'id': ident,
      'object': 'chat.completion.chunk',
      'created': int(time.time()),
      'model': self.model_id,
      'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}],
    }
    if usage is not None:
      chunk['usage'] = usage
    return f'data: {json.dumps(chunk)}\n\n'

  async def _events(self, ident: str, job: Job):
    yield self._chunk(ident, {'role': 'assistant', 'content': ''})
    try:
      async for kind, value in self.stream(job):
        if kind == 'text':
          yield self._chunk(ident, {'content': value})
        else:
          yield self._chunk(ident, {}, value['finish_reason'], _usage(value))
    except ApiError as e:
      yield f'data: {json.dumps(e.body())}\n\n'
    except Exception as e:  # The stream ends with an error and [DONE].
      yield f'data: {json.dumps(_internal(e).body())}\n\n'
    yield 'data: [DONE]\n\n'


def _internal(e: Exception) -> ApiError:
  """A 500 in OpenAI's shape for what no check foresaw (a UserError's own
  line, else the exception's name and a short message)."""
  if isinstance(e, UserError):
    return ApiError(500, str(e))
  return ApiError(
    500, f'the server could not answer ({type(e).__name__}: {str(e)[:160]})'
  )


def _usage(r: dict) -> dict:
  return {
    'prompt_tokens': r['prompt_tokens'],
    'completion_tokens': r['completion_tokens'],
    'total_tokens': r['prompt_tokens'] + r['completion_tokens'],
  }


async def _read_body(request) -> bytes:
  """The request body, refused above MAX_BODY bytes or when it takes over
  BODY_SECONDS to arrive (a stalled upload holds nothing for long)."""
  size = request.headers.get('content-length')
  if size is not None and size.isdigit() and int(size) > MAX_BODY:
    raise ApiError(400, f'the body is over {MAX_BODY >> 20} MB')
  chunks, total = [], 0
  try:
    async with asyncio.timeout(BODY_SECONDS):
      async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY:
          raise ApiError(400, f'the body is over {MAX_BODY >> 20} MB')
        chunks.append(chunk)
  except TimeoutError:
    raise ApiError(
      408, f'the body did not arrive within {BODY_SECONDS} s'
    ) from None
  return b''.join(chunks)


def _protocol():
  """uvicorn's HTTP protocol, with connections that send no request
  within IDLE_SECONDS closed (uvicorn times out only an idle connection
  after a response): idle sockets cost nothing and lock no one out."""
  from uvicorn.protocols.http.h11_impl import H11Protocol

  class IdleTimeoutProtocol(H11Protocol):
    def connection_made(self, transport):
      super().connection_made(transport)
      self._idle = self.loop.call_later(IDLE_SECONDS, self._close_if_idle)

    def _close_if_idle(self):
      if self.cycle is None and not self.transport.is_closing():
        self.transport.close()

    def connection_lost(self, exc):
      self._idle.cancel()
      super().connection_lost(exc)

  return IdleTimeoutProtocol


def state_bytes(decoder: Decoder) -> int:
  """Bytes of one conversation's decoder state (what a slot keeps)."""
  import jax

  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(decoder.state))


def check_host(host: str, api_key: str | None, open_without_key: bool):
  """Refuses to listen beyond loopback without an API key unless the user
  said so (`--open-without-key`)."""
  if not _loopback(host) and not api_key and not open_without_key:
    raise UserError(
      f'--host {host} makes the model reachable from other machines; set '
      '--api-key KEY (or JADE_API_KEY), or pass --open-without-key to let '
      'anyone who can reach it use it'
    )


def serve(
  decoder: Decoder,
  model_id: str,
  host: str = '127.0.0.1',
  port: int = 8000,
  api_key: str | None = None,
  max_queue: int = 16,
  defaults: sampling.SamplingSettings | None = None,
  log=print,
  allow_origins: tuple[str, ...] = (),
  open_without_key: bool = False,
  slots: int = 1,
  allow_hosts: tuple[str, ...] = (),
):
  """Serves until interrupted (Ctrl-C, SIGTERM: streams are cut within
  a few seconds)."""
  import uvicorn

  check_host(host, api_key, open_without_key)
  server = Server(
    decoder,
    model_id,
    api_key,
    max_queue,
    defaults,
    host,
    port,
    allow_origins,
    slots,
    allow_hosts,
  )
  where = f'http://{host}:{port}'
  log(
    f'serving {model_id} (step {decoder.step}, context {decoder.max_len} '
    f'tokens) on {where}: chat page {where}/, API {where}/v1'
    + ('' if api_key else ' (no API key)')
  )
  if getattr(decoder, 'curves', None):
    log(f'how it trained: {decoder.curves}')
  if slots > 1:
    import psutil

    each = state_bytes(decoder)
    free = psutil.virtual_memory().available
    if (slots - 1) * each > free // 2:
      raise UserError(
        f'--slots {slots}: {slots - 1} kept conversations of '
        f'{each / 2**20:.0f} MB each would take more than half the '
        f'{free / 2**30:.1f} GB of memory available; use fewer slots'
      )
    log(
      f'{slots} conversations kept at once, {each / 2**20:.1f} MB of decoder '
      'state each'
    )
  if not _loopback(host):
    log(
      f'note: {host} is reachable from other machines; anyone who can '
      'reach it can use the model' + ('' if api_key else ' (set --api-key)')
    )
  uvicorn.run(
    server.app(),
    host=host,
    port=port,
    log_level='warning',
    http=_protocol(),
    timeout_keep_alive=5,
    timeout_graceful_shutdown=3,
  )
