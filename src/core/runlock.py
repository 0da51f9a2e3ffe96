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

from src.core import rundir
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


def _read(path: str) -> dict | None:
  try:
    with open(path, encoding='utf-8') as f:
      holder = json.load(f)
  except (OSError, ValueError):
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
    holder = _read(path)
    if holder and holder.get('pid') == os.getpid():
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    if made:
      with contextlib.suppress(OSError):
        os.rmdir(out_dir)  # Only if nothing else was written.
