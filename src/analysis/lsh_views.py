"""What an LSH attention query can see, given the buckets of its head."""

from __future__ import annotations

import numpy as np


def in_view(buckets, length: int, chunk_len: int, before: int, query: int):
  """Positions the query at `query` may attend to, given one head's
  buckets: Trax sorts all hash rounds' (bucket, position) pairs, cuts the
  order into `chunk_len` chunks, and a chunk attends to itself and the
  `before` chunks just before it; causal, never itself."""
  buckets = np.asarray(buckets, np.int64)
  n = len(buckets)
  position = np.arange(n) % length
  order = np.argsort(length * buckets + position, kind='stable')
  chunk = np.empty(n, np.int64)
  chunk[order] = np.arange(n) // chunk_len
  seen = set()
  for c in chunk[position == query]:  # One per hash round.
    near = (chunk <= c) & (chunk >= c - before) & (position < query)
    seen.update(int(p) for p in position[near])
  return seen
