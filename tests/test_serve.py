"""The OpenAI-compatible server: `python evaluate.py --serve` on loopback,
driven by the official `openai` client, raw HTTP and a real browser."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from .conftest import ROOT, json_values

KEY = 'test-key'
TIMEOUT = 120  # Seconds any one request may take.


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _serve(run: str, port: int, out, *flags) -> subprocess.Popen:
  """`python evaluate.py --serve` of `run` on 127.0.0.1:`port`."""
  return subprocess.Popen(
    [
      sys.executable,
      'evaluate.py',
      '--serve',
      '--model-dir',
      run,
      '--port',
      str(port),
      *flags,
    ],
    cwd=ROOT,
    stdout=out,
    stderr=subprocess.STDOUT,
  )


@pytest.fixture(scope='module')
def server(tiny_run, tmp_path_factory):
  """`python evaluate.py --serve` on the shared tiny run, on 127.0.0.1."""
  port = _free_port()
  log = tmp_path_factory.mktemp('serve') / 'server.log'
  with open(log, 'w') as out:
    proc = _serve(
      tiny_run['out'],
      port,
      out,
      '--api-key',
      KEY,
      '--max-queue',
      '8',
      '--debug-headers',
    )
  base = f'http://127.0.0.1:{port}'
  deadline = time.time() + 300
  while True:
    try:
      with urllib.request.urlopen(base + '/health', timeout=5) as r:
        if r.status == 200:
          break
    except OSError:
      pass
    if proc.poll() is not None or time.time() > deadline:
      proc.kill()
      pytest.fail(f'the server did not start: {log.read_text()[-2000:]}')
    time.sleep(0.5)
  yield {'base': base, 'port': port, 'log': log, 'run': tiny_run['out']}
  proc.terminate()
  try:
    proc.wait(30)
  except subprocess.TimeoutExpired:
    proc.kill()


def call(server, path, body=None, key=KEY, raw=None, method=None):
  """`(status, parsed JSON body, headers)` of one request."""
  data = (
    raw if raw is not None else (json.dumps(body).encode() if body else None)
  )
  req = urllib.request.Request(server['base'] + path, data=data, method=method)
  req.add_header('Content-Type', 'application/json')
  if key:
    req.add_header('Authorization', f'Bearer {key}')
  try:
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
      return r.status, json.loads(r.read()), r.headers
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read()), e.headers


def client(server):
  import openai

  return openai.OpenAI(
    base_url=server['base'] + '/v1', api_key=KEY, timeout=TIMEOUT
  )


def test_models_and_health(server):
  status, body, _ = call(server, '/v1/models')
  assert status == 200
  (model,) = body['data']
  assert model['id'] == 'out' and model['context_length'] == 128
  assert model['vocab_size'] > 0
  status, health, _ = call(server, '/health', key=None)
  assert status == 200 and health['status'] == 'ok'


def test_openai_client_streamed_equals_whole_and_the_repl(server, capsys):
  """At temperature 0 the streamed reply is the non-streamed one, and both
  are what `evaluate.py --prompt` prints for the same message."""
  import evaluate
  from src.apps.cli import run_main

  api = client(server)
  messages = [{'role': 'user', 'content': 'Hello there!'}]
  whole = api.chat.completions.create(
    model='out', messages=messages, temperature=0, max_tokens=24, seed=0
  )
  reply = whole.choices[0].message.content
  assert whole.choices[0].finish_reason in ('stop', 'length')
  assert whole.usage.completion_tokens > 0
  assert whole.usage.prompt_tokens > 3  # pad, start, message, marker.
  pieces, finish = [], None
  for chunk in api.chat.completions.create(
    model='out',
    messages=messages,
    temperature=0,
    max_tokens=24,
    seed=0,
    stream=True,
  ):
    delta = chunk.choices[0].delta
    pieces.append(delta.content or '')
    finish = chunk.choices[0].finish_reason or finish
  assert ''.join(pieces) == reply
  assert finish == whole.choices[0].finish_reason
  args = ['--model-dir', server['run'], '--prompt', 'Hello there!']
  args += ['--temperature', '0', '--max-new-tokens', '24']
  assert run_main(lambda: evaluate.main(args)) == 0
  assert capsys.readouterr().out.rstrip('\n') == reply


def test_a_follow_up_reuses_the_conversation(server):
  api = client(server)
  messages = [{'role': 'user', 'content': 'Hi!'}]
  first = api.chat.completions.with_raw_response.create(
    model='out', messages=messages, temperature=0, max_tokens=8
  )
  answer = first.parse().choices[0].message.content
  messages += [
    {'role': 'assistant', 'content': answer},
    {'role': 'user', 'content': 'And then?'},
  ]
  again = api.chat.completions.with_raw_response.create(
    model='out', messages=messages, temperature=0.7, max_tokens=8
  )
  assert int(again.headers['x-jade-reused-tokens']) > 0  # Unseeded.
  # Another conversation is read again from the start.
  other = api.chat.completions.with_raw_response.create(
    model='out',
    messages=[{'role': 'system', 'content': 'Be brief.'}] + messages[2:],
    temperature=0,
    max_tokens=8,
  )
  assert other.headers['x-jade-reused-tokens'] == '0'
  assert other.headers['x-jade-system-dropped'] == '1'


@pytest.mark.parametrize(
  'case, status, param',
  [
    ('json', 400, None),
    ('field', 400, None),
    ('n', 400, 'n'),
    ('model', 404, 'model'),
    ('long', 400, 'messages'),
    ('role', 400, 'messages'),
    ('key', 401, None),
    ('route', 404, None),
  ],
)
def test_errors_have_openai_shape_and_status(server, case, status, param):
  body = {'messages': [{'role': 'user', 'content': 'Hi'}]}
  raw, key, path = None, KEY, '/v1/chat/completions'
  if case == 'json':
    raw = b'{"messages": ['
  elif case == 'field':
    body['temperature'] = 'hot'
  elif case == 'n':
    body['n'] = 2
  elif case == 'model':
    body['model'] = 'gpt-4'
  elif case == 'long':
    body['messages'][0]['content'] = 'word ' * 2000
  elif case == 'role':
    body['messages'].append({'role': 'assistant', 'content': 'x'})
  elif case == 'key':
    key = 'wrong'
  elif case == 'route':
    path = '/v1/embeddings'
  code, err, _ = call(server, path, body, key=key, raw=raw)
  assert code == status
  assert set(err['error']) == {'message', 'type', 'param', 'code'}
  assert err['error']['message']
  if param:
    assert err['error']['param'] == param
  if case == 'long':
    assert '128 tokens' in err['error']['message']


def test_a_client_that_leaves_mid_stream_frees_the_model(server):
  body = {
    'messages': [{'role': 'user', 'content': 'Tell me everything.'}],
    'stream': True,
    'max_tokens': 64,
    'temperature': 1.5,
  }
  conn = http.client.HTTPConnection('127.0.0.1', server['port'], timeout=60)
  conn.request(
    'POST',
    '/v1/chat/completions',
    json.dumps(body),
    {'Authorization': f'Bearer {KEY}', 'Content-Type': 'application/json'},
  )
  response = conn.getresponse()
  assert response.status == 200
  assert response.readline().startswith(b'data: ')
  conn.close()  # Gone after the first event.
  status, body, _ = call(
    server,
    '/v1/chat/completions',
    {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 4},
  )
  assert status == 200 and body['choices'][0]['message']['role'] == 'assistant'
  deadline = time.time() + 30
  while call(server, '/health', key=None)[1]['busy']:
    assert time.time() < deadline
    time.sleep(0.1)


def test_eight_concurrent_clients_all_get_whole_replies(server):
  api = client(server)

  def ask(i):
    r = api.chat.completions.create(
      model='out',
      messages=[{'role': 'user', 'content': f'Question number {i}?'}],
      temperature=0,
      max_tokens=12,
    )
    return r.choices[0].finish_reason, r.usage.completion_tokens

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(ask, range(8)))
  assert all(f in ('stop', 'length') and n <= 12 for f, n in results)


# ---- in-process: cancellation and the queue, without timing


@pytest.fixture(scope='module')
def decoder(tiny_run):
  from src.inference import decoding

  return decoding.Decoder.load(tiny_run['out'])


def test_cancel_stops_at_the_next_token(decoder):
  from src.apps import openai_api
  from src.inference import engine, sampling

  convs = engine.Conversations(decoder)
  job = openai_api.parse_job(
    {
      'messages': [{'role': 'user', 'content': 'Hi'}],
      'max_tokens': 64,
      'temperature': 0,
    },
    'out',
    decoder.max_len,
    sampling.SamplingSettings(repetition_penalty=1.0),
  )
  cancel, emitted = threading.Event(), []

  def emit(text):  # The client leaves after the first piece of text.
    emitted.append(text)
    cancel.set()

  result = convs.run(job, cancel, emit)
  # Nothing was generated after the piece that was sent.
  assert len(emitted) == 1 and result['text'] == emitted[0]
  assert result['completion_tokens'] < 64
  # The conversations are usable after a cancelled reply, and reuse it
  # (unseeded sampling reuses what it read; a greedy reply is read as a fresh
  # server reads it: test_a_follow_up_is_answered_as_a_fresh_server_would).
  job.messages += [('ai', result['text']), ('user', 'Go on')]
  job.settings = dataclasses.replace(job.settings, temperature=0.7)
  again = convs.run(job, threading.Event())
  assert again['reused_tokens'] > 0


def test_a_full_queue_is_refused_with_503(decoder):
  from src.apps import openai_api, serve

  server = serve.Server(
    decoder, serve.ServerSettings(model_id='out', max_queue=2)
  )

  async def scenario():
    await server._turn(server._enter())  # Answering one request.
    waiting = [
      asyncio.ensure_future(server._turn(server._enter())) for _ in range(2)
    ]
    await asyncio.sleep(0)
    assert server.waiting == 2
    with pytest.raises(openai_api.ApiError) as e:
      server._enter()
    assert e.value.status == 503 and 'max-queue 2' in e.value.message
    server._lock.release()
    await waiting[0]
    server._lock.release()
    await waiting[1]
    server._lock.release()

  asyncio.run(scenario())


def test_bad_serve_options_are_one_line(tiny_run, capsys):
  import evaluate
  from src.apps.cli import run_main

  args = ['--model-dir', tiny_run['out'], '--serve', '--port', '70000']
  assert run_main(lambda: evaluate.main(args)) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and '--port' in err[0]


# ---- a real browser


def _chromium():
  for name in ('chromium', 'chromium-browser', 'google-chrome'):
    if shutil.which(name):
      return shutil.which(name)
  return None


@pytest.mark.skipif(
  not (_chromium() and shutil.which('chromedriver')),
  reason='no Chromium and chromedriver here (Debian: apt install chromium '
  'chromium-driver); the browser test of the chat page is SKIPPED',
)
def test_the_page_chats_in_chromium(server, tmp_path):
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait

  options = webdriver.ChromeOptions()
  options.binary_location = _chromium()
  for flag in ('--headless=new', '--no-sandbox', '--disable-gpu'):
    options.add_argument(flag)
  options.add_argument('--window-size=420,800')  # A phone-sized window.
  driver = webdriver.Chrome(
    service=Service(shutil.which('chromedriver')), options=options
  )
  try:
    driver.set_page_load_timeout(60)
    driver.get(server['base'] + '/')
    driver.find_element(By.ID, 'key').send_keys(KEY)
    driver.execute_script(
      "document.getElementById('key').dispatchEvent(new Event('change'))"
    )
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: 'step' in d.find_element(By.ID, 'log').text)
    driver.find_element(By.ID, 'temperature').clear()
    driver.find_element(By.ID, 'temperature').send_keys('0')
    box = driver.find_element(By.ID, 'input')
    box.send_keys('Hello there!')
    box.send_keys('\n')  # Enter sends.
    wait.until(
      lambda d: (
        d.find_elements(By.CSS_SELECTOR, '.assistant[data-done]')
        or 'error' in d.find_element(By.ID, 'log').text
      )
    )
    shot = os.path.join(str(tmp_path), 'chat-page.png')
    driver.save_screenshot(shot)
    print(f'screenshot of the chat page: {shot}')
    reply = driver.find_element(By.CSS_SELECTOR, '.assistant[data-done]')
    assert reply.text.strip()
    assert driver.find_element(By.CSS_SELECTOR, '.user').text == 'Hello there!'
    status, whole, _ = call(
      server,
      '/v1/chat/completions',
      {
        'messages': [{'role': 'user', 'content': 'Hello there!'}],
        'temperature': 0,
        'max_tokens': 64,
      },
    )
    assert whole['choices'][0]['message']['content'] == reply.text.strip()
  finally:
    driver.quit()


# ---- A server that can be left running (issue 42, first part).


def _raw(server, request: bytes, timeout=30) -> tuple[int, bytes]:
  """Sends raw HTTP bytes; `(status, body)` of the answer."""
  with socket.create_connection(('127.0.0.1', server['port']), timeout) as s:
    s.sendall(request)
    data = b''
    while chunk := s.recv(65536):
      data += chunk
  head, _, body = data.partition(b'\r\n\r\n')
  return int(head.split()[1]), body


def _post(server, body: bytes, headers: dict | None = None):
  headers = {
    'Host': f'127.0.0.1:{server["port"]}',
    'Authorization': f'Bearer {KEY}',
    'Content-Type': 'application/json',
    'Content-Length': str(len(body)),
    'Connection': 'close',
    **(headers or {}),
  }
  lines = ''.join(f'{k}: {v}\r\n' for k, v in headers.items() if v is not None)
  return _raw(
    server,
    f'POST /v1/chat/completions HTTP/1.1\r\n{lines}\r\n'.encode() + body,
  )


@pytest.mark.parametrize(
  'body, param',
  [
    (b'[' * 100_000 + b']' * 100_000, None),  # RecursionError before.
    (
      b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": '
      + b'9' * 5000
      + b'}',
      None,
    ),  # ValueError before.
    (
      b'{"messages": [{"role": ["user"], "content": "Hi"}]}',
      'messages[0].role',
    ),
    (
      b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1e300}',
      'max_tokens',
    ),
  ],
  ids=['deep', 'digits', 'role-list', 'huge-float'],
)
def test_odd_bodies_get_an_error_in_openai_shape(server, body, param):
  status, data = _post(server, body)
  assert status == 400, data[:300]
  err = json.loads(data)['error']
  assert err['message'] and err['param'] == param


def test_a_tiny_temperature_is_greedy_not_nan(server):
  body = {
    'messages': [{'role': 'user', 'content': 'Hello!'}],
    'max_tokens': 8,
    'seed': 1,
  }
  greedy = call(server, '/v1/chat/completions', {**body, 'temperature': 0})
  tiny = call(server, '/v1/chat/completions', {**body, 'temperature': 5e-324})
  assert tiny[0] == greedy[0] == 200
  text = tiny[1]['choices'][0]['message']['content']
  assert text == greedy[1]['choices'][0]['message']['content']


def test_idle_sockets_lock_no_one_out(server):
  idle = [
    socket.create_connection(('127.0.0.1', server['port']), 10)
    for _ in range(40)
  ]
  try:
    status, body, _ = call(
      server,
      '/v1/chat/completions',
      {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 4},
    )
    assert (
      status == 200 and body['choices'][0]['message']['content'] is not None
    )
    # An idle connection that sends nothing is closed by the server.
    idle[0].settimeout(30)
    assert idle[0].recv(1) == b''
  finally:
    for s in idle:
      s.close()


@pytest.mark.parametrize(
  'headers, status',
  [
    ({'Origin': 'https://evil.example'}, 403),
    ({'Host': 'rebound.example:80'}, 403),
    ({'Origin': None}, 200),  # No Origin: not a browser's cross-site call.
    ({'Authorization': f'bearer {KEY}'}, 200),  # Any case of the scheme.
  ],
)
def test_foreign_origins_and_hosts_are_refused(server, headers, status):
  body = json.dumps(
    {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2}
  ).encode()
  got, data = _post(server, body, headers)
  assert got == status, data[:300]
  if status == 403:
    assert json.loads(data)['error']['type'] == 'permission_error'


def test_the_page_itself_may_call_the_api(server):
  origin = f'http://127.0.0.1:{server["port"]}'
  body = json.dumps(
    {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2}
  ).encode()
  assert _post(server, body, {'Origin': origin})[0] == 200


def test_a_huge_message_is_refused_before_it_is_tokenized(server):
  body = {'messages': [{'role': 'user', 'content': 'word ' * 800_000}]}
  started = time.time()
  status, err, _ = call(server, '/v1/chat/completions', body)
  assert status == 400 and '4,000,000 characters' in err['error']['message']
  assert time.time() - started < 30  # Bounded work (never asserted tight).


def test_a_long_conversation_is_trimmed_from_its_newest_turns(server):
  messages = []
  for i in range(2047):
    messages.append(
      {'role': 'user' if i % 2 == 0 else 'assistant', 'content': 'x ' * 495}
    )
  messages.append({'role': 'user', 'content': 'Hi'})
  status, body, headers = call(
    server, '/v1/chat/completions', {'messages': messages, 'max_tokens': 4}
  )
  assert status == 200
  assert int(headers['X-Jade-Dropped-Turns']) >= 2040


def test_a_full_queue_refuses_a_stream_before_its_200(decoder):
  from starlette.testclient import TestClient

  from src.apps import serve

  server = serve.Server(
    decoder, serve.ServerSettings(model_id='out', max_queue=0)
  )

  async def busy():
    await server._turn(server._enter())  # Answering; no one may wait.

  asyncio.run(busy())
  with TestClient(server.app(), base_url='http://127.0.0.1:8000') as http:
    r = http.post(
      '/v1/chat/completions',
      json={'messages': [{'role': 'user', 'content': 'Hi'}], 'stream': True},
    )
  assert r.status_code == 503 and r.json()['error']['type'] == 'server_busy'


def test_a_stalled_upload_does_not_hold_shutdown(tiny_run):
  port = _free_port()
  proc = _serve(tiny_run['out'], port, subprocess.DEVNULL)
  try:
    deadline = time.time() + 300
    while True:
      try:
        socket.create_connection(('127.0.0.1', port), 1).close()
        break
      except OSError:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.5)
    stalled = socket.create_connection(('127.0.0.1', port), 10)
    stalled.sendall(
      f'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n'
      'Content-Length: 100000\r\n\r\n{"mes'.encode()
    )
    time.sleep(1)
    started = time.time()
    proc.terminate()
    proc.wait(20)
    assert time.time() - started < 15
    stalled.close()
  finally:
    if proc.poll() is None:
      proc.kill()


def test_a_public_host_needs_a_key_or_an_explicit_yes(tiny_run, capsys):
  import evaluate
  from src.apps.cli import run_main

  args = ['--model-dir', tiny_run['out'], '--serve', '--host', '0.0.0.0']
  assert run_main(lambda: evaluate.main(args)) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and '--open-without-key' in err[0]


def _reply(server, messages, **settings):
  """`(reply text, reused tokens)` of one request."""
  status, body, headers = call(
    server,
    '/v1/chat/completions',
    {'messages': messages, 'max_tokens': 12, **settings},
  )
  assert status == 200, body
  return (
    body['choices'][0]['message']['content'],
    int(headers['X-Jade-Reused-Tokens']),
  )


@pytest.mark.parametrize(
  'settings',
  [
    {'temperature': 0},
    {'temperature': 0.9, 'seed': 7},
    {'temperature': 0, 'stop': ['e']},  # Hidden tokens after the stop.
  ],
  ids=['greedy', 'seeded', 'stop'],
)
def test_a_follow_up_is_answered_as_a_fresh_server_would(server, settings):
  first = [{'role': 'user', 'content': 'Hello!'}]
  answer, _ = _reply(server, first, **settings)
  follow = first + [
    {'role': 'assistant', 'content': answer},
    {'role': 'user', 'content': 'What is your name?'},
  ]
  warm, _ = _reply(server, follow, **settings)
  # The same request after another conversation: read from the start.
  _reply(server, [{'role': 'user', 'content': 'Good morning'}])
  fresh, reused = _reply(server, follow, **settings)
  assert reused == 0
  assert warm == fresh


def _fresh_read(convs, turns):
  """What a fresh server reads for an exact reply (`engine.prepare`)."""
  convs.context.reset()
  convs.context.turns = list(turns)
  convs.context.feed(convs.context.ids(), exact=True)


def test_reuse_gives_the_fresh_reads_logits_bit_for_bit(decoder):
  import numpy as np

  from src.inference import engine

  convs = engine.Conversations(decoder)
  turn = convs._turn
  earlier = [
    turn('user', 'Hello, I am Robin and I would like to talk about trains'),
    turn('ai', 'Hi there, trains are great and I like them a lot'),
  ]
  more = earlier + [turn('user', 'How are you?'), turn('ai', 'Fine, thanks')]
  _fresh_read(convs, earlier)
  d = convs.decoder
  assert d.block and d.mark >= d.block  # Past the first block.
  # The reply as generated: one token at a time after the kept state.
  for i in convs.context.ids(more)[len(convs.context.ids()) :][:5]:
    d.feed([i])
  kept, _ = convs._reuse(more, convs.context.ids(more), exact=True)
  assert kept == d.mark > 0 and kept % d.block == 0
  reused = convs.context.ask('And you?', 8)
  _fresh_read(convs, more)
  fresh = convs.context.ask('And you?', 8)
  np.testing.assert_array_equal(reused, fresh)
  # A kept state that does not share tokens up to its mark is not kept.
  _fresh_read(convs, [turn('user', 'Something else ' * 8)])
  assert convs._reuse(more, convs.context.ids(more), exact=True)[0] == 0


def test_exact_reuse_needs_the_start_block_a_fresh_read_takes(decoder):
  """A long conversation starts with one start block (`Decoder.feed`); a
  kept state is rewound and extended only when a fresh read of the
  follow-up takes the same start block, and then gives its logits."""
  import numpy as np

  from src.inference import decoding, engine

  convs = engine.Conversations(decoder)
  turn = convs._turn
  words = ' '.join(f'word{i}' for i in range(12))
  history = [turn('user', words), turn('ai', words), turn('user', words)]
  follow = history + [turn('ai', 'Fine'), turn('user', 'And?')]
  decoder.min_start = 64
  try:
    _fresh_read(convs, history)
    assert decoder.start == 64 and decoder.position > 64
    want = convs.context.ids(follow)
    assert decoder.start_part(2 + len(want)) == 64
    assert convs._reuse(follow, want, exact=True)[0] == decoder.mark
    reused = convs.context.ask('So?', 4)
    _fresh_read(convs, follow)
    np.testing.assert_array_equal(reused, convs.context.ask('So?', 4))
    # Read from the start without a start block: a fresh read of the
    # follow-up takes one, so nothing is kept.
    _fresh_read(convs, history[:1])
    assert decoder.start == 0
    assert convs._reuse(follow, want, exact=True)[0] == 0
  finally:
    decoder.min_start = decoding.MIN_START
    convs.reset()


def test_fuzzed_requests_get_a_reply_or_an_openai_error(decoder):
  """Random bodies over the request schema (every field a random JSON
  value, messages of random roles and contents): never a plain 500."""
  from hypothesis import HealthCheck, given, settings
  from hypothesis import strategies as st
  from starlette.testclient import TestClient

  from src.apps import serve

  scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
  )
  value = json_values(scalar, max_leaves=6)
  message = st.fixed_dictionaries(
    {
      'role': st.sampled_from(['user', 'assistant', 'system', 'tool']) | value,
      'content': st.text(max_size=40) | value,
    }
  )
  fields = st.fixed_dictionaries(
    {},
    optional={
      'messages': st.lists(message, min_size=0, max_size=4) | value,
      'temperature': value,
      'top_p': value,
      'top_k': value,
      'max_tokens': st.integers(-5, 100) | value,
      'stop': value,
      'seed': value,
      'stream': st.booleans() | value,
      'n': value,
      'model': st.just('out') | value,
    },
  )
  server = serve.Server(
    decoder, serve.ServerSettings(model_id='out', max_queue=4)
  )
  http = TestClient(server.app(), base_url='http://127.0.0.1:8000')

  @settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
  )
  @given(body=fields)
  def check(body):
    r = http.post(
      '/v1/chat/completions',
      content=json.dumps(body),  # NaN and Infinity too, as Python writes.
      headers={'Content-Type': 'application/json'},
    )
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300])
    if r.status_code != 200:
      assert set(r.json()['error']) == {'message', 'type', 'param', 'code'}
    elif body.get('stream') is True:
      assert r.text.rstrip().endswith('data: [DONE]')
      assert '"error"' not in r.text, r.text[-300:]

  check()


@pytest.mark.parametrize('slots', [1, 2])
def test_slots_let_alternating_users_feed_only_their_new_tokens(decoder, slots):
  from src.apps import openai_api
  from src.inference import engine, sampling

  convs = engine.Conversations(decoder, slots)
  greedy = sampling.SamplingSettings(temperature=0, repetition_penalty=1.0)

  def ask(messages):
    job = openai_api.parse_job(
      {'messages': messages, 'max_tokens': 6, 'temperature': 0.7},
      'out',
      decoder.max_len,
      greedy,
    )
    return convs.run(job, threading.Event())

  ann = [{'role': 'user', 'content': 'Hello! I am Ann.'}]
  bob = [{'role': 'user', 'content': 'Good morning, Bob here.'}]
  for who in (ann, bob):
    who.append({'role': 'assistant', 'content': ask(who)['text']})
    who.append({'role': 'user', 'content': 'And then?'})
  # Ann's follow-up after Bob spoke: reused with 2 slots, read again with 1.
  reused = ask(ann)['reused_tokens']
  assert (reused > 0) == (slots == 2), reused
  assert len(convs.parked) == slots - 1


def test_allow_host_admits_a_reverse_proxys_name(decoder):
  from starlette.testclient import TestClient

  from src.apps import serve

  body = {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2}
  for allowed, status in (((), 403), (('chat.example.org',), 200)):
    server = serve.Server(
      decoder, serve.ServerSettings(model_id='out', allow_hosts=allowed)
    )
    with TestClient(server.app(), base_url='https://chat.example.org') as c:
      assert c.post('/v1/chat/completions', json=body).status_code == status


def test_messages_are_tokenized_once_within_a_bound(decoder, monkeypatch):
  """A client resends its conversation every turn: each message is
  tokenized once (its tokens are a function of its text), and what is
  kept is bounded in bytes, least recently used dropped first."""
  from src.inference import engine

  convs = engine.Conversations(decoder)
  calls = []
  encode = convs.context.user_ids
  monkeypatch.setattr(
    convs.context, 'user_ids', lambda text: calls.append(text) or encode(text)
  )
  first = convs._turn('user', 'Hello there')
  one = engine._entry_bytes('Hello there', first)
  monkeypatch.setattr(engine, 'TOKENIZED_BYTES', 2 * one - 1)  # One fits.
  assert convs._turn('user', 'Hello there') is first and len(calls) == 1
  second = convs._turn('ai', 'Hello there')
  assert second.ids[0] == decoder.tokenizer.ai_start_id
  assert len(calls) == 2  # Another role: another turn.
  assert ('user', 'Hello there') not in convs._tokenized  # Over the bound.
  assert convs._cached_bytes == engine._entry_bytes('Hello there', second)
  # The bound is real memory: what 2,000 messages of 1,000 characters take
  # (Python's allocator says) is at most what is counted (an upper bound:
  # a token of a small vocabulary is a shared int).
  import tracemalloc

  monkeypatch.setattr(engine, 'TOKENIZED_BYTES', 1 << 40)
  convs._tokenized.clear()
  convs._cached_bytes = 0
  tracemalloc.start()
  before = tracemalloc.get_traced_memory()[0]
  for i in range(2000):
    convs._turn('user', f'message {i} ' + 'word ' * 198)
  taken = tracemalloc.get_traced_memory()[0] - before
  tracemalloc.stop()
  assert taken <= convs._cached_bytes < taken * 4


def test_a_request_sent_again_that_ends_at_the_mark_is_read(decoder):
  """A kept state whose mark falls exactly where the request ends (the
  same question sent again, the grid aligned there) is not reused up to
  it: there would be no token left to read for the reply's logits."""
  from src.inference import decoding, engine, generate

  convs = engine.Conversations(decoder)
  want = list(range(10, 40))
  have = want + [7, 8, 9]
  lead = 1 + 1  # The pad and START.

  def parked(mark):
    context = generate.Context(decoder)
    context.turns = [generate.Turn('user', '', have)]
    held = decoding.Held(None, len(have) + lead, 0, mark, None)
    return engine.Slot(context, held=held)

  assert convs._kept(parked(lead + len(want)), want, exact=True) == 0
  assert convs._kept(parked(lead + 16), want, exact=True) == 16


# ---- Round 3 (issue 52): disconnects, bursts, CORS, options.


@contextlib.contextmanager
def _in_process(server):
  """`server` (a serve.Server) on a free loopback port in a thread, as
  `serve.serve` runs it; yields the port."""
  import uvicorn

  from src.apps import asgi

  port = _free_port()
  http = uvicorn.Server(asgi.uvicorn_config(server.app(), '127.0.0.1', port))
  thread = threading.Thread(target=http.run, daemon=True)
  thread.start()
  while not http.started:
    time.sleep(0.02)
  try:
    yield port
  finally:
    http.should_exit = True
    thread.join(10)


def _slow(server):
  """Makes `server`'s model answer only when cancelled (or after 60 s):
  `calls` counts the replies begun, `ended` the ones that stopped."""
  calls, ended = [], []

  def run(job, cancel, emit=None):
    calls.append(job)
    cancel.wait(60)
    ended.append(job)
    return {
      'text': 'x',
      'finish_reason': 'length',
      'prompt_tokens': 1,
      'completion_tokens': 1,
      'reused_tokens': 0,
      'dropped_turns': 0,
      'logprobs': None,
    }

  server._run = run
  return calls, ended


def _send_and_leave(port, stream=False):
  body = json.dumps(
    {
      'messages': [{'role': 'user', 'content': 'Hi'}],
      'max_tokens': 64,
      'stream': stream,
    }
  ).encode()
  s = socket.create_connection(('127.0.0.1', port), 10)
  s.sendall(
    (
      f'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n'
      'Content-Type: application/json\r\n'
      f'Content-Length: {len(body)}\r\n\r\n'
    ).encode()
    + body
  )
  return s


def _until(condition, seconds=10.0):
  deadline = time.time() + seconds
  while not condition():
    assert time.time() < deadline, 'not within the time allowed'
    time.sleep(0.02)
  return time.time()


def test_abandoned_requests_free_the_model_queued_or_running(decoder):
  from src.apps import serve

  server = serve.Server(
    decoder, serve.ServerSettings(model_id='out', max_queue=8)
  )
  calls, ended = _slow(server)
  with _in_process(server) as port:
    running = _send_and_leave(port)
    _until(lambda: len(calls) == 1)
    queued = [_send_and_leave(port) for _ in range(3)]
    _until(lambda: server.waiting == 3)
    for s in queued:  # Gone while waiting: their places are given back.
      s.close()
    _until(lambda: server.waiting == 0, 2)
    left = time.time()
    running.close()  # Gone while its reply is generated: it stops.
    done = _until(lambda: len(ended) == 1, 2)
    assert done - left < 1.5
    _until(lambda: not server._lock.locked(), 2)
    assert len(calls) == 1  # The abandoned queued requests never ran.


def test_a_burst_of_streams_gets_whole_streams_or_json_503s(decoder):
  """40 streams at once, a queue of 4: every answer is a 503 in JSON before
  any 200, or a stream that is served to its end."""
  from src.apps import serve

  server = serve.Server(
    decoder, serve.ServerSettings(model_id='out', max_queue=4)
  )
  body = {
    'messages': [{'role': 'user', 'content': 'Hello'}],
    'max_tokens': 8,
    'stream': True,
  }

  def one(port):
    req = urllib.request.Request(
      f'http://127.0.0.1:{port}/v1/chat/completions',
      json.dumps(body).encode(),
      {'Content-Type': 'application/json'},
    )
    try:
      with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        text = r.read().decode()
      return 200, text
    except urllib.error.HTTPError as e:
      return e.code, e.read().decode()

  with _in_process(server) as port:
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
      answers = list(pool.map(lambda _: one(port), range(40)))
  statuses = [status for status, _ in answers]
  assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses
  for status, text in answers:
    if status == 503:
      assert json.loads(text)['error']['type'] == 'server_busy'
    else:
      assert 'error' not in text and text.endswith('data: [DONE]\n\n')
  assert server.waiting == 0


_NEEDS_CHROMIUM = pytest.mark.skipif(
  not (_chromium() and shutil.which('chromedriver')),
  reason='no Chromium and chromedriver here (Debian: apt install chromium '
  'chromium-driver); the browser test is SKIPPED',
)


@contextlib.contextmanager
def _browser():
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service

  options = webdriver.ChromeOptions()
  options.binary_location = _chromium()
  for flag in ('--headless=new', '--no-sandbox', '--disable-gpu'):
    options.add_argument(flag)
  driver = webdriver.Chrome(
    service=Service(shutil.which('chromedriver')), options=options
  )
  try:
    driver.set_page_load_timeout(60)
    yield driver
  finally:
    driver.quit()


@contextlib.contextmanager
def _static_page(html: dict):
  """Serves `html['page']` at / of a free loopback port (another origin);
  yields that origin."""
  import http.server

  class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
      data = html['page'].encode()
      self.send_response(200)
      self.send_header('Content-Type', 'text/html; charset=utf-8')
      self.send_header('Content-Length', str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def log_message(self, *args):
      pass

  httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Page)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  try:
    yield f'http://127.0.0.1:{httpd.server_address[1]}'
  finally:
    httpd.shutdown()


_CALLER = """<!doctype html><title>waiting</title><script>
const api = %(api)r, key = %(key)r;
const body = s => JSON.stringify({messages: [{role: 'user', content: 'Hi'}],
  max_tokens: 8, temperature: 0, stream: s});
const headers = {'Authorization': 'Bearer ' + key,
  'Content-Type': 'application/json'};
(async () => {
  try {
    const whole = await (await fetch(api, {method: 'POST', headers,
      body: body(false)})).json();
    const streamed = await (await fetch(api, {method: 'POST', headers,
      body: body(true)})).text();
    document.title = 'ok:' + JSON.stringify(
      [whole.choices[0].message.content, streamed.endsWith('[DONE]\\n\\n')]);
  } catch (e) {
    document.title = 'failed:' + e;
  }
})();
</script>"""


@_NEEDS_CHROMIUM
def test_a_page_of_an_allowed_origin_chats_and_another_is_refused(decoder):
  from selenium.webdriver.support.ui import WebDriverWait

  from src.apps import serve

  allowed, refused = {'page': ''}, {'page': ''}
  with _static_page(allowed) as origin, _static_page(refused) as other:
    settings = serve.ServerSettings(
      model_id='out', api_key=KEY, allow_origins=(origin + '/',)
    )
    server = serve.Server(decoder, settings)
    with _in_process(server) as port, _browser() as driver:
      api = f'http://127.0.0.1:{port}/v1/chat/completions'
      allowed['page'] = refused['page'] = _CALLER % {'api': api, 'key': KEY}
      driver.get(origin + '/')
      WebDriverWait(driver, 60).until(lambda d: d.title != 'waiting')
      assert driver.title.startswith('ok:'), driver.title
      text, done = json.loads(driver.title[3:])
      assert isinstance(text, str) and done is True
      driver.get(other + '/')  # Not named by --allow-origin.
      WebDriverWait(driver, 60).until(lambda d: d.title != 'waiting')
      assert driver.title.startswith('failed:'), driver.title


def test_cors_preflight_and_headers_for_allowed_origins_only(decoder):
  from starlette.testclient import TestClient

  from src.apps import serve

  origin = 'http://127.0.0.1:5173'
  server = serve.Server(
    decoder,
    serve.ServerSettings(model_id='out', api_key=KEY, allow_origins=(origin,)),
  )
  with TestClient(server.app(), base_url='http://127.0.0.1:8000') as http:
    pre = http.options(
      '/v1/chat/completions',
      headers={
        'Origin': origin,
        'Access-Control-Request-Method': 'POST',
        'Access-Control-Request-Headers': 'authorization,content-type',
      },
    )
    assert pre.status_code == 200
    assert pre.headers['access-control-allow-origin'] == origin
    allowed = pre.headers['access-control-allow-headers'].lower()
    assert 'authorization' in allowed and 'content-type' in allowed
    assert 'POST' in pre.headers['access-control-allow-methods']
    r = http.post(
      '/v1/chat/completions',
      headers={'Origin': origin, 'Authorization': f'Bearer {KEY}'},
      json={'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2},
    )
    assert r.status_code == 200
    assert r.headers['access-control-allow-origin'] == origin
    other = http.options(
      '/v1/chat/completions',
      headers={
        'Origin': 'http://evil.example',
        'Access-Control-Request-Method': 'POST',
      },
    )
    assert other.status_code == 403
    assert 'access-control-allow-origin' not in other.headers


@pytest.mark.parametrize(
  'option, value',
  [
    ('tools', [{'type': 'function', 'function': {'name': 'f'}}]),
    ('tool_choice', 'required'),
    ('tool_choice', {'type': 'function', 'function': {'name': 'f'}}),
    ('functions', [{'name': 'f'}]),
    ('response_format', {'type': 'json_object'}),
    ('response_format', {'type': 'json_schema', 'json_schema': {}}),
    ('logit_bias', {'5': 10}),
    ('modalities', ['text', 'audio']),
    ('audio', {'voice': 'x'}),
    ('reasoning_effort', 'low'),
    ('frobnicate', 1),
    ('top_logprobs', 2),  # Without "logprobs": true.
    ('presence_penalty', 3),
  ],
)
def test_options_not_done_are_refused_by_name(server, option, value):
  body = {'messages': [{'role': 'user', 'content': 'Hi'}], option: value}
  status, data, _ = call(server, '/v1/chat/completions', body)
  assert status == 400, data
  assert data['error']['param'] == option
  assert data['error']['type'] == 'invalid_request_error'


def test_harmless_and_empty_options_are_accepted(server):
  body = {
    'messages': [{'role': 'user', 'content': 'Hi'}],
    'max_tokens': 2,
    'tools': [],
    'tool_choice': 'none',
    'response_format': {'type': 'text'},
    'user': 'u1',
    'metadata': {'a': 'b'},
    'store': False,
    'stream_options': {'include_usage': True},
    'parallel_tool_calls': True,
    'modalities': ['text'],
  }
  status, data, _ = call(server, '/v1/chat/completions', body)
  assert status == 200, data
  assert data['choices'][0]['logprobs'] is None


def _tokens_of(server, **extra):
  body = {
    'messages': [{'role': 'user', 'content': 'Hello there'}],
    'temperature': 0,
    'max_tokens': 16,
    'logprobs': True,
    'top_logprobs': 3,
    **extra,
  }
  status, data, _ = call(server, '/v1/chat/completions', body)
  assert status == 200, data
  return data['choices'][0], data['usage']


def test_logprobs_whole_and_streamed(server):
  choice, usage = _tokens_of(server, repetition_penalty=1.0)
  entries = choice['logprobs']['content']
  assert len(entries) == usage['completion_tokens'] > 0
  for e in entries:
    top = e['top_logprobs']
    assert len(top) == 3 and e['logprob'] <= 0
    assert [t['logprob'] for t in top] == sorted(
      (t['logprob'] for t in top), reverse=True
    )
    assert top[0]['token'] == e['token']  # Greedy: the most likely one.
    assert top[0]['logprob'] == pytest.approx(e['logprob'])
    assert bytes(e['bytes']).decode() == e['token']
  joined = ''.join(e['token'] for e in entries)
  assert ' '.join(joined.split()) == ' '.join(
    choice['message']['content'].split()
  )
  streamed = []
  with client(server).chat.completions.create(
    model='out',
    messages=[{'role': 'user', 'content': 'Hello there'}],
    temperature=0,
    max_tokens=16,
    logprobs=True,
    top_logprobs=3,
    stream=True,
    extra_body={'repetition_penalty': 1.0},
  ) as chunks:
    for chunk in chunks:
      if chunk.choices and chunk.choices[0].logprobs:
        streamed += [e.model_dump() for e in chunk.choices[0].logprobs.content]
  assert [e['token'] for e in streamed] == [e['token'] for e in entries]
  assert [e['logprob'] for e in streamed] == pytest.approx(
    [e['logprob'] for e in entries]
  )


def test_frequency_and_presence_penalties_spread_the_reply(server):
  def most_repeated(**penalties):
    choice, _ = _tokens_of(server, repetition_penalty=1.0, **penalties)
    tokens = [e['token'] for e in choice['logprobs']['content']]
    return max(tokens.count(t) for t in tokens), len(tokens)

  plain, n = most_repeated()
  assert plain > 2 and n == 16  # The 4-step model repeats itself.
  assert most_repeated(frequency_penalty=2.0)[0] < plain
  assert most_repeated(presence_penalty=2.0)[0] < plain


def _streaming(server):
  """Makes `server`'s model stream 'word ' every 50 ms until cancelled (at
  most 100 words); `jobs` gets each request's messages."""
  jobs = []

  def run(job, cancel, emit=None):
    jobs.append(list(job.messages))
    n = 0
    while not cancel.wait(0.05) and n < 100:
      n += 1
      if emit is not None:
        emit('word ')
    return {
      'text': 'word ' * n,
      'finish_reason': 'length',
      'prompt_tokens': 1,
      'completion_tokens': n,
      'reused_tokens': 0,
      'dropped_turns': 0,
      'logprobs': None,
    }

  server._run = run
  return jobs


def _type(driver, text):
  from selenium.webdriver.common.by import By

  box = driver.find_element(By.ID, 'input')
  box.send_keys(text)
  box.send_keys('\n')


@_NEEDS_CHROMIUM
def test_new_chat_mid_reply_sends_a_clean_history(decoder):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait

  from src.apps import serve

  server = serve.Server(decoder, serve.ServerSettings(model_id='out'))
  jobs = _streaming(server)
  with _in_process(server) as port, _browser() as driver:
    driver.get(f'http://127.0.0.1:{port}/')
    wait = WebDriverWait(driver, 30)
    wait.until(lambda d: 'step' in d.find_element(By.ID, 'log').text)
    _type(driver, 'first chat')
    wait.until(
      lambda d: 'word' in d.find_element(By.CSS_SELECTOR, '.assistant').text
    )
    driver.find_element(By.ID, 'new').click()  # Mid-reply.
    time.sleep(0.3)  # The aborted reply's own ending runs now.
    assert not driver.find_elements(By.CSS_SELECTOR, '.user')
    assert '(stopped)' not in driver.find_element(By.ID, 'log').text
    _type(driver, 'second chat')
    wait.until(lambda d: len(jobs) == 2)
    assert jobs[1] == [('user', 'second chat')]
    # Stopped once a word has arrived: a reply stopped before its first word
    # leaves no bubble (and no assistant turn) behind.
    wait.until(
      lambda d: (
        'word' in d.find_elements(By.CSS_SELECTOR, '.assistant')[-1].text
      )
    )
    driver.find_element(By.ID, 'stop').click()
    wait.until(
      lambda d: d.find_elements(By.CSS_SELECTOR, '.assistant[data-done]')
    )
    _type(driver, 'and again')
    wait.until(lambda d: len(jobs) == 3)
    assert [role for role, _ in jobs[2]] == ['user', 'ai', 'user']
    assert jobs[2][0] == ('user', 'second chat')


@_NEEDS_CHROMIUM
def test_a_refused_send_takes_its_bubble_back(decoder):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait

  from src.apps import serve

  server = serve.Server(
    decoder, serve.ServerSettings(model_id='out', max_queue=0)
  )
  jobs = _streaming(server)
  with _in_process(server) as port, _browser() as driver:
    driver.get(f'http://127.0.0.1:{port}/')
    wait = WebDriverWait(driver, 30)
    wait.until(lambda d: 'step' in d.find_element(By.ID, 'log').text)
    busy = _send_and_leave(port, stream=True)  # Holds the model.
    wait.until(lambda d: len(jobs) == 1)
    _type(driver, 'are you there?')
    wait.until(lambda d: 'back in the box' in d.find_element(By.ID, 'log').text)
    assert not driver.find_elements(By.CSS_SELECTOR, '.user')
    box = driver.find_element(By.ID, 'input')
    assert box.get_attribute('value') == 'are you there?'
    busy.close()
    wait.until(lambda d: not server._lock.locked())
    box.send_keys('\n')  # Sent again, with the history it was typed in.
    wait.until(lambda d: len(jobs) == 2)
    assert jobs[1] == [('user', 'are you there?')]


def test_the_repl_and_the_server_read_a_prompt_the_same_way(decoder):
  """`evaluate.py --prompt` (the REPL's Context.ask) and a seeded API
  request give the same first-token logits, bit for bit, and the same
  seeded reply, for prompts of every length modulo the block (every
  remainder after whole blocks)."""
  from src.apps import openai_api
  from src.inference import engine, generate, sampling

  block = decoder.block
  words = (
    'hello there how are you doing today my friend what is new with the '
    'cat and the weather in lisbon this week tell me more please'
  ).split()
  convs = engine.Conversations(decoder)
  tok = decoder.tokenizer
  settings = sampling.SamplingSettings(temperature=0.9, max_new_tokens=12)
  lengths = set()
  for n in range(1, 3 * block):
    text = ' '.join(words[i % len(words)] for i in range(n))
    length = len(tok.encode(text)) + 2  # START, the AI start marker.
    if length + settings.max_new_tokens + 4 > decoder.max_len:
      break
    if length % block in lengths:
      continue
    lengths.add(length % block)
    decoder.reset()  # As a fresh `evaluate.py --prompt` starts.
    context = generate.Context(decoder)
    repl = np.array(context.ask(text, settings.max_new_tokens), copy=True)
    rng = np.random.default_rng(21743)
    repl_reply = engine.stream_reply(context, repl, settings, rng).text
    job = openai_api.parse_job(
      {
        'messages': [{'role': 'user', 'content': text}],
        'temperature': 0.9,
        'seed': 21743,
        'max_tokens': 12,
      },
      'out',
      decoder.max_len,
      sampling.SamplingSettings(),
    )
    convs.reset()
    logits, _, _ = convs.prepare(job)
    np.testing.assert_array_equal(np.asarray(logits), repl, err_msg=text)
    convs.reset()
    assert convs.run(job, threading.Event())['text'] == repl_reply, text
  assert len(lengths) >= block // 2  # Many remainders, 1-3 among them.
  assert {1, 2, 3} <= lengths


def test_a_stop_strings_hidden_tokens_are_not_kept(decoder):
  from src.apps import openai_api
  from src.inference import engine, sampling

  convs = engine.Conversations(decoder)

  def ask(messages, **extra):
    job = openai_api.parse_job(
      {'messages': messages, 'temperature': 0.8, 'max_tokens': 24, **extra},
      'out',
      decoder.max_len,
      sampling.SamplingSettings(repetition_penalty=1.0),
    )
    return convs.run(job, threading.Event())

  first = [{'role': 'user', 'content': 'Hello'}]
  whole = ask(first, seed=3)
  cut_at = whole['text'][len(whole['text']) // 2 :][:2]
  assert cut_at and whole['completion_tokens'] > 4
  cut = ask(first, seed=3, stop=[cut_at])
  assert len(cut['text']) < len(whole['text'])
  follow = first + [
    {'role': 'assistant', 'content': cut['text']},
    {'role': 'user', 'content': 'Go on'},
  ]
  again = ask(follow)  # Unseeded: it would reuse a kept state.
  convs.reset()
  fresh = ask(follow)
  assert again['prompt_tokens'] == fresh['prompt_tokens']
  assert again['reused_tokens'] == 0


@pytest.mark.parametrize(
  'request_bytes',
  [
    b'GARBAGE\r\n\r\n',
    b'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n'
    b'Content-Length: x\r\n\r\n',
    b'GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\nbad header line\r\n\r\n',
  ],
  ids=['not-http', 'bad-length', 'bad-header'],
)
def test_malformed_http_gets_an_openai_error(server, request_bytes):
  status, body = _raw(server, request_bytes)
  assert status == 400
  error = json.loads(body)['error']
  assert error['type'] == 'invalid_request_error'
  assert 'not a valid HTTP request' in error['message']
