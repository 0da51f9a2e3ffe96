"""Process settings that must be in place before JAX starts its backend.

`configure()` runs once, when the `src` package is imported, so training,
evaluation, the chat and the benchmarks all run with the same settings.

XLA CPU flags (`XLA_CPU_FLAGS`), measured in BENCHMARKS.md:

- `--xla_cpu_experimental_ynn_fusion_type=` (empty: no YNNPACK fusions).
  jaxlib 0.10's CPU backend hands matrix products to YNNPACK fusions by
  default; with Eigen's instead, a 32k-token training step of the benchmark
  model is ~4% faster and its peak memory 0.8 GB (23%) lower.

A flag the user already set in `XLA_FLAGS` (any value) is left as it is.
bfloat16 products (`precision.products`) run only in YNNPACK's products
on the CPU (Eigen's upcast them to float32, slower than float32 itself):
`configure(bf16_products=True)` (train.py, when the run's gin asks for
them) turns YNNPACK's individual products on instead, where the CPU has
bfloat16 dot instructions (`cpu_bf16_dot`); `ynn_products()` says whether
they are on (or `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=
individual_dot`, by hand).

The compilation cache is `src.runtime.compile_cache`.
"""

from __future__ import annotations

import functools
import os

YNN_FLAG = '--xla_cpu_experimental_ynn_fusion_type'
XLA_CPU_FLAGS = (YNN_FLAG + '=',)
YNN_PRODUCTS = YNN_FLAG + '=individual_dot'  # The flag that turns them on.
ADDED = 'JADE_XLA_FLAGS_ADDED'  # The flags `configure` added, not the user's.


def configure(bf16_products: bool = False):
  """Adds our XLA flags to `XLA_FLAGS` unless the user set them;
  `bf16_products`: YNNPACK's individual products, where the CPU has
  bfloat16 dot instructions. The flags added are named in `ADDED`, so a
  process this one starts (a bench's `train.py`) tells them from the
  user's and chooses its own."""
  ours = set(os.environ.get(ADDED, '').split())
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split() if f not in ours]
  wanted = XLA_CPU_FLAGS
  if bf16_products and cpu_bf16_dot():
    wanted = (YNN_PRODUCTS,)
  added = []
  for flag in wanted:
    name = flag.split('=')[0]
    if not any(f.startswith(name + '=') for f in flags):
      flags.append(flag)
      added.append(flag)
  os.environ['XLA_FLAGS'] = ' '.join(flags)
  os.environ[ADDED] = ' '.join(added)


def ynn_products() -> bool:
  """Whether XLA's CPU backend hands matrix products to YNNPACK (the
  last `--xla_cpu_experimental_ynn_fusion_type` in `XLA_FLAGS` names
  `dot` or `individual_dot`)."""
  kinds = ''
  for flag in os.environ.get('XLA_FLAGS', '').split():
    if flag.startswith(YNN_FLAG + '='):
      kinds = flag.split('=', 1)[1]
  return any(k in ('dot', 'individual_dot') for k in kinds.split(','))


@functools.cache
def cpu_bf16_dot() -> bool:
  """Whether this CPU has bfloat16 dot instructions (x86's AVX512-BF16 or
  AMX-BF16: Linux's `/proc/cpuinfo` flags; False where it cannot say)."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
      for line in f:
        if line.startswith('flags'):
          return bool({'avx512_bf16', 'amx_bf16'} & set(line.split()))
  except OSError:
    pass
  return False
