"""Reading an export's files: a file never through a link (`open_input`),
with a progress bar when big (`progress`), a JSON export as a stream
(`json_items`), a bounded line at a time (`lines`), and an export that is
a folder or a `.zip` (`ExportFiles`: Slack's workspace export, a Google
Takeout): listed without following links, each file read bounded, and
macOS's `__MACOSX/` and `._` copies left out."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import zipfile
import zlib

from src.core import bars, files
from src.core.errors import UserError
from src.data.importers import jsonstream

MAX_ENTRIES = 200_000  # Files in an export.


def files_in(root: str, limit: int) -> list[str]:
  """The regular files under the folder `root`, as `/`-separated paths
  relative to it, in sorted order; no link is followed or listed; more
  than `limit` is one line (an export given as its unzipped folder)."""
  names = []
  for folder, dirs, found in os.walk(root):
    dirs[:] = sorted(
      d for d in dirs if not os.path.islink(os.path.join(folder, d))
    )
    for name in sorted(found):
      path = os.path.join(folder, name)
      if stat.S_ISREG(os.lstat(path).st_mode):
        names.append(os.path.relpath(path, root).replace(os.sep, '/'))
      if len(names) > limit:
        raise UserError(
          f'{root}: more than {limit} files, more than an export holds; give '
          'the export itself'
        )
  return names


def zip_entries(raw) -> int | None:
  """How many entries a zip's central directory says it has, read from its
  end record before the directory itself is (which takes memory by the
  entry); None if the record cannot be read."""
  size = raw.seek(0, os.SEEK_END)
  tail = min(size, (1 << 16) + 22)
  raw.seek(size - tail)
  data = raw.read(tail)
  at = data.rfind(b'PK\x05\x06')
  if at < 0 or at + 22 > len(data):
    return None
  count = int.from_bytes(data[at + 10 : at + 12], 'little')
  if count == 0xFFFF:  # Zip64: the count is in the zip64 end record.
    at64 = data.rfind(b'PK\x06\x06', 0, at)
    if at64 < 0 or at64 + 40 > len(data):
      return None
    count = int.from_bytes(data[at64 + 32 : at64 + 40], 'little')
  return count


def open_input(path: str):
  """An export file opened for reading (binary): a regular file, never
  through a link; else a `UserError` that says what to give instead."""
  try:
    return files.open_regular(
      path,
      1 << 50,
      fix='give the exported chat file itself (cp -L copies what a link '
      'points to)',
    )
  except FileNotFoundError:
    raise UserError(f'{path}: no such file') from None


# Exports at least this big show a progress bar (on a terminal).
PROGRESS_MIN_BYTES = 16 * files.MB


class _Counted(io.RawIOBase):
  """A binary file whose reads advance a progress bar."""

  def __init__(self, f, bar):
    self.f, self.bar = f, bar

  def readable(self):
    return True

  def readinto(self, buffer):
    n = self.f.readinto(buffer)
    self.bar.update(n or 0)
    return n


@contextlib.contextmanager
def progress(binary, total: int, desc: str):
  """`binary` (an open binary file of `total` bytes) read through a
  progress bar on stderr, shown for big exports on a terminal."""
  bar = bars.byte_bar(total, desc, PROGRESS_MIN_BYTES)
  with bar:
    if bar.disable:
      yield binary
    else:
      yield io.BufferedReader(_Counted(binary, bar), 1 << 20)


def json_items(path: str, wanted: set[str], marks: set[str]):
  """A JSON export read as a stream, with progress (the steps every JSON
  importer shares): yields `(prefix, value, where)` for each object at a
  prefix in `wanted` (a message; `where` is `file[n]`, n counting them)
  and `(prefix, value, None)` for each mark (`jsonstream.objects`: a
  chat's name, or None where a list of messages starts)."""
  n = 0
  with (
    open_input(path) as raw,
    progress(raw, os.fstat(raw.fileno()).st_size, 'converting') as f,
  ):
    for prefix, value in jsonstream.objects(f, path, wanted, marks):
      if prefix in wanted:
        yield prefix, value, f'{path}[{n}]'
        n += 1
      else:
        yield prefix, value, None


def is_mac_copy(name: str) -> bool:
  """What a Mac adds when it zips a folder again: `__MACOSX/` and `._`
  files (resource forks), never a chat."""
  parts = name.replace('\\', '/').split('/')
  return '__MACOSX' in parts or parts[-1].startswith('._')


def lines(f, where: str, warn, limit: int):
  """`(number, text)` for each line of the binary file `f`; a line over
  limit bytes, or not UTF-8, is skipped with a warning."""
  n = 0
  while True:
    line = f.readline(limit + 1)
    if not line:
      return
    n += 1
    if len(line) > limit and not line.endswith(b'\n'):
      while line and not line.endswith(b'\n'):  # The rest of the line.
        line = f.readline(limit + 1)
      warn(f'{where}:{n}: left out: a line over {limit >> 20} MB')
      yield n, None
      continue
    try:
      yield n, line.decode('utf-8-sig' if n == 1 else 'utf-8')
    except UnicodeDecodeError:
      warn(f'{where}:{n}: left out: not UTF-8 text')
      yield n, None


class ExportFiles:
  """An export's files: `names` (relative, `/`-separated, sorted),
  `read_json(name)` and `open(name)`, every read bounded. `not_export`
  ends the line said when `path` is neither a folder nor a zip."""

  def __init__(self, path: str, not_export: str):
    self.path = path
    self.zip = self.raw = None
    if os.path.isdir(path) and not os.path.islink(path):
      names = files_in(path, MAX_ENTRIES)
    else:
      names = self._open_zip(not_export)
    self.names = sorted(n for n in names if not is_mac_copy(n))

  def _open_zip(self, not_export: str) -> list[str]:
    self.raw = open_input(self.path)
    try:
      if not zipfile.is_zipfile(self.raw):
        raise UserError(f'{self.path}: {not_export}')
      entries = zip_entries(self.raw)
      if entries is None or entries > MAX_ENTRIES:
        raise UserError(f'{self.path}: over {MAX_ENTRIES} files: not an export')
      self.raw.seek(0)
      self.zip = zipfile.ZipFile(self.raw)
      return [i.filename for i in self.zip.infolist() if not i.is_dir()]
    except (zipfile.BadZipFile, OSError) as e:
      self.close()
      raise UserError(
        f'{self.path}: a damaged zip ({e}); export again'
      ) from None
    except UserError:
      self.close()
      raise

  def close(self):
    if self.zip is not None:
      self.zip.close()
    if self.raw is not None:
      self.raw.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def where(self, name: str) -> str:
    return f'{self.path}:{name}'

  def size(self, name: str) -> int:
    if self.zip is not None:
      return self.zip.getinfo(name).file_size
    return os.lstat(os.path.join(self.path, name)).st_size

  @contextlib.contextmanager
  def open(self, name: str, limit: int):
    """The file `name` open for reading (binary), at most `limit` bytes
    (the size a zip's directory claims is checked before it is read, and
    a zip entry never yields more than it claims); a damaged entry, found
    while it is read, is one line."""
    if self.size(name) > limit:
      raise UserError(
        f'{self.where(name)}: over {limit >> 20} MB, more than an export '
        'holds; export again'
      )
    try:
      if self.zip is not None:
        with self.zip.open(name) as f:
          yield f
      else:
        with files.open_regular(
          os.path.join(self.path, name),
          limit,
          fix='give the export itself (cp -L copies what a link points to)',
        ) as f:
          yield f
    except (zipfile.BadZipFile, EOFError, zlib.error, RuntimeError) as e:
      # RuntimeError: an encrypted entry; NotImplementedError is a
      # RuntimeError: a compression zipfile cannot read.
      raise UserError(
        f'{self.where(name)}: cannot be read ({e}); export again'
      ) from None

  def read_json(self, name: str, limit: int):
    """The JSON value of the file `name`, or None when it is not valid."""
    with self.open(name, limit) as f:
      data = f.read(limit + 1)
    if len(data) > limit:
      raise UserError(
        f'{self.where(name)}: over {limit >> 20} MB; export again'
      )
    try:
      return files.parse_json(data.decode('utf-8-sig'), self.where(name))
    except (UserError, UnicodeDecodeError):
      return None
