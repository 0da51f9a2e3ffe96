"""One training run per out-dir: a lock file held for the run.

`OUT_DIR/train.lock` holds the pid, host and start time of the run using
the folder; it is created exclusively (`O_EXCL`), so of two runs started
at once exactly one gets it. A second run refuses with a line naming the
holder. A lock left by a run that died (its pid no longer alive on this
host) is taken over with a note; one from another host is never guessed
about: the message says how to remove it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from src.core import files, rundir
from src.core.errors import UserError

LOCK_FILE = rundir.LOCK


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Someone else's process: alive.
    return True
  return True


# A lock file holds one short JSON line.
MAX_LOCK_BYTES = 4096


def _read(path: str) -> dict | None:
  """The holder a lock file names; None if it is gone or not readable as
  one. A lock that is not a small regular file (a FIFO would block the
  read forever, a link would be followed) is refused: no run made it."""
  try:
    data = files.read_regular(path, MAX_LOCK_BYTES)
  except FileNotFoundError:
    return None
  except UserError:
    raise UserError(
      f'{path}: is not a lock file a run writes (a link, a FIFO or device, '
      'or too big); delete it, or use another --out-dir'
    ) from None
  try:
    holder = json.loads(data.decode('utf-8'))
  except ValueError:
    return None
  return holder if isinstance(holder, dict) else None


def _try_create(path: str) -> bool:
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  me = {
    'pid': os.getpid(),
    'host': socket.gethostname(),
    'since': time.strftime('%Y-%m-%d %H:%M:%S'),
  }
  with os.fdopen(fd, 'w', encoding='utf-8') as f:
    json.dump(me, f)
  return True


@contextlib.contextmanager
def held(out_dir: str, log=print):
  """Holds `out_dir`'s lock for the `with` block.

  Raises:
    UserError: another live run holds it.
  """
  made = not os.path.isdir(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, LOCK_FILE)
  try:
    for _ in range(3):
      if _try_create(path):
        break
      holder = _read(path)
      if holder is None:  # Being written this instant, or damaged.
        time.sleep(0.2)
        holder = _read(path) or {}
      pid, host = holder.get('pid'), holder.get('host')
      if (
        isinstance(pid, int)
        and host == socket.gethostname()
        and not _alive(pid)
      ) or not holder:
        log(
          f'note: taking over the lock of a run that is gone ({path}: '
          f'pid {pid} on {host})'
        )
        with contextlib.suppress(FileNotFoundError):
          os.remove(path)
        continue
      raise UserError(
        f'{out_dir}: another training run is using this out-dir (pid {pid} '
        f'on {host}, since {holder.get("since", "?")}); wait for it to '
        f'finish or use another --out-dir (if no such run is alive, delete '
        f'{path})'
      )
    else:
      raise UserError(f'{path}: could not take the lock; try again')
  except BaseException:
    if made:
      with contextlib.suppress(OSError):
        os.rmdir(out_dir)
    raise
  try:
    yield
  finally:
    holder = None
    with contextlib.suppress(UserError):
      holder = _read(path)
    if holder and holder.get('pid') == os.getpid():
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    if made:
      with contextlib.suppress(OSError):
        os.rmdir(out_dir)  # Only if nothing else was written.
