"""Jade V8: train a long-context Reformer chat model on your own chat logs.

Importing the package, once: sets XLA's CPU flags (`src.runtime`), silences
library noise the user cannot act on (`src.quiet`), applies the Trax/JAX
compatibility fixes and keeps TensorFlow unloaded until something uses it
(`src.compat`), routes Trax's checkpoint reading through the safe unpickler
(`src.checkpoint`) and installs the faster one-token LSH decoding step
(`src.fast_lsh`).

Tokenizing worker processes (`src.corpus`) set JADE_LIGHT_IMPORT=1: they
need only sentencepiece and the parser, not Trax.
"""

import os

if not os.environ.get('JADE_LIGHT_IMPORT'):
  from src import runtime

  runtime.configure()

  from src import quiet

  quiet.silence_libraries()

  from src import compat

  compat.apply()
  quiet.silence_loggers()

  from src import checkpoint

  checkpoint.install()

  from src import fast_lsh

  fast_lsh.install()
