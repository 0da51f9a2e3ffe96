"""What the scripts share: error reporting and exit codes."""

from __future__ import annotations

import sys
from collections.abc import Callable

from src.core.errors import UserError


def run_main(main: Callable[[], int | None]) -> int:
  """Runs `main`; a `UserError` prints one `error:` line and exits 2."""
  try:
    return main() or 0
  except UserError as e:
    sys.stdout.flush()
    print(f'{e.prefix}error: {e}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130
