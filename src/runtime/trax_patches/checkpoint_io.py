"""Trax's `Loop` reads pickles only through `src.core.safe_pickle`."""

from __future__ import annotations

from src.core.safe_pickle import check_meta, np_from_file, read_pickle


def _trax_unpickle_from_file(file_path, gzip=False):  # noqa: A002 (Trax API)
  return check_meta(read_pickle(file_path, gzipped=gzip), file_path)


def _no_data_counters(output_dir, host_id=None):
  del output_dir, host_id


def _patch_training(training):
  training.unpickle_from_file = _trax_unpickle_from_file


def _patch_inputs(inputs):
  inputs.load_data_counters = _no_data_counters
  inputs.save_data_counters = _no_data_counters


def install():
  """Makes Trax's `Loop` read pickles only through this module.

  Checkpoint pickles go through `SafeUnpickler` and are checked to have
  the shape Trax reads; weight and slot files are read header first.
  Trax's data counters (`data_counters<host>.pkl`, a plain pickle loaded
  with the stock loader whenever a Loop starts in an out-dir) are neither
  read nor written: Jade V8's batches are a pure function of (seed,
  step), so they hold nothing a run needs, and a planted one must never be
  unpickled. The training loop and data modules are patched as they are
  imported (at once after a full `import trax`).
  """
  import trax.layers
  from trax.layers import base

  from src.runtime.trax_patches import import_speed

  # Weights and optimizer slots: each NumPy header read before its data.
  trax.layers.np_from_file = np_from_file
  base.np_from_file = np_from_file
  import_speed.patch_on_import(
    {
      'trax.supervised.training': [_patch_training],
      'trax.data.inputs': [_patch_inputs],
    }
  )
