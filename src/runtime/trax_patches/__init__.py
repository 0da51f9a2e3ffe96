"""Every change we make to Trax 1.4.1 (the last release, 2021), in one place.

Trax is never edited in site-packages; `install()` replaces the functions
below once per process, before any model is built, and no other module of
Jade V8 patches Trax. Each fix is documented in its module with the symptom
it removes and is pinned by a test (mostly `tests/test_trax_patches.py`) that
fails without it.

- `lazy_tensorflow` (fixes 9, 10): TensorFlow stays unloaded until used.
- `import_speed` (fix 1): `import trax` in seconds, not ~25 s.
- `jax_api` (fixes 2-5, 7, 8): Trax's calls of removed or changed JAX APIs.
- `all_reduce` (fixes 11, 12): one device per process still all-reduces;
  on CPU the gradients are all-reduced as one array.
- `checkpoint_io`: Trax's `Loop` unpickles only through the safe unpickler
  and never reads its data counters.
- `loop_log`: Trax's `Loop` logs to absl, not to stdout.

Jade V8's own attention is no patch: its layers are subclasses of Trax's
in `src/model/attention.py`.
"""

from __future__ import annotations

# What `install()` applied, in order (tests compare it).
APPLIED: list[str] = []


def install(light: bool = False):
  """Applies every fix once; later calls do nothing. `light`: Trax without
  its data pipeline and training loop until something imports them
  (`import_speed`; the chat and the server)."""
  if APPLIED:
    return
  from src.runtime.trax_patches import import_speed, lazy_tensorflow

  lazy_tensorflow.install()  # Before anything imports Trax.
  import_speed.import_trax(light)
  # These import Trax themselves: only now.
  from src.runtime.trax_patches import (
    all_reduce,
    checkpoint_io,
    jax_api,
    loop_log,
  )

  import_speed.install()
  jax_api.install()
  all_reduce.install()
  checkpoint_io.install()
  loop_log.install()
  APPLIED.extend(
    [
      'fast_trax_import',
      'cond_keyword_form',
      'stop_gradient_static',
      'host_count_alias',
      'device_put_replicated',
      'on_cpu_uncommitted',
      'tree_unflatten_arrays',
      'tensorflow_off_accelerators',
      'tensorflow_on_demand',
      'all_reduce_one_local_device',
      'all_reduce_in_one_buffer',
      'safe_checkpoint_reading',
      'loop_logs_to_absl',
    ]
  )
