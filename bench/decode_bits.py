"""Does a change of the decoder keep every reply bit for bit? Dump, compare.

  python bench/decode_bits.py dump RUN_DIR OUT.npz
  python bench/decode_bits.py compare BEFORE.npz AFTER.npz

`dump` loads a run (or an export) with `Decoder.load`, as the chat does,
and feeds fixed random token ids through every way the decoder reads
them, with the model's own hash rounds and with 2: a long read from
position 0 (a start block, blocks, a short rest), ten tokens one at a
time, a block and a 3-token piece after them; then a 300-token read as
blocks, a piece read token by token, a block, a rewind to the mark and a
read after it; then 50 tokens one at a time, the conversation taken out,
another read, and the first put back and continued. Every logits vector
and the final state go into OUT.npz. Run it with the code before a change
and after it (the same run folder), then `compare`: every array must be
equal to the bit.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402, F401  (the repository on the path)


def dump(run: str, out: str) -> int:
  import jax
  import numpy as np

  from src.inference.decoding import Decoder

  found = {}
  for n_hashes in (None, 2):
    d = Decoder.load(run, n_hashes=n_hashes)
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.integers(5, d.tokenizer.vocab_size, 3000)]

    def keep(name, x, tag=f'hashes-{n_hashes}'):
      found[f'{tag}/{name}'] = np.asarray(x)

    n = int(min(d.max_len, 2048) * 0.6)
    if d.block:  # A start block of about a quarter of the read.
      d.min_start = max(d.block, min(d.max_len, 2048) // 4 // d.block * d.block)
    keep('long read', d.feed(ids[:n]))
    for i in range(10):
      keep(f'token {i}', d.feed([ids[n + i]]))
    keep('block', d.feed(ids[n + 10 : n + 80]))
    keep('piece', d.feed(ids[n + 80 : n + 83]))
    d.reset()
    keep('blocks', d.feed(ids[:300], blocks=True))
    keep('by token', d.feed(ids[300:307]))
    keep('block after', d.feed(ids[307:347], blocks=True))
    d.rewind()
    at = d.position
    keep('after rewind', d.feed(ids[at - 1 : at + 30], blocks=True))
    d.reset()
    keep('tokens', d.feed(ids[:50], blocks=False))
    held = d.take()
    keep('other', d.feed(ids[:20]))
    d.put(held)
    keep('put back', d.feed(ids[50:60]))
    leaves = jax.tree_util.tree_leaves(d.state)
    flat = [np.ravel(np.asarray(x, np.float64)) for x in leaves]
    keep('state', np.concatenate(flat))
  np.savez(out, **found)
  print(f'{out}: {len(found)} arrays')
  return 0


def compare(before: str, after: str) -> int:
  import numpy as np

  a, b = np.load(before), np.load(after)
  differ = sorted(
    k
    for k in set(a) | set(b)
    if k not in a or k not in b or not np.array_equal(a[k], b[k])
  )
  if differ:
    total = len(set(a) | set(b))
    print(f'{len(differ)} of {total} arrays differ: {", ".join(differ)}')
    return 1
  print(f'all {len(a)} arrays equal to the bit')
  return 0


def main(argv=None) -> int:
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('what', choices=('dump', 'compare'))
  parser.add_argument('first')
  parser.add_argument('second')
  args = parser.parse_args(argv)
  if args.what == 'compare':
    return compare(args.first, args.second)
  from src import runtime

  runtime.bootstrap()
  return dump(args.first, args.second)


if __name__ == '__main__':
  sys.exit(main())
