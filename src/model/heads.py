"""An attention layer's heads all at once in training and evaluation, the
output projection summed over the heads inside one product.

Trax's `EfficientAttentionBase.forward_and_or_backward`, where every
example and head runs in one call (`n_parallel_heads` covers them; its
default, 1, runs one head at a time), vmaps each head's
`forward_unbatched`, its output projection included, and sums the heads'
`[heads, length, d_model]` outputs. XLA on a CPU then runs one thin
product a head and a pass over all of their outputs (the forward 74 ms
against 43 at 32k positions, 4 heads of 64, d_model 256; BENCHMARKS.md
"All heads in one call"). Here each head's attention runs under vmap up
to its output (`forward_unbatched(..., project_output=False)`), and
`project` contracts heads and features in one product: the same sums in
another order.

Every head and example shares one `rng` in Trax's pass, so the output
dropout's mask is the same for all of them, and applying it once to the
sum is the same as to each head's share (`project`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax import numpy as jnp
from trax import fastmath
from trax.layers.research import efficient_attention as ea


def applies(layer, inputs) -> bool:
  """Whether `forward_and_or_backward` runs `layer`'s pass: a training
  or evaluation pass (not a chat decoder's) of all examples and heads at
  once, through a `forward_unbatched` that can stop before its output
  projection (`heads_at_once`)."""
  first = inputs if not isinstance(inputs, (tuple, list)) else inputs[0]
  together = int(first.shape[0]) * layer._n_heads
  parallel = layer._n_parallel_heads
  return (
    not layer._incremental
    and layer.heads_at_once()
    and (not parallel or parallel >= together)
  )


def project_one(layer, o, weights, output_rng, project_output=True):
  """One head's output `o` through its output projection and dropout, as
  Trax's `forward_unbatched` ends; `o` itself where `project_output` is
  False (`project` then projects all heads at once)."""
  if not project_output:
    return o
  out = jnp.matmul(o, layer.weight(weights, 'o'))
  return ea.apply_broadcasted_dropout(out, layer._output_dropout, output_rng)


def project(layer, o_heads, w_o, rng):
  """`[length, d_model]`: the heads' attention outputs `o_heads` (`[heads,
  length, d_v]`) through their output projections `w_o` (`[heads, d_v,
  d_model]`), summed over the heads, with the output dropout each head's
  `forward_unbatched` applies (one `rng` for all, so one mask)."""
  out = jnp.einsum('hnd,hde->ne', o_heads, w_o)
  _, output_rng = fastmath.random.split(rng)
  return ea.apply_broadcasted_dropout(out, layer._output_dropout, output_rng)


def _rows_of(state, batch: int, heads: int):
  """The state's rows of this call's examples x heads, `[batch, heads,
  ...]`. The state may hold more rows (it was made for the whole batch;
  a micro-batch of accumulation, or a device's share, is smaller): a call
  reads and writes its first rows, as Trax's pass does."""
  rows = batch * heads
  return jax.tree.map(
    lambda s: s[:rows].reshape((batch, heads) + s.shape[1:]), state
  )


def _with_rows(state, new):
  """`state` with its first rows replaced by `new` (`_rows_of`'s shape)."""

  def put(old, new):
    rows = new.shape[0] * new.shape[1]
    return old.at[:rows].set(new.reshape((rows,) + new.shape[2:]))

  return jax.tree.map(put, state, new)


def forward_and_or_backward(
  layer,
  inputs,
  weights,
  state,
  rng,
  output_grad=None,
  compute_output=True,
  update_state=True,
):
  """Trax's `forward_and_or_backward` (all heads and examples in one call,
  its `(output, new_state, inputs_grad, weights_grad)`), the output
  projection as `project`."""
  single = not isinstance(inputs, (tuple, list))
  kind = tuple if single else type(inputs)  # Trax's gradients keep it.
  inputs = (inputs,) if single else tuple(inputs)
  batch, heads = int(inputs[0].shape[0]), layer._n_heads
  differentiable = [
    i for i, x in enumerate(inputs) if np.issubdtype(x.dtype, np.inexact)
  ]

  def attend(i_x, w_h, s_h):
    return layer.forward_unbatched(
      *i_x,
      weights=w_h,
      state=s_h,
      rng=rng,
      update_state=update_state,
      project_output=False,
    )

  def one_example(i_x, w_all, s_x):
    o_heads, s_x = jax.vmap(attend, in_axes=(None, 0, 0))(i_x, w_all, s_x)
    return project(layer, o_heads, layer.weight(w_all, 'o'), rng), s_x

  def forward(d_inputs, w_all):
    full = list(inputs)
    for i, x in zip(differentiable, d_inputs):
      full[i] = x
    s = _rows_of(state, batch, heads)
    o, s = jax.vmap(one_example, in_axes=(0, None, 0))(tuple(full), w_all, s)
    return o.astype(inputs[0].dtype), _with_rows(state, s)

  d_inputs = tuple(inputs[i] for i in differentiable)
  if output_grad is None:
    o, s = forward(d_inputs, weights)
    return o, (s if update_state else None), None, None
  o, backward, s = jax.vjp(forward, d_inputs, weights, has_aux=True)
  d_ct, w_ct = backward(output_grad)
  i_ct = [jnp.zeros_like(x) for x in inputs]
  for i, ct in zip(differentiable, d_ct):
    i_ct[i] = ct
  return (
    o if compute_output else None,
    s if update_state else None,
    i_ct[0] if single else kind(i_ct),
    w_ct,
  )
