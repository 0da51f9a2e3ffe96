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
(beyond that: 503). The conversations, their reuse and the streamed
reply are the inference engine's (`src.inference.engine`); this module is
HTTP. The model keeps the conversation it read last: a
request that repeats it and adds a user message (what chat clients send
each turn) feeds only the new message (prefix reuse); any other is read
again as one block. A client that disconnects stops its generation at the
next token.

What it takes from a client is bounded: connections that send no request
are closed after `asgi.IDLE_SECONDS`, a body must arrive within
`asgi.BODY_SECONDS`,
a conversation is tokenized only as far as it fits, every error (however
odd the input) has OpenAI's shape, and pages of other origins and foreign
Host names (DNS rebinding) are refused with 403.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import os
import threading
import time
import uuid

from src.apps import asgi
from src.apps.openai_api import ApiError, Job, parse_job
from src.core.errors import UserError
from src.inference import engine, sampling
from src.inference.decoding import Decoder

PAGE = os.path.join(os.path.dirname(__file__), 'web', 'index.html')
LOOPBACK_NAMES = {'localhost', '127.0.0.1', '::1'}


def _loopback(host: str) -> bool:
  return host.strip('[]').lower() in LOOPBACK_NAMES


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSettings:
  """How the server is reached and what it allows (`evaluate.py --serve`'s
  options)."""

  model_id: str = 'model'  # The name `/v1/models` gives the model.
  host: str = '127.0.0.1'
  port: int = 8000
  api_key: str | None = None  # None: no key asked (loopback only).
  max_queue: int = 16  # Requests that may wait beyond the one served.
  # Sampling for what a request does not say.
  defaults: sampling.SamplingSettings = dataclasses.field(
    default_factory=sampling.SamplingSettings
  )
  allow_origins: tuple[str, ...] = ()  # Web pages that may call the API.
  allow_hosts: tuple[str, ...] = ()  # Host names besides the address's.
  slots: int = 1  # Conversations kept at once (`engine.Slot`).
  debug_headers: bool = False  # Send X-Jade-Reused-Tokens.
  open_without_key: bool = False  # Serve beyond loopback without a key.


class Server:
  """The model, its queue and the ASGI app."""

  def __init__(self, decoder: Decoder, settings: ServerSettings = None):
    settings = settings or ServerSettings()
    self.settings = settings
    self.conversations = engine.Conversations(decoder, settings.slots)
    self.allow_origins = {o.rstrip('/').lower() for o in settings.allow_origins}
    self.allow_hosts = {h.strip('[]').lower() for h in settings.allow_hosts}
    self.waiting = 0
    self.served = 0
    self.created = int(time.time())
    self._lock: asyncio.Lock | None = None

  # ---- the model, one request at a time

  def _enter(self) -> asgi.Place:
    """A place in the queue, taken now (a 503 when the model is busy and
    the queue full). A stream takes it before its 200, so once the 200 is
    sent the stream is served. `_turn` waits with it; `_leave` gives back
    one that was never used."""
    if self._lock is None:
      self._lock = asyncio.Lock()
    if self._lock.locked() and self.waiting >= self.settings.max_queue:
      raise ApiError(
        503,
        f'the server is busy ({self.waiting} requests waiting; '
        f'--max-queue {self.settings.max_queue}); try again shortly',
      )
    self.waiting += 1
    return asgi.Place()

  def _leave(self, place: asgi.Place):
    if place.held:
      place.held = False
      self.waiting -= 1

  async def _turn(self, place: asgi.Place):
    """Waits for the model with the place `_enter` took."""
    try:
      await self._lock.acquire()
    finally:
      self._leave(place)

  async def complete(self, job: Job, place, gone=None) -> dict | None:
    """The whole reply (the lock is held until the model is free); None
    when `gone` (an asyncio.Event: the client disconnected) is set first,
    while waiting or generating: the request stops within a token."""
    import anyio

    cancel = threading.Event()
    watch = asyncio.ensure_future(gone.wait()) if gone is not None else None
    try:
      turn = asyncio.ensure_future(self._turn(place))
      if watch is not None:
        await asyncio.wait({turn, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not turn.done():  # Gone while queued: its place is given back.
          turn.cancel()
          with contextlib.suppress(asyncio.CancelledError):
            await turn
          if not turn.cancelled() and turn.exception() is None:
            self._lock.release()  # Acquired as it was cancelled.
          return None
      await turn
      try:
        if watch is not None:
          watch.add_done_callback(lambda _: cancel.set())
        result = await anyio.to_thread.run_sync(self._run, job, cancel)
        return None if cancel.is_set() else result
      finally:
        cancel.set()
        self.served += 1
        self._lock.release()
    finally:
      if watch is not None:
        watch.cancel()

  def _run(self, job: Job, cancel: threading.Event, emit=None) -> dict:
    """The engine's reply to `job`; what it refuses is a 400."""
    try:
      return self.conversations.run(job, cancel, emit)
    except engine.Refused as e:
      raise ApiError(400, str(e), e.param) from None

  async def stream(self, job: Job, place: asgi.Place):
    """Yields the reply's text pieces, then the result dict."""
    import anyio

    await self._turn(place)  # The place `chat` took before the 200.
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def emit(text, tokens=None):  # tokens: their logprobs, if asked.
      loop.call_soon_threadsafe(queue.put_nowait, ('text', (text, tokens)))

    def work():
      try:
        result = self._run(job, cancel, emit)
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
    if self.allow_origins:
      # Pages of the origins given with --allow-origin may call the API
      # from a browser: their preflight (OPTIONS) is answered, and every
      # response to them, streams included, names them.
      from starlette.middleware.cors import CORSMiddleware

      inner = CORSMiddleware(
        inner,
        allow_origins=sorted(self.allow_origins),
        allow_methods=['GET', 'POST'],
        allow_headers=['Authorization', 'Content-Type'],
        expose_headers=['X-Jade-System-Dropped', 'X-Jade-Dropped-Turns'],
        max_age=600,
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
    if not self.settings.api_key:
      return
    scheme, _, given = request.headers.get('authorization', '').partition(' ')
    if scheme.lower() != 'bearer' or not hmac.compare_digest(
      given.strip().encode(), self.settings.api_key.encode()
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
    if _loopback(self.settings.host) and not known:
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
        'model': self.settings.model_id,
        'busy': bool(self._lock and self._lock.locked()),
        'waiting': self.waiting,
        'served': self.served,
      }
    )

  def _model(self) -> dict:
    d = self.conversations.decoder
    return {
      'id': self.settings.model_id,
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
    from starlette.responses import JSONResponse, Response

    try:
      self._check_key(request)
      data = await asgi.read_body(request)
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
        body,
        self.settings.model_id,
        self.conversations.decoder.max_len,
        self.settings.defaults,
      )
      ident = f'chatcmpl-{uuid.uuid4().hex[:24]}'
      headers = {'X-Jade-System-Dropped': str(job.dropped_system)}
      place = self._enter()  # A full queue is a 503, before any 200.
      if not job.stream:
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(asgi.disconnect(request, gone))
        try:
          r = await self.complete(job, place, gone)
        finally:
          watcher.cancel()
          self._leave(place)
        if r is None:  # The client is gone: nothing to send.
          return Response(status_code=499)
        headers['X-Jade-Dropped-Turns'] = str(r['dropped_turns'])
        headers.update(self._reuse_header(r))
        return JSONResponse(self._completion(ident, r), headers=headers)
    except ApiError as e:
      return self._error(e)
    except Exception as e:  # Never a plain 500: OpenAI's shape, one line.
      return self._error(_internal(e))
    return asgi.Stream(
      self._events(ident, job, place),
      lambda: self._leave(place),  # A stream that never started.
      media_type='text/event-stream',
      headers={**headers, 'Cache-Control': 'no-cache'},
    )

  def _reuse_header(self, r: dict) -> dict:
    """How many context tokens were kept from an earlier request: only
    with --debug-headers (it tells a client how much of its conversation
    matches what another client sent)."""
    if not self.settings.debug_headers:
      return {}
    return {'X-Jade-Reused-Tokens': str(r['reused_tokens'])}

  def _completion(self, ident: str, r: dict) -> dict:
    return {
      'id': ident,
      'object': 'chat.completion',
      'created': int(time.time()),
      'model': self.settings.model_id,
      'choices': [
        {
          'index': 0,
          'message': {'role': 'assistant', 'content': r['text']},
          'logprobs': (
            None if r['logprobs'] is None else {'content': r['logprobs']}
          ),
          'finish_reason': r['finish_reason'],
        }
      ],
      'usage': _usage(r),
    }

  def _chunk(
    self, ident: str, delta: dict, finish=None, usage=None, logprobs=None
  ) -> str:
    choice = {'index': 0, 'delta': delta, 'finish_reason': finish}
    if logprobs is not None:
      choice['logprobs'] = {'content': logprobs}
    chunk = {
      'id': ident,
      'object': 'chat.completion.chunk',
      'created': int(time.time()),
      'model': self.settings.model_id,
      'choices': [choice],
    }
    if usage is not None:
      chunk['usage'] = usage
    return f'data: {json.dumps(chunk)}\n\n'

  async def _events(self, ident: str, job: Job, place: asgi.Place):
    yield self._chunk(ident, {'role': 'assistant', 'content': ''})
    try:
      async for kind, value in self.stream(job, place):
        if kind == 'text':
          text, tokens = value
          yield self._chunk(ident, {'content': text}, logprobs=tokens)
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


def _check_slots(decoder: Decoder, slots: int, log):
  """Refuses `--slots` whose kept states would take more than half the
  memory available; states what each takes."""
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


def serve(decoder: Decoder, settings: ServerSettings, log=print):
  """Serves until interrupted (Ctrl-C, SIGTERM: streams are cut within
  a few seconds)."""
  import uvicorn

  host, port, api_key = settings.host, settings.port, settings.api_key
  check_host(host, api_key, settings.open_without_key)
  server = Server(decoder, settings)
  where = f'http://{host}:{port}'
  log(
    f'serving {settings.model_id} (step {decoder.step}, context '
    f'{decoder.max_len} tokens) on {where}: chat page {where}/, API {where}/v1'
    + ('' if api_key else ' (no API key)')
  )
  if getattr(decoder, 'curves', None):
    log(f'how it trained: {decoder.curves}')
  if settings.slots > 1:
    _check_slots(decoder, settings.slots, log)
  if not _loopback(host):
    log(
      f'note: {host} is reachable from other machines; anyone who can '
      'reach it can use the model' + ('' if api_key else ' (set --api-key)')
    )
  uvicorn.Server(asgi.uvicorn_config(server.app(), host, port)).run()
