"""Memory the C allocator holds but no longer uses, handed back.

Measured on the 32k benchmark step (BENCHMARKS.md, "Training speed"): with
glibc's allocator a training process's resident memory between steps
stays ~0.9 GB above what it uses. XLA's compiler and each step's scratch
leave freed holes inside glibc's heap, which glibc keeps; the next step's
large scratch buffers are mapped fresh beside them, so the peak is the
holes plus the step. `malloc_trim(0)` returns the free pages of every hole
to the system (glibc >= 2.8): per-step peak 1.88-1.91 GB instead of
2.23-2.31 GB, at no measurable cost in step time.

Short steps have the opposite problem: glibc maps each step's large
scratch buffers fresh (a buffer over its mmap threshold, or one in a
thread's arena, whose emptied sub-heaps glibc unmaps) and the kernel
zeroes every page again. A step of the long-conversation walkthrough's
run 2 faulted in ~26,200 fresh pages (~100 MB), and on an Intel Xeon
under KVM those faults cost 1.18x in step time. `keep_scratch()` (called
by `runtime.bootstrap` for every process that trains) serves every
allocation from glibc's one main heap and keeps up to `KEEP_BYTES` freed
at its top: a step then faults in no page, and `release()` after a long
step still hands the freed memory back.

Without glibc (macOS, musl) both do nothing; with another allocator
preloaded (jemalloc), glibc's heap is nearly empty and the trim finds
little to return. `JADE_HEAP=off` leaves glibc's own settings.
"""

from __future__ import annotations

import ctypes
import functools

from src.runtime import switches


@functools.cache
def _glibc(name: str, *argtypes):
  """glibc's function `name` (returning int), or None where there is
  none: looked up among the symbols the process already has (no
  `find_library`, which runs `ldconfig` at every start-up)."""
  try:
    function = getattr(ctypes.CDLL(None), name)
  except (OSError, AttributeError):
    return None
  function.argtypes = list(argtypes)
  function.restype = ctypes.c_int
  return function


def _trim():
  """glibc's `malloc_trim`, or None where there is none."""
  return _glibc('malloc_trim', ctypes.c_size_t)


# glibc's `mallopt` parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
# Freed memory at the heap's top kept for the next step (glibc's default
# gives back anything over 128 KB). A 32k step's scratch is larger and is
# returned by `release()` after the step.
KEEP_BYTES = 1 << 30


def keep_scratch() -> bool:
  """Sets glibc's allocator to keep a step's scratch: one arena (no
  thread's sub-heaps to unmap), no `mmap` for large blocks, up to
  `KEEP_BYTES` freed kept. Call before other threads allocate (arenas
  made before stay). True if set; False without glibc or under
  `JADE_HEAP=off`."""
  if switches.off('JADE_HEAP'):
    return False
  mallopt = _glibc('mallopt', ctypes.c_int, ctypes.c_int)
  if mallopt is None:
    return False
  settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_BYTES))
  return all([mallopt(name, value) == 1 for name, value in settings])


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
