"""The server: follow-up latency with and without prefix reuse, throughput
and latency under concurrent clients, and memory over many requests.

  python bench/serve.py runs/demo [--requests 1000] [--json out.json]

1. Time to the first reply token of a follow-up turn after ~4k tokens of
   conversation (`src.inference.engine.Conversations`, no HTTP): with
   prefix reuse (only the new 20-token message is fed; unseeded
   sampling), without (the conversation read again as one block), greedy
   (the state a fresh server reads: reused only when that is exact), one
   fresh one-token decoder step for scale, what each follow-up read after
   what it kept read alone as blocks at that position (the block's own
   cost), and two users alternating follow-ups with 1 and 2 `--slots`.
   The model is the decode bench's shape (4 layers, d256, 4160-token
   context, random weights: speed does not depend on them) with the run's
   tokenizer.
2. The run's model served over HTTP on 127.0.0.1 (uvicorn in this process):
   1, 4 and 8 concurrent clients, each sending its own one-message
   conversations (max_tokens 16, temperature 0.8, seeded): requests/s,
   reply tokens/s, p50/p95 latency, errors.
3. The server's resident memory after 10 requests and after `--requests`.
4. A soak: 100 clients at once beside 40 idle connections for
   `--soak-seconds`: the answers by status (200 up to the queue, JSON 503
   beyond it, never no answer) and the memory every 2 s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import platform
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from src import runtime  # noqa: E402

runtime.bootstrap()
import jax  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import trax  # noqa: E402

from src.apps import asgi, openai_api, serve  # noqa: E402
from src.data import chatformat, tokenizer  # noqa: E402
from src.inference import decoding, engine, sampling  # noqa: E402
from src.model import ginconf  # noqa: E402

GIN = os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin')


def follow_up(run_dir: str, repeats: int = 5) -> dict:
  """Part 1: first-token time of a follow-up turn at ~4k of history."""
  tok = tokenizer.load(run_dir)
  binds = common.DECODE_BINDINGS + tuple(decoding.predict_bindings(4))
  ginconf.parse(GIN, binds)
  layer = ginconf.model(tok.vocab_size, 'predict')
  layer.rng = jax.random.PRNGKey(0)
  layer.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  decoder = decoding.Decoder(layer, common.DECODE_CONTEXT, tok)
  convs = engine.Conversations(decoder)
  rng = np.random.default_rng(0)
  words = [tok.decode([int(i)]) for i in rng.integers(10, tok.vocab_size, 4000)]
  # ~4k tokens of history in 2-message exchanges, then a new message.
  history = []
  for i in range(0, 3900, 100):
    role = chatformat.USER if (i // 100) % 2 == 0 else chatformat.AI
    history.append((role, ' '.join(words[i : i + 100])))
  new = ' '.join(words[3900:3920])
  defaults = sampling.SamplingSettings(temperature=0.0, max_new_tokens=1)

  def job(messages, exact=False):
    """Unseeded sampling (the chat page's way: reuse what was read), or
    greedy (`exact`: the state a fresh server reads)."""
    body = {
      'messages': [
        {'role': 'user' if r == chatformat.USER else 'assistant', 'content': c}
        for r, c in messages
      ],
      'max_tokens': 1,
      'temperature': 0 if exact else 0.8,
    }
    return openai_api.parse_job(body, 'bench', decoder.max_len, defaults)

  def first_token(reuse: bool, exact=False) -> tuple[float, dict]:
    convs.reset()
    convs.run(job(history, exact), threading.Event())
    # The follow-up a chat client sends: everything so far, the reply it
    # got, and a new 20-token message.
    follow = convs.conversation + [(chatformat.USER, new)]
    if not reuse:  # Another conversation came in between.
      convs.reset()
    shown = []  # When the reply's first text reached the client.
    t0 = time.perf_counter()
    r = convs.run(
      job(follow, exact),
      threading.Event(),
      emit=lambda text: shown or shown.append(time.perf_counter()),
    )
    # The reply's one token, or (a token that shows nothing) its end.
    return (shown[0] if shown else time.perf_counter()) - t0, r

  first_token(True)  # Compile the block and step paths.
  first_token(False)
  reused = [first_token(True) for _ in range(repeats)]
  fresh = [first_token(False) for _ in range(repeats)]
  exact = [first_token(True, exact=True) for _ in range(repeats)]
  alternating = {n: _alternating(decoder, words, job, n) for n in (1, 2)}
  decoder.reset()
  decoder.feed([5])
  steps = []
  for _ in range(20):
    t0 = time.perf_counter()
    decoder.feed([7])
    steps.append(time.perf_counter() - t0)
  # What each follow-up read after what it kept, read alone as blocks at
  # that position of a ~4k context: the block's own cost.
  read = {
    'unseeded': reused[0][1]['prompt_tokens'] - reused[0][1]['reused_tokens'],
    'greedy': exact[0][1]['prompt_tokens'] - exact[0][1]['reused_tokens'],
  }
  block_ms = {}
  for name, n in read.items():
    times = []
    for _ in range(repeats):
      decoder.reset()
      at = exact[0][1]['prompt_tokens'] - n
      decoder.feed([10 + i % 200 for i in range(at)])
      t0 = time.perf_counter()
      decoder.feed([20 + i % 200 for i in range(n)], blocks=True)
      times.append(time.perf_counter() - t0)
    block_ms[name] = 1000 * float(np.median(times))
  return {
    'history_tokens': reused[0][1]['prompt_tokens'],
    'reused_tokens': reused[0][1]['reused_tokens'],
    'with_reuse_ms': 1000 * float(np.median([r[0] for r in reused])),
    'without_reuse_ms': 1000 * float(np.median([r[0] for r in fresh])),
    'greedy_follow_up_ms': 1000 * float(np.median([r[0] for r in exact])),
    'greedy_reused_tokens': exact[0][1]['reused_tokens'],
    'one_step_ms': 1000 * float(np.median(steps)),
    'tokens_read': read,
    'block_ms': block_ms,
    'alternating_ms': {f'slots {n}': ms for n, ms in alternating.items()},
  }


def _alternating(decoder, words, job, slots: int, turns: int = 4) -> float:
  """Median first-token time of two users who alternate follow-ups, each
  with ~1.9k tokens of history, on a server keeping `slots`
  conversations."""
  convs = engine.Conversations(decoder, slots)
  users = []
  for u in range(2):
    start = 2000 * u
    users.append(
      [
        (
          chatformat.USER if i % 2 == 0 else chatformat.AI,
          ' '.join(words[start + 100 * i : start + 100 * i + 100]),
        )
        for i in range(19)
      ]
    )
  times = []
  for turn in range(turns):
    for messages in users:
      t0 = time.perf_counter()
      r = convs.run(job(messages), threading.Event())
      if turn:  # The first turn of each reads its history.
        times.append(time.perf_counter() - t0)
      messages += [
        (chatformat.AI, r['text'] or '.'),
        (chatformat.USER, ' '.join(words[3900 + 5 * turn : 3905 + 5 * turn])),
      ]
  return 1000 * float(np.median(times))


def _post(port: int, body: dict) -> tuple[int, dict, float]:
  t0 = time.perf_counter()
  conn = http.client.HTTPConnection('127.0.0.1', port, timeout=300)
  try:
    conn.request(
      'POST',
      '/v1/chat/completions',
      json.dumps(body),
      {'Content-Type': 'application/json'},
    )
    r = conn.getresponse()
    data = json.loads(r.read())
    return r.status, data, time.perf_counter() - t0
  finally:
    conn.close()


def start_server(run_dir: str, n_hashes: int | None = None, far_keys=None):
  import uvicorn

  decoder = decoding.Decoder.load(run_dir, n_hashes, far_keys)
  server = serve.Server(
    decoder, serve.ServerSettings(model_id='bench', max_queue=64)
  )
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  config = asgi.uvicorn_config(server.app(), '127.0.0.1', port)
  http_server = uvicorn.Server(config)
  thread = threading.Thread(target=http_server.run, daemon=True)
  thread.start()
  while not http_server.started:
    time.sleep(0.05)
  return port, http_server


def load(port: int, clients: int, per_client: int) -> dict:
  """Part 2: `clients` concurrent clients, `per_client` requests each."""

  def client(c):
    out = []
    for i in range(per_client):
      body = {
        'messages': [{'role': 'user', 'content': f'Hello number {c}-{i}!'}],
        'max_tokens': 16,
        'temperature': 0.8,
        'seed': 1000 * c + i,
      }
      status, data, seconds = _post(port, body)
      tokens = data.get('usage', {}).get('completion_tokens', 0)
      out.append((status, seconds, tokens))
    return out

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = [r for rs in pool.map(client, range(clients)) for r in rs]
  wall = time.perf_counter() - t0
  latency = np.array([s for _, s, _ in results])
  return {
    'clients': clients,
    'requests': len(results),
    'errors': sum(status != 200 for status, _, _ in results),
    'requests_per_s': len(results) / wall,
    'tokens_per_s': sum(t for *_, t in results) / wall,
    'p50_ms': 1000 * float(np.percentile(latency, 50)),
    'p95_ms': 1000 * float(np.percentile(latency, 95)),
  }


def soak(port: int, clients: int = 100, seconds: float = 30.0) -> dict:
  """Part 4: `clients` clients at once, each sending one-message
  requests back to back for `seconds`, beside 40 idle connections; the
  server's memory sampled every 2 s. Beyond the queue (64) the answer is
  a JSON 503."""
  process = psutil.Process()
  idle = [socket.create_connection(('127.0.0.1', port)) for _ in range(40)]
  stop = time.time() + seconds
  counts: dict[int, int] = {}
  lock = threading.Lock()

  def client(c):
    i = 0
    while time.time() < stop:
      body = {
        'messages': [{'role': 'user', 'content': f'Hi {c}-{i}'}],
        'max_tokens': 8,
      }
      try:
        status = _post(port, body)[0]
      except (OSError, ValueError):
        status = 0  # No answer at all.
      with lock:
        counts[status] = counts.get(status, 0) + 1
      i += 1

  rss = []
  threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
  for t in threads:
    t.start()
  while time.time() < stop:
    rss.append(process.memory_info().rss / 2**20)
    time.sleep(2)
  for t in threads:
    t.join()
  for s in idle:
    s.close()
  return {
    'clients': clients,
    'seconds': seconds,
    'answers': {str(k): v for k, v in sorted(counts.items())},
    'rss_mb_first': rss[0],
    'rss_mb_last': rss[-1],
    'rss_mb_max': max(rss),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('run', help='a trained model folder (runs/demo)')
  parser.add_argument('--requests', type=int, default=1000)
  parser.add_argument('--json', help='write the figures here')
  parser.add_argument('--soak-seconds', type=float, default=30.0)
  args = parser.parse_args()
  found = {
    'machine': f'{platform.processor() or platform.machine()}, '
    f'{os.cpu_count()} cores',
  }
  found['follow_up'] = follow_up(args.run)
  print(json.dumps(found['follow_up']), flush=True)
  port, http_server = start_server(args.run)
  process = psutil.Process()
  load(port, 1, 10)  # Compile, and the first 10 requests.
  found['rss_after_10_mb'] = process.memory_info().rss / 2**20
  found['load'] = [load(port, c, 24 // c * 2) for c in (1, 4, 8)]
  for row in found['load']:
    print(json.dumps(row), flush=True)
  done = 10 + sum(r['requests'] for r in found['load'])
  rest = max(args.requests - done, 0)
  if rest:
    load(port, 4, -(-rest // 4))
  found['requests_total'] = done + 4 * -(-rest // 4)
  found['rss_after_total_mb'] = process.memory_info().rss / 2**20
  print(
    json.dumps({k: v for k, v in found.items() if 'rss' in k or 'total' in k})
  )
  found['soak'] = soak(port, seconds=args.soak_seconds)
  print(json.dumps(found['soak']), flush=True)
  http_server.should_exit = True
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(found, f, indent=2)


if __name__ == '__main__':
  main()
