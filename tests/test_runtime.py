"""Process settings applied before JAX starts (src.runtime.xla)."""

import ctypes
import os
import subprocess
import sys
from unittest import mock

import pytest

from src.runtime import xla

from .conftest import ROOT, TINY_GIN


def test_our_xla_flags_are_added_to_the_users():
  env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  with mock.patch.dict(os.environ, env):
    xla.configure()
    flags = os.environ['XLA_FLAGS'].split()
  assert flags[0] == '--xla_force_host_platform_device_count=8'
  assert set(xla.XLA_CPU_FLAGS) <= set(flags)


def test_a_flag_the_user_set_is_kept():
  env = {'XLA_FLAGS': '--xla_cpu_experimental_ynn_fusion_type=dot'}
  with mock.patch.dict(os.environ, env):
    xla.configure()
    assert os.environ['XLA_FLAGS'] == env['XLA_FLAGS']


def test_bfloat16_products_turn_on_ynnpacks_products_where_the_cpu_has_them():
  for native, want in ((True, xla.YNN_PRODUCTS), (False, 'ynn_fusion_type= ')):
    with (
      mock.patch.dict(os.environ, {'XLA_FLAGS': '', xla.ADDED: ''}),
      mock.patch.object(xla, 'cpu_bf16_dot', return_value=native),
    ):
      xla.configure(bf16_products=True)
      assert want in os.environ['XLA_FLAGS'] + ' '
  users = {
    'XLA_FLAGS': '--xla_cpu_experimental_ynn_fusion_type=',
    xla.ADDED: '',
  }
  with (
    mock.patch.dict(os.environ, users),
    mock.patch.object(xla, 'cpu_bf16_dot', return_value=True),
  ):
    xla.configure(bf16_products=True)
    assert os.environ['XLA_FLAGS'] == users['XLA_FLAGS']


def test_a_process_started_by_ours_chooses_its_own_flags():
  """A bench's `train.py` inherits the flags its parent's `configure`
  added: they are not the user's, so it replaces them; the user's stay."""
  user = '--xla_force_host_platform_device_count=2'
  with (
    mock.patch.dict(os.environ, {'XLA_FLAGS': user, xla.ADDED: ''}),
    mock.patch.object(xla, 'cpu_bf16_dot', return_value=True),
  ):
    xla.configure()  # The parent: float32's flags.
    assert os.environ['XLA_FLAGS'] == f'{user} {xla.XLA_CPU_FLAGS[0]}'
    xla.configure(bf16_products=True)  # The child, asked for bfloat16.
    assert os.environ['XLA_FLAGS'] == f'{user} {xla.YNN_PRODUCTS}'


def test_the_runs_products_are_read_from_its_gin_text_as_data(tmp_path):
  from src.config import safegin

  gin = tmp_path / 'a.gin'
  gin.write_text("ReformerLM.d_model = 8\nprecision.products = 'auto'\n")
  name = 'precision.products'
  assert safegin.bound_value(str(gin), [], name) == 'auto'
  binds = ["jade.precision.products = 'bfloat16'", 'ReformerLM.n_layers = 2']
  assert safegin.bound_value(str(gin), binds, name) == 'bfloat16'
  assert safegin.bound_value(str(tmp_path / 'none.gin'), [], name) is None
  assert safegin.bound_value(TINY_GIN, [], name) is None
  gin.write_text('import os\n')  # Refused by the run's parse; not read here.
  assert safegin.bound_value(str(gin), [], name) is None


def test_ynnpack_products_are_read_from_the_flags():
  cases = {
    '': False,
    '--xla_cpu_experimental_ynn_fusion_type=': False,
    '--xla_cpu_experimental_ynn_fusion_type=eltwise,reduce': False,
    xla.YNN_PRODUCTS: True,
    '--xla_cpu_experimental_ynn_fusion_type=dot,eltwise': True,
    f'{xla.YNN_PRODUCTS} --xla_cpu_experimental_ynn_fusion_type=': False,
  }
  for flags, want in cases.items():
    with mock.patch.dict(os.environ, {'XLA_FLAGS': flags}):
      assert xla.ynn_products() is want, flags


def test_bfloat16_products_on_a_cpu_without_ynnpack_are_refused():
  """`precision.products = 'bfloat16'` on the CPU with Jade's flags
  (XLA's Eigen products would compute them in float32, slower): one line
  with the fix; with YNNPACK's products, or float32, the run goes on."""
  from src.core.errors import UserError
  from src.model import ginconf
  from src.training import plan

  setup = ginconf.parse(TINY_GIN, ("precision.products = 'bfloat16'",))
  off = {'XLA_FLAGS': '--xla_cpu_experimental_ynn_fusion_type='}
  with mock.patch.dict(os.environ, off):
    # Any CPU: the one line names what this CPU lacks.
    with mock.patch.object(xla, 'cpu_bf16_dot', return_value=True):
      with pytest.raises(UserError, match='XLA_FLAGS=--xla_cpu_experimental'):
        plan._check_products(setup, 'bfloat16')
    with mock.patch.object(xla, 'cpu_bf16_dot', return_value=False):
      with pytest.raises(
        UserError, match="no bfloat16 dot instructions.*'auto'"
      ):
        plan._check_products(setup, 'bfloat16')
    plan._check_products(setup, 'float32')
  with mock.patch.dict(os.environ, {'XLA_FLAGS': xla.YNN_PRODUCTS}):
    plan._check_products(setup, 'bfloat16')


def test_this_process_runs_with_them():
  # conftest imports `src` before JAX starts its backend.
  flags = os.environ['XLA_FLAGS'].split()
  assert set(xla.XLA_CPU_FLAGS) <= set(flags)


def test_free_memory_goes_back_after_long_steps_only():
  """`heap.release_after_step` trims glibc's heap after a long training
  step and leaves short steps alone (a trim costs them 5% or more); the
  trim really returns freed memory to the system."""
  from src.runtime import heap

  assert heap.release_after_step(heap.MIN_STEP_SECONDS / 10) is False
  if heap._trim() is None:
    pytest.skip('no glibc malloc_trim here')
  libc = ctypes.CDLL(None)
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]

  def resident():
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')

  # Many small blocks (the heap, not mmap), touched, then all but the
  # last freed: glibc keeps the hole below the last one.
  size, count = 64 * 1024, 1600  # ~100 MB
  blocks = [libc.malloc(size) for _ in range(count)]
  for b in blocks:
    ctypes.memset(b, 1, size)
  for b in blocks[:-1]:
    libc.free(b)
  before = resident()
  assert heap.release_after_step(heap.MIN_STEP_SECONDS) is True
  after = resident()
  libc.free(blocks[-1])
  assert before - after > 50 * 1024 * 1024


KEPT_SCRATCH = r"""
import ctypes, resource, sys, threading
sys.path.insert(0, sys.argv[1])
from src.runtime import heap

kept = heap.keep_scratch()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 100 * 1024 * 1024  # A walkthrough step's scratch: ~100 MB.
faults = []

def step():
  for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

worker = threading.Thread(target=step)  # As XLA's threads allocate.
worker.start()
worker.join()
print(kept, faults[-1])
"""


@pytest.mark.skipif(
  not sys.platform.startswith('linux'), reason="glibc's mallopt is Linux's"
)
@pytest.mark.parametrize('switch', ['on', 'off'])
def test_a_steps_scratch_is_kept_and_not_faulted_in_again(switch):
  """`heap.keep_scratch` (every training process, from `bootstrap`): a
  100 MB block freed and asked for again by another thread comes back
  without a page fault; with `JADE_HEAP=off` glibc maps it fresh and the
  kernel zeroes its ~25,600 pages again, every time."""
  from src.runtime import heap

  if heap._glibc('mallopt', ctypes.c_int, ctypes.c_int) is None:
    pytest.skip('no glibc mallopt here')
  env = {**os.environ, 'JADE_HEAP': switch}
  out = subprocess.run(
    [sys.executable, '-c', KEPT_SCRATCH, ROOT],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()
  kept, faults = out[0] == 'True', int(out[1])
  if switch == 'on':
    assert kept and faults < 1000
  else:
    assert not kept and faults > 20000
