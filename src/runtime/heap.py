"""Memory the C allocator holds but no longer uses, handed back.

Measured on the 32k benchmark step (BENCHMARKS.md, "Training speed"): with
glibc's allocator a training process's resident memory between steps
stays ~0.9 GB above what it uses. XLA's compiler and each step's scratch
leave freed holes inside glibc's heap, which glibc keeps; the next step's
large scratch buffers are mapped fresh beside them, so the peak is the
holes plus the step. `malloc_trim(0)` returns the free pages of every hole
to the system (glibc >= 2.8): per-step peak 1.88-1.91 GB instead of
2.23-2.31 GB, at no measurable cost in step time.

Without glibc (macOS, musl) `release()` does nothing; with another
allocator preloaded (jemalloc), glibc's heap is nearly empty and the trim
finds little to return.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _trim():
  """glibc's `malloc_trim`, or None where there is none."""
  name = ctypes.util.find_library('c')
  if not name:
    return None
  try:
    trim = ctypes.CDLL(name).malloc_trim
  except (OSError, AttributeError):
    return None
  trim.argtypes = [ctypes.c_size_t]
  trim.restype = ctypes.c_int
  return trim


# Steps shorter than this keep their freed memory: a trim (and the page
# faults of mapping that memory again in the next step) took ~13 ms after
# a 0.24 s step (1k tokens, 5.6% of it) but ~65 ms after an 8 s one (32k
# tokens, 0.8%), and short steps have little memory to return.
MIN_STEP_SECONDS = 1.0


def release_after_step(step_seconds: float) -> bool:
  """`release()` after a training step that took `step_seconds`, when
  that step was long enough for it to be worth its cost; True if done."""
  if step_seconds < MIN_STEP_SECONDS:
    return False
  return release()


def release() -> bool:
  """Returns the allocator's free memory to the system; True if it could
  (glibc), False where nothing can be done."""
  trim = _trim()
  if trim is None:
    return False
  trim(0)
  return True
