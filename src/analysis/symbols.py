"""Training a model on symbol tasks (no tokenizer, no run folder).

The benches' synthetic tasks (bench/duplication.py, the far recall of
`src.analysis.far_recall`) train with Trax's own `Loop`, weighted
cross-entropy and Adam, and score held-out batches as they go.
"""

from __future__ import annotations

import time

import numpy as np

VOCAB = 128  # Symbols 1..127 and the separator 0, as in the Reformer paper.


def train(
  lm,
  data,
  held_out,
  steps,
  rate,
  warmup,
  every,
  log=None,
  seed=None,
  until=None,
):
  """Trains `lm` on endless `(inputs, targets, weights)` batches `data`
  with Trax's own `Loop`, weighted cross-entropy and Adam at a constant
  `rate` after `warmup` steps; `held_out` batches are scored (weighted
  accuracy) every `every` steps, and each score is passed to `log`.
  `seed`: the model's start (None: Trax draws one). `until`: stop at the
  first evaluation whose accuracy reaches it (None: train `steps`).
  Returns `({step: accuracy}, seconds)`."""
  loop = _loop(lm, data, held_out, steps, rate, warmup, every, seed)
  t0 = time.time()
  done = 0
  while done < steps:
    n = min(every, steps - done)
    loop.run(n)
    done += n
    _, accuracy = loop.history.get('eval', 'metrics/WeightedCategoryAccuracy')[
      -1
    ]
    if log:
      log(
        f'step {done}: held-out accuracy {accuracy:.3f} '
        f'({time.time() - t0:.0f} s)'
      )
    if until is not None and accuracy >= until:
      break
  history = loop.history.get('eval', 'metrics/WeightedCategoryAccuracy')
  curve = {int(s): round(float(a), 4) for s, a in history}
  return curve, time.time() - t0


def _loop(lm, data, held_out, steps, rate, warmup, every, seed):
  """Trax's `Loop` for `train`."""
  import trax
  from trax import layers as tl
  from trax.supervised import training

  from src.model import optim

  task = training.TrainTask(
    labeled_data=data,
    loss_layer=tl.WeightedCategoryCrossEntropy(),
    optimizer=trax.optimizers.Adam(
      learning_rate=rate, b1=0.9, b2=0.98, eps=1e-9, clip_grad_norm=1.0
    ),
    lr_schedule=optim.lr_schedule(
      steps, peak=rate, warmup_steps=warmup, decay='constant'
    ),
    n_steps_per_checkpoint=steps,
  )
  eval_task = training.EvalTask(
    labeled_data=held_out,
    metrics=[tl.WeightedCategoryAccuracy()],
    n_eval_batches=4,
  )
  loop = training.Loop(
    lm,
    [task],
    eval_tasks=[eval_task],
    eval_at=lambda step: step % every == 0,
    output_dir=None,
    random_seed=seed,
  )
  return loop


def recall_batches(rng, batch: int, length: int, pairs: int = 63):
  """Associative recall, the clean form of "look the fact up".

  `0 k1 v1 ... kn vn 0 q1 a1 ... qn an`: n pairs (`pairs`, at most
  (length / 2 - 1) // 2 and 63) of a key (1..63, each at most once) and a
  value (64..127, drawn at random), then every key asked once in another
  random order, each followed by its value; zero padding fills each half
  to `length / 2`. A position holding a question key must predict the
  value that followed that key earlier: the value is found by the content
  of the token *before* it, an induction lookup (one block gathers the
  previous token into the value's position, a later block matches the
  question against it), at distances of `length / 2 - 2n` tokens or more.
  Position alone cannot solve it, and one block alone cannot either.

  Yields `[batch, length]` int32 inputs and targets (the same: the model
  shifts its inputs right itself) and `[batch, length]` float32 weights,
  1.0 on the answers `a_i`. Chance: 1/64.
  """
  half = length // 2
  n = min((half - 1) // 2, pairs, 63)
  weights = np.zeros((batch, length), np.float32)
  weights[:, half + 2 : half + 2 + 2 * n : 2] = 1.0
  while True:
    seq = np.zeros((batch, length), np.int32)
    for b in range(batch):
      keys = rng.permutation(63)[:n] + 1
      values = rng.integers(64, VOCAB, n)
      seq[b, 1 : 1 + 2 * n : 2] = keys
      seq[b, 2 : 2 + 2 * n : 2] = values
      order = rng.permutation(n)
      seq[b, half + 1 : half + 1 + 2 * n : 2] = keys[order]
      seq[b, half + 2 : half + 2 + 2 * n : 2] = values[order]
    yield seq, seq, weights


def duplication_batches(rng, batch: int, length: int):
  """Endless `(inputs, targets, weights)`: `[batch, length]` int32 twice
  (the model shifts its inputs right itself) and `[batch, length]` float32,
  1.0 on the second copy's symbols."""
  n = length // 2 - 1
  weights = np.zeros((batch, length), np.float32)
  weights[:, length // 2 + 1 :] = 1.0
  while True:
    w = rng.integers(1, VOCAB, (batch, n)).astype(np.int32)
    zero = np.zeros((batch, 1), np.int32)
    seq = np.concatenate([zero, w, zero, w], axis=1)
    yield seq, seq, weights
