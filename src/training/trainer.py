"""Training: chat files -> tokenizer -> windows -> Trax `Loop` -> checkpoints.

`train(settings)` is everything `train.py` does: a `RunPlan`
(`src.training.plan`), the run's files, the Trax tasks, a `JadeLoop`, and
the loop run until done, stopped or diverged.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys

import jax
import numpy as np
from trax.supervised import training as trax_training

from src.config.jsonconfig import Section
from src.core import files, rundir, runlock, safe_pickle
from src.core.errors import UserError
from src.core.signals import StopSignals
from src.model import ginconf, losses, preflight, reformer
from src.storage import checkpoints, modelfolder, snapshots
from src.training import callbacks, distributed, finetune, samples
from src.training import plan as run_plan
from src.training.loop import Diverged, JadeLoop, StopRequested
from src.training.progress import Progress, devices_text, time_lines


def _write_text(path: str, text: str):
  files.write_atomic(path, text.encode('utf-8'))


def _start_from(loop: JadeLoop, source: modelfolder.ModelFolder, setup):
  """Puts the pretrained weights into a fresh Loop (step 0); attention
  or an output layer that the run grows (`finetune.grown_blocks`,
  `grown_output`) gets its new weights at zero."""
  treedef = jax.tree_util.tree_structure(loop.model.weights)
  mine = jax.tree_util.tree_leaves(loop.model.weights)
  flat = source.flat
  grown = finetune.grown_blocks(setup, source.setup)
  output = finetune.grown_output(setup, source.setup)
  if grown or output:
    flat = finetune.grow_weights(loop.model, flat, setup, grown, output)
  checkpoints.check_fit(
    f'init-from {source.path!r}', flat, mine, 'copy the model folder again'
  )
  weights = jax.tree_util.tree_unflatten(
    treedef, [jax.numpy.asarray(w, a.dtype) for w, a in zip(flat, mine)]
  )
  loop.update_weights_and_state(weights=weights)


def _refuse_in_a_starting_worker():
  """The tokenizer's worker processes start by re-running the script that
  started training (Python's `spawn`): a script that calls `train()` at
  its top level would train again in each of them, and the first run
  would wait for them. Refused there with the fix (`_inheriting` is
  multiprocessing's own mark of a process still starting, the one its
  `spawn` checks)."""
  if getattr(multiprocessing.current_process(), '_inheriting', False):
    raise UserError(
      'train() was called while a worker process was starting: the script '
      'that calls it runs again in each tokenizing worker; call it under '
      "`if __name__ == '__main__':`"
    )


def train(settings: Section, gin_bindings=(), log=print) -> JadeLoop | None:
  """Trains (or resumes) a run as configured; returns the finished Loop.

  The out-dir is locked for the run (`runlock`): one run per out-dir. With
  `coordinator` set this process first joins the others of the run
  (`src.training.distributed`); only process 0 locks and writes out-dir."""
  _refuse_in_a_starting_worker()
  cluster = distributed.start(settings)
  prefix = cluster.prefix
  if prefix:

    def log(line, _log=log):  # noqa: PLR1704 (the given log, prefixed)
      _log(prefix + line)

  try:
    if not cluster.chief:
      return _train(settings, gin_bindings, log, cluster)
    with runlock.held(run_plan.check_out_dir(settings), log):
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


def _train(
  settings: Section, gin_bindings, log, cluster: distributed.Cluster
) -> JadeLoop | None:
  plan = run_plan.prepare_cluster(settings, gin_bindings, log, cluster)
  s = plan.settings
  _report(plan, cluster, log)
  if plan.start_step >= s['steps']:
    log(
      f'already trained to step {plan.start_step} (steps = {s["steps"]}); '
      'raise --steps to train further'
    )
    return None
  init_text = _write_run_files(plan, cluster, log)
  progress = Progress(
    s['steps'], plan.start_step, average=s['log-every'], prefix=cluster.prefix
  )
  loop = _build_loop(plan, cluster, progress, init_text, log)
  _run_until_done(loop, plan, progress)
  return _finish(loop, plan, cluster, progress)


def _report(plan: run_plan.RunPlan, cluster: distributed.Cluster, log):
  """The data, the model, the devices and the time estimate, in a few
  lines."""
  s, data, setup = plan.settings, plan.corpus, plan.gin
  log(
    f'data: {data.n_conversations} conversations, {data.n_turns} turns, '
    f'{plan.n_tokens} tokens ({"cached" if data.hit else "tokenized"} in '
    f'{os.path.relpath(data.folder)}); vocabulary {plan.tokenizer.vocab_size}'
  )
  log(plan.held)
  if plan.replay_corpus is not None:
    r = plan.replay_corpus
    log(
      f'replay: {s["replay"]} ({r.n_conversations} conversations, '
      f'{len(r.tokens)} tokens); every epoch draws '
      f'{plan.train_batches.replay_tokens} tokens of it at random '
      f'({100 * s["replay-share"]:.0f}% of the epoch'
      + _passes(plan.train_batches.replay_passes)
      + ')'
    )
  if s['epochs']:
    log(f'{s["epochs"]} epochs = {s["steps"]} steps at batch {plan.batch_size}')
  if plan.finetune is not None:
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
  k = s['accumulate-steps']
  log(
    f'model: {setup.path}, context {setup.max_len} tokens'
    + (
      f' (trained on windows of {plan.window} at random offsets)'
      if plan.window < setup.max_len
      else ''
    )
    + ', '
    f'{setup.attention_text}; {devices_text(cluster)} '
    f'({jax.devices()[0].platform}), '
    + ('bfloat16 products, ' if ginconf.precision() == 'bfloat16' else '')
    + f'batch {plan.batch_size}'
    + (f' in {k} micro-batches' if k > 1 else '')
    + f'; memory estimate {preflight.gb(plan.memory.total)} per device of '
    f'{preflight.gb(plan.memory_limit)}'
  )
  for line in time_lines(plan.step_seconds, plan.start_step, s['steps']):
    log(line)


def _passes(passes: int) -> str:
  """What the replay line adds when the replay is read more than once."""
  if passes <= 1:
    return ''
  return f'; the replay is smaller: each conversation up to {passes} times'


def _write_run_files(plan: run_plan.RunPlan, cluster, log) -> str | None:
  """Restores an intact snapshot over a damaged checkpoint, writes the
  run's model.gin and settings, records a fine-tune's source; returns
  the line TensorBoard shows for a fine-tune (None for other runs)."""
  s, fine, start = plan.settings, plan.finetune, plan.start_step
  out_dir = s['out-dir']
  if plan.checkpoint_damage and cluster.chief:
    log(
      f'note: the checkpoint in {out_dir} is damaged '
      f'({plan.checkpoint_damage}); resuming from the intact one at step '
      f'{start} ({plan.checkpoint_folder}) instead'
    )
    snapshots.restore(out_dir, plan.checkpoint_folder)
  if start:
    log(f'resuming from the checkpoint at step {start} in {out_dir}')
  if cluster.chief:
    _write_text(os.path.join(out_dir, rundir.MODEL_GIN), plan.gin.text)
    _write_text(
      os.path.join(out_dir, rundir.SETTINGS),
      json.dumps({'train': dict(s.values)}, indent=2) + '\n',
    )
  if fine is not None and fine.source is not None:
    finetune.record(out_dir, fine.source)
    if cluster.chief:
      finetune.copy_curves(out_dir, fine.source, log)
    init_text = f'fine-tuned from {fine.source.describe()}'
    log(
      f'{init_text}: its tokenizer, model settings and weights; optimizer '
      'and step count start fresh'
    )
    return init_text
  if fine is not None:
    r = fine.record
    log(
      f'fine-tune run (started from {r["path"]}, step {r["step"]}); '
      'resuming from its own checkpoint'
    )
  return None


def _tasks(plan: run_plan.RunPlan):
  """Trax's train and eval tasks, and a function that gives the last
  training batch's loss tokens."""
  s, start = plan.settings, plan.start_step
  last_tokens = [0.0]

  def train_data():
    for batch in plan.train_batches.iterate(start):
      last_tokens[0] = float(batch[2].sum())
      yield batch

  train_task = trax_training.TrainTask(
    labeled_data=train_data(),
    loss_layer=losses.loss_layer(),
    optimizer=ginconf.optimizer(learning_rate=ginconf.lr_peak()),
    lr_schedule=ginconf.lr_schedule(s['steps']),
    n_steps_per_checkpoint=s['checkpoint-every'],
    loss_name='loss',
    sample_batch=plan.train_batches.batch(0),
  )
  ranges = losses.position_ranges(plan.window)
  eval_task = trax_training.EvalTask(
    labeled_data=plan.eval_batches.iterate(0),
    metrics=losses.metric_layers(ranges),
    metric_names=losses.metric_names(ranges),
    n_eval_batches=s['eval-batches'],
    sample_batch=plan.eval_batches.batch(0),
  )
  return train_task, eval_task, lambda: last_tokens[0]


def _train_model(plan, vocab: int):
  """The model the run trains: windows shorter than the context start at a
  random offset of the position grid, so every position the context
  reaches is trained."""
  offset = 'random' if plan.window < plan.gin.max_len else 'zero'
  return ginconf.fresh_model(vocab, offset)


def _build_loop(plan, cluster, progress, init_text, log) -> JadeLoop:
  """The Loop, at the plan's start step, with the chief's weights on every
  process (or a pretrained model's at step 0)."""
  s, start, total = plan.settings, plan.start_step, plan.settings['steps']
  out_dir = s['out-dir']
  train_task, eval_task, tokens_per_step = _tasks(plan)
  vocab = plan.tokenizer.vocab_size
  with _checked_checkpoint(plan, cluster):
    loop = JadeLoop(
      _train_model(plan, vocab),
      [train_task],
      eval_model=ginconf.model(vocab, 'eval'),
      eval_tasks=[eval_task],
      output_dir=out_dir if cluster.chief else None,
      checkpoint_at=lambda step: (
        step % s['checkpoint-every'] == 0 or step == total
      ),
      permanent_checkpoint_at=lambda step: False,
      eval_at=lambda step: (
        step == start + 1 or step % s['eval-every'] == 0 or step == total
      ),
      random_seed=s['seed'],
      progress=progress,
      tokens_per_step=tokens_per_step,
      loss_chunk_size=ginconf.output_loss(),
      products=ginconf.precision(),
      signals=StopSignals(),
      keep_checkpoints=s['keep-checkpoints'],
      tokens_before=(
        (snapshots.read_manifest(out_dir) or {}).get('tokens', 0)
        if cluster.chief
        else 0
      ),
      init_text=init_text,
      ranges=losses.position_ranges(plan.window),
      log_every=s['log-every'],
      accumulate=s['accumulate-steps'],
      cluster=cluster,
    )
  fine = plan.finetune
  if fine is not None and fine.source is not None:
    _start_from(loop, fine.source, plan.gin)
  # The others take the chief's step, weights and optimizer slots.
  distributed.share_loop_state(cluster, loop)
  if loop.step != start:
    raise UserError(
      f'{out_dir}: the checkpoint says step {start} but loaded '
      f'as step {loop.step}; the checkpoint files disagree'
    )
  _add_samples(loop, plan, cluster, progress, log)
  if cluster.chief:
    _add_full_context(loop, plan, progress)
    _write_text(
      os.path.join(out_dir, rundir.OPERATIVE_GIN), ginconf.operative_text()
    )
  log(
    f'{reformer.count_params(loop.model):,} weights; training steps '
    f'{start + 1}..{total}; TensorBoard: tensorboard --logdir {out_dir}'
  )
  return loop


def _add_full_context(loop, plan, progress):
  """The chief's evaluation of long held-out conversations at the whole
  context (`callbacks.FullContext`), where windows are shorter."""
  vocab, s = plan.tokenizer.vocab_size, plan.settings
  loop.full_context = callbacks.FullContext.build(
    plan.eval_batches.view,
    plan.window,
    plan.gin.max_len,
    s['ai-only-loss'],
    model=lambda: ginconf.model(vocab, 'eval'),
    chunk=ginconf.output_loss(),
    progress=progress,
    last=s['steps'],
  )


@contextlib.contextmanager
def _checked_checkpoint(plan, cluster):
  """Around Trax's loading of the checkpoint (the Loop's constructor): the
  files it reads are those whose checksums were checked, read from the
  bytes that were (`files.pinned`), and a weights or slots file may hold
  at most what this model needs (Adam keeps two slots a weight)."""
  limit = 2 * preflight.weight_file_bytes(plan.gin, plan.tokenizer.vocab_size)
  checked = {}
  if plan.start_step and cluster.chief:
    snapshots.verify(plan.settings['out-dir'], keep=checked)
  with safe_pickle.weights_limit(limit), files.pinned(checked):
    yield


def _add_samples(loop: JadeLoop, plan, cluster, progress: Progress, log):
  """Sample replies at every evaluation, on the chief."""
  prompts = plan.settings['sample-prompts']
  if not prompts or not cluster.chief:
    return
  try:
    replies = samples.SampleReplies(plan.tokenizer, plan.gin, prompts)
    loop.samples = callbacks.SampleReplies(replies, progress)
  except (UserError, AssertionError, ValueError, TypeError) as e:
    # The model trains whatever its predict mode makes of the settings.
    log(f'note: no sample replies during training ({e or type(e).__name__})')


def _run_until_done(loop: JadeLoop, plan, progress: Progress):
  """Trains to the last step. A signal saves and exits 128 + its number;
  divergence rolls back to the last good checkpoint and exits 3."""
  out_dir, total = plan.settings['out-dir'], plan.settings['steps']
  try:
    try:
      with loop.signals.armed():
        loop.run(total - plan.start_step)
    except StopRequested as stop:
      loop.save_checkpoint('model')  # May find the run diverged.
      name = signal.Signals(stop.signum).name
      progress.message(
        f'{name}: stopped after step {loop.step}; checkpoint saved in '
        f'{out_dir}. Run the same command to resume.'
      )
      raise SystemExit(128 + stop.signum) from None
  except Diverged as d:
    _diverged(d, out_dir, progress)
  except KeyboardInterrupt:
    saved = snapshots.latest_step(out_dir)
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


def _diverged(d: Diverged, out_dir: str, progress: Progress):
  saved = snapshots.latest_step(out_dir)
  if d.saved_bad and saved == d.step:
    saved = snapshots.discard(out_dir, d.step)
  progress.message(
    f'error: training diverged at step {d.step}: {d.what}. Nothing was '
    f'saved at that step; the last good checkpoint is '
    + (f'at step {saved}' if saved else 'none (no checkpoint yet)')
    + '. Lower the learning rate (e.g. --bind "lr_schedule.peak = '
    f'{ginconf.lr_peak() / 10:g}") or check the data, then run again.'
  )
  raise SystemExit(3) from None


def _finish(loop: JadeLoop, plan, cluster, progress: Progress) -> JadeLoop:
  out_dir = plan.settings['out-dir']
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
  digest = checkpoints.weights_digest(flat)
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
