"""Jade V8: train a long-context Reformer chat model on your own chat logs.

The packages, each importing only the ones listed before it:

- `core`: errors, safe unpickling, file helpers, the run lock.
- `runtime`: XLA flags, quiet logs and every patch of Trax, applied by
  `runtime.bootstrap()`.
- `config`: the JSON settings and the restricted gin reader.
- `data`: the line format, importers, tokenizer, token cache, windows.
- `model`: the Reformer, its gin registry, memory pre-flight.
- `storage`: run folders, checkpoints and exports on disk.
- `inference`: loading a model, decoding, sampling, chat sessions, scoring.
- `training`: the training run, fine-tuning, multi-process training.
- `analysis`: measurements of trained models (memorization, ...).
- `apps`: command lines (chat REPL, convert, export).

Importing `src` or any package changes nothing: the scripts call
`src.runtime.bootstrap()` first.
"""
