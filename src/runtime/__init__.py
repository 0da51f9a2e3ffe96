"""The process before any model exists: XLA flags, quiet logs, Trax patches.

`bootstrap()` is the one call that prepares a process; the scripts
(`train.py`, `evaluate.py`, `src.apps.*`), the benches and the tests call it
first. Importing `src` or any of its packages changes nothing by itself.
"""

from __future__ import annotations

_DONE: list[bool] = []


def bootstrap(light: bool = False, bf16_products: bool = False):
  """Once per process: glibc's heap set to keep a step's scratch where the
  process may train (`heap.keep_scratch`; not under `light`), XLA's CPU
  flags (`xla`), library noise silenced
  (`quiet`), JAX's compilation cache in the user's checked cache folder
  (`compile_cache`),
  then Trax imported and patched (`trax_patches`). Later calls do nothing.
  Call it before JAX starts its backend. `light` (a process that only
  decodes): Trax's data pipeline and training loop are imported only if
  something uses them. `bf16_products`: the run's gin asks for bfloat16
  products (`xla.configure`)."""
  if _DONE:
    return
  from src.runtime import compile_cache, heap, quiet, trax_patches, xla

  if not light:
    heap.keep_scratch()  # Before any thread of JAX's allocates.
  xla.configure(bf16_products)
  quiet.silence_libraries()
  compile_cache.install()
  trax_patches.install(light)
  quiet.silence_loggers()
  _DONE.append(True)
