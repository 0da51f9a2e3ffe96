"""Far recall: a fact stated once, asked for thousands of tokens later.

A sequence of symbols (vocabulary 128): random filler, a block of facts,
more filler, then the questions:

  ... v1 k1 v2 k2 ... vF kF  <gap of filler>  ? k3 v3 ? k1 v1 ...

Keys are symbols 2..33 (F of them, each once), values 34..65 (drawn at
random), filler 66..127, `?` is 1. After `? k` the model must say the value
stated before `k`: it has to find the earlier `k` by its content (the same
symbol) and read the symbol before it, which only a lookup that reaches
back over the gap can do. Only the answers are scored (chance 1/32).
`stated=False` leaves the facts out (filler in their place): the no-fact
baseline, what a model scores by guessing.

The filler is random symbols, or (`words=True`) a text of "words": a fixed
lexicon of 2-4 symbol words (`LEXICON`) strung together at random, so
that, as in real text, the next symbol often follows from the one before.
A model trained with a little loss on such filler learns early to carry
each position's previous symbol, the first half of the lookup.
"""

from __future__ import annotations

import os

import numpy as np

from src.analysis import symbols

VOCAB = 128
ASK = 1
KEYS = (2, 34)
VALUES = (34, 66)
FILLER = (66, VOCAB)
CHANCE = 1 / (VALUES[1] - VALUES[0])


def _lexicon(n_words: int = 64, seed: int = 1234) -> list:
  """`n_words` fixed words of 2-4 filler symbols."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(2, 5, n_words)
  return [rng.integers(*FILLER, int(n)).astype(np.int32) for n in sizes]


LEXICON = _lexicon()


def filler(rng, batch: int, length: int, words: bool):
  """`[batch, length]` int32 filler: random symbols, or words strung."""
  if not words:
    return rng.integers(*FILLER, (batch, length)).astype(np.int32)
  rows = []
  for _ in range(batch):
    picks = rng.integers(0, len(LEXICON), length // 2 + 1)
    row = np.concatenate([LEXICON[i] for i in picks])
    start = int(rng.integers(0, len(row) - length + 1))
    rows.append(row[start : start + length])
  return np.stack(rows)


def sequences(
  rng,
  batch: int,
  length: int,
  facts: int,
  gap=None,
  stated: bool = True,
  words: bool = False,
):
  """`(tokens, weights, distance)`: `[batch, length]` int32 tokens (the
  model shifts them right itself: they are also the targets),
  `[batch, length]` float32 weights, 1.0 on the answers, and the mean
  distance in tokens from a question's key back to its fact's key.

  `gap`: filler tokens between the facts and the questions; None draws
  it at random per sequence (training: every distance the window holds).
  The facts start at a random place that leaves room for the rest.
  `words`: the filler is a text of words (`filler`).
  """
  n_keys = KEYS[1] - KEYS[0]
  if not 1 <= facts <= n_keys:
    raise ValueError(f'facts {facts}: 1..{n_keys}')
  span, asked = 2 * facts, 3 * facts
  room = length - span - asked
  if room < 0 or (gap is not None and gap > room):
    raise ValueError(f'length {length} holds no {facts} facts, gap {gap}')
  tokens = filler(rng, batch, length, words)
  weights = np.zeros((batch, length), np.float32)
  distances = []
  for b in range(batch):
    g = int(rng.integers(0, room + 1)) if gap is None else gap
    start = int(rng.integers(0, room - g + 1))
    keys = rng.permutation(n_keys)[:facts] + KEYS[0]
    values = rng.integers(*VALUES, facts)
    if stated:
      tokens[b, start : start + span : 2] = values
      tokens[b, start + 1 : start + span : 2] = keys
    ask = start + span + g
    order = rng.permutation(facts)
    tokens[b, ask : ask + asked : 3] = ASK
    tokens[b, ask + 1 : ask + asked : 3] = keys[order]
    tokens[b, ask + 2 : ask + asked : 3] = values[order]
    weights[b, ask + 2 : ask + asked : 3] = 1.0
    said = start + 1 + 2 * order
    distances.append(np.mean(ask + 1 + 3 * np.arange(facts) - said))
  return tokens, weights, float(np.mean(distances))


def score(logits, tokens, weights) -> dict:
  """Exact answers, the probability of the stated value, and the
  probability on any value (the question's kind), over the weighted
  positions: `{'right', 'p_value', 'p_kind', 'n'}`."""
  logits = np.asarray(logits, np.float64)
  at = weights > 0
  picked = logits[at]
  picked = picked - picked.max(-1, keepdims=True)
  probs = np.exp(picked)
  probs /= probs.sum(-1, keepdims=True)
  target = tokens[at]
  rows = np.arange(len(target))
  return {
    'right': int((probs.argmax(-1) == target).sum()),
    'p_value': float(probs[rows, target].sum()),
    'p_kind': float(probs[:, VALUES[0] : VALUES[1]].sum()),
    'n': int(len(target)),
  }


# ---- The model and its measurement --------------------------------------

TINY_GIN = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(__file__))), 'gin', 'tiny.gin'
)
GRID = 32768  # The position grid: gin/reformer_32k.gin's context.
# The blocks with smeared keys and values (src/model/attention.py): the
# lookup is found in one layer, where the shipped blocks' plateau lasted
# as long as the rounding decided (BENCHMARKS.md "Smeared keys and
# values").
SMEARED = (
  'ReformerLM.attention_type = [@SmearedLocalSelfAttention, '
  '@SmearedDirectedLSHSelfAttention, @SmearedLocalSelfAttention]',
)
# Their rate: at `train`'s 0.003 the lookup formed in seeds 0 and 1 of 3
# on an AVX-512 Xeon and only in seed 1 on an AVX2 Zen 3; at 0.0015 in
# seeds 0-3 of 0-4 on the Zen 3, by step 200-500 (BENCHMARKS.md "The far
# lookup on a real AVX2 machine").
SMEARED_RATE = 0.0015
LSH_CHUNK = 32  # gin/tiny.gin's.


def bindings(length: int, hashes: int, extra=(), buckets=None) -> list[str]:
  """gin/tiny.gin's model on a 32,768-position grid (axial 128 x 256) at
  `length` tokens: LSH chunks of 32 and one bucket per chunk, or `buckets`
  buckets (chunks of `length / buckets`, at least 32)."""
  buckets = buckets or max(2, length // LSH_CHUNK)
  return [
    f'ReformerLM.max_len = {GRID}',
    'ReformerLM.pos_axial_shape = (128, 256)',
    'ReformerLM.dropout = 0.0',
    f'LSHSelfAttention.chunk_len = {max(LSH_CHUNK, length // buckets)}',
    f'LSHSelfAttention.n_buckets = {buckets}',
    f'LSHSelfAttention.n_hashes = {hashes}',
    *extra,
  ]


def build(mode: str, binds, offset: str = 'zero'):
  """The model under gin/tiny.gin and `binds`; in training its windows
  start at `offset` ('zero' or 'random') of the grid."""
  from src.model import ginconf

  ginconf.parse(TINY_GIN, tuple(binds))
  if mode == 'train':
    return ginconf.fresh_model(VOCAB, offset)
  return ginconf.model(VOCAB, mode)


def batches(seed, batch, length, facts, words=True, filler_weight=0.0):
  """Endless `(inputs, targets, weights)`; the filler weighs
  `filler_weight` in the loss (the answers 1.0)."""
  rng = np.random.default_rng(seed)
  while True:
    tokens, weights, _ = sequences(rng, batch, length, facts, words=words)
    if filler_weight:
      weights = np.where(weights > 0, weights, filler_weight)
      weights[:, 0] = 0.0
    yield tokens, tokens, weights.astype(np.float32)


def train(
  length=256,
  steps=3000,
  batch=8,
  facts=16,
  rate=0.003,
  offset='random',
  words=True,
  filler_weight=0.1,
  hashes=2,
  buckets=None,
  extra=(),
  log=None,
  seed=None,
  until=None,
):
  """Trains the model on far recall in `length`-token windows; returns
  `(weights, {step: held-out accuracy}, seconds)`. `seed`: the model's
  start (None: Trax draws one); `until`: stop once the held-out accuracy
  reaches it."""
  lm = build('train', bindings(length, hashes, extra, buckets), offset)
  curve, seconds = symbols.train(
    lm,
    batches(0, batch, length, facts, words, filler_weight),
    batches(1, batch, length, facts, words),
    steps,
    rate,
    warmup=100,
    every=max(steps // 20, 1),
    log=log,
    seed=seed,
    until=until,
  )
  return lm.weights, curve, seconds


def measure(
  weights,
  length: int,
  hashes: int,
  facts: int = 16,
  samples: int = 16,
  words: bool = True,
  buckets=None,
  extra=(),
) -> dict:
  """Scores trained `weights` on `samples` sequences of `length` tokens,
  the facts at the start and the questions at the end, with `hashes` hash
  rounds (and `buckets`, see `bindings`), once as they are ('stated') and
  once with the facts left out ('none'): each `{'accuracy', 'p_value',
  'p_kind', 'questions', 'distance'}`."""
  import jax
  import trax

  from src.inference import scoring

  layer = build('eval', bindings(length, hashes, extra, buckets))
  layer.init(trax.shapes.ShapeDtype((1, length), np.int32))
  weights = jax.tree_util.tree_unflatten(
    jax.tree_util.tree_structure(layer.weights),
    jax.tree_util.tree_leaves(weights),
  )
  forward = scoring.forward_fn(layer, weights)
  gap = length - 5 * facts - 4
  found = {}
  for stated in (True, False):
    rng = np.random.default_rng(100 + length)
    total = {'right': 0, 'p_value': 0.0, 'p_kind': 0.0, 'n': 0}
    distance = []
    for i in range(samples):
      tokens, w, d = sequences(rng, 1, length, facts, gap, stated, words)
      logits = forward(tokens, jax.random.PRNGKey(i))
      for k, v in score(logits, tokens, w).items():
        total[k] += v
      distance.append(d)
    n = total['n']
    found['stated' if stated else 'none'] = {
      'accuracy': round(total['right'] / n, 4),
      'p_value': round(total['p_value'] / n, 4),
      'p_kind': round(total['p_kind'] / n, 4),
      'questions': n,
      'distance': round(float(np.mean(distance))),
    }
  return found
