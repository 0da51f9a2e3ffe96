"""The reversible stack whose last blocks keep their activations
(gin: `reversible.kept_blocks`).

Trax's `ReversibleSerial` keeps no activations: its backward pass takes
each block's input back from its output and runs the block's forward
again to differentiate it (`reverse_and_grad`), so every block's forward
runs twice a step. For the last blocks that buys nothing: their
activations are made just before the loss and needed right after it, so
keeping them costs memory only while the output layer and loss run.
`KeptSerial` is the same stack (the same sublayers, so the same weights,
checkpoints and exports) whose last `kept` sublayers are differentiated
by JAX from the activations of the forward pass (`jax.vjp`), their
feed-forward chunks without rematerialization; the sublayers before them
are reversed as Trax reverses them, from the kept part's input. A step
does a kept block's forward once (BENCHMARKS.md "Blocks that keep their
activations").

An attention layer of `src.model.attention` in a kept block then has no
custom backward of its own (`keep_activations`); Trax's keep theirs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from trax import fastmath
from trax import layers as tl
from trax.layers import combinators as cb

from src.core.errors import UserError


def settings(kept_blocks: int = 0) -> int:
  """How the reversible stack differentiates its blocks (gin:
  reversible).

  Args:
    kept_blocks: How many of the last blocks keep their activations for
      the backward pass (all, where the model has fewer): 0 (Trax: every
      block's forward runs again in the backward pass), or more.

  Returns:
    `kept_blocks`; anything but a whole number from 0 is one line naming
    the setting (`model.reformer_lm` and the memory pre-flight read it).
  """
  if (
    isinstance(kept_blocks, bool)
    or not isinstance(kept_blocks, int)
    or kept_blocks < 0
  ):
    raise UserError(
      f'reversible.kept_blocks = {kept_blocks!r}: write a whole number of '
      'blocks (0: none) in the gin file'
    )
  return kept_blocks


class _Saved(NamedTuple):
  """What the forward pass keeps for `KeptSerial`'s backward pass."""

  state: tuple  # Every sublayer's state before the step.
  rngs: tuple  # Every sublayer's rng.
  mid: tuple  # The kept sublayers' input (the stack after the others).
  weights: tuple
  new_state: tuple
  pull: object  # `jax.vjp`'s function of the kept sublayers.


class KeptSerial(tl.ReversibleSerial):
  """`tl.ReversibleSerial(*layers)` whose last `kept` sublayers keep their
  activations (module doc): those are built again without a custom
  backward (`_plain`), around the same inner layers. `kept` 0 is Trax's
  stack."""

  def __init__(self, layers, kept: int):
    first = len(layers) - max(0, min(int(kept), len(layers)))
    super().__init__(*layers[:first], *(_plain(x) for x in layers[first:]))
    self._first_kept = first

  def _do_custom_gradients(self, x):
    n = self._first_kept
    if n == self._n_layers:
      return super()._do_custom_gradients(x)

    def primal(state, rng, x, weights):
      rngs = cb._split_rngs(rng, self._n_layers)
      return self._through(0, self._n_layers, x, weights, state, rngs)

    def forward(state, rng, x, weights):
      rngs = cb._split_rngs(rng, self._n_layers)
      mid, first_state = self._through(0, n, x, weights, state, rngs)

      def tail(mid, tail_weights):
        w = tuple(weights[:n]) + tuple(tail_weights)
        return self._through(n, self._n_layers, mid, w, state, rngs)

      out, pull, tail_state = jax.vjp(
        tail, mid, tuple(weights[n:]), has_aux=True
      )
      new_state = first_state + tail_state
      saved = _Saved(state, rngs, mid, weights, new_state, pull)
      return (out, new_state), saved

    def backward(saved: _Saved, grad):
      mid_grad, tail_grads = saved.pull(grad[0])  # The state has none.
      x, x_grad, first_grads = saved.mid, mid_grad, []
      for i in reversed(range(n)):
        layer = self.sublayers[i]
        val = cb.inputs_from_stack(x, layer.n_out)
        ct = cb.inputs_from_stack(x_grad, layer.n_out)
        val, (ct, w_ct) = layer.reverse_and_grad(
          val,
          ct,
          saved.weights[i],
          saved.state[i],
          saved.new_state[i],
          rng=saved.rngs[i],
        )
        first_grads.insert(0, w_ct)
        x = cb.outputs_onto_stack(val, x, layer.n_out)
        x_grad = cb.outputs_onto_stack(ct, x_grad, layer.n_out)
      return None, None, x_grad, tuple(first_grads) + tuple(tail_grads)

    run = fastmath.custom_vjp(primal, forward, backward)
    return run(self.state, self._rng, x, self.weights)

  def _through(self, start, stop, stack, weights, state, rngs):
    """Sublayers `start`..`stop` on `stack`, each as a pure function of
    its weights, state and rng: `(stack, their new states)`."""
    new_state = []
    for i in range(start, stop):
      layer = self.sublayers[i]
      inputs = cb.inputs_from_stack(stack, layer.n_in)
      outputs, s = layer.pure_fn(inputs, weights[i], state[i], rngs[i])
      stack = cb.outputs_onto_stack(outputs, stack, layer.n_in)
      new_state.append(s)
    return stack, tuple(new_state)


class PlainHalfResidual(tl.ReversibleHalfResidual):
  """Trax's `ReversibleHalfResidual` with no custom backward: JAX
  differentiates its forward from the activations it keeps."""

  has_backward = False


def _plain(layer):
  """A kept sublayer: a half-residual built again as `PlainHalfResidual`
  around the same inner layers, its attention without its own custom
  backward (`keep_activations`) and its feed-forward chunks scanned
  without rematerialization; any other sublayer (a swap) as it is."""
  if not isinstance(layer, tl.ReversibleHalfResidual):
    return layer
  inner = [_unrematerialized(x) for x in layer._compute_residual.sublayers]
  attention = layer._attention_layer
  if hasattr(attention, 'keep_activations'):
    attention.keep_activations()
  return PlainHalfResidual(*inner, attention_layer=attention, name=layer.name)


def _unrematerialized(layer):
  """`layer`, its `Scan`s (Trax's feed-forward chunks) built again without
  rematerialization: the kept block keeps every chunk's activations."""
  if isinstance(layer, cb.Scan):
    return cb.Scan(
      _unrematerialized(layer.sublayer),
      axis=layer._axis,
      n_carry=layer._n_carry,
      remat=False,
      mode=layer._mode,
    )
  if isinstance(layer, cb.BatchLeadingAxes):
    return cb.BatchLeadingAxes(
      _unrematerialized(layer.sublayers[0]),
      n_last_axes_to_keep=layer._n_last_axes_to_keep,
    )
  if type(layer) is cb.Serial:
    return cb.Serial(*(_unrematerialized(x) for x in layer.sublayers))
  return layer
