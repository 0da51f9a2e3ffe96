"""Trax 1.4.1 on today's JAX: removed and deprecated JAX APIs.

2. ``cond_keyword_form``: Trax calls `fastmath.cond(pred=, true_operand=,
   true_fun=, false_operand=, false_fun=)`; JAX removed that keyword form of
   `lax.cond`, so LSH attention in `mode='predict'` raises a TypeError. We
   translate it to the positional form.
3. ``stop_gradient_static``: LSH attention calls
   `fastmath.stop_gradient(seqlen)` on a Python int. Today's JAX turns that
   into a traced array, so a static slice length becomes a tracer and
   predict-mode decoding fails. Stopping the gradient of a Python number is a
   no-op, so we return the number unchanged.
4. ``host_count_alias``: `jax.host_count()` (used by `trax.supervised
   .training` and `trax.data`) is a deprecated alias of `jax.process_count()`
   that warns on every call and is slated for removal.
5. ``device_put_replicated``: Trax's multi-device path replicates weights
   with `jax.device_put_replicated`, deprecated in JAX 0.10 (it warns, and
   raises under `-W error`). We replicate with `jax.device_put` onto a
   sharding over the local devices, which is what JAX recommends.
7. ``on_cpu_uncommitted``: Trax keeps optimizer slots "on CPU" with
   `jax.device_put(x, cpu)`, which commits them to one device. The old
   `jax.pmap` moved such inputs to its devices; today's `pmap` (a
   `jit(shard_map)`) rejects them ("Sharding passed to jit does not match"),
   so training on several devices fails at the first step. Host NumPy
   arrays are equally on the CPU and uncommitted, so we return those.
8. ``tree_unflatten_arrays``: `fastmath.tree_unflatten` tests `tree in
   copy_from_tree`, which compares a JAX array with `()`; JAX now raises
   TypeError on that comparison, so resuming from a checkpoint (optimizer
   slots) fails. We compare containers only.
"""

from __future__ import annotations

import types


def cond_compat(*args, **kwargs):
  """`lax.cond` that also accepts Trax's removed keyword form (fix 2)."""
  from jax import lax

  if 'true_fun' not in kwargs:
    return lax.cond(*args, **kwargs)
  pred = kwargs.pop('pred') if 'pred' in kwargs else args[0]
  true_fun, false_fun = kwargs.pop('true_fun'), kwargs.pop('false_fun')
  true_op, false_op = kwargs.pop('true_operand'), kwargs.pop('false_operand')
  if kwargs:
    raise TypeError(f'cond_compat: unexpected arguments {sorted(kwargs)}')
  if true_op is false_op:
    return lax.cond(pred, true_fun, false_fun, true_op)
  return lax.cond(
    pred,
    lambda ops: true_fun(ops[0]),
    lambda ops: false_fun(ops[1]),
    (true_op, false_op),
  )


def stop_gradient_compat(x):
  """`lax.stop_gradient` that leaves Python numbers static (fix 3)."""
  from jax import lax

  if isinstance(x, (bool, int, float)):
    return x
  return lax.stop_gradient(x)


def device_put_replicated_compat(x, devices):
  """Replicates `x` onto `devices` with a leading device axis (fix 5).

  Returns:
    An array of shape `[len(devices), *x.shape]` sharded so that device `i`
    holds slice `i`, as `jax.device_put_replicated` did.
  """
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  x = np.asarray(x) if not isinstance(x, jax.Array) else x
  mesh = Mesh(np.array(devices), ('devices',))
  sharding = NamedSharding(mesh, PartitionSpec('devices'))
  stacked = jax.numpy.broadcast_to(x, (len(devices),) + tuple(x.shape))
  return jax.device_put(stacked, sharding)


def _patch_fastmath():
  from trax.fastmath import jax as fastmath_jax

  fastmath_jax.JAX_BACKEND['cond'] = cond_compat
  fastmath_jax.JAX_BACKEND['stop_gradient'] = stop_gradient_compat


def on_cpu_compat(x):
  """Moves `x` to host memory without committing it to a device (fix 7)."""
  import jax
  import numpy as np

  return jax.tree_util.tree_map(np.asarray, x)


def _in_copy_from_tree(tree, copy_from_tree) -> bool:
  for item in copy_from_tree:
    if tree is item:
      return True
    if isinstance(item, (list, tuple, dict)) and type(tree) is type(item):
      if tree == item:
        return True
  return False


def tree_unflatten_compat(flat, tree, copy_from_tree=None):
  """`fastmath.tree_unflatten` that never compares arrays (fix 8).

  Same contract as Trax's version: returns `(new_tree, rest_of_flat)`, the
  tree with the structure of `tree` and leaves from `flat`.
  """
  if copy_from_tree is not None and _in_copy_from_tree(tree, copy_from_tree):
    return tree, flat
  if isinstance(tree, (list, tuple)):
    new_tree, rest = [], flat
    for t in tree:
      new_t, rest = tree_unflatten_compat(rest, t, copy_from_tree)
      new_tree.append(new_t)
    return (tuple(new_tree) if isinstance(tree, tuple) else new_tree), rest
  if isinstance(tree, dict):
    new_tree, rest = {}, flat
    for k in tree:
      new_v, rest = tree_unflatten_compat(rest, tree[k], copy_from_tree)
      new_tree[k] = new_v
    return new_tree, rest
  return flat[0], flat[1:]


def _patch_trees_and_placement():
  import trax
  from trax import fastmath
  from trax.fastmath import numpy as fastmath_numpy
  from trax.layers import acceleration

  fastmath_numpy.tree_unflatten = tree_unflatten_compat
  fastmath.tree_unflatten = tree_unflatten_compat
  acceleration.on_cpu = on_cpu_compat
  trax.layers.on_cpu = on_cpu_compat


def _patch_jax_aliases():
  import jax

  jax.host_count = jax.process_count
  from trax.layers import acceleration

  acceleration.jax = _JaxForAcceleration('jax')


class _JaxForAcceleration(types.ModuleType):
  """`jax` as `trax.layers.acceleration` sees it, with fix 5 in place."""

  device_put_replicated = staticmethod(device_put_replicated_compat)

  def __getattr__(self, name):
    import jax

    return getattr(jax, name)


def install():
  _patch_fastmath()
  _patch_jax_aliases()
  _patch_trees_and_placement()
