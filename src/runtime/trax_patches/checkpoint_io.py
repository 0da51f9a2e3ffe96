"""Trax's `Loop` reads pickles only through `src.core.safe_pickle`."""

from __future__ import annotations

from src.core.safe_pickle import read_pickle


def _trax_unpickle_from_file(file_path, gzip=False):  # noqa: A002 (Trax API)
  return read_pickle(file_path, gzipped=gzip)


def _no_data_counters(output_dir, host_id=None):
  del output_dir, host_id


def install():
  """Makes Trax's `Loop` read pickles only through this module.

  Checkpoint pickles go through `SafeUnpickler`. Trax's data counters
  (`data_counters<host>.pkl`, a plain pickle loaded with the stock loader
  whenever a Loop starts in an out-dir) are neither read nor written: Jade
  V8's batches are a pure function of (seed, step), so they hold nothing a
  run needs, and a planted one must never be unpickled.
  """
  from trax.data import inputs
  from trax.supervised import training

  training.unpickle_from_file = _trax_unpickle_from_file
  inputs.load_data_counters = _no_data_counters
  inputs.save_data_counters = _no_data_counters
