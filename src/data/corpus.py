"""Corpus preparation: text files -> token cache in out-dir, read once.

The data is scanned once (content hash and cut points), the tokenizer is
trained on a sample of it (or reused), and every file is parsed and
tokenized in pieces of about `PIECE_BYTES`, cut at blank lines, in parallel
across the CPU cores. The result goes to `out-dir/cache/<name>-<key>/`:

- `tokens.bin`: the token stream, `uint16` (vocabularies up to 65535) or
  `int32`, memory-mapped when read;
- `roles.bin`: `uint8` per token (`tokenizer.ROLE_*`), which sets the loss
  weights;
- `conversations.npy`: `[n_conversations] int64` end offset of each
  conversation (after its EOS), for held-out splits by conversation;
- `meta.json`: sizes, dtype and the key, written last: a folder without it
  is unfinished and never read.

The key hashes the data's bytes, the tokenizer model and the parse
settings, so changed data or a changed tokenizer makes a new cache; a
later run or a resume with the same key reads no text at all. Peak memory
is one piece per worker plus the conversation index: the token arrays are
written to disk as they are produced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
import zlib
from concurrent import futures

import numpy as np

from src.core import bars, files, rundir
from src.core.errors import UserError
from src.data import chatformat, tokenizer

FORMAT_VERSION = 2  # 2: meta.json holds CRC-32s of the arrays.
PIECE_BYTES = 8 << 20  # Text per parse/tokenize task.
SAMPLE_BYTES = 32 << 20  # Text the tokenizer is trained on, at most.
PARALLEL_MIN_BYTES = 16 << 20  # Smaller corpora are tokenized in-process.
CACHE_DIR = rundir.CACHE
MAX_WARNINGS_SHOWN = 20


@dataclasses.dataclass(frozen=True)
class Piece:
  """Bytes `[start, end)` of a file, starting at line `first_line`."""

  path: str
  start: int
  end: int
  first_line: int
  whole_file: bool


@dataclasses.dataclass
class Scan:
  files: list[str]
  pieces: list[Piece]
  digest: str
  n_bytes: int


@dataclasses.dataclass
class Corpus:
  """A prepared corpus.

  Attributes:
    tokens: `[n]` uint16 or int32 token ids (memory-mapped).
    roles: `[n]` uint8 token roles (memory-mapped).
    conversation_ends: `[n_conversations]` int64 end offsets.
    folder: The cache folder.
    hit: Whether the cache already existed.
    n_turns: Turns in the corpus.
    n_bytes: Bytes of text read.
  """

  tokens: np.ndarray
  roles: np.ndarray
  conversation_ends: np.ndarray
  folder: str
  hit: bool
  n_turns: int
  n_bytes: int

  @property
  def n_conversations(self) -> int:
    return len(self.conversation_ends)


def _next_blank_line(f, pos: int, size: int) -> int:
  """The offset just after the first blank line at or after `pos`."""
  f.seek(pos)
  carry = b''
  base = pos
  while base < size:
    block = f.read(1 << 20)
    if not block:
      break
    data = carry + block
    found = [i for i in (data.find(b'\n\n'), data.find(b'\n\r\n')) if i >= 0]
    if found:
      i = min(found)
      return base - len(carry) + i + (2 if data[i + 1 : i + 2] == b'\n' else 3)
    carry = data[-2:]
    base += len(block)
  return size


def scan(files: list[str], piece_bytes: int | None = None) -> Scan:
  """Hashes the files and cuts them into pieces at blank lines.

  Raises:
    UserError: for an empty file.
  """
  piece_bytes = piece_bytes or PIECE_BYTES
  digest = hashlib.sha256(f'jade-corpus-{FORMAT_VERSION}'.encode())
  pieces, total = [], 0
  for path in files:
    size = os.path.getsize(path)
    digest.update(f'{os.path.basename(path)}\0{size}\0'.encode())
    cuts = [0]
    with open(path, 'rb') as f:
      while cuts[-1] + piece_bytes < size:
        cuts.append(_next_blank_line(f, cuts[-1] + piece_bytes, size))
      if cuts[-1] != size:
        cuts.append(size)
      f.seek(0)
      n = len(cuts) - 1
      first_lines, newlines, pos, has_text = [], 0, 0, False
      while block := f.read(1 << 22):
        digest.update(block)
        has_text = has_text or not block.isspace()
        end = pos + len(block)
        while len(first_lines) < n and cuts[len(first_lines)] <= end:
          cut = cuts[len(first_lines)] - pos
          first_lines.append(1 + newlines + block.count(b'\n', 0, cut))
        newlines += block.count(b'\n')
        pos = end
    if not has_text:
      raise UserError(
        f'{path}: the file is empty; add conversations or remove '
        'the file from the data folder'
      )
    for i in range(n):
      pieces.append(Piece(path, cuts[i], cuts[i + 1], first_lines[i], n == 1))
    total += size
  return Scan(files, pieces, digest.hexdigest(), total)


def read_piece(piece: Piece, parse_kwargs: dict, warnings: list):
  """Parses one piece into conversations (errors name file:line)."""
  with open(piece.path, 'rb') as f:
    f.seek(piece.start)
    raw = f.read(piece.end - piece.start)
  try:
    text = raw.decode('utf-8-sig' if piece.start == 0 else 'utf-8')
  except UnicodeDecodeError as e:
    line = piece.first_line + raw[: e.start].count(b'\n')
    raise UserError(
      f'{piece.path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x}); '
      're-save the file as UTF-8'
    ) from None
  return chatformat.parse_text(
    text,
    piece.path,
    warnings=warnings,
    line_offset=piece.first_line - 1,
    allow_empty=not piece.whole_file,
    **parse_kwargs,
  )


# Worker state (one tokenizer per process).
_worker: dict = {}


def _init_worker(model_proto: bytes, markers, parse_kwargs: dict):
  _worker['init'] = (model_proto, markers, parse_kwargs)
  _worker['tok'] = tokenizer.Tokenizer(model_proto, markers)
  _worker['parse'] = parse_kwargs


def _encode_task(init: tuple, piece: Piece):
  """A worker's task. The tokenizer comes with each task, built once a
  worker, not as the pool's `initargs`: those are written whole into a
  starting worker's pipe, and a worker that stopped as it started (a
  script re-run by `spawn`) left that write, and the run, waiting
  forever."""
  if _worker.get('init') != init:
    _init_worker(*init)
  return _encode_piece(piece)


def _encode_piece(piece: Piece, num_threads: int = 1):
  warnings: list = []
  conversations = read_piece(piece, _worker['parse'], warnings)
  ids, roles, lengths = _worker['tok'].encode_with_roles(
    conversations, num_threads=num_threads
  )
  n_turns = sum(len(c.turns) for c in conversations)
  return ids, roles, lengths, [str(w) for w in warnings], n_turns


def _encoded_pieces(scanned: Scan, tok, parse_kwargs, workers: int):
  """Yields each piece's encoding, in order."""
  init = (tok.model_proto, tok.markers, parse_kwargs)
  if workers <= 1 or len(scanned.pieces) < 2:
    _init_worker(*init)
    for piece in scanned.pieces:
      yield piece, _encode_piece(piece, num_threads=-1)
    return
  # Workers import `src.data` only: no Trax, no JAX. An executor, not a
  # `multiprocessing.Pool`: a worker that dies (killed for memory, or one
  # that cannot start) fails the map, where a Pool waited forever.
  pool = futures.ProcessPoolExecutor(
    workers, mp_context=multiprocessing.get_context('spawn')
  )
  task = functools.partial(_encode_task, init)
  try:
    try:
      yield from zip(scanned.pieces, pool.map(task, scanned.pieces))
    except OSError as e:
      # A worker that dies while the map still starts the others breaks
      # the pool under them: the next start fails on its closed queue.
      if not getattr(pool, '_broken', False):
        raise
      raise futures.process.BrokenProcessPool(str(e)) from e
  except futures.process.BrokenProcessPool as e:
    where = os.path.commonpath(scanned.files) if scanned.files else '.'
    raise UserError(
      f'{where}: a tokenizing process stopped before it finished '
      '(out of memory? killed?); nothing was cached: free some memory and '
      f'run again{_script_hint()}'
    ) from e
  finally:
    pool.shutdown(wait=True, cancel_futures=True)


def _script_hint() -> str:
  """Where the main module is a script of the user's (not the project's
  own, not an interactive session): the other way a worker stops as it
  starts, a script that trains at its top level (`spawn` re-runs it in
  every worker)."""
  main = sys.modules.get('__main__')
  if getattr(main, '__spec__', None) is not None:
    return ''  # `python -m MODULE` (pytest, a package's tool): not named.
  path = getattr(main, '__file__', None)
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  ours = {os.path.realpath(root), os.path.realpath(os.path.join(root, 'bench'))}
  if not path or os.path.dirname(os.path.realpath(path)) in ours:
    return ''
  return (
    f' (or {os.path.basename(path)} calls train() outside `if __name__ == '
    "'__main__':`)"
  )


def _sample(scanned: Scan, parse_kwargs) -> list:
  """Conversations from evenly spread pieces, about SAMPLE_BYTES of text."""
  pieces = scanned.pieces
  if scanned.n_bytes > SAMPLE_BYTES:
    share = SAMPLE_BYTES / scanned.n_bytes
    k = max(1, math.ceil(len(pieces) * share))
    picks = np.unique(np.linspace(0, len(pieces) - 1, k).round().astype(int))
    pieces = [pieces[i] for i in picks]
  conversations = []
  for piece in pieces:
    conversations.extend(read_piece(piece, parse_kwargs, []))
  return conversations


def cache_key(digest: str, tok, parse_kwargs: dict) -> str:
  h = hashlib.sha256()
  h.update(digest.encode())
  h.update(hashlib.sha256(tok.model_proto).hexdigest().encode())
  h.update(json.dumps(tok.markers.all()).encode())
  h.update(json.dumps({k: str(v) for k, v in parse_kwargs.items()}).encode())
  return h.hexdigest()[:20]


def _open(folder: str, meta: dict, n_bytes: int, hit: bool) -> Corpus:
  n = meta['tokens']
  if n:
    tokens = np.memmap(
      os.path.join(folder, 'tokens.bin'), meta['dtype'], 'r', shape=(n,)
    )
    roles = np.memmap(
      os.path.join(folder, 'roles.bin'), np.uint8, 'r', shape=(n,)
    )
  else:
    tokens, roles = np.zeros([0], np.int32), np.zeros([0], np.uint8)
  ends = np.load(os.path.join(folder, 'conversations.npy'))
  return Corpus(tokens, roles, ends, folder, hit, meta['turns'], n_bytes)


def _crc32(path: str) -> int:
  crc = 0
  with open(path, 'rb') as f:
    while block := f.read(8 << 20):
      crc = zlib.crc32(block, crc)
  return crc


def _read_meta(folder: str) -> tuple[dict | None, str]:
  """`(meta, '')` for a finished, intact cache folder, else `(None, why)`
  (why is '' when there is simply no usable cache)."""
  path = os.path.join(folder, 'meta.json')
  try:
    with open(path, encoding='utf-8') as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None, ''
  if meta.get('version') != FORMAT_VERSION:
    return None, ''
  try:
    for name, size in (
      ('tokens.bin', meta['tokens'] * np.dtype(meta['dtype']).itemsize),
      ('roles.bin', meta['tokens']),
    ):
      file = os.path.join(folder, name)
      if not os.path.exists(file) or os.path.getsize(file) != size:
        return None, f'{name} is missing or has the wrong size'
      if _crc32(file) != meta['crc32'][name]:
        return None, f'{name} does not match its checksum'
  except (KeyError, TypeError, ValueError):
    return None, 'meta.json is damaged'
  return meta, ''


def _write_warnings(folder: str, warnings: list[str]):
  """Shows the first MAX_WARNINGS_SHOWN warnings and keeps them all in
  the cache's warnings.txt."""
  for w in warnings[:MAX_WARNINGS_SHOWN]:
    print(w, file=sys.stderr)
  if len(warnings) > MAX_WARNINGS_SHOWN:
    print(
      f'... and {len(warnings) - MAX_WARNINGS_SHOWN} more warnings (all in '
      f'{os.path.join(folder, "warnings.txt")})',
      file=sys.stderr,
    )
  with open(os.path.join(folder, 'warnings.txt'), 'w', encoding='utf-8') as f:
    f.write(''.join(w + '\n' for w in warnings))


def _build(folder, scanned, tok, parse_kwargs, workers, key, log):
  """Tokenizes every piece into `folder` (a temporary folder)."""
  dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
  ends, n_tokens, n_turns, warnings = [], 0, 0, []
  crc = {'tokens.bin': 0, 'roles.bin': 0}
  t0 = time.time()
  bar = bars.byte_bar(scanned.n_bytes, 'tokenizing', PARALLEL_MIN_BYTES)
  with (
    open(os.path.join(folder, 'tokens.bin'), 'wb') as ftok,
    open(os.path.join(folder, 'roles.bin'), 'wb') as frole,
    bar,
  ):
    for piece, (ids, roles, lengths, warns, turns) in _encoded_pieces(
      scanned, tok, parse_kwargs, workers
    ):
      data = ids.astype(dtype).tobytes()
      ftok.write(data)
      crc['tokens.bin'] = zlib.crc32(data, crc['tokens.bin'])
      data = roles.astype(np.uint8).tobytes()
      frole.write(data)
      crc['roles.bin'] = zlib.crc32(data, crc['roles.bin'])
      ends.append(n_tokens + np.cumsum(lengths))
      n_tokens += len(ids)
      n_turns += turns
      warnings.extend(warns)
      bar.update(piece.end - piece.start)
  seconds = time.time() - t0
  ends = np.concatenate(ends) if ends else np.zeros([0], np.int64)
  np.save(os.path.join(folder, 'conversations.npy'), ends.astype(np.int64))
  _write_warnings(folder, warnings)
  meta = {
    'version': FORMAT_VERSION,
    'key': key,
    # The data's bytes and file names hashed (`scan`): what an export says
    # of the data, without naming it.
    'data_sha256': scanned.digest,
    'tokens': n_tokens,
    'dtype': np.dtype(dtype).name,
    'turns': n_turns,
    'conversations': len(ends),
    'bytes': scanned.n_bytes,
    'files': len(scanned.files),
    'seconds': round(seconds, 2),
    'warnings': len(warnings),
    'crc32': crc,
  }
  with open(os.path.join(folder, 'meta.json'), 'w', encoding='utf-8') as f:
    json.dump(meta, f, indent=2)
  if scanned.n_bytes >= PARALLEL_MIN_BYTES:
    log(
      f'tokenized {scanned.n_bytes / 1e6:.1f} MB in {seconds:.1f} s '
      f'({scanned.n_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s, '
      f'{workers} worker(s))'
    )
  return meta


def _tokenizer(out_dir, scanned, parse_kwargs, vocab_size: int, log):
  """The run's tokenizer: loaded from out-dir, or trained on a sample of
  the scanned data (not written yet)."""
  return tokenizer.load_or_train(
    out_dir,
    lambda: _sample(scanned, parse_kwargs),
    vocab_size,
    parse_kwargs['markers'],
    write=False,
    log=log,
    fingerprint=scanned.digest,
  )


def _into_place(out_dir: str, name: str, key: str, fill) -> dict | None:
  """Makes the cache `name-key` in a temporary folder (`fill(tmp)`: its
  meta, or None for nothing) and renames it into place, replacing older
  caches of `name`; a failure or None leaves nothing behind."""
  cache_root = os.path.join(out_dir, CACHE_DIR)
  made = [d for d in (out_dir, cache_root) if not os.path.exists(d)]
  tmp = os.path.join(cache_root, f'.tmp-{name}-{key}-{os.getpid()}')
  os.makedirs(tmp, exist_ok=True)
  meta = None
  try:
    meta = fill(tmp)
  finally:
    if meta is None:
      shutil.rmtree(tmp, ignore_errors=True)
      for d in reversed(made):  # Leave no trace of a failed first run.
        with contextlib.suppress(OSError):
          os.rmdir(d)
  if meta is None:
    return None
  for old in os.listdir(cache_root):
    if old.startswith(f'{name}-'):
      files.remove_inside(os.path.join(cache_root, old), out_dir)
  os.replace(tmp, os.path.join(cache_root, f'{name}-{key}'))
  return meta


def _build_cache(out_dir, name, key, scanned, tok, parse_kwargs, workers, log):
  """Builds the cache `name-key` (`_into_place`)."""
  if workers is None:
    workers = os.cpu_count() or 1
  if scanned.n_bytes < PARALLEL_MIN_BYTES:
    workers = 1
  return _into_place(
    out_dir,
    name,
    key,
    lambda tmp: _build(tmp, scanned, tok, parse_kwargs, workers, key, log),
  )


def _copy_limits(n_bytes: int) -> dict[str, int]:
  """The most each file of a cache of `n_bytes` of text may hold: a token
  is at least one byte of text (4 bytes each at most), a conversation at
  least one token; the slack covers a turn's markers."""
  slack = 1 << 20
  return {
    'meta.json': slack,
    'tokens.bin': 4 * n_bytes + slack,
    'roles.bin': n_bytes + slack,
    'conversations.npy': 8 * n_bytes + slack,
  }


def _copied(src: str, tmp: str, n_bytes: int, key: str) -> dict | None:
  """Copies the cache folder `src` into `tmp` (plain files only, each
  within `_copy_limits`) and checks the copy as a cache of our own is
  checked (`_read_meta`, and its key); None when `src` is not an intact
  cache of `key`."""
  try:
    for name, limit in _copy_limits(n_bytes).items():
      path = os.path.join(src, name)
      with (
        files.open_regular(path, limit) as f,
        open(os.path.join(tmp, name), 'xb') as out,
      ):
        left = limit + 1  # A file that grows while read is cut, then fails.
        while left > 0 and (block := f.read(min(8 << 20, left))):
          out.write(block)
          left -= len(block)
  except (OSError, UserError):
    return None
  meta, _ = _read_meta(tmp)
  return meta if meta is not None and meta.get('key') == key else None


def _reuse_cache(out_dir, name, key, reuse: str, n_bytes: int, log):
  """The cache `name-key` of the run folder `reuse` (a fine-tune's
  pretrained run: the same data read by the same tokenizer) copied into
  out-dir's cache, checked as our own: its meta, or None when `reuse`
  holds no intact one (then the cache is built)."""
  src = os.path.join(reuse, CACHE_DIR, f'{name}-{key}')
  if os.path.islink(src) or not os.path.isdir(src):
    return None
  meta = _into_place(
    out_dir, name, key, lambda tmp: _copied(src, tmp, n_bytes, key)
  )
  if meta is not None:
    log(f'token cache ({name}): copied from {reuse} (same data and tokenizer)')
  return meta


def prepare(
  data: str,
  out_dir: str,
  *,
  name: str = 'train',
  markers: chatformat.Markers,
  vocab_size: int,
  repeat_limit: int = 8,
  collapse: bool = False,
  tok: tokenizer.Tokenizer | None = None,
  workers: int | None = None,
  save_tokenizer: bool = True,
  reuse: str | None = None,
  log=print,
):
  """Prepares `data` (a file or folder) for training, reusing the cache.

  Args:
    data: The conversations (see `chatformat.list_files`).
    out_dir: The run folder; the cache goes to `out_dir/cache/`.
    name: Names the cache (`train`, `eval`); a new cache of the same name
      replaces the old one.
    markers: The format's markers.
    vocab_size: For a new tokenizer.
    repeat_limit: See `chatformat.parse_text`.
    collapse: See `chatformat.parse_text`.
    tok: Use this tokenizer (e.g. for a held-out folder) instead of the
      run's own (loaded from out-dir, or trained on a sample of `data`).
    workers: Processes for tokenizing (default: the CPU count).
    save_tokenizer: Save a newly trained tokenizer once the corpus is
      ready (False: the caller saves it, e.g. after a held-out corpus).
    reuse: A run folder (a fine-tune's pretrained run) whose cache of
      the same data and tokenizer is copied, not built again.
    log: Where messages go.

  Returns:
    `(tokenizer, Corpus)`. A newly trained tokenizer is saved to out-dir
    only once the whole corpus parsed without error.
  """
  parse_kwargs = dict(
    markers=markers, repeat_limit=repeat_limit, collapse=collapse
  )
  setting = 'eval-data' if name == 'eval' else 'data'
  scanned = scan(chatformat.list_files(data, setting))
  if tok is None:
    tok = _tokenizer(out_dir, scanned, parse_kwargs, vocab_size, log)
  key = cache_key(scanned.digest, tok, parse_kwargs)
  folder = os.path.join(out_dir, CACHE_DIR, f'{name}-{key}')
  meta = _read_cache(folder, log)
  hit = meta is not None
  if not hit and reuse:
    meta = _reuse_cache(out_dir, name, key, reuse, scanned.n_bytes, log)
  if meta is None:
    meta = _build_cache(
      out_dir, name, key, scanned, tok, parse_kwargs, workers, log
    )
  if save_tokenizer:
    tokenizer.save(out_dir, tok)
  return tok, _open(folder, meta, scanned.n_bytes, hit=hit)


def _read_cache(folder: str, log) -> dict | None:
  """The meta of the intact cache `folder`, or None (said when damaged)."""
  meta, problem = _read_meta(folder)
  if problem:
    log(
      f'note: the token cache in {folder} is damaged ({problem}); '
      'building it again'
    )
  return meta
