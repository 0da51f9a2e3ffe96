"""What the scripts share: error reporting and exit codes."""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable

from src.core.errors import UserError


def _error(prefix: str, text: str) -> int:
  sys.stdout.flush()
  print(f'{prefix}error: {text}', file=sys.stderr)
  return 2


def run_main(main: Callable[[], int | None]) -> int:
  """Runs `main`; a `UserError` prints one `error:` line and exits 2.

  Running out of memory or nesting too deep (a damaged or hostile file the
  checks did not catch) is one line too; `JADE_VERBOSE=1` shows the
  traceback as well."""
  try:
    return main() or 0
  except UserError as e:
    return _error(e.prefix, str(e))
  except (MemoryError, RecursionError) as e:
    if os.environ.get('JADE_VERBOSE'):
      traceback.print_exc()
    what = (
      'ran out of memory'
      if isinstance(e, MemoryError)
      else ('input nested too deeply')
    )
    return _error(
      '',
      f'{what} ({type(e).__name__}) while reading the input; a file given '
      'to it (data, a model or run folder) is far larger or deeper than '
      'it should be: check it, or copy the folder again',
    )
  except KeyboardInterrupt:
    return 130
  finally:
    # Python collects every object at exit; after a model was loaded that
    # is ~0.25 s of nothing (the process ends anyway). Frozen objects are
    # skipped by the collector; files are closed and atexit runs as ever.
    gc.freeze()
