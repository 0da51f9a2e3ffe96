"""A run's checkpoint files: their step, and whole-or-absent snapshots.

Trax writes a checkpoint as three files; `seal` records them in a
manifest and keeps the last ones as snapshots, `verify` checks them (and
falls back to the newest intact snapshot), `restore` puts one back.
`check_file` and `check_listing` are the file checks exports use too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile

from src.core import files, rundir
from src.core.errors import UserError
from src.core.safe_pickle import check_meta, is_int, read_pickle

CHECKPOINT = rundir.CHECKPOINT
WEIGHTS = rundir.WEIGHTS


def read_meta(model_dir: str) -> dict | None:
  """The checkpoint's metadata (step, history, ...), or None if absent."""
  path = os.path.join(model_dir, CHECKPOINT)
  if not os.path.lexists(path):
    return None
  return check_meta(read_pickle(path), path)


def latest_step(model_dir: str) -> int:
  """The step of the saved checkpoint; 0 if there is none."""
  meta = read_meta(model_dir)
  return int(meta['step']) if meta else 0


def check_listing(listing):
  """A manifest's or export.json's `files`: name -> {size, sha256}."""
  if not isinstance(listing, dict):
    raise TypeError(f'files is a {type(listing).__name__}, not an object')
  for name, want in listing.items():
    if not (
      isinstance(want, dict)
      and is_int(want.get('size'))
      and want['size'] >= 0
      and isinstance(want.get('sha256'), str)
    ):
      raise ValueError(f'the entry of {name!r} is not {{size, sha256}}')
    if os.path.basename(name) != name or name in ('.', '..'):
      raise ValueError(f'{name!r} is not a file name')


def check_file(path: str, want: dict, keep: dict | None = None) -> str:
  """'' if `path` is a regular file of the listed size and checksum, else
  what is wrong. The file is read through one descriptor; with `keep`,
  the bytes that were hashed are kept there (by path) to be parsed."""
  name = os.path.basename(path)
  if not os.path.lexists(path):
    return f'{name} is missing'
  if os.path.islink(path) or not os.path.isfile(path):
    return f'{name} is not a regular file'
  try:
    with files.open_regular(path, 1 << 50) as f:
      size = f.seek(0, os.SEEK_END)  # Pinned bytes have no descriptor.
      f.seek(0)
      if size != want['size']:
        return f'{name} has {size} bytes, not {want["size"]}'
      chunks = []
      found = digest(f, chunks if keep is not None else None)
  except UserError:
    return f'{name} is not a regular file'
  if found != want['sha256']:
    return f'{name} does not match its checksum'
  if keep is not None:
    keep[path] = b''.join(chunks)
  return ''


# ---- Whole-or-absent checkpoints -------------------------------------------
#
# Trax writes a checkpoint as three files, each through a temporary file and
# a rename, one after another; a kill between the renames leaves files of two
# different steps. After Trax has written them, `seal` records their sizes
# and SHA-256 in `model.manifest.json` (written last, atomically) and links
# them, with the manifest, into `checkpoints/step-N/` (hard links: no extra
# disk; Trax's next save replaces the top-level files, not these). The last
# `keep` snapshots are kept. `verify` checks the top-level set against its
# manifest; a damaged or mixed set falls back to the newest intact
# snapshot, and `restore` copies that one back before training resumes.

MANIFEST = rundir.MANIFEST
SNAPSHOTS = rundir.SNAPSHOTS
_SLOTS = re.compile(r'^model\.opt_slots\d+\.npy\.gz$')


def checkpoint_files(folder: str) -> list[str]:
  """Names of the checkpoint files present in `folder`."""
  try:
    names = os.listdir(folder)
  except OSError:
    return []
  slots = sorted(n for n in names if _SLOTS.match(n))
  return [n for n in (CHECKPOINT, WEIGHTS) if n in names] + slots


def digest(f, chunks: list | None = None) -> str:
  """SHA-256 of an open file read to its end; `chunks`, if given, gets
  the bytes that were hashed."""
  h = hashlib.sha256()
  while block := f.read(1 << 22):
    h.update(block)
    if chunks is not None:
      chunks.append(block)
  return h.hexdigest()


def sha256(path: str) -> str:
  with files.open_regular(path, 1 << 50) as f:
    return digest(f)


def write_json(path: str, obj):
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=folder, prefix='.' + os.path.basename(path))
  with os.fdopen(fd, 'w', encoding='utf-8') as f:
    json.dump(obj, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _manifest(path: str) -> dict | None:
  """A manifest with the shape `seal` writes, else None."""
  manifest = files.read_json(path)
  try:
    if not isinstance(manifest, dict):
      return None
    if not is_int(manifest.get('step')) or manifest['step'] < 0:
      return None
    tokens = manifest.get('tokens', 0)
    if tokens is not None and not is_int(tokens):
      return None
    check_listing(manifest.get('files'))
  except (ValueError, TypeError):
    return None
  return manifest


def read_manifest(folder: str) -> dict | None:
  """`model.manifest.json` of a checkpoint folder, or None (missing or not
  what `seal` writes)."""
  try:
    return _manifest(os.path.join(folder, MANIFEST))
  except (OSError, UserError):
    return None


def snapshots(out_dir: str) -> list[tuple[int, str]]:
  """`(step, folder)` of the kept snapshots, newest first."""
  root = os.path.join(out_dir, SNAPSHOTS)
  found = []
  for name in os.listdir(root) if os.path.isdir(root) else []:
    m = re.fullmatch(r'step-(\d+)', name)
    if m:
      found.append((int(m.group(1)), os.path.join(root, name)))
  return sorted(found, reverse=True)


def seal(out_dir: str, step: int, keep: int = 2, extra: dict | None = None):
  """Records the checkpoint Trax just wrote (see above) and keeps `keep`.
  `extra`: more facts for the manifest (e.g. `tokens` trained on)."""
  names = checkpoint_files(out_dir)
  manifest = {
    **(extra or {}),
    'step': int(step),
    'files': {
      n: {
        'size': os.path.getsize(os.path.join(out_dir, n)),
        'sha256': sha256(os.path.join(out_dir, n)),
      }
      for n in names
    },
  }
  root = os.path.join(out_dir, SNAPSHOTS)
  os.makedirs(root, exist_ok=True)
  for name in os.listdir(root):  # Left by a run killed while sealing.
    if name.startswith('.tmp-step-'):
      files.remove_inside(os.path.join(root, name), out_dir)
  tmp = os.path.join(root, f'.tmp-step-{step}-{os.getpid()}')
  os.makedirs(tmp)
  for n in names:
    try:
      os.link(os.path.join(out_dir, n), os.path.join(tmp, n))
    except OSError:  # A file system without hard links.
      shutil.copy2(os.path.join(out_dir, n), os.path.join(tmp, n))
  write_json(os.path.join(tmp, MANIFEST), manifest)
  final = os.path.join(root, f'step-{step}')
  files.remove_inside(final, out_dir)
  os.replace(tmp, final)
  write_json(os.path.join(out_dir, MANIFEST), manifest)
  for _, old in snapshots(out_dir)[max(keep, 1) :]:
    files.remove_inside(old, out_dir)


def check(folder: str, only=None, keep=None) -> tuple[dict | None, str]:
  """`(manifest, '')` if `folder` holds an intact checkpoint, else
  `(None, what is wrong)`. `only`: check just these of its files (reading
  the weights needs no optimizer slots). `keep`: a dict that receives the
  checked bytes of an intact checkpoint's files, by path."""
  path = os.path.join(folder, MANIFEST)
  try:
    manifest = _manifest(path)
  except (OSError, UserError):
    return None, f'{path} is missing or damaged'
  if manifest is None:
    return None, f'{path} is missing or damaged'
  files = manifest['files']
  present = set(checkpoint_files(folder))
  if only is not None:
    if not set(only) <= set(files) & present:
      return None, f'one of {", ".join(only)} is missing'
    files = {n: files[n] for n in only}
  elif set(files) != present or CHECKPOINT not in files:
    return None, 'its files are not the ones the manifest lists'
  checked = {} if keep is not None else None
  for name, want in files.items():
    problem = check_file(os.path.join(folder, name), want, keep=checked)
    if problem:
      return None, problem
  if keep is not None:
    keep.update(checked)
  return manifest, ''


def exists(out_dir: str) -> bool:
  """Whether `out_dir` holds a checkpoint (intact or not) that `verify`
  would resume from or refuse: checkpoint files, a manifest or a kept
  snapshot."""
  return bool(
    checkpoint_files(out_dir)
    or snapshots(out_dir)
    or os.path.exists(os.path.join(out_dir, MANIFEST))
  )


def verify(out_dir: str, only=None, keep=None):
  """Finds the checkpoint to resume from or read (`only`: the files the
  reader needs, see `_check`; default all; `keep`: a dict that receives
  the checked bytes of the files of the checkpoint found, by path, to be
  read under `files.pinned`).

  Returns:
    `(step, folder, problem)`: `folder` holds an intact checkpoint of
    `step` (out-dir itself, or a snapshot when the top-level one is
    damaged, then `problem` says what is wrong with it); `(0, None, '')`
    when there is no checkpoint. A run written before manifests existed
    (no manifest, no snapshots) is returned as it is.

  Raises:
    UserError: the checkpoint is damaged and no intact snapshot is kept.
  """
  top = checkpoint_files(out_dir)
  kept = snapshots(out_dir)
  has_manifest = os.path.exists(os.path.join(out_dir, MANIFEST))
  if not exists(out_dir):
    return 0, None, ''
  if not has_manifest and not kept:  # An older run: no manifest to check.
    for name in (CHECKPOINT, WEIGHTS):
      if name not in top:
        raise UserError(
          f'{os.path.join(out_dir, name)}: missing while {top[0]} is '
          'there; the checkpoint is incomplete. Delete the model.* files '
          'to start over'
        )
    return latest_step(out_dir), out_dir, ''
  manifest, problem = check(out_dir, only, keep)
  if manifest is not None:
    return int(manifest['step']), out_dir, ''
  for step, folder in kept:
    if check(folder, only, keep)[0] is not None:
      return step, folder, problem
  raise UserError(
    f'{out_dir}: the checkpoint is damaged ({problem}) and no intact '
    f'earlier one is kept in {SNAPSHOTS}/; restore the folder from a '
    'backup or train into a new out-dir'
  )


def restore(out_dir: str, folder: str):
  """Copies the intact checkpoint in `folder` (a snapshot) back to the top
  level of `out_dir`, manifest last; stray files of the damaged set go."""
  for n in checkpoint_files(out_dir):
    if n not in checkpoint_files(folder):
      files.remove_inside(os.path.join(out_dir, n), out_dir)
  for n in checkpoint_files(folder):
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f'.{n}.restore-')
    try:
      with (
        files.open_regular(os.path.join(folder, n), 1 << 50) as src,
        os.fdopen(fd, 'wb') as dst,
      ):
        shutil.copyfileobj(src, dst, 1 << 22)
      os.replace(tmp, os.path.join(out_dir, n))
    except BaseException:
      if os.path.lexists(tmp):
        os.remove(tmp)
      raise
  write_json(
    os.path.join(out_dir, MANIFEST),
    files.read_json(os.path.join(folder, MANIFEST)),
  )


def discard(out_dir: str, step: int) -> int:
  """Takes back the checkpoint of `step` (found bad after it was saved):
  the newest earlier intact snapshot becomes the checkpoint again, or, if
  there is none, the checkpoint files go. Returns the step now saved."""
  files.remove_inside(os.path.join(out_dir, SNAPSHOTS, f'step-{step}'), out_dir)
  for earlier, folder in snapshots(out_dir):
    if earlier < step and check(folder)[0] is not None:
      restore(out_dir, folder)
      return earlier
  for n in checkpoint_files(out_dir) + [MANIFEST]:
    files.remove_inside(os.path.join(out_dir, n), out_dir)
  return 0
