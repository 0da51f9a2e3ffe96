"""The files of an export that is a folder or a `.zip` (Slack's workspace
export, a Google Takeout): listed without following links, each read
bounded, and macOS's `__MACOSX/` and `._` copies left out."""

from __future__ import annotations

import contextlib
import os
import zipfile
import zlib

from src.core import files
from src.core.errors import UserError
from src.data.importers import chatlog

MAX_ENTRIES = 200_000  # Files in an export.


def is_mac_copy(name: str) -> bool:
  """`__MACOSX/...` and `._name`: what a Mac adds when it re-zips."""
  return name.startswith('__MACOSX/') or name.split('/')[-1].startswith('._')


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
      names = chatlog.files_in(path, MAX_ENTRIES)
    else:
      names = self._open_zip(not_export)
    self.names = sorted(n for n in names if not is_mac_copy(n))

  def _open_zip(self, not_export: str) -> list[str]:
    self.raw = chatlog.open_input(self.path)
    try:
      if not zipfile.is_zipfile(self.raw):
        raise UserError(f'{self.path}: {not_export}')
      entries = chatlog.zip_entries(self.raw)
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
