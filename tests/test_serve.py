"""The OpenAI-compatible server: `python evaluate.py --serve` on loopback,
driven by the official `openai` client, raw HTTP and a real browser."""

from __future__ import annotations

import asyncio
import concurrent.futures
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

import pytest

from .conftest import ROOT

KEY = 'test-key'
TIMEOUT = 120  # Seconds any one request may take.


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def server(tiny_run, tmp_path_factory):
  """`python evaluate.py --serve` on the shared tiny run, on 127.0.0.1."""
  port = _free_port()
  log = tmp_path_factory.mktemp('serve') / 'server.log'
  with open(log, 'w') as out:
    proc = subprocess.Popen(
      [
        sys.executable,
        'evaluate.py',
        '--serve',
        '--model-dir',
        tiny_run['out'],
        '--port',
        str(port),
        '--api-key',
        KEY,
        '--max-queue',
        '8',
      ],
      cwd=ROOT,
      stdout=out,
      stderr=subprocess.STDOUT,
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
    model='out', messages=messages, temperature=0, max_tokens=8
  )
  assert int(again.headers['x-jade-reused-tokens']) > 0
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
  from src.apps import serve
  from src.inference import sampling

  slot = serve.Slot(decoder)
  job = serve.parse_job(
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

  result = slot.run(job, cancel, emit)
  # Nothing was generated after the piece that was sent.
  assert len(emitted) == 1 and result['text'] == emitted[0]
  assert result['completion_tokens'] < 64
  # The slot is usable after a cancelled reply, and reuses it.
  job.messages += [('ai', result['text']), ('user', 'Go on')]
  again = slot.run(job, threading.Event())
  assert again['reused_tokens'] > 0


def test_a_full_queue_is_refused_with_503(decoder):
  from src.apps import serve

  server = serve.Server(decoder, 'out', None, 2)

  async def scenario():
    await server._turn()  # Answering one request.
    waiting = [asyncio.ensure_future(server._turn()) for _ in range(2)]
    await asyncio.sleep(0)
    assert server.waiting == 2
    with pytest.raises(serve.ApiError) as e:
      await server._turn()
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
