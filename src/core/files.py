"""Files from folders we did not write: read bounded, write only our own.

A run folder (out-dir) or a model folder may come from someone else. What
is read from one is read by `read_regular` / `read_json`: a regular file
(never a link, a device or a FIFO), at most `limit` bytes, JSON nested at
most `MAX_JSON_DEPTH` deep. What is written into one is written by
`write_atomic` (a fresh temporary file, renamed into place: the rename
replaces a planted link, it never writes through it), and an out-dir that
holds links is refused before anything is written (`check_no_links`);
`remove_inside` deletes only real entries inside the folder.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import stat
import tempfile

from src.core.errors import UserError

MB = 1024 * 1024
MAX_JSON_DEPTH = 64
MAX_ENTRIES = 100_000  # Entries an out-dir may hold before we stop looking.


def write_atomic(path: str, data: bytes):
  """Writes `data` to `path` through a temporary file and a rename."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix='.' + os.path.basename(path))
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def open_for_write(path: str, mode: str = 'wb'):
  """`open(path, mode)` for writing into a folder we did not make, never
  through what is there: a name written from the start ('w', 'x') is
  removed first and made anew (`O_EXCL`), so a symbolic or hard link
  planted there is replaced, not written through; a file appended to or
  updated ('a', 'r+') must be a regular file with no other link."""
  base = os.O_CREAT | getattr(os, 'O_NOFOLLOW', 0) | getattr(os, 'O_CLOEXEC', 0)
  base |= os.O_RDWR if '+' in mode else os.O_WRONLY
  if 'a' in mode or mode.startswith('r'):
    flags = base | os.O_APPEND if 'a' in mode else base & ~os.O_CREAT
    try:
      fd = os.open(path, flags, 0o666)
    except OSError as e:
      if e.errno != errno.ELOOP:
        raise
      raise UserError(
        f'{path}: is a link; a run never writes through one: remove it, '
        'or use a new out-dir'
      ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
      os.close(fd)
      raise UserError(
        f'{path}: is not a file of its own (a hard link or a special file); '
        'remove it, or use a new out-dir'
      )
    return os.fdopen(fd, mode)
  if 'x' not in mode:
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass
    except IsADirectoryError:
      raise UserError(f'{path}: is a folder; remove it') from None
  fd = os.open(path, base | os.O_EXCL, 0o666)
  return os.fdopen(fd, mode.replace('x', 'w'))


# Bytes already read and checked, by absolute path (`pinned`): a reader
# of such a path parses these, not what the name holds by then.
_PINNED: dict[str, bytes] = {}


@contextlib.contextmanager
def pinned(contents: dict[str, bytes]):
  """Within the block, `open_regular` and `read_regular` of these paths
  give these bytes: the bytes whose checksum was checked are the bytes
  that are parsed, whatever is renamed into the folder meanwhile."""
  keys = {os.path.abspath(p): data for p, data in contents.items()}
  _PINNED.update(keys)
  try:
    yield
  finally:
    for key in keys:
      _PINNED.pop(key, None)


def _size_text(n: int) -> str:
  return f'{n / MB:.1f} MB' if n >= MB else f'{n} bytes'


_FOLDER_FIX = (
  'a model or run folder must hold plain files: copy the folder again'
)


def open_regular(path: str, limit: int, fix: str = _FOLDER_FIX):
  """An open binary file for `path`, which must be a regular file (not a
  link, device or FIFO) of at most `limit` bytes; else a `UserError`
  ending with `fix`, what the user should do (by default: copy the model
  or run folder again). A missing file raises FileNotFoundError."""
  data = _PINNED.get(os.path.abspath(path))
  if data is not None:
    if len(data) > limit:
      raise UserError(f'{path}: more than {_size_text(limit)}; copy it again')
    return io.BytesIO(data)
  flags = (
    os.O_RDONLY | getattr(os, 'O_NOFOLLOW', 0) | getattr(os, 'O_NONBLOCK', 0)
  )
  try:
    fd = os.open(path, flags)
  except OSError as e:
    if e.errno == errno.ELOOP or os.path.islink(path):
      raise UserError(
        f'{path}: is a link ({os.readlink(path)!r}); {fix}'
      ) from None
    if isinstance(e, FileNotFoundError):
      raise
    raise UserError(f'{path}: cannot be read ({e.strerror})') from None
  info = os.fstat(fd)
  if not stat.S_ISREG(info.st_mode):
    os.close(fd)
    raise UserError(f'{path}: is not a regular file; {fix}')
  if info.st_size > limit:
    os.close(fd)
    raise UserError(
      f'{path}: {_size_text(info.st_size)}, more than such a file can be '
      f'({_size_text(limit)}); the folder is damaged or not a Jade V8 '
      'folder: copy it again'
    )
  return os.fdopen(fd, 'rb')


def read_regular(path: str, limit: int) -> bytes:
  """The bytes of `path` (see `open_regular`)."""
  with open_regular(path, limit) as f:
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    data = f.read(size + 1)  # Never a buffer of the limit for a small file.
  if len(data) > size:  # Grew while we read it.
    raise UserError(f'{path}: changed while it was read; copy it again')
  return data


def json_depth(text: str) -> int:
  """How deep `text`'s arrays and objects nest (strings skipped)."""
  depth = deepest = 0
  in_string = escaped = False
  for ch in text:
    if in_string:
      if escaped:
        escaped = False
      elif ch == '\\':
        escaped = True
      elif ch == '"':
        in_string = False
    elif ch == '"':
      in_string = True
    elif ch in '[{':
      depth += 1
      deepest = max(deepest, depth)
    elif ch in ']}':
      depth -= 1
  return deepest


def parse_json(text: str, path: str):
  """`json.loads(text)`, refusing nesting deeper than MAX_JSON_DEPTH."""
  if json_depth(text) > MAX_JSON_DEPTH:
    raise UserError(
      f'{path}: JSON nested more than {MAX_JSON_DEPTH} deep, which no Jade '
      'V8 file is; the file is damaged: copy the folder again'
    )
  try:
    return json.loads(text)
  except ValueError as e:
    raise UserError(
      f'{path}: not valid JSON ({e}); the file is damaged: copy the '
      'folder again'
    ) from None


def damaged(path: str, e: Exception, fix: str) -> UserError:
  """The one line for a file of ours that does not hold what it must:
  which file, what is wrong (`e`) and the `fix`."""
  return UserError(f'{path}: damaged ({type(e).__name__}: {e}); {fix}')


def read_text(path: str, kind: str) -> str:
  """A settings file the user wrote (a config, a gin file), as text; a
  file that cannot be read, or is not UTF-8, is one line: save it as
  UTF-8 `kind`."""
  try:
    with open(path, encoding='utf-8') as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    reason = ' '.join(str(e).split())
    raise UserError(
      f'{path}: cannot be read ({reason}); save it as UTF-8 {kind}'
    ) from None


def read_json(path: str, limit: int = MB):
  """A JSON file from a model or run folder, bounded (see `read_regular`)."""
  data = read_regular(path, limit)
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError:
    raise UserError(
      f'{path}: not UTF-8 text; the file is damaged: copy the folder again'
    ) from None
  return parse_json(text, path)


def links_inside(folder: str) -> list[tuple[str, str]]:
  """`(path, what is wrong)` of every entry in `folder`, at any depth, that
  a run must not write or delete through (nothing is followed): a symbolic
  link, a FIFO, socket or device, a file with a hard link outside the
  folder (more links than the folder holds: checkpoint snapshots are hard
  links inside it). A temporary name left by a killed run is no danger:
  every write replaces the name with a new file (`open_for_write`)."""
  found, seen = [], 0
  inodes: dict[tuple[int, int], list] = {}
  for root, dirs, names in os.walk(folder):
    for name in dirs + names:
      seen += 1
      path = os.path.join(root, name)
      try:
        info = os.lstat(path)
      except OSError:
        continue
      if stat.S_ISLNK(info.st_mode):
        found.append((path, f'is a link to {os.readlink(path)!r}'))
      elif stat.S_ISDIR(info.st_mode):
        continue
      elif not stat.S_ISREG(info.st_mode):
        found.append((path, 'is not a regular file (a FIFO or device)'))
      elif info.st_nlink > 1:
        inodes.setdefault((info.st_dev, info.st_ino), [info.st_nlink]).append(
          path
        )
    if seen > MAX_ENTRIES:
      raise UserError(
        f'{folder}: more than {MAX_ENTRIES} files and folders, which no run '
        'folder holds; use a new --out-dir'
      )
  for nlink, *paths in inodes.values():
    if nlink > len(paths):  # Checkpoint snapshots link inside; never out.
      found.append((paths[0], 'has a hard link outside the folder'))
  return found


def check_no_links(folder: str, what: str = 'out-dir'):
  """Refuses a folder that holds links, special files or hard links to
  files elsewhere: the run would write or delete where they point. (The
  folder itself may be a link: it is used where it points, and everything
  inside must be real.)"""
  if not os.path.isdir(folder):
    return
  found = links_inside(folder)
  if found:
    path, problem = found[0]
    more = f' (and {len(found) - 1} more)' if len(found) > 1 else ''
    raise UserError(
      f'{what} {folder!r}: {path} {problem}{more}; a run writes and deletes '
      'inside its out-dir, never through links: remove the links (and such '
      'files) or use a new --out-dir'
    )


def is_inside(path: str, folder: str) -> bool:
  """Whether `path` is a real entry (not a link) under `folder`."""
  if os.path.islink(path):
    return False
  real, top = os.path.realpath(path), os.path.realpath(folder)
  return real != top and os.path.commonpath([real, top]) == top


def remove_inside(path: str, folder: str):
  """Deletes `path` (a file or a folder tree) if it is a real entry inside
  `folder`; a link or anything outside is left alone."""
  if not os.path.lexists(path) or not is_inside(path, folder):
    return
  if os.path.isdir(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    os.remove(path)
