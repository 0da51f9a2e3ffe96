"""Everything a run needs, checked before out-dir is touched: a `RunPlan`.

`prepare` reads the settings, the gin file, any pretrained model and any
earlier run in out-dir, tokenizes the data and builds the batch iterators.
Order matters for the promise that bad input never touches out-dir: all
checks come before the first write (the tokenizer and token cache).
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import os
import shutil

from src.config.jsonconfig import Section
from src.core import files, rundir
from src.core.errors import UserError
from src.data import chatformat, corpus, tokenizer, windows
from src.model import ginconf, preflight, shortlist
from src.runtime import xla
from src.storage import snapshots
from src.training import distributed, finetune


def _markers(settings: Section) -> chatformat.Markers:
  markers = chatformat.Markers(
    settings['ai-start'], settings['ai-end'], settings['line-break']
  )
  markers.check(settings.source)
  return markers


def _notes(s: Section, log=print):
  """Notes on settings that are accepted but do nothing (the checks are
  made when the settings are read: `jsonconfig.check_train`)."""
  if s['tpu-ip']:
    log(
      f'note: "tpu-ip" ({s["tpu-ip"]}) is not needed and is ignored: on a '
      'TPU VM, JAX finds the TPU cores itself (JAX no longer drives remote '
      'TPU nodes by IP). Run train.py on the TPU VM.'
    )


def check_out_dir(s: Section) -> str:
  """The out-dir setting, refused if empty or a file."""
  out_dir = s['out-dir']
  if not out_dir.strip():
    raise UserError(
      f'{s.source}: train.out-dir is empty; name a folder for the run '
      '(e.g. "runs/mine")'
    )
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise UserError(f'out-dir {out_dir!r} is a file; choose a folder name')
  if os.path.islink(out_dir) and not os.path.exists(out_dir):
    raise UserError(
      f'out-dir {out_dir!r} is a link to {os.readlink(out_dir)!r}, which '
      'does not exist; create that folder or choose another out-dir'
    )
  files.check_no_links(out_dir)
  return out_dir


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """What `prepare` decided and built; nothing in out-dir is trained yet."""

  settings: Section  # The train settings, with a pretrained tokenizer's.
  finetune: finetune.Plan | None  # A fine-tune run's source, if any.
  tokenizer: tokenizer.Tokenizer
  gin: ginconf.GinSetup  # The model's gin setup (file, bindings, text).
  gin_added: tuple[str, ...]  # Bindings the plan added (`_output_choice`).
  corpus: corpus.Corpus  # The training token cache.
  eval_corpus: corpus.Corpus | None  # `eval-data`'s token cache, if set.
  replay_corpus: corpus.Corpus | None  # `replay`'s token cache, if set.
  batch_size: int  # Windows per step over all devices.
  window: int  # Tokens a training window holds (<= the model's context).
  start_step: int  # The checkpoint's step (0: a fresh run).
  checkpoint_folder: str | None  # An intact snapshot to restore from.
  checkpoint_damage: str | None  # Why out-dir's checkpoint is not usable.
  train_batches: windows.WindowBatches
  eval_batches: windows.WindowBatches
  n_tokens: int  # Tokens in the training corpus (held-out part included).
  n_train_tokens: int
  n_eval_tokens: int
  eval_is_train: bool  # Nothing held out: evaluation uses training data.
  held: str  # One line on what is held out.
  memory: preflight.Estimate  # Per-device memory estimate.
  memory_limit: float  # Bytes of memory per device.
  step_seconds: float  # Estimated seconds per step.


def window_length(s, setup: ginconf.GinSetup) -> int:
  """The training window: `window` tokens (0: the model's context), at
  most the context and a multiple of every attention chunk length (a
  window is cut into the attention's chunks)."""
  length = s['window'] or setup.max_len
  if length > setup.max_len:
    raise UserError(
      f"{s.source}: train.window {length} is longer than the model's "
      f'context ({setup.max_len} tokens, ReformerLM.max_len); use at most '
      f'{setup.max_len}, or 0 for the whole context'
    )
  chunks = [
    (f'{name}.chunk_len', int(part['chunk_len']))
    for name, part in (
      ('LSHSelfAttention', setup.attention),
      ('SelfAttention', setup.local),
    )
    if part and part.get('chunk_len')
  ]
  for name, chunk in chunks:
    if length % chunk:
      raise UserError(
        f'{s.source}: train.window {length} must be a multiple of {name} '
        f'{chunk} (e.g. {max(chunk, length - length % chunk)})'
      )
  return length


def _setup(s, gin_bindings, base, fine, leader, log=print):
  """The model's settings: the gin file, the preset's `gin-bindings`, the
  command line's `--bind` (a fine-tune's model settings under them; it
  may read its attention otherwise, `finetune.READING`, and says so), and
  the output layer `_output_choice` adds (in another process of a run,
  the chief's: `leader`). Returns `(setup, bindings added)`."""
  bindings = tuple(s['gin-bindings']) + tuple(gin_bindings)
  setup = ginconf.parse(s['gin'], bindings, base=base)
  if leader is None:
    added = _output_choice(s, setup, base)
  else:
    added = tuple(leader['added'])
  if added:
    setup = ginconf.parse(s['gin'], bindings + added, base=base)
    log(
      f'vocabulary of {s["vocab-size"]:,} pieces: {added[0]} (the most '
      'used pieces scored from all features, the rest through a quarter of '
      'them; --bind "output_layer.shortlist = 0" keeps Trax\'s full layer)'
    )
  if fine is not None and fine.source is not None:
    changed = finetune.check_settings(setup, fine.source, s['gin'])
    grows = finetune.growth(setup, fine.source.setup)
    if grows:
      log(
        'grows the pretrained model (its weights, the new ones at zero): '
        f'{", ".join(grows)}'
      )
    if changed:
      log(
        'reads its attention otherwise than the pretrained model (same '
        f'weights): {", ".join(changed)}'
      )
  return setup, added


def _output_choice(s, setup, base) -> tuple[str, ...]:
  """The binding that gives a new run at a vocabulary of thousands of
  pieces a shortlist output layer (`shortlist.auto_size`), or () where
  the gin or a binding chose an output layer, a fine-tune takes its
  pretrained model's, or out-dir holds a run started without one (it
  resumes as it started)."""
  lines = ginconf.canonical(setup.text).splitlines()
  if base is not None or any(x.startswith(OUTPUT_CHOICES) for x in lines):
    return ()
  saved = ginconf.saved_text(s['out-dir'])
  if saved is not None:  # A run resumes with the layer it started with.
    kept = ginconf.canonical(saved).splitlines()
    return tuple(x for x in kept if x.startswith('output_layer.shortlist'))
  size = shortlist.auto_size(s['vocab-size'])
  return (f'output_layer.shortlist = {size}',) if size else ()


# Bindings that choose the output layer (a shortlist and `tied` exclude
# each other): where one is set, `_output_choice` adds nothing.
OUTPUT_CHOICES = ('output_layer.shortlist', 'output_layer.tied')


def _window(s, setup, out_dir: str, resuming: bool) -> int:
  """The run's training window (`window_length`); a resumed run must use
  the window it started with (it then sees the data it would have)."""
  window = window_length(s, setup)
  saved = _saved_window(out_dir, setup) if resuming else None
  if saved is not None and saved != window:
    raise UserError(
      f'{out_dir}: this run trained on windows of {saved} tokens; resume it '
      f'with --window {saved} (it then sees the data it would have), or '
      'use a new out-dir'
    )
  return window


def _saved_window(out_dir: str, setup) -> int | None:
  """The window a run in `out_dir` trained with (its settings.json; None
  when there is none): a resumed run must see the windows it would have."""
  path = os.path.join(out_dir, rundir.SETTINGS)
  if not os.path.isfile(path):
    return None
  try:
    saved = files.read_json(path)['train'].get('window', 0)
  except (UserError, KeyError, TypeError, AttributeError):
    return None
  if isinstance(saved, bool) or not isinstance(saved, int) or saved < 0:
    return None
  return saved or setup.max_len


def _data(s, fine, leader, markers, window, batch_size, cluster, log) -> dict:
  """The tokenizer and corpora (`corpora`), the train and eval views and
  the held-out share (`views`), and the batches of `window`-token windows
  (`batches`)."""
  adopted, data_settings = _given_tokenizer(s, fine, leader, markers)
  # A fine-tune copies its pretrained run's caches of the same data.
  reuse = fine.source.path if fine is not None and fine.source else None
  corpora = _prepare_data(data_settings, markers, log, adopted, reuse)
  _, train_corpus, eval_corpus, replay_corpus = corpora
  views = _views(s, train_corpus, eval_corpus)
  replay_view = None if replay_corpus is None else _view(replay_corpus)
  batches = _batches(
    s,
    window,
    batch_size,
    cluster,
    (views[0], replay_view),
    views[1],
    log,
  )
  return {'corpora': corpora, 'views': views, 'batches': batches}


def _check_products(setup, products: str):
  """bfloat16 products on the CPU need XLA's YNNPACK products (its other
  products compute them in float32, slower than float32), which train.py
  turns on when the gin asks for them on a CPU with bfloat16 dot
  instructions."""
  if products != 'bfloat16' or preflight.platform_name() != 'cpu':
    return
  if xla.ynn_products():
    return
  where = f"{setup.path}: precision.products = 'bfloat16'"
  if not xla.cpu_bf16_dot():
    raise UserError(
      f'{where}: this CPU has no bfloat16 dot instructions (AVX512-BF16, '
      "AMX), so its bfloat16 products are slower than float32; set 'auto' "
      "(bfloat16 where the CPU has them) or 'float32'"
    )
  raise UserError(
    f"{where} runs on this CPU only with XLA's YNNPACK products, which "
    f'train.py turns on unless XLA_FLAGS sets {xla.YNN_FLAG}; run with '
    f"XLA_FLAGS={xla.YNN_PRODUCTS}, or set 'float32'"
  )


def _preflight(setup, vocab_size: int, micro: int, window: int):
  """`(memory, limit, step seconds)` of a step on `window`-token windows,
  checked before anything is compiled; one micro-batch's activations are
  alive at a time."""
  products = ginconf.precision()
  _check_products(setup, products)
  memory, limit = preflight.check(
    setup, vocab_size, micro, ginconf.output_loss(), window
  )
  seconds = preflight.step_seconds(setup, vocab_size, micro, window, products)
  return memory, limit, seconds


def prepare(
  settings: Section,
  gin_bindings=(),
  log=print,
  cluster: distributed.Cluster | None = None,
  leader: dict | None = None,
) -> RunPlan:
  """Checks everything and builds the run's pieces without training.

  Args:
    cluster: The processes of the run (default: this one, all its devices).
      Batches are sized for all their devices; this process gets its part.
    leader: For a process other than the chief of a multi-process run: what
      the chief decided (`_leader_message`): its tokenizer, the step it
      resumes from, a pretrained model's settings. Out-dir is then neither
      read nor written; the token cache goes to a private folder.

  Returns:
    The `RunPlan` (the tokenizer is written to out-dir after all checks).
  """
  cluster = cluster or distributed.local()
  _notes(settings, log)
  out_dir = check_out_dir(settings)
  s, fine, base = _with_pretrained(settings, out_dir, leader)
  setup, added = _setup(s, gin_bindings, base, fine, leader, log)
  start_step, checkpoint_folder, damage = _resume_point(setup, out_dir, leader)
  window = _window(s, setup, out_dir, start_step and not leader)
  batch_size, micro = _batch_size(s, cluster)
  memory, limit, seconds = _preflight(setup, s['vocab-size'], micro, window)
  data = _data(s, fine, leader, _markers(s), window, batch_size, cluster, log)
  tok, train_corpus, eval_corpus, replay_corpus = data['corpora']
  train_view, eval_view, held = data['views']
  train_batches, eval_batches = data['batches']
  if s['epochs']:
    s = _with_values(s, {'steps': max(1, train_batches.epoch_end(s['epochs']))})
  return RunPlan(
    settings=s,
    window=window,
    finetune=fine,
    tokenizer=tok,
    gin=setup,
    gin_added=added,
    corpus=train_corpus,
    eval_corpus=eval_corpus,
    replay_corpus=replay_corpus,
    batch_size=batch_size,
    start_step=start_step,
    checkpoint_folder=checkpoint_folder,
    checkpoint_damage=damage,
    train_batches=train_batches,
    eval_batches=eval_batches,
    n_tokens=len(train_corpus.tokens),
    n_train_tokens=len(train_view),
    n_eval_tokens=len(eval_view),
    eval_is_train=eval_view is train_view,
    held=held,
    memory=memory,
    memory_limit=limit,
    step_seconds=seconds * s['accumulate-steps'],
  )


def _resume_point(setup, out_dir: str, leader: dict | None):
  """(step, intact snapshot folder or None, damage or None) of out-dir's
  checkpoint; out-dir's model.gin must match the model. Reads only."""
  if leader is not None:  # The chief checked out-dir.
    return leader['start'], None, None
  ginconf.check_same_as_saved(setup, out_dir)
  # May raise. A damaged checkpoint gives a snapshot folder.
  return snapshots.verify(out_dir)


def _with_values(s: Section, values: dict) -> Section:
  return dataclasses.replace(s, values={**s.values, **values})


def _with_pretrained(s: Section, out_dir: str, leader: dict | None):
  """(settings, fine-tune plan, base gin bindings): a fine-tune run takes
  its pretrained model's tokenizer settings and model bindings."""
  if leader is not None:  # The chief read out-dir and any pretrained model.
    base = tuple(leader['base']) if leader['base'] else None
    return _with_values(s, leader['tokenizer_settings']), None, base
  # Reads (and checks) the pretrained model of a fine-tune run; writes
  # nothing.
  fine = finetune.plan(s, out_dir)
  if fine is None:
    return s, None, None
  where = fine.source.path if fine.source else out_dir
  s = _with_values(s, finetune.tokenizer_settings(s, fine.tok_info, where))
  return s, fine, fine.gin


def _batch_size(s: Section, cluster: distributed.Cluster) -> tuple[int, int]:
  """(windows per step over all devices, windows per micro-batch on one
  device), refused where the devices or micro-batches do not split it."""
  devices = cluster.devices
  if devices != cluster.local_devices * cluster.count:
    raise UserError(
      f'the {cluster.count} processes have {devices} devices, not the same '
      f'number each ({cluster.local_devices} here); give every process '
      'the same number of devices'
    )
  batch_size = windows.batch_size_for(devices, s['batch-size'])
  per_device, k = batch_size // devices, s['accumulate-steps']
  if per_device % k:
    raise UserError(
      f'{s.source}: train.accumulate-steps {k} does not split the batch '
      f'of {per_device} window(s) per device ({batch_size} over {devices} '
      f'device(s)) evenly; set batch-size to a multiple of {devices * k}'
    )
  return batch_size, per_device // k


def _given_tokenizer(s: Section, fine, leader: dict | None, markers):
  """(a tokenizer to use instead of training one, or None; the settings
  for the data: another process writes its token cache privately)."""
  if leader is not None:
    tok = tokenizer.Tokenizer(base64.b64decode(leader['tokenizer']), markers)
    return tok, _with_values(s, {'out-dir': leader['private']})
  if fine is not None and fine.source is not None:
    source = fine.source
    tok = tokenizer.adopt(
      source.tok, source.tok_info, os.path.abspath(source.path)
    )
    return tok, s
  return None, s


def _view(c: corpus.Corpus, spans=None) -> windows.TokenView:
  spans = (
    windows.conversation_spans(c.conversation_ends) if spans is None else spans
  )
  return windows.TokenView(c.tokens, c.roles, spans)


def _views(s: Section, train_corpus, eval_corpus):
  """(training view, held-out view, one line on what is held out)."""
  if eval_corpus is not None:
    eval_view = _view(eval_corpus)
    return (
      _view(train_corpus),
      eval_view,
      (
        f'held out: {s["eval-data"]} ({eval_corpus.n_conversations} '
        f'conversations, {len(eval_view)} tokens)'
      ),
    )
  train_spans, eval_spans, n_held = windows.split_conversations(
    train_corpus.conversation_ends, s['eval-fraction'], s['seed']
  )
  all_tokens = len(_view(train_corpus))
  train_view = _view(train_corpus, train_spans)
  if eval_spans is None:
    held = 'evaluating on the training data' + (
      ' (a single conversation: nothing to hold out)'
      if s['eval-fraction'] > 0
      else ''
    )
    return train_view, train_view, held
  eval_view = _view(train_corpus, eval_spans)
  return (
    train_view,
    eval_view,
    (
      f'held out: {n_held} of {train_corpus.n_conversations} '
      f'conversations at random ({len(eval_view)} tokens, '
      f'{100 * len(eval_view) / all_tokens:.1f}%)'
    ),
  )


def _batches(s, max_len, batch_size, cluster, train_views, eval_view, log):
  """The training and held-out batch iterators of `max_len`-token windows
  (the training window; `train_views`: the data's view and the replay view
  or None)."""
  train_view, replay_view = train_views
  options = {
    'ai_only': s['ai-only-loss'],
    'pad_fraction': s['pad-fraction'],
    'windows': s['windows'],
    'part': cluster.part,
  }
  train_batches = windows.WindowBatches(
    train_view,
    max_len,
    batch_size,
    s['seed'],
    replay=replay_view,
    replay_share=s['replay-share'],
    splice=s['splice'],
    **options,
  )
  eval_batches = windows.WindowBatches(
    eval_view, max_len, batch_size, s['seed'] + 1, **options
  )
  if train_batches.n_chunks < batch_size:
    log(
      f'note: only {train_batches.n_chunks} chunk(s) of {max_len} tokens '
      f'for a batch of {batch_size}: some devices will see the same window '
      'in a step; add data or use shorter windows (window)'
    )
  return train_batches, eval_batches


def _prepare_data(s: Section, markers, log, tok=None, reuse=None):
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
      'reuse': reuse,
      'log': log,
    }
    tok, train_corpus = corpus.prepare(s['data'], out_dir, tok=tok, **options)
    made.append(train_corpus)
    eval_corpus = replay_corpus = None
    if s['eval-data'] is not None:
      _, eval_corpus = corpus.prepare(
        s['eval-data'], out_dir, name='eval', tok=tok, **options
      )
      made.append(eval_corpus)
    if s['replay'] is not None:
      _, replay_corpus = corpus.prepare(
        s['replay'], out_dir, name='replay', tok=tok, **options
      )
      made.append(replay_corpus)
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
  return tok, train_corpus, eval_corpus, replay_corpus


def _leader_message(run) -> dict:
  """What the chief sends the other processes before training (JSON)."""
  s, fine = run.settings, run.finetune
  return {
    'error': None,
    'start': run.start_step,
    'base': list(fine.gin) if fine is not None and fine.gin else None,
    'added': list(run.gin_added),
    'tokenizer': base64.b64encode(run.tokenizer.model_proto).decode(),
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
  caches = [os.path.basename(run.corpus.folder)]
  for c in (run.eval_corpus, run.replay_corpus):
    if c is not None:
      caches.append(os.path.basename(c.folder))
  return {
    'settings': distributed.digest(given),
    'gin': distributed.digest(run.gin.text),
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
