"""Process settings that must be in place before JAX starts its backend.

`configure()` runs once, when the `src` package is imported, so training,
evaluation, the chat and the benchmarks all run with the same settings.

XLA CPU flags (`XLA_CPU_FLAGS`), measured in BENCHMARKS.md:

- `--xla_cpu_experimental_ynn_fusion_type=` (empty: no YNNPACK fusions).
  jaxlib 0.10's CPU backend hands matrix products to YNNPACK fusions by
  default; with Eigen's instead, a 32k-token training step of the benchmark
  model is ~4% faster and its peak memory 0.8 GB (23%) lower.

A flag the user already set in `XLA_FLAGS` (any value) is left as it is.

`compile_cache()` keeps compiled programs in the user's own cache folder
(`$XDG_CACHE_HOME/jade-v8/jax`, default `~/.cache/jade-v8/jax`; the
environment variable `JADE_COMPILE_CACHE` names another folder, or `off`),
so a second start of the chat or the server skips XLA's compilation
(BENCHMARKS.md). Never in a model folder or out-dir: those come from
others, and a cached executable is code.
"""

from __future__ import annotations

import os
import stat

XLA_CPU_FLAGS = ('--xla_cpu_experimental_ynn_fusion_type=',)


def configure():
  """Adds our XLA flags to `XLA_FLAGS` unless the user set them."""
  flags = os.environ.get('XLA_FLAGS', '')
  for flag in XLA_CPU_FLAGS:
    name = flag.split('=')[0]
    if name + '=' not in flags:
      flags = f'{flags} {flag}'.strip()
  os.environ['XLA_FLAGS'] = flags


# Compilations shorter than this are not kept (all are: the many small
# ones of a start add up to seconds).
MIN_COMPILE_SECONDS = 0.0


def cache_folder() -> str | None:
  """The compilation cache folder, or None when it is off or not the
  user's own (created 0700 when missing)."""
  folder = os.environ.get('JADE_COMPILE_CACHE')
  if folder and folder.lower() == 'off':
    return None
  if not folder:
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(
      os.path.expanduser('~'), '.cache'
    )
    folder = os.path.join(base, 'jade-v8', 'jax')
  try:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.lstat(folder)
  except OSError:
    return None
  mine = not hasattr(os, 'getuid') or info.st_uid == os.getuid()
  if not stat.S_ISDIR(info.st_mode) or not mine or info.st_mode & 0o022:
    return None  # A link, someone else's or writable by others: unused.
  # One subfolder per jaxlib and CPU: a home folder shared by machines, or
  # a jaxlib changed in place, never meets programs built for another.
  sub = os.path.join(folder, _machine_key())
  try:
    os.makedirs(sub, mode=0o700, exist_ok=True)
  except OSError:
    return None
  return sub


def _machine_key() -> str:
  """jaxlib's version and a digest of this CPU's model and features."""
  import hashlib
  import importlib.metadata
  import platform

  try:
    jaxlib = importlib.metadata.version('jaxlib')
  except importlib.metadata.PackageNotFoundError:
    jaxlib = 'unknown'
  cpu = platform.machine() + platform.processor()
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
      for line in f:
        if line.startswith(('model name', 'flags', 'Features')):
          cpu += line
        if line.strip() == '':
          break  # The first processor says it all.
  except OSError:
    pass
  return f'jaxlib-{jaxlib}-{hashlib.sha256(cpu.encode()).hexdigest()[:12]}'


def compile_cache():
  """Turns on JAX's persistent compilation cache in `cache_folder()`."""
  folder = cache_folder()
  if folder is None:
    return
  import jax

  jax.config.update('jax_compilation_cache_dir', folder)
  jax.config.update(
    'jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_SECONDS
  )
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
