"""Jade V8: train a long-context Reformer chat model on your own chat logs.

Importing the package silences library noise the user cannot act on and
applies the Trax/JAX compatibility fixes (`src.compat`) once.
"""

from src import quiet

quiet.silence_libraries()

from src import compat  # noqa: E402

compat.apply()
quiet.silence_loggers()

from src import checkpoint  # noqa: E402

checkpoint.install()

from src import fast_lsh  # noqa: E402

fast_lsh.install()
