"""The smeared attention layers: keys and values that see the positions
before them.

- `SmearedLocalSelfAttention`, `SmearedDirectedLSHSelfAttention`: a key
  and a value read the position before too (`k_t = x_t w_k + x_(t-1)
  w_s`), so one layer finds "what came after X" (an induction head)
  without a previous-token head below it (BENCHMARKS.md, "Smeared keys
  and values").
- `ContextLSHSelfAttention`: that LSH layer whose directed query and key
  also read a sum of the last few positions (the recent context): a
  question and the statement it asks about share the thing named ("the
  word", "my cat") a few tokens before, which one token before does not
  hold (BENCHMARKS.md, "A query that reads the recent context").

Each is a subclass of its base in `src.model.attention` and reads the
base's gin settings; `smear.aligned` starts them as induction heads.
"""

from __future__ import annotations

from jax import numpy as jnp
from trax import fastmath

from src.core.errors import UserError
from src.model import decode_state
from src.model.attention import (
  DirectedLSHSelfAttention,
  LocalSelfAttention,
  weight_roles,
)


class _Smeared:
  """What the `Smeared...` classes add to their base: `_smeared` (read
  by `_values`, `decode_block.local_keys` and the decoders) and the two
  projections of the position before, `w_s` and `w_u`, after the base's
  weights (their `EXTRA_ROLES` end with 's', 'u')."""

  _smeared = True
  _aligned = False  # `w_s` starts as the query projection (`start_aligned`).

  def start_aligned(self):
    """`w_s` starts equal to the head's query projection when the layer is
    initialized (`w_a`, the directed query, in LSH; `w_q` in a local
    layer): a query's score then favours, from the first step, the
    positions that follow an earlier occurrence of its own token (an
    induction head), which the lookup of something said once builds on
    (`model.reformer_lm` asks; `smear.aligned`)."""
    self._aligned = True

  def query_role(self) -> str:
    """The query projection `w_s` aligns to: `a` (LSH) or `q` (local)."""
    return 'a' if 'a' in weight_roles(self) else 'q'

  def create_weights_unbatched(self, input_signature, rng):
    """The base's weights of one head, plus `w_s` and `w_u`."""
    weights = super().create_weights_unbatched(input_signature, rng)
    w_s, w_u = smear_weights(self, input_signature, rng)
    if self._aligned:
      w_s = weights[weight_roles(self).index(self.query_role())]
    return (*weights, w_s, w_u)


class SmearedLocalSelfAttention(_Smeared, LocalSelfAttention):
  """A local attention whose keys and values see the position before too
  (smeared): `k_t = x_t w_k + x_(t-1) w_s`, `v_t = x_t w_v + x_(t-1) w_u`.

  A query then finds "what came after X" in one layer, by matching the
  key of the position whose predecessor is X (the induction head that
  copying needs), and a position found reads out what came before it
  (a value stated before its key), without a previous-token head in a
  layer below (which absolute positions make slow to learn: the copy
  task is learned ~3x sooner, BENCHMARKS.md "Smeared keys and values").
  Its own keys (`share_qk` off), no bias.
  """

  EXTRA_ROLES = ('s', 'u')


class SmearedDirectedLSHSelfAttention(_Smeared, DirectedLSHSelfAttention):
  """Directed LSH whose directed keys and values see the position before
  too: `b_t = x_t w_b + x_(t-1) w_s`, `v_t = x_t w_v + x_(t-1) w_u` (see
  `SmearedLocalSelfAttention`): a query's `a` finds, in its buckets, the
  position that followed what it looks for, and reads what preceded
  what it found."""

  EXTRA_ROLES = ('a', 'b', 's', 'u')

  def _directed_keys(self, x, weights, x_before):
    b = jnp.matmul(x, self.weight(weights, 'b'))
    return b + jnp.matmul(x_before, self.weight(weights, 's'))


def smear_weights(layer, input_signature, rng):
  """`(w_s, w_u)`: the projections of the position before into the keys
  (`[d_model, d_qk]`) and the values (`[d_model, d_v]`), drawn as the
  layer's other projections are."""
  if isinstance(input_signature, (tuple, list)):
    input_signature = input_signature[0]
  d_model = input_signature.shape[-1]
  rng_s, rng_u = fastmath.random.split(fastmath.random.split(rng, 7)[6])
  return (
    layer._kernel_initializer((d_model, layer._d_qk), rng_s),
    layer._kernel_initializer((d_model, layer._d_v), rng_u),
  )


# A sum is `span` additions when traced: bounded (a model.gin is input).
MOST_SPAN = 256


class ContextLSHSelfAttention(SmearedDirectedLSHSelfAttention):
  """`SmearedDirectedLSHSelfAttention` whose directed query and key also
  read the recent context:

    a_t = x_t w_a + Q_t w_c,   Q_t = (x_(t-q+1) + ... + x_t) / sqrt(q)
    b_t = x_t w_b + x_(t-1) w_s + K_t w_r,
                               K_t = (x_(t-k) + ... + x_(t-1)) / sqrt(k)

  with `q = query_span`, `k = key_span`, both sums times `context_scale`
  (below 1 their weights change the score more slowly at first; Adam
  moves every weight at the same rate). A question ("what was the word
  I asked you to remember?") and the statement it asks about ("remember
  this word: X") share the thing named some tokens before the answer and
  before X: the sums hold it, one position before does not. `w_c` and
  `w_r` start at zero, so the layer starts as its base and learns to read
  the context (BENCHMARKS.md, "A query that reads the recent context").
  A chat reads the sums from the layer's memory of inputs
  (`decode_state.window_sums`): the same additions as training.
  """

  EXTRA_ROLES = ('a', 'b', 's', 'u', 'c', 'r')
  # A fine-tune may grow a trained model's `GROWS_FROM` layers into this
  # class (`train.py --init-from` with this class bound in their place,
  # `src.training.finetune.grown_blocks`): the trained weights, then
  # `w_c` and `w_r` (the last `GROWN_WEIGHTS`) at zero: the same function
  # at its first step, and the settings `GROWN_SETTINGS` are new.
  GROWS_FROM = SmearedDirectedLSHSelfAttention
  GROWN_WEIGHTS = 2
  GROWN_SETTINGS = ('query_span', 'key_span', 'context_scale')

  def __init__(
    self,
    *args,
    query_span: int = 12,
    key_span: int = 8,
    context_scale: float = 1.0,
    **kw,
  ):
    super().__init__(*args, **kw)
    for name, span in (('query_span', query_span), ('key_span', key_span)):
      whole = isinstance(span, int) and not isinstance(span, bool)
      if not whole or not 1 <= span <= MOST_SPAN:
        raise UserError(
          f'ContextLSHSelfAttention.{name} = {span!r} must be a whole '
          f'number of positions from 1 to {MOST_SPAN}; fix it in the gin '
          'file '
          '(12 and 8: BENCHMARKS.md, "A query that reads the recent '
          'context")'
        )
    scale = context_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
      scale = float('nan')
    if not 0 < scale <= 1:
      raise UserError(
        f'ContextLSHSelfAttention.context_scale = {context_scale!r} must '
        'be above 0 and at most 1; fix it in the gin file (1.0: the sums '
        'as they are)'
      )
    self._query_span, self._key_span = query_span, key_span
    self._scale = float(scale)

  def create_weights_unbatched(self, input_signature, rng):
    """The base's weights of one head, plus `w_c` and `w_r` (zeros)."""
    weights = super().create_weights_unbatched(input_signature, rng)
    if isinstance(input_signature, (tuple, list)):
      input_signature = input_signature[0]
    shape = (input_signature.shape[-1], self._d_qk)
    zeros = jnp.zeros(shape, weights[0].dtype)
    return (*weights, zeros, zeros)

  def key_context(self, mem, x, start):
    """The row before each of `x` and the sum of the `key_span` before it,
    side by side (`[..., n, 2 d]`)."""
    before = super().key_context(mem, x, start)
    span = self._key_span
    recent = decode_state.window_sums(mem, x, start, span, inclusive=False)
    return jnp.concatenate([before, self._scale * recent], -1)

  def selected_context(self, x, kv_indices):
    return self.key_context(None, x, 0)[kv_indices]

  def query_rows(self, mem, x, start):
    """The rows `x` and the sum of the `query_span` ending with each, side
    by side (`[..., n, 2 d]`)."""
    span = self._query_span
    recent = decode_state.window_sums(mem, x, start, span, inclusive=True)
    return jnp.concatenate([x, self._scale * recent], -1)

  def _values(self, x, weights, x_before):
    return super()._values(x, weights, x_before[..., : x.shape[-1]])

  def _directed_keys(self, x, weights, x_before):
    d = x.shape[-1]
    b = super()._directed_keys(x, weights, x_before[..., :d])
    return b + jnp.matmul(x_before[..., d:], self.weight(weights, 'r'))

  def _directed_queries(self, x_q, weights):
    d = x_q.shape[-1] // 2
    a = super()._directed_queries(x_q[..., :d], weights)
    return a + jnp.matmul(x_q[..., d:], self.weight(weights, 'c'))
