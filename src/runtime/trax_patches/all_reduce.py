"""Gradients all-reduced across devices and processes (fixes 11, 12).

11. ``all_reduce_one_local_device``: Trax's trainer takes its single-device
   path (a plain `jit`, no gradient all-reduce) whenever *this process* has
   one device. With one device per process, the usual layout of a GPU
   cluster or of two CPU machines, every process would train its own model
   and nothing would tell. Where more processes than one share a run, a
   single local device gets Trax's multi-device path instead: a `pmap` over
   one local device whose `psum` spans the devices of every process.
12. ``all_reduce_in_one_buffer``: Trax all-reduces the gradient tree as it
   is, one array a weight. XLA's CPU backend sends a tuple all-reduce
   array by array (through gloo between processes: a round trip each);
   on CPU the gradients now travel as one flat array, summed and divided
   as Trax does (the same numbers). Two processes training the
   walkthrough's run 1 (542k weights) on two cores: 4,894 tokens/s a
   process against 3,459 (BENCHMARKS.md, "Gradients in one buffer").
"""

from __future__ import annotations

_TRAX_ACCELERATE_UPDATE_FN = []  # Trax's own, kept by fix 11.
_TRAX_AVERAGE = []  # Trax's own gradient average, kept by fix 12.


def average_gradients(gradients, adasum=False):
  """Trax's `_average_multidevice_gradients` (inside a `pmap` over
  'batch'): on CPU, without Adasum or sharded weights, the gradients
  flattened into one array for one all-reduce (fix 12)."""
  import jax
  from jax import numpy as jnp
  from jax.flatten_util import ravel_pytree
  from trax import fastmath
  from trax.layers import base

  if adasum or base.N_WEIGHTS_SHARDS > 1 or jax.default_backend() != 'cpu':
    return _TRAX_AVERAGE[0](gradients, adasum)
  flat, unravel = ravel_pytree(gradients)
  n = jnp.array(fastmath.global_device_count(), jnp.float32)
  return unravel(jax.lax.psum(flat, 'batch') / n)


def accelerate_update_fn_compat(
  forward_and_backward_fn, optimizer, n_devices, accelerate=True, adasum=False
):
  """Trax's `_accelerate_update_fn`, all-reducing with one local device when
  several processes share the run (fix 11)."""
  import jax
  from jax import numpy as jnp
  from trax.optimizers import trainer

  own = _TRAX_ACCELERATE_UPDATE_FN[0]
  if n_devices != 1 or not accelerate or jax.process_count() == 1:
    return own(
      forward_and_backward_fn, optimizer, n_devices, accelerate, adasum
    )

  def update(weights_and_slots, step, opt_params, batch, state, rng):
    weights, slots = weights_and_slots
    (loss, state), gradients = forward_and_backward_fn(
      batch, weights, state, rng
    )
    gradients = trainer._average_multidevice_gradients(gradients, adasum)
    weights, slots, stats = optimizer.tree_update(
      step, gradients, weights, slots, opt_params, store_slots=False
    )
    stats['loss'] = loss
    return (weights, slots), state, stats

  pmapped = jax.pmap(update, axis_name='batch', donate_argnums=(0,))

  # Each one compiled call a step, not one eager call an array (~0.1 ms
  # each; the walkthrough's weights and slots are ~150 arrays).
  @jax.jit
  def add(tree):
    return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), tree)

  @jax.jit
  def first(tree):
    return jax.tree_util.tree_map(lambda x: x[0], tree)

  def one_device_update(weights_and_slots, step, opt_params, batch, state, rng):
    out = pmapped(
      add(weights_and_slots),
      jnp.reshape(jnp.asarray(step, jnp.int32), (1,)),
      add(opt_params),
      add(batch),
      add(state),
      add(rng),
    )
    return first(out)

  return one_device_update


def install():
  from trax.optimizers import trainer

  if not _TRAX_ACCELERATE_UPDATE_FN:
    _TRAX_ACCELERATE_UPDATE_FN.append(trainer._accelerate_update_fn)
    _TRAX_AVERAGE.append(trainer._average_multidevice_gradients)
  trainer._accelerate_update_fn = accelerate_update_fn_compat
  trainer._average_multidevice_gradients = average_gradients
