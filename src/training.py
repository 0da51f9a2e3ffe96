"""Training: chat files -> tokenizer -> chunks -> Trax `Loop` -> checkpoints.

`train(settings)` is everything `train.py` does. Order matters for the
promise that bad input never touches out-dir: the config, data, gin file
and any earlier run in out-dir are all checked before the first write.
"""

from __future__ import annotations

import atexit
import base64
import collections
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time

import jax
import numpy as np
import trax
from trax import optimizers as trax_optimizers
from trax.layers import base as trax_base
from trax.supervised import training as trax_training

from src import (
  chatformat,
  checkpoint,
  chunks,
  corpus,
  distributed,
  finetune,
  ginconf,
  model,
  preflight,
  runlock,
  samples,
  tokenizer,
)
from src.config import Section
from src.errors import UserError

# The run's resolved `train` settings, saved in out-dir as a config file
# (`python train.py --config OUT_DIR/settings.json` repeats the run).
SETTINGS_FILE = 'settings.json'

# Trax's Loop prints its own step lines and blank separators to stdout; our
# JadeLoop prints a progress line and one line per evaluation instead. Trax
# still logs everything through absl (see JADE_VERBOSE in src.quiet).
_trax_log = trax_training._log


def _log_without_stdout(s, stdout=True):
  del stdout
  _trax_log(s, stdout=False)


trax_training._log = _log_without_stdout


def _format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  if seconds >= 2 * 86400:
    return f'{seconds / 86400:.0f} days'
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f'{h}h{m:02d}m' if h else (f'{m}m{s:02d}s' if m else f'{s}s')


class Progress:
  """One live status line: step/total, loss, perplexity, lr, tokens/s, ETA.

  On a terminal the line is redrawn in place; otherwise a line is printed
  every `interval` seconds. The loss shown is the mean of the last
  `average` steps (not one noisy step). Step times exclude the first two
  steps of the session (they include compilation), so the ETA is not
  thrown off.
  """

  def __init__(
    self,
    total: int,
    start: int,
    stream=None,
    interval: float = 10.0,
    average: int = 10,
    prefix: str = '',
  ):
    self.total, self.start = total, start
    self.prefix = prefix  # Names the process in a multi-process run.
    # Device values, read only when shown (no per-step wait).
    self.recent = collections.deque(maxlen=max(1, average))
    self.stream = stream or sys.stdout
    self.tty = self.stream.isatty()
    self.interval = 0.5 if self.tty else interval
    self.last_print = 0.0
    self.timed_steps, self.timed_seconds, self.timed_tokens = 0, 0.0, 0.0
    self.last_time = None
    self.live = False

  def step_done(self, step: int, loss, lr: float, tokens: float):
    now = time.time()
    if self.last_time is not None and step - self.start > 2:
      self.timed_steps += 1
      self.timed_seconds += now - self.last_time
      self.timed_tokens += tokens
    self.last_time = now
    self.recent.append(loss)
    if now - self.last_print < self.interval and step < self.total:
      return
    self.last_print = now
    loss = self.running_loss()
    ppl = math.exp(min(loss, 50.0))
    parts = [
      f'step {step}/{self.total}',
      f'loss {loss:.3f}',
      f'ppl {ppl:.1f}',
      f'lr {lr:.2e}',
    ]
    if self.timed_steps:
      per_step = self.timed_seconds / self.timed_steps
      parts.append(f'{self.timed_tokens / self.timed_seconds:.0f} tok/s')
      parts.append(f'ETA {_format_duration(per_step * (self.total - step))}')
    else:
      parts.append('compiling' if step - self.start <= 2 else '')
    self._write(' | '.join(p for p in parts if p))

  def running_loss(self) -> float:
    """Mean loss of the last `average` steps."""
    return float(np.mean([np.mean(np.asarray(v)) for v in self.recent]))

  def _write(self, line: str):
    line = self.prefix + line
    if self.tty:
      self.stream.write('\r\033[K' + line)
      self.live = True
    else:
      self.stream.write(line + '\n')
    self.stream.flush()

  def message(self, line: str):
    """Prints a line that stays (eval results, checkpoints, notes)."""
    if self.live:
      self.stream.write('\r\033[K')
      self.live = False
    self.stream.write(self.prefix + line + '\n')
    self.stream.flush()


class Diverged(Exception):
  """The loss, gradients or weights stopped being finite at `step`."""

  def __init__(self, step: int, what: str, saved_bad: bool = False):
    super().__init__(step, what)
    self.step, self.what, self.saved_bad = step, what, saved_bad


class StopRequested(Exception):
  """Raised after a training step when SIGTERM or SIGINT arrived in it."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class StopSignals:
  """SIGTERM (a preemptible VM being taken away) and SIGINT (Ctrl-C) during
  training: the current step finishes, then the run saves and stops. A
  second Ctrl-C stops at once, without saving."""

  def __init__(self):
    self.signum: int | None = None

  def _handler(self, signum, frame):
    del frame
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = signum

  @contextlib.contextmanager
  def installed(self):
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        previous[sig] = signal.signal(sig, self._handler)
      except ValueError:  # Not the main thread: leave signals alone.
        pass
    try:
      yield self
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)


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
    # Running scalars every `log_every` steps: the loss is the progress
    # line's running mean (over `log_every` steps, see `_train`).
    self._log_every = log_every
    self._window_tokens = 0.0  # Loss tokens since the last log.
    self._window_hits = None  # Device [hits, total] since the last log.
    self._window_start = time.time()
    self._running_writer = None
    self.sampler = None  # samples.SampleReplies, set once the Loop exists.
    self._keep = keep_checkpoints
    self._tokens = float(tokens_before)  # Loss tokens trained on so far.
    self._init_text = init_text
    self._unchecked = None  # (step, loss, gradient norm), see _check_finite
    self._progress = progress
    self._signals = signals or StopSignals()
    self._tokens_per_step = tokens_per_step
    self._output_chunk = loss_chunk_size
    super().__init__(*args, **kwargs)
    self._rng_per_process = self._cluster.count > 1

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
    return model.chunked_model(
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
    if self._accumulate > 1:
      if fused is None:  # Trax's own model-with-loss, accumulated.
        fused = trax.layers.Serial(self._model, task.loss_layer)
      fused = model.Accumulate(fused, self._accumulate)
    if fused is None:
      return super()._init_trainer(task)
    task.optimizer.tree_init(fused.weights)
    return trax_optimizers.Trainer(fused, task.optimizer, adasum=self._adasum)

  def _init_evaluator(self, eval_task):
    """Trax's evaluator, with loss and accuracy computed from chunked
    logits; `eval_task.metrics` are the same two."""
    fused = self._chunked(self._eval_model, with_accuracy=True)
    if fused is None:
      return super()._init_evaluator(eval_task)
    return trax_training._Evaluator(
      weights=self._for_n_devices(fused.weights[1]),
      state=self._for_n_devices(fused.state[1]),
      metrics_fn=trax_training._accelerate_model_with_metrics(
        fused, self.n_devices
      ),
    )

  def _run_one_step(self, task_index, task_changed):
    loss, stats = super()._run_one_step(task_index, task_changed)
    lr = float(self._tasks[task_index].learning_rate(self.step))
    tokens = self._tokens_per_step()
    # This process's tokens; the others' are about as many.
    self._tokens += tokens * self._cluster.count
    self._progress.step_done(self.step, loss, lr, tokens)
    self._window_tokens += tokens
    counts = model.hit_counts(
      self._trainer_per_task[task_index].accelerated_model_with_loss.state
    )
    if counts is not None:  # Added on the device: no wait here.
      w = self._window_hits
      self._window_hits = counts if w is None else w + counts
    if self.step % self._log_every == 0:
      self._write_running(lr)
    # The previous step's values are ready by now; checking this step's
    # here would make every step wait for the device to finish it.
    self._check_finite()
    self._unchecked = (self.step, loss, stats.get('gradients_l2', 0.0))
    if self._signals.signum is not None:
      self._check_finite()
      raise StopRequested(self._signals.signum)
    return loss, stats

  def _write_running(self, lr: float):
    """Running training scalars of the last `log_every` steps."""
    tokens, self._window_tokens = self._window_tokens, 0.0
    counts, self._window_hits = self._window_hits, None
    now, start = time.time(), self._window_start
    self._window_start = now
    if not self.is_chief or self.output_dir is None:
      return
    if self._running_writer is None:
      from trax import jaxboard

      self._running_writer = jaxboard.SummaryWriter(
        os.path.join(self.output_dir, 'train')
      )
    loss = self._progress.running_loss()
    values = {
      'loss': loss,
      'perplexity': math.exp(min(loss, 50.0)),
      'learning_rate': lr,
      'tokens_per_second': tokens / max(now - start, 1e-9),
    }
    if counts is not None:  # The chunked loss counts right guesses.
      hits, total = (float(v) for v in np.asarray(counts))
      values['accuracy'] = hits / max(total, 1e-9)
    for name, value in values.items():
      self._running_writer.scalar(f'running/{name}', value, step=self.step)
    self._running_writer.flush()

  def run_evals(self, summary_writers=None):
    super().run_evals(summary_writers)
    if self.sampler is None or not self.is_chief:
      return
    replies = self.sampler(self._eval_model.weights)
    for prompt, reply in replies:
      self._progress.message(
        f'step {self.step}: sample {prompt!r} -> {reply!r}'
      )
    writer = (summary_writers or [None])[0]
    if writer is not None:
      writer.text(
        'samples', samples.markdown(self.step, replies), step=self.step
      )
      writer.flush()

  def close_writers(self):
    if self._running_writer is not None:
      self._running_writer.close()
      self._running_writer = None

  def _check_finite(self):
    """Raises `Diverged` if the last unchecked step's loss or gradient
    norm is not finite (before any checkpoint of that step is written)."""
    if self._unchecked is None:
      return
    step, loss, grad_norm = self._unchecked
    self._unchecked = None
    for name, value in (('loss', loss), ('gradient norm', grad_norm)):
      if not np.isfinite(np.asarray(value)).all():
        raise Diverged(
          step, f'the {name} is {float(np.mean(value))}', saved_bad=True
        )

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
    values = model.range_losses(values)
    if 'loss' in values and not np.isfinite(float(values['loss'])):
      # Scored with the weights of this step, which were just checkpointed
      # if this is a checkpoint step: take that checkpoint back.
      raise Diverged(
        self.step,
        f'the {log_prefix} loss is {float(values["loss"])}',
        saved_bad=self._checkpoint_at(self.step),
      )
    if 'loss' in values:
      values['perplexity'] = float(np.exp(min(float(values['loss']), 50.0)))
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
    self._check_finite()
    leaves = jax.tree_util.tree_leaves(self._model.weights)
    if not all(bool(jax.numpy.isfinite(w).all()) for w in leaves):
      raise Diverged(self.step, 'the weights hold NaN/inf')
    super().save_checkpoint(basename)
    if basename == 'model' and self.is_chief:
      checkpoint.seal(
        self.output_dir, self.step, self._keep, {'tokens': int(self._tokens)}
      )
      self._progress.message(
        f'step {self.step}: checkpoint saved in {self.output_dir}'
      )


def _devices_text(cluster: distributed.Cluster) -> str:
  if cluster.count == 1:
    return f'{cluster.devices} device(s)'
  return (
    f'{cluster.devices} devices in {cluster.count} processes '
    f'({cluster.local_devices} in this one)'
  )


def time_lines(step_seconds: float, start: int, total: int) -> list[str]:
  """The time pre-flight's log lines for steps `start + 1..total`."""
  remaining = max(total - start, 0) * step_seconds
  lines = [
    f'time estimate: about {step_seconds:.3g} s a step on this device, '
    f'{_format_duration(remaining)} for steps {start + 1}..{total}'
  ]
  if remaining > preflight.DAY:
    lines.append(
      f'note: that is more than {int(remaining // preflight.DAY)} day(s). '
      'For a quick run on a CPU use the small model: --gin gin/tiny.gin '
      '(see the README quick start)'
    )
  return lines


def _markers(settings: Section) -> chatformat.Markers:
  markers = chatformat.Markers(
    settings['ai-start'], settings['ai-end'], settings['line-break']
  )
  markers.check(settings.source)
  return markers


def _check_run_settings(s: Section):
  for key in (
    'steps',
    'eval-every',
    'log-every',
    'checkpoint-every',
    'eval-batches',
    'vocab-size',
    'keep-checkpoints',
    'accumulate-steps',
  ):
    if s[key] < 1:
      raise UserError(
        f'{s.source}: train.{key} must be at least 1 (got {s[key]})'
      )
  if not 0 <= s['seed'] < 2**31:
    raise UserError(
      f'{s.source}: train.seed {s["seed"]} must be between 0 and {2**31 - 1}'
    )
  if s['windows'] not in chunks.WINDOWS:
    raise UserError(
      f'{s.source}: train.windows {s["windows"]!r} is not "moving" or '
      '"fixed"; use "moving" (the default)'
    )
  if not 0 <= s['pad-fraction'] < 1:
    raise UserError(
      f'{s.source}: train.pad-fraction {s["pad-fraction"]} must be at '
      f'least 0 and below 1 (the default is {chunks.PAD_FRACTION})'
    )
  if s['vocab-size'] < 16:
    raise UserError(
      f'{s.source}: train.vocab-size {s["vocab-size"]} is too '
      'small; use at least 16 (the default is 500)'
    )


def _check_out_dir(s: Section) -> str:
  """The out-dir setting, refused if empty or a file."""
  out_dir = s['out-dir']
  if not out_dir.strip():
    raise UserError(
      f'{s.source}: train.out-dir is empty; name a folder for the run '
      '(e.g. "runs/mine")'
    )
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise UserError(f'out-dir {out_dir!r} is a file; choose a folder name')
  return out_dir


def prepare(
  settings: Section,
  gin_bindings=(),
  log=print,
  cluster: distributed.Cluster | None = None,
  leader: dict | None = None,
):
  """Checks everything and builds the run's pieces without training.

  Args:
    cluster: The processes of the run (default: this one, all its devices).
      Batches are sized for all their devices; this process gets its part.
    leader: For a process other than the chief of a multi-process run: what
      the chief decided (`_leader_message`): its tokenizer, the step it
      resumes from, a pretrained model's settings. Out-dir is then neither
      read nor written; the token cache goes to a private folder.

  Returns:
    A dict with the tokenizer, gin setup, batch iterators and sizes; the
    tokenizer is written to out-dir only after all checks passed.
  """
  s = settings
  cluster = cluster or distributed.local()
  _check_run_settings(s)
  if s['tpu-ip']:
    log(
      f'note: "tpu-ip" ({s["tpu-ip"]}) is not needed and is ignored: on a '
      'TPU VM, JAX finds the TPU cores itself (JAX no longer drives remote '
      'TPU nodes by IP). Run train.py on the TPU VM.'
    )
  out_dir = _check_out_dir(s)
  if leader is None:
    # Reads (and checks) the pretrained model of a fine-tune run; writes
    # nothing.
    fine = finetune.plan(s, out_dir)
    base = fine.gin if fine else None
  else:  # The chief read out-dir and any pretrained model.
    fine = None
    base = tuple(leader['base']) if leader['base'] else None
    s = dataclasses.replace(
      s, values={**s.values, **leader['tokenizer_settings']}
    )
  if fine is not None:
    where = fine.source.path if fine.source else out_dir
    s = dataclasses.replace(
      s,
      values={
        **s.values,
        **finetune.tokenizer_settings(s, fine.tok_info, where),
      },
    )
  markers = _markers(s)
  setup = ginconf.parse(s['gin'], tuple(gin_bindings), base=base)
  if fine is not None and fine.source is not None:
    finetune.check_settings(setup, fine.source, s['gin'])
  if leader is None:
    ginconf.check_same_as_saved(setup, out_dir)
    # Reads only; may raise. A damaged checkpoint gives a snapshot folder.
    start_step, checkpoint_folder, damage = checkpoint.verify(out_dir)
  else:
    start_step, checkpoint_folder, damage = leader['start'], None, None
  devices = cluster.devices
  if devices != cluster.local_devices * cluster.count:
    raise UserError(
      f'the {cluster.count} processes have {devices} devices, not the same '
      f'number each ({cluster.local_devices} here); give every process '
      'the same number of devices'
    )
  batch_size = chunks.batch_size_for(devices, s['batch-size'])
  if s['eval-data'] is None and not 0 <= s['eval-fraction'] < 1:
    raise UserError(
      f'{s.source}: eval-fraction {s["eval-fraction"]} must be at least 0 '
      'and below 1 (e.g. 0.05)'
    )
  per_device, k = batch_size // devices, s['accumulate-steps']
  if per_device % k:
    raise UserError(
      f'{s.source}: train.accumulate-steps {k} does not split the batch '
      f'of {per_device} chunk(s) per device ({batch_size} over {devices} '
      f'device(s)) evenly; set batch-size to a multiple of {devices * k}'
    )
  # One micro-batch's activations are alive at a time.
  memory, limit = preflight.check(
    setup, s['vocab-size'], per_device // k, ginconf.output_loss()
  )
  step_seconds = (
    preflight.step_seconds(setup, s['vocab-size'], per_device // k) * k
  )
  adopted, data_settings = None, s
  if fine is not None and fine.source is not None:
    adopted = tokenizer.adopt(
      fine.source.tok, fine.source.tok_info, os.path.abspath(fine.source.path)
    )
  if leader is not None:
    adopted = tokenizer.Tokenizer(
      base64.b64decode(leader['tokenizer']), markers
    )
    data_settings = dataclasses.replace(
      s, values={**s.values, 'out-dir': leader['private']}
    )
  tok, train_corpus, eval_corpus = _prepare_data(
    data_settings, markers, log, adopted
  )
  max_len = setup.max_len
  train_view = chunks.TokenView(
    train_corpus.tokens,
    train_corpus.roles,
    chunks.conversation_spans(train_corpus.conversation_ends),
  )
  if eval_corpus is not None:
    eval_view = chunks.TokenView(
      eval_corpus.tokens,
      eval_corpus.roles,
      chunks.conversation_spans(eval_corpus.conversation_ends),
    )
    held = (
      f'held out: {s["eval-data"]} ({eval_corpus.n_conversations} '
      f'conversations, {len(eval_view)} tokens)'
    )
  else:
    train_spans, eval_spans, n_held = chunks.split_conversations(
      train_corpus.conversation_ends, s['eval-fraction'], s['seed']
    )
    all_tokens = len(train_view)
    train_view = chunks.TokenView(
      train_corpus.tokens, train_corpus.roles, train_spans
    )
    if eval_spans is None:
      eval_view = train_view
      held = 'evaluating on the training data' + (
        ' (a single conversation: nothing to hold out)'
        if s['eval-fraction'] > 0
        else ''
      )
    else:
      eval_view = chunks.TokenView(
        train_corpus.tokens, train_corpus.roles, eval_spans
      )
      held = (
        f'held out: {n_held} of {train_corpus.n_conversations} '
        f'conversations at random ({len(eval_view)} tokens, '
        f'{100 * len(eval_view) / all_tokens:.1f}%)'
      )
  window_options = {
    'ai_only': s['ai-only-loss'],
    'pad_fraction': s['pad-fraction'],
    'windows': s['windows'],
    'part': cluster.part,
  }
  train_batches = chunks.ChunkBatches(
    train_view, max_len, batch_size, s['seed'], **window_options
  )
  eval_batches = chunks.ChunkBatches(
    eval_view, max_len, batch_size, s['seed'] + 1, **window_options
  )
  if train_batches.n_chunks < batch_size:
    log(
      f'note: only {train_batches.n_chunks} chunk(s) of {max_len} tokens '
      f'for a batch of {batch_size}: some devices will see the same chunk '
      'in a step; add data or lower max_len'
    )
  return {
    'settings': s,
    'eval_corpus': eval_corpus,
    'finetune': fine,
    'corpus': train_corpus,
    'tokenizer': tok,
    'gin': setup,
    'batch_size': batch_size,
    'start_step': start_step,
    'checkpoint_folder': checkpoint_folder,
    'checkpoint_damage': damage,
    'train_batches': train_batches,
    'eval_batches': eval_batches,
    'n_tokens': len(train_corpus.tokens),
    'n_train_tokens': len(train_view),
    'n_eval_tokens': len(eval_view),
    'eval_is_train': eval_view is train_view,
    'held': held,
    'memory': memory,
    'memory_limit': limit,
    'step_seconds': step_seconds,
  }


def _prepare_data(s: Section, markers, log, tok=None):
  """Tokenizer and token caches; out-dir is as before if anything fails."""
  out_dir = s['out-dir']
  existed = os.path.isdir(out_dir)
  cache_root = os.path.join(out_dir, corpus.CACHE_DIR)
  cache_existed = os.path.isdir(cache_root)
  made = []
  try:
    options = {
      'markers': markers,
      'vocab_size': s['vocab-size'],
      'repeat_limit': s['repeat-limit'],
      'collapse': s['collapse-repeats'],
      'save_tokenizer': False,  # Saved below, once every corpus is ready.
      'log': log,
    }
    tok, train_corpus = corpus.prepare(s['data'], out_dir, tok=tok, **options)
    made.append(train_corpus)
    eval_corpus = None
    if s['eval-data'] is not None:
      _, eval_corpus = corpus.prepare(
        s['eval-data'], out_dir, name='eval', tok=tok, **options
      )
      made.append(eval_corpus)
    tokenizer.save(out_dir, tok)
  except BaseException:
    if not existed:
      shutil.rmtree(out_dir, ignore_errors=True)
    else:
      for c in made:
        if not c.hit:
          shutil.rmtree(c.folder, ignore_errors=True)
      if not cache_existed:
        shutil.rmtree(cache_root, ignore_errors=True)
    raise
  return tok, train_corpus, eval_corpus


def _write_text(path: str, text: str):
  tokenizer.write_atomic(path, text.encode('utf-8'))


def _start_from(loop: JadeLoop, source: finetune.Source):
  """Puts the pretrained weights into a fresh Loop (step 0)."""
  treedef = jax.tree_util.tree_structure(loop.model.weights)
  mine = jax.tree_util.tree_leaves(loop.model.weights)
  if len(mine) != len(source.flat) or any(
    tuple(a.shape) != tuple(b.shape) for a, b in zip(mine, source.flat)
  ):
    raise UserError(
      f'init-from {source.path!r}: its weights do not fit the model its '
      'model.gin describes; copy the model folder again'
    )
  weights = jax.tree_util.tree_unflatten(
    treedef,
    [jax.numpy.asarray(w, a.dtype) for w, a in zip(source.flat, mine)],
  )
  loop.update_weights_and_state(weights=weights)


def train(settings: Section, gin_bindings=(), log=print) -> JadeLoop | None:
  """Trains (or resumes) a run as configured; returns the finished Loop.

  The out-dir is locked for the run (`runlock`): one run per out-dir. With
  `coordinator` set this process first joins the others of the run
  (`src.distributed`); only process 0 locks and writes out-dir."""
  cluster = distributed.start(settings)
  prefix = cluster.prefix
  if prefix:

    def log(line, _log=log):  # noqa: PLR1704 (the given log, prefixed)
      _log(prefix + line)

  try:
    if not cluster.chief:
      return _train(settings, gin_bindings, log, cluster)
    with runlock.held(_check_out_dir(settings), log):
      return _train(settings, gin_bindings, log, cluster)
  except UserError as e:
    e.prefix = prefix
    raise
  except Exception as e:
    if cluster.count > 1 and distributed.lost_contact(e):
      # Another process is gone; JAX ends this one too (its shutdown would
      # wait for the lost process): say why first, then leave at once.
      detail = ' '.join(str(e).split())[:200]
      sys.stdout.flush()
      print(
        f'{prefix}error: lost contact with another process of this run '
        f'({detail}). Every process stops; fix the one that failed, then '
        'run the same command on every machine to resume from the last '
        'checkpoint',
        file=sys.stderr,
        flush=True,
      )
      os._exit(4)
    raise


def _leader_message(run) -> dict:
  """What the chief sends the other processes before training (JSON)."""
  s, fine = run['settings'], run['finetune']
  return {
    'error': None,
    'start': run['start_step'],
    'base': list(fine.gin) if fine is not None and fine.gin else None,
    'tokenizer': base64.b64encode(run['tokenizer'].model_proto).decode(),
    'tokenizer_settings': {
      k: s[k] for k in ('vocab-size', 'ai-start', 'ai-end', 'line-break')
    },
  }


def _fingerprints(settings: Section, run) -> dict[str, str]:
  """What every process of a run must agree on (see `check_same`)."""
  given = {
    k: v
    for k, v in settings.values.items()
    if k not in distributed.PER_PROCESS_KEYS
  }
  caches = [os.path.basename(run['corpus'].folder)]
  if run['eval_corpus'] is not None:
    caches.append(os.path.basename(run['eval_corpus'].folder))
  return {
    'settings': distributed.digest(given),
    'gin': distributed.digest(run['gin'].text),
    'data': distributed.digest(caches),
  }


def prepare_cluster(
  settings: Section, gin_bindings, log, cluster: distributed.Cluster
):
  """`prepare` on every process of a run: the chief first, then the others
  with what it sends; then all compare their settings, gin and data."""
  if cluster.count == 1:
    return prepare(settings, gin_bindings, log=log, cluster=cluster)
  if cluster.chief:
    try:
      run = prepare(settings, gin_bindings, log=log, cluster=cluster)
    except UserError as e:
      cluster.broadcast_json({'error': str(e)})
      raise
    cluster.broadcast_json(_leader_message(run))
  else:
    leader = cluster.broadcast_json()
    if leader['error']:
      raise UserError(f'process 0 could not start the run: {leader["error"]}')
    leader['private'] = distributed.private_folder(cluster)
    atexit.register(shutil.rmtree, leader['private'], True)
    try:
      run = prepare(
        settings, gin_bindings, log=log, cluster=cluster, leader=leader
      )
    except UserError:
      distributed.check_same(cluster, None)  # Tells the others.
      raise
  distributed.check_same(cluster, _fingerprints(settings, run))
  return run


def _train(
  settings: Section, gin_bindings, log, cluster: distributed.Cluster
) -> JadeLoop | None:
  run = prepare_cluster(settings, gin_bindings, log, cluster)
  s, fine = run['settings'], run['finetune']
  out_dir, total = s['out-dir'], s['steps']
  start = run['start_step']
  tok, setup = run['tokenizer'], run['gin']
  data = run['corpus']
  log(
    f'data: {data.n_conversations} conversations, {data.n_turns} turns, '
    f'{run["n_tokens"]} tokens ({"cached" if data.hit else "tokenized"} in '
    f'{os.path.relpath(data.folder)}); vocabulary {tok.vocab_size}'
  )
  log(run['held'])
  if fine is not None:
    unknown = finetune.unknown_share(data.tokens)
    log(
      f'unknown pieces: {100 * unknown:.2f}% of the tokens (the pretrained '
      'tokenizer is kept)'
    )
    if unknown > finetune.UNKNOWN_WARN:
      log(
        f'warning: {100 * unknown:.1f}% of the tokens are unknown pieces: '
        "the pretrained tokenizer does not cover this data's characters "
        '(another script, emoji, ...); the model cannot read or write them'
      )
  log(
    f'model: {setup.path}, context {setup.max_len} tokens, '
    f'{setup.attention_text}; {_devices_text(cluster)} '
    f'({jax.devices()[0].platform}), batch {run["batch_size"]}'
    + (
      f' in {s["accumulate-steps"]} micro-batches'
      if s['accumulate-steps'] > 1
      else ''
    )
    + '; memory '
    f'estimate {preflight.gb(run["memory"].total)} per device of '
    f'{preflight.gb(run["memory_limit"])}'
  )
  for line in time_lines(run['step_seconds'], start, total):
    log(line)
  if start >= total:
    log(
      f'already trained to step {start} (steps = {total}); raise --steps '
      'to train further'
    )
    return None
  if run['checkpoint_damage'] and cluster.chief:
    log(
      f'note: the checkpoint in {out_dir} is damaged '
      f'({run["checkpoint_damage"]}); resuming from the intact one at step '
      f'{start} ({run["checkpoint_folder"]}) instead'
    )
    checkpoint.restore(out_dir, run['checkpoint_folder'])
  if start:
    log(f'resuming from the checkpoint at step {start} in {out_dir}')
  if cluster.chief:
    _write_text(os.path.join(out_dir, ginconf.MODEL_GIN), setup.text)
    _write_text(
      os.path.join(out_dir, SETTINGS_FILE),
      json.dumps({'train': dict(s.values)}, indent=2) + '\n',
    )
  init_text = None
  if fine is not None and fine.source is not None:
    finetune.record(out_dir, fine.source)
    init_text = f'fine-tuned from {fine.source.describe()}'
    log(
      f'{init_text}: its tokenizer, model settings and weights; optimizer '
      'and step count start fresh'
    )
  elif fine is not None:
    r = fine.record
    log(
      f'fine-tune run (started from {r["path"]}, step {r["step"]}); '
      'resuming from its own checkpoint'
    )

  train_batches, eval_batches = run['train_batches'], run['eval_batches']
  last_tokens = [0.0]

  def train_data():
    for batch in train_batches.iterate(start):
      last_tokens[0] = float(batch[2].sum())
      yield batch

  schedule = ginconf.lr_schedule(total)
  train_task = trax_training.TrainTask(
    labeled_data=train_data(),
    loss_layer=model.loss_layer(),
    optimizer=ginconf.optimizer(learning_rate=ginconf.lr_peak()),
    lr_schedule=schedule,
    n_steps_per_checkpoint=s['checkpoint-every'],
    loss_name='loss',
    sample_batch=train_batches.batch(0),
  )
  ranges = model.position_ranges(setup.max_len)
  eval_task = trax_training.EvalTask(
    labeled_data=eval_batches.iterate(0),
    metrics=model.metric_layers(ranges),
    metric_names=model.metric_names(ranges),
    n_eval_batches=s['eval-batches'],
    sample_batch=eval_batches.batch(0),
  )

  def checkpoint_at(step):
    return step % s['checkpoint-every'] == 0 or step == total

  def eval_at(step):
    return step == start + 1 or step % s['eval-every'] == 0 or step == total

  progress = Progress(
    total, start, average=s['log-every'], prefix=cluster.prefix
  )
  signals = StopSignals()
  vocab = tok.vocab_size
  loop = JadeLoop(
    model.reformer_lm(vocab, 'train', ginconf.positions(), ginconf.lsh()),
    [train_task],
    eval_model=model.reformer_lm(vocab, 'eval', directed=ginconf.lsh()),
    eval_tasks=[eval_task],
    output_dir=out_dir if cluster.chief else None,
    checkpoint_at=checkpoint_at,
    permanent_checkpoint_at=lambda step: False,
    eval_at=eval_at,
    random_seed=s['seed'],
    progress=progress,
    tokens_per_step=lambda: last_tokens[0],
    loss_chunk_size=ginconf.output_loss(),
    signals=signals,
    keep_checkpoints=s['keep-checkpoints'],
    tokens_before=(
      (checkpoint.read_manifest(out_dir) or {}).get('tokens', 0)
      if cluster.chief
      else 0
    ),
    init_text=init_text,
    ranges=ranges,
    log_every=s['log-every'],
    accumulate=s['accumulate-steps'],
    cluster=cluster,
  )
  if fine is not None and fine.source is not None:
    _start_from(loop, fine.source)
  # The others take the chief's step, weights and optimizer slots.
  distributed.share_loop_state(cluster, loop)
  if loop.step != start:
    raise UserError(
      f'{out_dir}: the checkpoint says step {start} but loaded '
      f'as step {loop.step}; the checkpoint files disagree'
    )
  if s['sample-prompts'] and cluster.chief:
    try:
      loop.sampler = samples.SampleReplies(tok, setup, s['sample-prompts'])
    except (UserError, AssertionError, ValueError, TypeError) as e:
      # The model trains whatever its predict mode makes of the settings.
      log(f'note: no sample replies during training ({e or type(e).__name__})')
  if cluster.chief:
    _write_text(
      os.path.join(out_dir, ginconf.OPERATIVE_GIN), ginconf.operative_text()
    )
  n_weights = model.count_params(loop.model)
  log(
    f'{n_weights:,} weights; training steps {start + 1}..{total}; '
    f'TensorBoard: tensorboard --logdir {out_dir}'
  )
  try:
    try:
      with signals.installed():
        loop.run(total - start)
    except StopRequested as stop:
      loop.save_checkpoint('model')  # May find the run diverged.
      name = signal.Signals(stop.signum).name
      progress.message(
        f'{name}: stopped after step {loop.step}; checkpoint saved in '
        f'{out_dir}. Run the same command to resume.'
      )
      raise SystemExit(128 + stop.signum) from None
  except Diverged as d:
    saved = checkpoint.latest_step(out_dir)
    if d.saved_bad and saved == d.step:
      saved = checkpoint.discard(out_dir, d.step)
    progress.message(
      f'error: training diverged at step {d.step}: {d.what}. Nothing was '
      f'saved at that step; the last good checkpoint is '
      + (f'at step {saved}' if saved else 'none (no checkpoint yet)')
      + '. Lower the learning rate (e.g. --bind "lr_schedule.peak = '
      f'{ginconf.lr_peak() / 10:g}") or check the data, then run again.'
    )
    raise SystemExit(3) from None
  except KeyboardInterrupt:
    saved = checkpoint.latest_step(out_dir)
    progress.message(
      f'interrupted at step {loop.step}; '
      + (
        f'the last checkpoint is at step {saved}. Run the same command to '
        'resume.'
        if saved
        else 'no checkpoint was saved yet.'
      )
    )
    raise
  finally:
    loop.close_writers()
  if cluster.count > 1:
    digest = _same_weights_everywhere(cluster, loop)
    progress.message(
      f'done: step {loop.step}; weights {digest[:12]} (SHA-256) on all '
      f'{cluster.count} processes'
    )
    if not cluster.chief:
      return loop
  progress.message(
    f'done: step {loop.step}. Chat with it: python evaluate.py --model-dir '
    f'{out_dir} | curves: tensorboard --logdir {out_dir}'
  )
  return loop


def _same_weights_everywhere(cluster: distributed.Cluster, loop) -> str:
  """The weights' SHA-256, checked to be the same on every process."""
  flat = [np.asarray(w) for w in jax.tree_util.tree_leaves(loop.model.weights)]
  digest = checkpoint.weights_digest(flat)
  every = cluster.gather_digests([digest])
  mismatch = distributed.first_mismatch(every)
  if mismatch is not None:
    p, _ = mismatch
    raise UserError(
      f'process {p} ended with different weights than process 0 '
      f'({every[p][0][:12]} vs {every[0][0][:12]}); the processes did not '
      'train the same model: check that they run the same versions of '
      'jax/jaxlib and trax'
    )
  return digest
