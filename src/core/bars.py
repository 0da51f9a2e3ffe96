"""The one progress bar for long reads: bytes done of a total, on stderr.

Shown only on a terminal and only for work big enough to wait for (logs
stay quiet: a file or pipe gets nothing).
"""

from __future__ import annotations

import sys


def byte_bar(total: int, desc: str, min_bytes: int):
  """A tqdm bar over `total` bytes, disabled below `min_bytes` or when
  stderr is not a terminal; `update(n)` as bytes are done."""
  from tqdm import tqdm

  return tqdm(
    total=total,
    unit='B',
    unit_scale=True,
    desc=desc,
    disable=not sys.stderr.isatty() or total < min_bytes,
    leave=False,
  )
