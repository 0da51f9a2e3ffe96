"""JAX's persistent compilation cache, kept where only this user can write.

A second start of the chat or the server skips XLA's compilation by
reading the programs the first start compiled (BENCHMARKS.md). A cached
program is code this process runs, so the cache is used only where no one
else can have written it:

- The folder: `$XDG_CACHE_HOME/jade-v8/jax/<jaxlib-cpu>` (default
  `~/.cache/jade-v8/...`), or `JADE_COMPILE_CACHE=FOLDER/<jaxlib-cpu>`;
  `JADE_COMPILE_CACHE=off` turns it off (e.g. on a shared machine where the
  home folder is not private). Never a model folder or out-dir.
- Every folder from `/` down to it is opened one name at a time, never
  through a link (`O_NOFOLLOW`), and checked on what was opened (`fstat`):
  the folders above the cache's own belong to this user or root and no
  one else may write in them (a folder under `/tmp`, or `~/.cache` linked
  there, is not used); the cache's own folders belong to this user, are
  not links, and are made 0700. The last one is then held open and every
  entry is read and written relative to it (`dir_fd`), so a folder swapped
  after the check is never followed.
- Each entry carries a SHA-256 of its key and program: a damaged entry, or
  one holding another key's program, is removed before JAX reads it, and
  one that JAX cannot load is removed too; both are compiled again and
  kept, with one note line per process.
- At most `MAX_BYTES` (least recently used entries go first); subfolders of
  other jaxlib versions or CPUs unused for `PRUNE_DAYS` are removed.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
import sys
import time

from src.runtime import quiet

MAX_BYTES = 1 << 30  # The cache folder's entries, at most (LRU beyond).
PRUNE_DAYS = 14  # Another jaxlib/CPU subfolder unused this long is removed.
MAGIC = b'jade-v8-xla-1\n'
_DIGEST = 32
_FLAGS = (
  os.O_RDONLY | getattr(os, 'O_NOFOLLOW', 0) | getattr(os, 'O_NONBLOCK', 0)
)
_DIR_FLAGS = _FLAGS | getattr(os, 'O_DIRECTORY', 0)


class Unsafe(Exception):
  """A folder on the way to the cache that others could write or swap."""


def _check(fd: int, path: str, own: bool):
  info = os.fstat(fd)
  me = os.getuid()
  owners = (me,) if own else (me, 0)
  if not stat.S_ISDIR(info.st_mode):
    raise Unsafe(f'{path} is not a folder')
  if info.st_uid not in owners:
    raise Unsafe(f'{path} belongs to another user')
  if info.st_mode & 0o022:
    raise Unsafe(f'{path} can be written by other users')


def _open_in(fd: int, name: str, path: str, mine: bool) -> tuple[int, bool]:
  """`(descriptor, mine)` of the folder `name` in the held folder `fd`,
  never through a link, checked (`_check`; as this user's own when `mine`
  or when it was missing: then it is made 0700)."""
  try:
    os.mkdir(name, 0o700, dir_fd=fd)
    mine = True
  except FileExistsError:
    pass
  try:
    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
  except OSError as e:
    raise Unsafe(f'{path} cannot be opened as a folder ({e.strerror})') from e
  try:
    _check(child, path, own=mine)
  except BaseException:
    os.close(child)
    raise
  return child, mine


def open_chain(above: str, own: list[str]) -> int:
  """An open descriptor of the folder `above/own[0]/own[1]/...`: `above`
  (made absolute and resolved) is walked from `/` and each of its folders
  checked as one others cannot write; the `own` names below it, and any
  missing folder of `above`, are made 0700 and must be this user's.
  Raises `Unsafe` or OSError."""
  parts = [p for p in os.path.realpath(above).split(os.sep) if p]
  fd = os.open('/', _DIR_FLAGS)
  path, mine = '', False
  try:
    _check(fd, '/', own=False)
    for i, name in enumerate(parts + own):
      path = f'{path}/{name}'
      child, mine = _open_in(fd, name, path, mine or i >= len(parts))
      os.close(fd)
      fd = child
    return fd
  except BaseException:
    os.close(fd)
    raise


def machine_key() -> str:
  """jaxlib's version and a digest of this CPU's model and features: a
  home folder shared by machines, or a jaxlib changed in place, never meets
  programs built for another."""
  import importlib.metadata
  import platform

  try:
    jaxlib = importlib.metadata.version('jaxlib')
  except importlib.metadata.PackageNotFoundError:
    jaxlib = 'unknown'
  cpu = platform.machine() + platform.processor() + ''.join(cpu_lines())
  return f'jaxlib-{jaxlib}-{hashlib.sha256(cpu.encode()).hexdigest()[:12]}'


# The lines of /proc/cpuinfo the cache's key is made of.
KEY_LINES = ('model name', 'flags', 'Features')


def cpu_lines(prefixes: tuple[str, ...] = KEY_LINES) -> list[str]:
  """The first processor's lines of /proc/cpuinfo that start with one of
  `prefixes` (the key's: `model name`, `flags` and `Features`), as read
  (none where there is no such file)."""
  found = []
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
      for line in f:
        if line.startswith(prefixes):
          found.append(line)
        if line.strip() == '':
          break  # The first processor says it all.
  except OSError:
    pass
  return found


def where(kind: str = 'jax') -> tuple[str, list[str]] | None:
  """`(above, own names)` of the cache folder, or None when it is off;
  `kind='kernels'`: the compiled kernels' folder beside it
  (`src.model.chunk_attention`), `.../jade-v8/kernels/<jaxlib-cpu>` or
  `JADE_COMPILE_CACHE/kernels/<jaxlib-cpu>`."""
  folder = os.environ.get('JADE_COMPILE_CACHE')
  if folder and folder.lower() == 'off':
    return None
  inner = [] if kind == 'jax' else [kind]
  if folder:
    folder = os.path.abspath(folder)
    own = [os.path.basename(folder), *inner, machine_key()]
    return os.path.dirname(folder), own
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(
    os.path.expanduser('~'), '.cache'
  )
  return base, ['jade-v8', kind, machine_key()]


def _entry_name(key: str) -> str:
  """A file name for a JAX cache key (its own, when it is a plain name)."""
  if key and len(key) <= 200 and key[0] != '.':
    if all(c.isalnum() or c in '-_' for c in key):
      return key
  return 'k-' + hashlib.sha256(key.encode()).hexdigest()


def _digest(key: str, value: bytes) -> bytes:
  return hashlib.sha256(MAGIC + key.encode() + b'\0' + value).digest()


class FolderCache:
  """The cache's entries in the held folder `fd` (JAX's `CacheInterface`:
  `get`, `put`); see the module docstring."""

  def __init__(self, fd: int, path: str, max_bytes: int = MAX_BYTES):
    import pathlib

    self.fd, self.path, self.max_bytes = fd, path, max_bytes
    self._path = pathlib.Path(path)  # What JAX's interface names.
    self.replaced = 0
    self._total: int | None = None  # Bytes of entries, as last counted.

  def get(self, key: str) -> bytes | None:
    name = _entry_name(key)
    try:
      fd = os.open(name, _FLAGS, dir_fd=self.fd)
    except OSError:
      return None
    with os.fdopen(fd, 'rb') as f:
      info = os.fstat(fd)
      if not stat.S_ISREG(info.st_mode) or info.st_size > self.max_bytes:
        data = b''
      else:
        data = f.read(info.st_size + 1)
    head = len(MAGIC) + _DIGEST
    value = data[head:]
    if data[: len(MAGIC)] != MAGIC or data[len(MAGIC) : head] != _digest(
      key, value
    ):
      self.discard(key)
      return None
    try:
      os.utime(name, dir_fd=self.fd, follow_symlinks=False)  # Recently used.
    except OSError:
      pass
    return value

  def put(self, key: str, value: bytes):
    data = MAGIC + _digest(key, value) + value
    if len(data) > self.max_bytes:
      return
    name = _entry_name(key)
    tmp = f'.{name[:64]}.{os.getpid()}.{secrets.token_hex(4)}'
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0)
    try:
      fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
      try:
        with os.fdopen(fd, 'wb') as f:
          f.write(data)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
      except BaseException:
        _unlink(tmp, self.fd)
        raise
      if self._total is not None:
        self._total += len(data)
      if self._total is None or self._total > self.max_bytes:
        self.evict()  # Counted afresh once a process, then when over.
    except OSError as e:  # A full disk: the program just is not kept.
      quiet.note(f'compilation cache entry not written ({e.strerror})')

  def discard(self, key: str):
    """Removes a damaged entry (compiled again, and kept, by the caller)."""
    if _unlink(_entry_name(key), self.fd) and not self.replaced:
      print(
        f'note: damaged entries of the compilation cache ({self.path}) are '
        'removed and compiled again',
        file=sys.stderr,
      )
    self.replaced += 1

  def entries(self) -> list[tuple[float, int, str]]:
    """`(last used, size, name)` of each entry, oldest first."""
    found = []
    for name in os.listdir(self.fd):
      try:
        info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
      except OSError:
        continue
      if stat.S_ISREG(info.st_mode):
        found.append((info.st_mtime, info.st_size, name))
    return sorted(found)

  def evict(self):
    """Removes the least recently used entries beyond `max_bytes` (and
    temporary files a killed process left an hour ago)."""
    entries = self.entries()
    total = sum(size for _, size, _ in entries)
    now = time.time()
    for used, size, name in entries:
      stale = name.startswith('.') and now - used > 3600
      if total > self.max_bytes or stale:
        if _unlink(name, self.fd):
          total -= size
    self._total = total


def _unlink(name: str, dir_fd: int) -> bool:
  try:
    os.unlink(name, dir_fd=dir_fd)
    return True
  except OSError:
    return False


def prune(parent_fd: int, keep: str, days: float = PRUNE_DAYS):
  """Removes the subfolders of `parent_fd` but `keep` unused for `days`
  (another jaxlib or CPU), and anything there that is not a folder (the
  compiled kernels' folder, `where('kernels')`, stays)."""
  now = time.time()
  for name in os.listdir(parent_fd):
    if name in (keep, 'kernels'):
      continue
    try:
      info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
      if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=parent_fd)
      elif now - info.st_mtime > days * 86400:
        shutil.rmtree(name, dir_fd=parent_fd)  # Never follows a link.
    except OSError:
      continue


_STATE: dict = {}


def _refused(e: Exception):
  """Why the cache is not used: one line on stderr when the user named
  the folder (`JADE_COMPILE_CACHE`), since every start then compiles
  again (the long-conversation block ~65 s slower, BENCHMARKS.md "The
  block on a fresh clone, timed"); else a note with `JADE_VERBOSE=1`."""
  named = os.environ.get('JADE_COMPILE_CACHE')
  if not named:
    quiet.note(f'the compilation cache is not used: {e}')
    return
  print(
    f'JADE_COMPILE_CACHE={named}: not used ({e}), so each start compiles '
    'again; name a folder only you can write, or JADE_COMPILE_CACHE=off',
    file=sys.stderr,
  )


def open_cache() -> FolderCache | None:
  """The checked cache folder, held open (None when off or unsafe: then a
  start compiles, and `_refused` says why)."""
  found = where()
  if found is None:
    return None
  above, own = found
  try:
    parent = open_chain(above, own[:-1])
  except (Unsafe, OSError) as e:
    _refused(e)
    return None
  try:
    fd, _ = _open_in(parent, own[-1], own[-1], mine=True)
  except (Unsafe, OSError) as e:
    os.close(parent)
    _refused(e)
    return None
  os.utime(fd)  # This subfolder is in use (see `prune`).
  prune(parent, own[-1])
  os.close(parent)
  path = os.path.join(os.path.realpath(above), *own)
  return FolderCache(fd, path)


def install():
  """Turns on JAX's persistent compilation cache in the checked folder:
  JAX's file cache is replaced by `FolderCache`, and an entry JAX cannot
  load is removed (compiled again and kept) instead of a warning on every
  start. Does nothing when the cache is off or unsafe."""
  cache = open_cache()
  if cache is None:
    return None
  import jax
  from jax._src import compilation_cache as cc

  _STATE['cache'] = cache
  if not _STATE.get('patched'):
    _STATE['patched'] = True
    read = cc.get_executable_and_time

    def get_file_cache(path):
      return _STATE['cache'], path

    def get_executable_and_time(cache_key, *args, **kwargs):
      try:
        return read(cache_key, *args, **kwargs)
      except Exception:  # noqa: BLE001 (any failure: compile it again)
        _STATE['cache'].discard(cache_key)
        return None, None

    cc.get_file_cache = get_file_cache
    cc.get_executable_and_time = get_executable_and_time
  jax.config.update('jax_compilation_cache_dir', cache.path)
  # Every program is kept: the many small ones of a start add up to seconds.
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  return cache
