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
`ynn_products()` says whether the user turned those on
(`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot`).

The compilation cache is `src.runtime.compile_cache`.
"""

from __future__ import annotations

import os

YNN_FLAG = '--xla_cpu_experimental_ynn_fusion_type'
XLA_CPU_FLAGS = (YNN_FLAG + '=',)
YNN_PRODUCTS = YNN_FLAG + '=individual_dot'  # The flag that turns them on.


def configure():
  """Adds our XLA flags to `XLA_FLAGS` unless the user set them."""
  flags = os.environ.get('XLA_FLAGS', '')
  for flag in XLA_CPU_FLAGS:
    name = flag.split('=')[0]
    if name + '=' not in flags:
      flags = f'{flags} {flag}'.strip()
  os.environ['XLA_FLAGS'] = flags


def ynn_products() -> bool:
  """Whether XLA's CPU backend hands matrix products to YNNPACK (the
  last `--xla_cpu_experimental_ynn_fusion_type` in `XLA_FLAGS` names
  `dot` or `individual_dot`)."""
  kinds = ''
  for flag in os.environ.get('XLA_FLAGS', '').split():
    if flag.startswith(YNN_FLAG + '='):
      kinds = flag.split('=', 1)[1]
  return any(k in ('dot', 'individual_dot') for k in kinds.split(','))
