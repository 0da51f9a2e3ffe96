"""The compilation cache (src.runtime.compile_cache): used only where no one
else can write, entries bound to their keys, damaged ones replaced once."""

import os
import shutil
import tempfile
import time

from src.runtime import compile_cache as cc

from .conftest import run_script


def _opened(monkeypatch, **env):
  for name in ('JADE_COMPILE_CACHE', 'XDG_CACHE_HOME'):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  cache = cc.open_cache()
  if cache is not None:
    os.close(cache.fd)
  return cache


def test_the_cache_is_the_users_own_folder(safe_dir, monkeypatch):
  assert _opened(monkeypatch, JADE_COMPILE_CACHE='off') is None
  cache = _opened(monkeypatch, XDG_CACHE_HOME=os.path.join(safe_dir, 'c'))
  top = os.path.join(safe_dir, 'c', 'jade-v8', 'jax')
  # One subfolder per jaxlib and CPU (a shared home, a reinstalled jaxlib).
  assert os.path.dirname(cache.path) == top
  assert os.path.basename(cache.path).startswith('jaxlib-')
  for folder in (top, cache.path):
    assert os.stat(folder).st_mode & 0o777 == 0o700


def test_a_folder_others_can_write_or_a_link_is_never_used(
  safe_dir, tmp_path, monkeypatch
):
  # Under a world-writable parent (/tmp, where tmp_path is): unused, even
  # when the folder itself is private.
  private = tmp_path / 'private'
  private.mkdir(mode=0o700)
  assert _opened(monkeypatch, XDG_CACHE_HOME=str(private)) is None
  assert _opened(monkeypatch, JADE_COMPILE_CACHE=str(private / 'c')) is None
  # A world-writable folder on the way, under a private one.
  shared = os.path.join(safe_dir, 'shared')
  os.mkdir(shared)
  os.chmod(shared, 0o777)
  assert _opened(monkeypatch, XDG_CACHE_HOME=shared) is None
  os.chmod(shared, 0o1777)  # Sticky does not make it private.
  assert _opened(monkeypatch, XDG_CACHE_HOME=shared) is None
  # The cache's own folders linked elsewhere (here to a world-writable
  # one), or one of them world-writable: unused.
  base = os.path.join(safe_dir, 'base')
  os.mkdir(base)
  os.symlink(shared, os.path.join(base, 'jade-v8'))
  assert _opened(monkeypatch, XDG_CACHE_HOME=base) is None
  os.symlink(shared, os.path.join(safe_dir, 'link'))
  link = os.path.join(safe_dir, 'link')
  assert _opened(monkeypatch, JADE_COMPILE_CACHE=link) is None
  mine = os.path.join(safe_dir, 'mine')
  assert _opened(monkeypatch, JADE_COMPILE_CACHE=mine) is not None
  os.chmod(mine, 0o777)
  assert _opened(monkeypatch, JADE_COMPILE_CACHE=mine) is None


def test_a_named_folder_that_is_refused_says_so_in_one_line(
  tmp_path, monkeypatch, capsys
):
  """A folder the user named (`JADE_COMPILE_CACHE`) and the cache refuses
  is one line on stderr (every start then compiles again); the default
  folder refused stays quiet unless `JADE_VERBOSE=1`."""
  monkeypatch.delenv('JADE_VERBOSE', raising=False)
  private = tmp_path / 'private'
  private.mkdir(mode=0o700)
  named = str(private / 'c')
  assert _opened(monkeypatch, JADE_COMPILE_CACHE=named) is None
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f'JADE_COMPILE_CACHE={named}')
  assert 'compiles again' in lines[0] and 'JADE_COMPILE_CACHE=off' in lines[0]
  assert _opened(monkeypatch, XDG_CACHE_HOME=str(private)) is None
  assert capsys.readouterr().err == ''
  assert _opened(monkeypatch, JADE_COMPILE_CACHE='off') is None
  assert capsys.readouterr().err == ''


def test_a_folder_swapped_after_the_check_is_not_followed(safe_dir):
  fd = cc.open_chain(safe_dir, ['c', 'sub'])
  cache = cc.FolderCache(fd, os.path.join(safe_dir, 'c', 'sub'))
  cache.put('jit_a-1', b'program')
  held = os.path.join(safe_dir, 'c', 'sub')
  os.rename(held, held + '.old')  # Someone swaps the checked folder ...
  planted = tempfile.mkdtemp(dir=safe_dir)
  os.symlink(planted, held)
  shutil.copy(os.path.join(held + '.old', 'jit_a-1'), planted)
  cache.put('jit_b-2', b'other')
  assert cache.get('jit_a-1') == b'program'
  assert os.listdir(planted) == ['jit_a-1']  # ... the cache never went there.
  os.close(fd)


def test_entries_are_bound_to_their_keys_and_bounded(safe_dir):
  fd = cc.open_chain(safe_dir, ['c'])
  cache = cc.FolderCache(fd, os.path.join(safe_dir, 'c'), max_bytes=400)
  cache.put('jit_a-1', b'a' * 100)
  cache.put('jit_b-2', b'b' * 100)
  assert cache.get('jit_a-1') == b'a' * 100
  folder = os.path.join(safe_dir, 'c')
  # Another key's program under this key's name: removed, a miss.
  shutil.copy(os.path.join(folder, 'jit_b-2'), os.path.join(folder, 'jit_a-1'))
  assert cache.get('jit_a-1') is None
  assert not os.path.exists(os.path.join(folder, 'jit_a-1'))
  assert cache.replaced == 1
  # A key that is no plain file name gets a hashed one.
  cache.put('../x', b'c')
  assert cache.get('../x') == b'c' and not os.path.exists(safe_dir + '/x')
  # Over max_bytes: the least recently used entries go first.
  old = time.time() - 100
  os.utime(os.path.join(folder, 'jit_b-2'), (old, old))
  for i in range(3):
    cache.put(f'jit_n-{i}', b'n' * 100)
  names = os.listdir(folder)
  assert 'jit_b-2' not in names and 'jit_n-2' in names
  assert sum(size for _, size, _ in cache.entries()) <= 400
  os.close(fd)


def test_old_subfolders_are_pruned(safe_dir):
  fd = cc.open_chain(safe_dir, ['jax'])
  for name in ('jaxlib-old', 'jaxlib-recent', 'jaxlib-now'):
    os.makedirs(os.path.join(safe_dir, 'jax', name, 'x'))
  old = time.time() - (cc.PRUNE_DAYS + 1) * 86400
  os.utime(os.path.join(safe_dir, 'jax', 'jaxlib-old'), (old, old))
  os.utime(os.path.join(safe_dir, 'jax', 'jaxlib-now'), (old, old))
  cc.prune(fd, 'jaxlib-now')
  assert sorted(os.listdir(os.path.join(safe_dir, 'jax'))) == [
    'jaxlib-now',
    'jaxlib-recent',
  ]
  os.close(fd)


_PROGRAM = """
from src import runtime
runtime.bootstrap(light=True)
import jax, jax.numpy as jnp
print(float(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).sum()))
"""


def _start(env):
  run = run_script(['-c', _PROGRAM], env=env, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  return run.stdout, [x for x in run.stderr.splitlines() if x.strip()]


def _entries(folder):
  sub = os.path.join(folder, os.listdir(folder)[0])
  return {n: open(os.path.join(sub, n), 'rb').read() for n in os.listdir(sub)}


def test_damaged_entries_are_replaced_once_quietly(safe_dir):
  folder = os.path.join(safe_dir, 'cache')
  env = {'JADE_COMPILE_CACHE': folder, 'JADE_VERBOSE': ''}
  answer, lines = _start(env)
  first = _entries(folder)
  assert first and lines == []
  sub = os.path.join(folder, os.listdir(folder)[0])
  names = sorted(first)
  for i, name in enumerate(names):  # Every entry damaged, in three ways.
    data = first[name]
    if i % 3 == 0:
      data = data[:-1] + bytes([data[-1] ^ 1])
    elif i % 3 == 1:
      data = first[names[(i + 1) % len(names)]]  # Another program.
    else:
      # Bound to its key, but not a program JAX can load.
      value = b'not a program'
      data = cc.MAGIC + cc._digest(name, value) + value
    with open(os.path.join(sub, name), 'wb') as f:
      f.write(data)
  again, lines = _start(env)
  assert again == answer
  assert len(lines) <= 2 and 'compiled again' in lines[0], lines
  third, lines = _start(env)
  assert third == answer and lines == []
  assert sorted(_entries(folder)) == names
