"""`JadeLoop`: Trax's training `Loop` with the chunked loss, our console,
sealed checkpoints, and the jobs around each step (`src.training.callbacks`:
finite checks, running scalars, sample replies)."""

from __future__ import annotations

import time

import jax
import numpy as np
import trax
from trax import optimizers as trax_optimizers
from trax.layers import base as trax_base
from trax.optimizers import trainer as trax_trainer
from trax.supervised import training as trax_training

from src.core.signals import StopSignals
from src.model import losses, precision
from src.runtime import heap
from src.storage import snapshots
from src.training import callbacks, distributed
from src.training.callbacks import Diverged
from src.training.progress import Progress


class StopRequested(Exception):
  """Raised after a training step when SIGTERM or SIGINT arrived in it."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class CompileFirstTrainer(trax_optimizers.Trainer):
  """Trax's trainer whose first step compiles before it runs, handing the
  compiler's freed memory back in between (`heap.release`).

  The compiler's working memory is freed inside glibc's heap, which keeps
  it; compiled and run in one call, the first step's scratch came on top
  of it, and the process's peak memory was the first step's (32k
  benchmark: 2.2 GB against ~1.9 GB for every later step). The executable
  is JAX's own cached one: the step that follows runs it, and nothing is
  compiled twice.
  """

  _compiled = False

  def __init__(self, model_with_loss, optimizer, products='float32', **kw):
    super().__init__(model_with_loss, optimizer, **kw)
    self._checked = products == 'float32'  # The first step's products ran.
    if products != 'float32':  # `precision.products`: the step's products.
      self._forward_and_backward_fn = precision.with_products(
        self._forward_and_backward_fn, products
      )
      self._accelerated_update_fn = trax_trainer._accelerate_update_fn(
        self._forward_and_backward_fn,
        self._optimizer,
        n_devices=self._n_devices,
        accelerate=True,
        adasum=self._adasum,
      )

  def one_step(self, batch, rng, step=0, learning_rate=None):
    update = self._accelerated_update_fn
    # One device, Trax's plain `jit` (several devices, or fix 11's pmap over
    # one, reshape the batch first: those compile as Trax calls them).
    single = self._n_devices == 1 and hasattr(update, 'lower')
    if not self._compiled and single:
      self._compiled = True
      if learning_rate is not None:  # As Trax's `one_step` sets it.
        self._opt_params['learning_rate'] = trax.layers.for_n_devices(
          learning_rate, self._n_devices
        )
      model = self._accelerated_model_with_loss
      update.lower(
        (model.weights, self._slots),
        step,
        self._opt_params,
        batch,
        model.state,
        rng,
      ).compile()
      heap.release()
    out = super().one_step(batch, rng, step, learning_rate)
    if not self._checked:  # XLA may fail a bfloat16 product as it runs.
      self._checked = True
      try:
        jax.block_until_ready(out)
      except jax.errors.JaxRuntimeError as e:
        line = precision.explained(e)
        if line is None:
          raise
        raise line from e
    return out


class JadeLoop(trax_training.Loop):
  """Trax's Loop with our console output (progress line, eval lines).

  Trax still writes TensorBoard events, checkpoints and its gin config; we
  only replace its stdout chatter and add perplexity next to every loss.
  """

  def __init__(
    self,
    *args,
    progress: Progress,
    tokens_per_step,
    loss_chunk_size: int = 0,
    products: str = 'float32',
    signals: StopSignals | None = None,
    keep_checkpoints: int = 2,
    tokens_before: int = 0,
    init_text: str | None = None,
    ranges=(),
    log_every: int = 10,
    accumulate: int = 1,
    cluster: distributed.Cluster | None = None,
    **kwargs,
  ):
    self._cluster = cluster or distributed.local()
    self._rng_per_process = False  # Set once the weights are initialized.
    self._accumulate = accumulate
    self._ranges = tuple(ranges)  # Position ranges of the eval losses.
    self.samples = None  # callbacks.SampleReplies, set once the Loop exists.
    self.full_context = None  # callbacks.FullContext, likewise (or None).
    self._keep = keep_checkpoints
    self._tokens = float(tokens_before)  # Loss tokens trained on so far.
    self._init_text = init_text
    self._finite = callbacks.FiniteCheck()
    self._progress = progress
    self.signals = signals or StopSignals()
    self._tokens_per_step = tokens_per_step
    self._output_chunk = loss_chunk_size
    self._products = products  # `precision.products`: training's only.
    super().__init__(*args, **kwargs)
    self._rng_per_process = self._cluster.count > 1
    self._running = callbacks.RunningScalars(
      progress, log_every, self.output_dir, self.is_chief
    )

  def new_rng(self):
    """Trax's next key; after initialization, a different one on each
    process (dropout and LSH hashing would otherwise repeat on every
    process; the weights must start the same everywhere)."""
    rng = super().new_rng()
    if self._rng_per_process:
      rng = jax.random.fold_in(rng, self._cluster.index)
    return rng

  def _chunked(self, model_, with_accuracy: bool):
    """`model.chunked_model` for this Loop, or None where Trax's own path
    must be used (no chunking, memory-efficient trainer, sharded weights)."""
    if self._use_memory_efficient_trainer or trax_base.N_WEIGHTS_SHARDS > 1:
      return None
    return losses.chunked_model(
      model_,
      self._output_chunk,
      with_accuracy,
      self._ranges if with_accuracy else (),
    )

  def _init_trainer(self, task):
    """Trax's trainer, with the output layer and loss chunked: the
    `[batch, length, vocab]` logits never exist in training, so large
    vocabularies fit."""
    fused = self._chunked(self._model, with_accuracy=False)
    if fused is None and (self._accumulate > 1 or self._products != 'float32'):
      fused = trax.layers.Serial(self._model, task.loss_layer)  # Trax's.
    if self._accumulate > 1:
      fused = losses.Accumulate(fused, self._accumulate)
    if fused is None:
      return super()._init_trainer(task)
    task.optimizer.tree_init(fused.weights)
    return CompileFirstTrainer(
      fused, task.optimizer, adasum=self._adasum, products=self._products
    )

  def _init_evaluator(self, eval_task):
    """Trax's evaluator, with loss and accuracy computed from chunked
    logits; `eval_task.metrics` are the same two."""
    fused = self._chunked(self._eval_model, with_accuracy=True)
    if fused is None:
      return super()._init_evaluator(eval_task)
    return trax_training._Evaluator(
      weights=self._for_n_devices(losses.loss_part(fused.weights)),
      state=self._for_n_devices(losses.loss_part(fused.state)),
      metrics_fn=trax_training._accelerate_model_with_metrics(
        fused, self.n_devices
      ),
    )

  def _run_one_step(self, task_index, task_changed):
    started = time.perf_counter()
    loss, stats = super()._run_one_step(task_index, task_changed)
    lr = float(self._tasks[task_index].learning_rate(self.step))
    tokens = self._tokens_per_step()
    # This process's tokens; the others' are about as many.
    self._tokens += tokens * self._cluster.count
    self._progress.step_done(self.step, loss, lr, tokens)
    counts = losses.hit_counts(
      self._trainer_per_task[task_index].accelerated_model_with_loss.state
    )
    self._running.after_step(self.step, lr, tokens, counts)
    self._finite.after_step(self.step, loss, stats.get('gradients_l2', 0.0))
    # The step has run (its loss was read): what it freed goes back to the
    # system before the next step maps its scratch anew (long steps only).
    heap.release_after_step(time.perf_counter() - started)
    if self.signals.signum is not None:
      self._finite.check()
      raise StopRequested(self.signals.signum)
    return loss, stats

  def run_evals(self, summary_writers=None):
    super().run_evals(summary_writers)
    writer = (summary_writers or [None])[0]
    if self.samples is not None and self.is_chief:
      self.samples.after_eval(self.step, self._eval_model.weights, writer)
    if self.full_context is not None and self.is_chief:
      self.full_context.after_eval(self.step, self._eval_model.weights, writer)

  def close_writers(self):
    self._running.close()

  def _save_gin(self, summary_writer):
    super()._save_gin(summary_writer)
    if self._init_text and summary_writer is not None and self.is_chief:
      summary_writer.text('init_from', self._init_text)

  def _log_step(self, msg, stdout=True):
    super()._log_step(msg, stdout=False)

  def log_summary(
    self, values, summary_writer, value_prefix, log_prefix, stdout=True
  ):
    if value_prefix == 'metrics/':
      values = self._mean_over_processes(values)
    values = losses.range_losses(values)
    if 'loss' in values and not np.isfinite(float(values['loss'])):
      # Scored with the weights of this step, which were just checkpointed
      # if this is a checkpoint step: take that checkpoint back.
      raise Diverged(
        self.step,
        f'the {log_prefix} loss is {float(values["loss"])}',
        saved_bad=self._checkpoint_at(self.step),
      )
    if 'loss' in values:
      values['perplexity'] = losses.perplexity(values['loss'])
    super().log_summary(
      values, summary_writer, value_prefix, log_prefix, stdout=False
    )
    if value_prefix == 'metrics/':
      shown = ' | '.join(f'{k} {float(v):.4g}' for k, v in values.items())
      self._progress.message(f'step {self.step}: {log_prefix} {shown}')

  def _mean_over_processes(self, values: dict) -> dict:
    """Each process scored its own rows: the mean of all processes'."""
    if self._cluster.count == 1 or not values:
      return values
    from jax.experimental import multihost_utils

    names = list(values)
    parts = [np.ravel(np.asarray(values[k], np.float64)) for k in names]
    every = np.asarray(multihost_utils.process_allgather(np.concatenate(parts)))
    mean, out, at = every.mean(axis=0), {}, 0
    for k, p in zip(names, parts):
      shape = np.shape(values[k])
      # Scalars stay NumPy scalars: they go into the checkpoint's history.
      part = mean[at : at + p.size]
      out[k] = np.float64(part[0]) if shape == () else part.reshape(shape)
      at += p.size
    return out

  def save_checkpoint(self, basename):
    self._finite.check()
    leaves = jax.tree_util.tree_leaves(self._model.weights)
    if not all(bool(jax.numpy.isfinite(w).all()) for w in leaves):
      raise Diverged(self.step, 'the weights hold NaN/inf')
    super().save_checkpoint(basename)
    if basename == 'model' and self.is_chief:
      snapshots.seal(
        self.output_dir, self.step, self._keep, {'tokens': int(self._tokens)}
      )
      self._progress.message(
        f'step {self.step}: checkpoint saved in {self.output_dir}'
      )
