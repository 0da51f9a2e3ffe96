"""Process settings applied before JAX starts (src.runtime.xla)."""

import os
from unittest import mock

from src.runtime import xla


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


def test_this_process_runs_with_them():
  # conftest imports `src` before JAX starts its backend.
  flags = os.environ['XLA_FLAGS'].split()
  assert set(xla.XLA_CPU_FLAGS) <= set(flags)
