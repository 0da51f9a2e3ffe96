"""Trax checkpoints' weights: read, named by digest, fitted and set into a
layer. A model folder (a run or an export) is read and checked by
`src.storage.modelfolder`; a run's snapshot folders are
`src.storage.snapshots`.

Trax checkpoints are `model.pkl.gz` (a pickle: step, state, history, input
signature) beside `model.weights.npy.gz` and `model.opt_slots0.npy.gz`
(NumPy arrays, read without pickle). A pickle can run arbitrary code when
loaded, so we never unpickle with the stock loader: `src.core.safe_pickle`
accepts only the handful of types a Trax checkpoint contains and refuses
anything else with a `UserError`; `src.runtime.trax_patches.checkpoint_io`
routes Trax's own loader through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

from src.core.errors import UserError
from src.core.safe_pickle import read_weights_file
from src.storage import snapshots


def read_checkpoint_weights(folder: str, max_bytes: int | None = None):
  """`(flat weight arrays, step)` of the checkpoint in `folder`, a folder
  `verify` has already found intact."""
  import jax
  import numpy as np

  meta = snapshots.read_meta(folder)
  path = os.path.join(folder, snapshots.WEIGHTS)
  if not os.path.exists(path):
    raise UserError(f'{path}: missing; the checkpoint is incomplete')
  flat = read_weights_file(path, max_bytes)
  flat = [
    np.asarray(jax.lax.bitcast_convert_type(w, jax.numpy.bfloat16))
    if w.dtype == np.uint16
    else w
    for w in flat
  ]
  return flat, int(meta['step'])


def weights_digest(flat) -> str:
  """SHA-256 over the arrays' dtypes, shapes and bytes (names a model's
  weights independently of the file they came in)."""
  import numpy as np

  h = hashlib.sha256()
  for w in flat:
    w = np.ascontiguousarray(w)
    h.update(f'{w.dtype.str}{w.shape};'.encode())
    h.update(w.tobytes())
  return h.hexdigest()


def check_fit(where: str, flat, expected, fix: str) -> None:
  """The one weight-shape check: `flat` arrays against the `expected`
  ones (arrays or shape signatures), in order; `fix` ends the message."""
  import numpy as np

  if len(flat) != len(expected):
    raise UserError(
      f'{where}: has {len(flat)} weight arrays, its model.gin needs '
      f'{len(expected)}; {fix}'
    )
  for i, (w, e) in enumerate(zip(flat, expected)):
    if tuple(np.shape(w)) != tuple(e.shape):
      raise UserError(
        f'{where}: weight array {i} has shape {tuple(np.shape(w))}, the '
        f'model needs {tuple(e.shape)}; {fix}'
      )


def set_weights(model_dir: str, layer, input_signature, flat) -> None:
  """Initializes `layer` and sets the flat weights `flat` (read from
  `model_dir`, named in messages) into it."""
  import jax
  import numpy as np
  from trax import fastmath
  from trax import layers as tl

  # The state (LSH hash seeds) is drawn at init: seed it so that scoring
  # and sampling are reproducible from run to run. The weights Trax would
  # draw are replaced by `flat`: they are not drawn (`weights_not_drawn`).
  layer.rng = jax.random.PRNGKey(0)
  with weights_not_drawn(layer):
    layer.init(input_signature)
  expected = tl.flatten_weights_and_state(layer.weights, layer.state)[0]
  check_fit(
    model_dir,
    flat,
    expected,
    'the weights, model.gin and tokenizer do not match',
  )
  if not all(np.isfinite(w).all() for w in flat if w.dtype.kind not in 'iub'):
    raise UserError(
      f'{model_dir}: the weights contain NaN/inf (the training run '
      'diverged); train again with a lower learning rate (lr_schedule.peak)'
    )
  # The initialized weights are the tree's template (Trax's own
  # `unflatten_weights_and_state` takes their abstract signature, which
  # costs another trace of the whole model).
  markers = [tl.EMPTY_WEIGHTS, tl.GET_WEIGHTS_FROM_CACHE]
  weights, _ = fastmath.tree_unflatten(
    list(flat), layer.weights, copy_from_tree=markers
  )
  layer.weights = jax.tree_util.tree_map(jax.numpy.asarray, weights)


@contextlib.contextmanager
def weights_not_drawn(layer):
  """Within it, `layer.init` makes its weights zeros instead of drawing
  them: every `*_initializer` of `layer` and its sublayers returns zeros
  of the asked shape. For weights that are replaced at once: Trax draws
  each array eagerly, one small compiled program per shape, ~0.5 s of a
  chat's start on the tiny model. The state (hash seeds, rotations) is
  drawn as before."""
  import numpy as np

  def zeros(shape, rng=None):
    del rng
    return np.zeros(shape, np.float32)

  swapped = []
  todo = [layer]
  while todo:
    sub = todo.pop()
    todo.extend(sub.sublayers)
    for name, value in list(vars(sub).items()):
      if name.endswith('_initializer') and callable(value):
        swapped.append((sub, name, value))
        setattr(sub, name, zeros)
  try:
    yield
  finally:
    for sub, name, value in swapped:
      setattr(sub, name, value)
