"""HTTP plumbing of the server (`src.apps.serve`), bounded: uvicorn's
protocol with idle connections closed and malformed requests answered in
OpenAI's error shape, its configuration, a request body read within a size
and a time, a client's disconnect watched, a queue place, and a stream that
calls back however it ends."""

from __future__ import annotations

import asyncio
import functools
import json

from src.apps.openai_api import ApiError

MAX_BODY = 4 * 1024 * 1024  # Bytes of one request body.
BODY_SECONDS = 30  # A request body must arrive within this.
IDLE_SECONDS = 10  # A connection must send its request within this.


class Place:
  """A request's place in the queue (see `Server._enter`)."""

  held = True


@functools.cache
def _stream_class():
  from starlette.responses import StreamingResponse

  class Stream(StreamingResponse):
    """A streamed response that calls `on_close` however it ends (a
    client gone before the body started never runs the body)."""

    def __init__(self, content, on_close, **kwargs):
      super().__init__(content, **kwargs)
      self.on_close = on_close

    async def __call__(self, scope, receive, send):
      try:
        await super().__call__(scope, receive, send)
      finally:
        self.on_close()

  return Stream


def Stream(content, on_close, **kwargs):  # noqa: N802 (a class, made late)
  return _stream_class()(content, on_close, **kwargs)


async def disconnect(request, gone: asyncio.Event):
  """Sets `gone` when the client of `request` (its body read) disconnects:
  uvicorn answers the next `receive` with `http.disconnect` then."""
  while True:
    message = await request.receive()
    if message['type'] == 'http.disconnect':
      gone.set()
      return


async def read_body(request) -> bytes:
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


def protocol():
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

    def send_400_response(self, msg: str):
      """A request that is not HTTP gets OpenAI's error shape too (uvicorn
      answers plain text)."""
      import h11

      body = json.dumps(
        ApiError(400, f'not a valid HTTP request ({msg[:120]})').body()
      ).encode()
      headers = [
        (b'content-type', b'application/json'),
        (b'content-length', str(len(body)).encode()),
        (b'connection', b'close'),
      ]
      try:
        for event in (
          h11.Response(status_code=400, headers=headers, reason=b'Bad Request'),
          h11.Data(data=body),
          h11.EndOfMessage(),
        ):
          self.transport.write(self.conn.send(event))
      except h11.LocalProtocolError:  # Too broken to answer in HTTP.
        pass
      self.transport.close()

  return IdleTimeoutProtocol


def uvicorn_config(app, host: str, port: int):
  """How the server runs `app` (the tests and benches run it so too):
  quiet logs, idle connections closed, a short shutdown."""
  import uvicorn

  return uvicorn.Config(
    app,
    host=host,
    port=port,
    log_level='warning',
    http=protocol(),
    timeout_keep_alive=5,
    timeout_graceful_shutdown=3,
  )
