"""The project's CPU kernels: one library, built and registered with XLA.

Seven sources, compiled together (with `cpu_pool.h`, their one way of
spreading work over XLA's threads, `bf16.h`, their bfloat16 rounding and
products, and `vec8.h`, their 8-float vectors and micro-tile height) into
one shared library:
- `chunk_attention.cc`: Trax's chunked attention fused, forward and
  backward (`src.model.chunk_attention`);
- `bf16_cast.cc`: float32 to bfloat16 as opaque calls, plain and
  transposed (`src.model.precision`: bfloat16 products XLA can hand to
  YNNPACK);
- `lsh_hash.cc`: Trax's LSH buckets (the rotations' products and their
  argmax fused: `src.model.lsh_hash`);
- `gather_rows.cc`: rows taken by index and their gradient (the LSH
  layer's sort into bucket order and back: `src.model.gather_rows`);
- `memory_attention.cc`: a chat's new tokens over a wide LSH layer's
  whole key cache, fused (`src.model.memory_attention`);
- `output_layer.cc`: the output layer and its cross-entropy, one chunk of
  rows fused on AMX tiles (`src.model.output_layer`);
- `layer_norm.cc`: Trax's layer norm and the LSH layer's normalized keys,
  and their gradients, a row at a time (`src.model.layer_norm`).

The library is compiled once per source, jaxlib and CPU with the system's
C++ compiler (`c++`; its sources side by side, ~10 s on 2 cores) into
the kernels' folder beside the compilation cache
(src/runtime/compile_cache.py: every folder checked, never through a
link, this user's own, 0700) and loaded from the held folder. Where that
folder is off or unsafe, the build goes to a fresh private temporary
folder, removed once loaded. Without a compiler (or where the library
cannot be loaded) `ready()` is False and every caller computes without
the kernels; `JADE_VERBOSE=1` says why in one line. `JADE_KERNELS=off`
does the same on purpose: none is built or run, and every caller computes
as without a compiler (to rule the kernels out when something looks
wrong; `JADE_CHUNK_KERNEL=off` turns off the fused attention alone).

Where the CPU has AMX (Intel Sapphire Rapids and later) and Linux lends
its tiles, the fused attention's bfloat16 products run on them (`amx()`;
`src/model/bf16.h`); `JADE_AMX=off` builds the library without (its
products on AVX512-BF16 instructions alone: to compare, or rule AMX out).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent import futures
from pathlib import Path

import jax

from src.runtime import quiet, switches

_HERE = Path(__file__).parent
SOURCES = (
  _HERE / 'chunk_attention.cc',
  _HERE / 'bf16_cast.cc',
  _HERE / 'lsh_hash.cc',
  _HERE / 'gather_rows.cc',
  _HERE / 'memory_attention.cc',
  _HERE / 'output_layer.cc',
  _HERE / 'layer_norm.cc',
)
HEADERS = (_HERE / 'cpu_pool.h', _HERE / 'bf16.h', _HERE / 'vec8.h')
_OPTIONS = ('-O3', '-march=native', '-std=c++17', '-fPIC', '-w')
_NO_AMX = ('-mno-amx-tile', '-mno-amx-bf16', '-mno-amx-int8')  # JADE_AMX=off.
_LINK = ('-shared',)  # The objects into one library.
# XLA's name for each handler: the library's symbol.
TARGETS = {
  'jade_chunk_attention_forward': 'JadeChunkAttentionForward',
  'jade_chunk_attention_backward': 'JadeChunkAttentionBackward',
  'jade_cast_bf16': 'JadeCastBf16',
  'jade_cast_transpose_bf16': 'JadeCastTransposeBf16',
  'jade_lsh_buckets': 'JadeLshBuckets',
  'jade_gather_rows': 'JadeGatherRows',
  'jade_scatter_add_rows': 'JadeScatterAddRows',
  'jade_memory_attention': 'JadeMemoryAttention',
  'jade_output_pack': 'JadeOutputPack',
  'jade_output_chunk': 'JadeOutputChunk',
  'jade_layer_norm': 'JadeLayerNorm',
  'jade_layer_norm_backward': 'JadeLayerNormBackward',
  'jade_unit_rows': 'JadeUnitRows',
  'jade_unit_rows_backward': 'JadeUnitRowsBackward',
}


def available() -> bool:
  """Whether the kernels can run here: XLA's CPU backend, and `ready()`."""
  return jax.default_backend() == 'cpu' and ready()


def _library_name() -> str:
  from src.runtime import compile_cache

  digest = hashlib.sha256()
  for path in (*SOURCES, *HEADERS):
    digest.update(path.name.encode() + b'\0' + path.read_bytes())
  digest.update(' '.join((*_options(), *_LINK)).encode())
  digest.update(compile_cache.machine_key().encode())
  return f'kernels-{digest.hexdigest()[:16]}.so'


def _build(folder_fd: int, name: str):
  """Compiles the library into `name` in the held private folder (written
  under a temporary name, then renamed: a half-written library is never
  loaded). The sources compile side by side, one compiler a core (each
  parses XLA's FFI header: 3.8-7.1 s a source on a Zen 3, 20.5 s as one
  call), then link."""
  compiler = shutil.which('c++') or shutil.which('g++')
  if compiler is None:
    raise OSError('no C++ compiler (c++) on PATH')
  with tempfile.TemporaryDirectory(prefix='jade-kernel-') as scratch:
    out = os.path.join(scratch, name)
    include = (f'-I{jax.ffi.include_dir()}', f'-I{_HERE}')
    command = [compiler, *_options(), *include]
    objects = [os.path.join(scratch, f'{s.stem}.o') for s in SOURCES]
    jobs = [
      [*command, '-c', str(source), '-o', obj]
      for source, obj in zip(SOURCES, objects)
    ]
    _compile_all(jobs)
    _compile_all([[compiler, *_LINK, *objects, '-o', out]])
    data = Path(out).read_bytes()
  tmp = f'.{name}.{os.getpid()}'
  flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, 'O_NOFOLLOW', 0)
  fd = os.open(tmp, flags, 0o700, dir_fd=folder_fd)
  with os.fdopen(fd, 'wb') as f:
    f.write(data)
  os.replace(tmp, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)


def _compile_all(commands):
  """Runs the compiler `commands`, as many at once as this process has
  cores; OSError with the first failure's last lines."""

  def run(command):
    return subprocess.run(command, capture_output=True, text=True)

  try:
    cores = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    cores = os.cpu_count() or 1
  workers = max(1, min(len(commands), cores))
  with futures.ThreadPoolExecutor(workers) as pool:
    for done in pool.map(run, commands):
      if done.returncode != 0:
        raise OSError(f'the compiler failed: {done.stderr.strip()[-400:]}')


def _private_folder() -> tuple[int, str | None]:
  """`(held descriptor, temporary path or None)` of the kernels' private
  folder: the compilation cache's (`kernels/<machine>`), or a fresh
  temporary one (0700, made by this process; removed once loaded)."""
  from src.runtime import compile_cache

  place = compile_cache.where('kernels')
  if place is not None:
    try:
      return compile_cache.open_chain(*place), None
    except (compile_cache.Unsafe, OSError) as e:
      quiet.note(f'kernel folder not used ({e}); building in a temporary one')
  folder = tempfile.mkdtemp(prefix='jade-kernel-')  # 0700, ours, new.
  flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, 'O_NOFOLLOW', 0)
  return os.open(folder, flags), folder


def switched_off() -> bool:
  """`JADE_KERNELS=off`: no kernel is built or run in this process."""
  return switches.off('JADE_KERNELS')


def amx_off() -> bool:
  """`JADE_AMX=off`: the library is built without AMX."""
  return switches.off('JADE_AMX')


def _options() -> tuple:
  """The compiler's options: `_OPTIONS`, and `_NO_AMX` under `amx_off()`
  (a library of its own name)."""
  return (*_OPTIONS, *_NO_AMX) if amx_off() else _OPTIONS


def ready() -> bool:
  """Builds (once per machine) and registers the kernels for XLA's CPU
  backend; False where they cannot be or are `switched_off()` (the
  callers then compute without them)."""
  return not switched_off() and _library() is not None


def native_bf16() -> bool:
  """Whether the kernels were built for bfloat16 dot instructions
  (AVX512-BF16): the attention kernel's products then read bfloat16 under
  `precision.products = 'bfloat16'` (float32 elsewhere)."""
  if not ready():
    return False
  return bool(_library().JadeNativeBf16())


def amx() -> bool:
  """Whether the attention kernel's bfloat16 products run on AMX tiles:
  the library built for them (not `amx_off()`) and Linux lent them."""
  return ready() and bool(_library().JadeAmx())


def pass_rows(chunk: int, width: int, bf16: bool = False) -> int:
  """Query rows the built attention kernel takes a pass, for chunks of
  `chunk` rows reading `width` keys (its tile shape, this CPU's), its
  products in float32 or (`bf16`) bfloat16."""
  return int(_library().JadeChunkPassRows(chunk, width, int(bf16)))


@functools.cache
def _library():
  """The loaded library, its handlers registered; None where it cannot be."""
  import ctypes

  try:
    fd, temporary = _private_folder()
    try:
      name = _library_name()
      try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
      except FileNotFoundError:
        _build(fd, name)
      library = ctypes.CDLL(f'/proc/self/fd/{fd}/{name}')
    finally:
      os.close(fd)
      if temporary:
        shutil.rmtree(temporary, ignore_errors=True)
    for target, symbol in TARGETS.items():
      capsule = jax.ffi.pycapsule(getattr(library, symbol))
      jax.ffi.register_ffi_target(target, capsule, platform='cpu')
    library.JadeNativeBf16.restype = ctypes.c_int
    library.JadeAmx.restype = ctypes.c_int
    library.JadeChunkPassRows.restype = ctypes.c_int64
    library.JadeChunkPassRows.argtypes = (ctypes.c_int64,) * 3
    return library
  except (OSError, AttributeError) as e:
    quiet.note(
      f"the CPU kernels are not used ({e}): Trax's attend runs, and XLA "
      'rounds bfloat16 products itself'
    )
    return None
