"""The compilation cache: its size after a training run, a chat and a server
start, and what a start costs and prints once every entry is damaged.

  python bench/compile_cache.py [WORK_DIR]

Uses a new, empty cache folder (`JADE_COMPILE_CACHE`, under the home
folder: a cache under /tmp is never used) and, in child processes as a user
runs them:

1. `train.py` on the sample data with `gin/tiny.gin` (20 steps);
2. `evaluate.py --prompt Hello` on that run (twice: the second start reads
   the cache);
3. `evaluate.py --serve` on that run, one chat request, then stopped;
4. every entry damaged (a flipped byte), then `evaluate.py --prompt`
   twice: what the first prints and costs, and whether the second finds
   intact entries again.

Prints the cache's size and entry count after each, and the wall time of
each command.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _size(folder: str) -> tuple[int, int]:
  total = count = 0
  for root, _, names in os.walk(folder):
    for name in names:
      total += os.path.getsize(os.path.join(root, name))
      count += 1
  return total, count


def _run(args, env, label, cache):
  t0 = time.perf_counter()
  run = subprocess.run(
    [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True
  )
  seconds = time.perf_counter() - t0
  if run.returncode != 0:
    sys.exit(f'{label} failed:\n{run.stderr[-3000:]}')
  size, count = _size(cache)
  noise = [x for x in run.stderr.splitlines() if x.strip()]
  print(
    f'{label:<34} {seconds:6.2f} s  cache {size / 1e6:7.2f} MB '
    f'{count:4d} entries  stderr lines {len(noise)}'
  )
  for line in noise[:3]:
    print(f'    stderr: {line[:160]}')
  return run


def _serve(run_dir, env, cache):
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  t0 = time.perf_counter()
  proc = subprocess.Popen(
    [
      sys.executable,
      'evaluate.py',
      '--model-dir',
      run_dir,
      '--serve',
      '--port',
      str(port),
    ],
    cwd=ROOT,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  body = json.dumps(
    {'messages': [{'role': 'user', 'content': 'Hello!'}], 'max_tokens': 8}
  ).encode()
  try:
    while True:
      try:
        request = urllib.request.Request(
          f'http://127.0.0.1:{port}/v1/chat/completions',
          body,
          {'Content-Type': 'application/json'},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
          r.read()
        break
      except OSError:
        if proc.poll() is not None:
          sys.exit('the server ended before it answered')
        time.sleep(0.2)
    seconds = time.perf_counter() - t0
  finally:
    proc.terminate()
    proc.wait(timeout=30)
  size, count = _size(cache)
  print(
    f'{"serve + one request":<34} {seconds:6.2f} s  cache {size / 1e6:7.2f} '
    f'MB {count:4d} entries'
  )


def main():
  work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
  cache = tempfile.mkdtemp(
    dir=os.path.expanduser('~'), prefix='.jade-bench-cache-'
  )
  env = {**os.environ, 'JADE_COMPILE_CACHE': cache}
  run_dir = os.path.join(work, 'run')
  try:
    train = [
      'train.py',
      '--data',
      'data/examples',
      '--gin',
      'gin/tiny.gin',
      '--out-dir',
      run_dir,
      '--steps',
      '20',
      '--vocab-size',
      '300',
      '--eval-every',
      '10',
      '--eval-batches',
      '1',
    ]
    _run(train, env, 'train.py (tiny, 20 steps)', cache)
    chat = ['evaluate.py', '--model-dir', run_dir, '--prompt', 'Hello']
    _run(chat, env, 'evaluate.py --prompt (first)', cache)
    _run(chat, env, 'evaluate.py --prompt (second)', cache)
    _serve(run_dir, env, cache)
    for root, _, names in os.walk(cache):
      for name in names:
        path = os.path.join(root, name)
        with open(path, 'r+b') as f:
          data = bytearray(f.read())
          data[len(data) // 2] ^= 0xFF
          f.seek(0)
          f.write(data)
    _run(chat, env, '--prompt, every entry damaged', cache)
    _run(chat, env, '--prompt, the start after', cache)
  finally:
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == '__main__':
  main()
