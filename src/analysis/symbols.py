"""Training a model on symbol tasks (no tokenizer, no run folder).

The benches' synthetic tasks (bench/duplication.py, the far recall of
`src.analysis.far_recall`) train with Trax's own `Loop`, weighted
cross-entropy and Adam, and score held-out batches as they go.
"""

from __future__ import annotations

import time


def train(lm, data, held_out, steps, rate, warmup, every, log=None, seed=None):
  """Trains `lm` on endless `(inputs, targets, weights)` batches `data`
  with Trax's own `Loop`, weighted cross-entropy and Adam at a constant
  `rate` after `warmup` steps; `held_out` batches are scored (weighted
  accuracy) every `every` steps, and each score is passed to `log`.
  `seed`: the model's start (None: Trax draws one).
  Returns `({step: accuracy}, seconds)`."""
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
  t0 = time.time()
  done = 0
  while done < steps:
    n = min(every, steps - done)
    loop.run(n)
    done += n
    if log:
      _, accuracy = loop.history.get(
        'eval', 'metrics/WeightedCategoryAccuracy'
      )[-1]
      log(
        f'step {done}: held-out accuracy {accuracy:.3f} '
        f'({time.time() - t0:.0f} s)'
      )
  history = loop.history.get('eval', 'metrics/WeightedCategoryAccuracy')
  curve = {int(s): round(float(a), 4) for s, a in history}
  return curve, time.time() - t0
