"""What an LSH attention query can see, given the buckets of its head."""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def recording_buckets(found: list):
  """Inside, tracing an LSH layer (`FastLSHSelfAttention` and the directed
  one) makes every later call of it append `(layer index, buckets)` to
  `found`: buckets `[n_hashes * length]` int32, one array per head."""
  import jax

  from src.model import attention

  cls = attention.FastLSHSelfAttention
  plain = cls.hash_vectors
  traced = []  # LSH layers in the order the model calls them.

  def hash_vectors(self, vecs, rng, mask=None):
    b = plain(self, vecs, rng, mask)
    layer = id(self)  # Calls may come back in any order: tag them.
    if layer not in traced:
      traced.append(layer)
    jax.debug.callback(
      lambda v: found.append((traced.index(layer), np.asarray(v))), b
    )
    return b

  cls.hash_vectors = hash_vectors
  try:
    yield
  finally:
    cls.hash_vectors = plain
