"""The project's on/off environment switches, read one way.

`JADE_KERNELS`, `JADE_AMX`, `JADE_MEMORY_KERNEL` (src/model/kernels.py),
`JADE_OUTPUT_KERNEL` (src/model/output_layer.py), `JADE_NORM_KERNEL`
(src/model/layer_norm.py),
`JADE_CHUNK_SKIP` (src/model/chunk_attention.py) and `JADE_HEAP`
(heap.py) are on unless set to off (any case, any spaces around).
"""

from __future__ import annotations

import os


def off(variable: str) -> bool:
  """Whether the switch `variable` is set to off."""
  return os.environ.get(variable, 'on').strip().lower() == 'off'
