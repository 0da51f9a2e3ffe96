"""Jade V8: train a long-context Reformer chat model on your own chat logs.

Importing the package, once: silences library noise the user cannot act on
(`src.quiet`), applies the Trax/JAX compatibility fixes (`src.compat`),
routes Trax's checkpoint reading through the safe unpickler
(`src.checkpoint`) and installs the faster one-token LSH decoding step
(`src.fast_lsh`).
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
