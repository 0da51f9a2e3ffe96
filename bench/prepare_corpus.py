"""Corpus preparation at scale: a synthetic corpus through the real path.

  python bench/prepare_corpus.py --gigabytes 1 --dir /tmp/jade-corpus

Generates a corpus in the line format (Zipf-distributed words, 2-8 turns
per conversation, some `|br|`), then runs `src.training.plan.prepare` (the path
`train.py` takes up to its first batch) twice, each in a fresh process:

1. cold: scan + hash, tokenizer training on a sample, parallel tokenization
   into the cache;
2. warm: the same command again, which must hit the cache.

Reports tokenizer training time, tokenization MB/s, peak RSS (the process
and its tokenizing workers, summed, sampled every 0.1 s) and the time from
process start to the first batch. Targets (issue 5): >= 5 MB/s on 2 cores,
peak RSS < 3 GB, cached run < 10 s to the first training step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(folder: str, gigabytes: float, files: int, seed: int = 0):
  """Writes `files` files of synthetic conversations, `gigabytes` in all."""
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(seed)
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
  words = np.array(
    [''.join(rng.choice(letters, rng.integers(1, 10))) for _ in range(30000)]
  )
  p = 1.0 / np.arange(1, len(words) + 1) ** 1.1
  p /= p.sum()
  counts = rng.integers(2, 24, size=400_000)
  drawn = words[rng.choice(len(words), int(counts.sum()), p=p)]
  ends = np.cumsum(counts)
  pool = []
  for end, n, mark in zip(ends, counts, rng.choice(['.', '?', '!'], 400_000)):
    sentence = ' '.join(drawn[end - n : end])
    pool.append(sentence[0].upper() + sentence[1:] + mark)
  pool = np.array(pool, dtype=object)
  for i in range(pool.size // 20):  # Some messages with line breaks.
    pool[i] = pool[i] + ' |br| ' + pool[-i - 1]
  target = int(gigabytes * 1e9 / files)
  for k in range(files):
    path = os.path.join(folder, f'part-{k:03d}.txt')
    with open(path, 'w', encoding='utf-8') as f:
      written = 0
      while written < target:
        lengths = rng.integers(1, 5, size=20000)  # Exchanges per chat.
        picks = pool[rng.integers(0, pool.size, size=2 * int(lengths.sum()))]
        lines, j = [], 0
        for n in lengths:
          for _ in range(n):
            lines.append(picks[j])
            lines.append(
              f'|aigenerationstart| {picks[j + 1]} |endofgeneration|'
            )
            j += 2
          lines.append('')
        text = '\n'.join(lines) + '\n'
        f.write(text)
        written += len(text)


CHILD = r"""
import json, sys, time
t0 = time.time()
from src import runtime
runtime.bootstrap()
from src.config import jsonconfig as config
from src.data import corpus, tokenizer
from src.training import plan as training
timings = {}
def timed(name, fn):
  def wrapper(*a, **k):
    t = time.time()
    try:
      return fn(*a, **k)
    finally:
      timings[name] = timings.get(name, 0) + time.time() - t
  return wrapper
tokenizer.train = timed('tokenizer_train', tokenizer.train)
corpus.scan = timed('scan_and_hash', corpus.scan)
corpus._build = timed('tokenize', corpus._build)
t_import = time.time() - t0
settings = config.from_values('train', json.loads(sys.argv[1]))
run = training.prepare(settings, log=lambda line: None)
batch = run.train_batches.batch(0)
t_first = time.time() - t0
c = run.corpus
print(json.dumps(dict(
  timings, import_seconds=t_import, first_batch_seconds=t_first,
  hit=c.hit, tokens=int(len(c.tokens)), conversations=c.n_conversations,
  bytes=c.n_bytes, vocab=run.tokenizer.vocab_size,
  held=run.held)))
"""


def run_child(settings: dict) -> dict:
  """Runs one preparation in a fresh process; adds its peak RSS."""
  import psutil

  proc = subprocess.Popen(
    [sys.executable, '-c', CHILD, json.dumps(settings)],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    text=True,
  )
  peak = {'tree': 0, 'main': 0}
  ps = psutil.Process(proc.pid)

  def sample():
    while proc.poll() is None:
      try:
        rss = ps.memory_info().rss
        tree = rss + sum(
          c.memory_info().rss for c in ps.children(recursive=True)
        )
        peak['main'] = max(peak['main'], rss)
        peak['tree'] = max(peak['tree'], tree)
      except psutil.Error:
        pass
      time.sleep(0.1)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  out, _ = proc.communicate()
  thread.join()
  if proc.returncode:
    raise SystemExit(f'child failed with exit code {proc.returncode}')
  result = json.loads(out.strip().splitlines()[-1])
  result['peak_rss_gb'] = peak['tree'] / 1e9
  result['peak_rss_main_gb'] = peak['main'] / 1e9
  return result


def make_settings(data, out, args):
  return {
    'data': data,
    'out-dir': out,
    'gin': os.path.join(ROOT, 'gin', 'tiny.gin'),
    'vocab-size': args.vocab_size,
    'repeat-limit': 0,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--gigabytes', type=float, default=1.0)
  parser.add_argument('--files', type=int, default=8)
  parser.add_argument('--dir', default='/tmp/jade-corpus-bench')
  parser.add_argument('--vocab-size', type=int, default=8000)
  parser.add_argument('--keep', action='store_true', help='reuse the data')
  parser.add_argument(
    '--warm-only', action='store_true', help='only the cached run'
  )
  args = parser.parse_args()
  data = os.path.join(args.dir, 'data')
  out = os.path.join(args.dir, 'run')
  if not (args.keep and os.path.isdir(data)):
    t = time.time()
    generate(data, args.gigabytes, args.files)
    print(f'generated {args.gigabytes} GB in {time.time() - t:.0f} s: {data}')
  if args.warm_only:
    warm = run_child(make_settings(data, out, args))
    print(json.dumps(warm, indent=2))
    print(
      f'cached run to first batch: {warm["first_batch_seconds"]:.1f} s '
      f'({warm["import_seconds"]:.1f} s of it importing), hit={warm["hit"]}'
    )
    return
  subprocess.run(['rm', '-rf', out], check=True)
  settings = make_settings(data, out, args)
  cold = run_child(settings)
  warm = run_child(settings)
  mb = cold['bytes'] / 1e6
  print(json.dumps({'cold': cold, 'warm': warm}, indent=2))
  print(
    f'corpus {mb:.0f} MB, {cold["conversations"]} conversations, '
    f'{cold["tokens"]} tokens (vocab {cold["vocab"]}); {os.cpu_count()} cores'
  )
  print(f'scan + hash:        {cold["scan_and_hash"]:.1f} s')
  print(f'tokenizer training: {cold["tokenizer_train"]:.1f} s (on a sample)')
  print(
    f'tokenization:       {cold["tokenize"]:.1f} s = '
    f'{mb / cold["tokenize"]:.1f} MB/s (target >= 5)'
  )
  print(
    f'cold run to first batch: {cold["first_batch_seconds"]:.1f} s; '
    f'peak RSS {cold["peak_rss_gb"]:.2f} GB with workers '
    f'({cold["peak_rss_main_gb"]:.2f} GB main) (target < 3)'
  )
  print(
    f'cached run to first batch: {warm["first_batch_seconds"]:.1f} s '
    f'({warm["import_seconds"]:.1f} s of it importing; target < 10), '
    f'hit={warm["hit"]}; peak RSS {warm["peak_rss_gb"]:.2f} GB'
  )


if __name__ == '__main__':
  main()
