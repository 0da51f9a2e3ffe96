"""Training speed and memory at long contexts: Jade V8 vs its peers.

  python bench/train_speed.py                      # 8k-64k, all contenders
  python bench/train_speed.py --lengths 32768 --contenders jade peer
  python bench/train_speed.py --lengths 32768 --vocabs 500 8000 32000
  python bench/train_speed.py --smoke              # tiny, one step each

One process per (contender, length), run one after another. The model:
causal LM, vocab 500, d_model 256, d_ff 1024, 4 layers, 4 heads of 64,
LSH attention in every layer (chunk 64, 1 hash; Trax's shared query/key
score, as the peer's, without gin/tiny.gin's directed term and local
blocks), reversible layers, axial
positions, feed-forwards over chunks of positions (4096 for Jade, as
gin/reformer_32k.gin; the peer's default 100 chunks), batch 1, float32,
Adam, no dropout. Contenders:

- jade: the project's real path: `training.train` with gin/tiny.gin plus
  bindings for the architecture, a synthetic corpus through the data
  pipeline, Trax's Loop (evaluation switched off);
- jade-mean: the same with `output_layer.halves = 'mean'`: the output
  layer reads the mean of the residual halves, as the peer's does;
- jade-short, jade-short-bf16: jade and jade-bf16 with a shortlist output
  layer (`output_layer.shortlist = 2048`: the 2,048 most used pieces
  scored from all features, the rest through a quarter of them;
  `src/model/shortlist.py`); at a vocabulary of 2,049 or fewer, jade;
  from 8,000 pieces asked, jade's own default (`shortlist.auto_size`):
  every jade contender without a shortlist binding has the layer there;
- jade-full, jade-full-bf16: jade and jade-bf16 with Trax's full output
  layer at every vocabulary (`output_layer.shortlist = 0`);
- jade-kept, jade-kept-bf16: jade and jade-bf16 whose blocks all keep
  their activations for the backward pass (`reversible.kept_blocks`:
  no block's forward runs again; more memory);
- jade-xla-attend: jade with Trax's chunked `attend` on XLA instead of the
  fused kernel (`JADE_CHUNK_KERNEL=off`: the trainer before the kernel);
- jade-bf16, jade-mean-bf16: jade and jade-mean with `precision.products
  = 'bfloat16'`: every training product reads bfloat16 and sums in
  float32 (fast where the CPU has AVX512-BF16 or AMX; on the CPU with
  `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot`);
- jade-bf16-no-amx: jade-bf16 with the project's kernels built without
  AMX (`JADE_AMX=off`: the fused attention's products on AVX512-BF16
  instructions; the same as jade-bf16 on a CPU without AMX);
- peer: lucidrains' reformer-pytorch 1.4.4 (`pip install -r
  bench/requirements.txt`, e.g. in its own venv: --peer-python), torch
  threads = cores;
- peer-tuned: the same with jemalloc and memory release turned off
  (`LD_PRELOAD=libjemalloc.so.2`, `MALLOC_CONF=dirty_decay_ms:-1,
  muzzy_decay_ms:-1`; Debian/Ubuntu: `apt install libjemalloc2`), which
  spares it most of its page faults. Ratios are to the faster of the two;
- peer-tuned-bf16: peer-tuned with its forward and loss under torch's CPU
  autocast to bfloat16 (the like-for-like peer of jade-bf16; the table's
  "vs bf16 peer" column);
- full: Trax's full-attention TransformerLM of the same size, until it runs
  out of memory.

Every contender runs at each vocabulary of `--vocabs` (the peer computes
its full logits; Jade its chunked output loss). The table's header names
the CPU, its vector instruction family and the measured matmul peak (a
4096 x 4096 float32 product under JAX, best of 5), against which the
achieved FLOP/s are set unless `--peak-gflops` gives another; on a CPU
with bfloat16 dot instructions also the same product's with bfloat16
inputs and float32 sums (YNNPACK's products), against which the
bfloat16 contenders' FLOP/s are set too ("% of bf16 peak").

`--rounds N` runs every contender N times, the contenders in turn in
each round (ABAB: this kind of machine drifts by +-5% between runs, as
much as most changes), measures the matmul peaks after each round, and
reports each contender's median run with the runs' range: its ratios to
the peers are of medians, its share of the peak of the median peak.

Reported: tokens/s (median of the timed steps; the first steps, which
compile, are reported separately), peak RSS of the process, and achieved
FLOP/s = tokens/s x (6 x matmul weights + 3 x attention FLOPs per token),
attention FLOPs per token = 4 x layers x heads x d_head x keys attended
(LSH: 2 chunks of 64 = 128 keys; full attention: L/2 on average). The
output layer is counted over the features each contender's reads: Trax's
ReformerLM concatenates its two residual halves (2 x d_model), the peer
and jade-mean average them (d_model), so at a large vocabulary jade's
output layer does twice the peer's work.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import CHUNK, D_FF, D_HEAD, HEADS, LAYERS, VOCAB, D  # noqa: E402
from src.runtime.xla import YNN_PRODUCTS  # noqa: E402

FF_CHUNK = 4096  # Positions per feed-forward chunk (gin/reformer_32k.gin).


def axial(length):
  rows = 128 if length >= 16384 else 64
  return (rows, length // rows)


def matmul_weights(vocab=VOCAB, output_in=D, shortlist=0):
  """Weights a token's products read; with a shortlist output layer
  (`output_layer.shortlist`, width a quarter of its features) the
  shortlist's and its projection's, then the rarer pieces' over the
  width."""
  per_layer = 4 * D * HEADS * D_HEAD + 2 * D * D_FF
  output = output_in * vocab
  if 0 < shortlist < vocab - 1:
    width = output_in // 4
    output = output_in * (shortlist + 1 + width) + width * (vocab - shortlist)
  return LAYERS * per_layer + output


def output_features(name):
  """Features the contender's output layer reads: Trax's ReformerLM
  concatenates its two residual halves (2 x d_model); reformer-pytorch
  averages them (as jade-mean does), and the full-attention
  TransformerLM has one stream."""
  return D if MEAN in JADE_BINDS.get(name, [MEAN]) else 2 * D


def flops_per_token(length, lsh=True, vocab=VOCAB, output_in=D, shortlist=0):
  keys = 2 * CHUNK if lsh else length / 2
  attention = 4 * LAYERS * HEADS * D_HEAD * keys
  return 6 * matmul_weights(vocab, output_in, shortlist) + 3 * attention


def peak_rss():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- contenders (each runs in its own process)


def jade_bindings(length):
  """The gin bindings (over gin/tiny.gin) of the benchmark model at
  `length` tokens (bench/step_profile.py builds the same)."""
  rows, cols = axial(length)
  return [
    f'ReformerLM.max_len = {length}',
    f'ReformerLM.d_model = {D}',
    f'ReformerLM.d_ff = {D_FF}',
    f'ReformerLM.n_layers = {LAYERS}',
    # As the peer's: LSH in every block, shared queries/keys only.
    'ReformerLM.attention_type = @FastLSHSelfAttention',
    f'ReformerLM.n_heads = {HEADS}',
    f'ReformerLM.d_attention_key = {D_HEAD}',
    f'ReformerLM.d_attention_value = {D_HEAD}',
    'ReformerLM.dropout = 0.0',
    f'ReformerLM.pos_axial_shape = ({rows}, {cols})',
    f'ReformerLM.pos_d_axial_embs = ({D // 2}, {D // 2})',
    f'LSHSelfAttention.chunk_len = {CHUNK}',
    'LSHSelfAttention.n_hashes = 1',
    f'LSHSelfAttention.n_buckets = {length // CHUNK}',
    f'LSHSelfAttention.predict_mem_len = {length}',
    # Every head in one call, as the peer runs them; the heads' output
    # projection then runs as one product (src/model/heads.py).
    f'LSHSelfAttention.n_parallel_heads = {HEADS}',
    # Feed-forwards over chunks of positions, as gin/reformer_32k.gin runs
    # them (the peer chunks its feed-forwards too: `ff_chunks=100`).
    f'ReformerLM.ff_chunk_size = {FF_CHUNK if length > FF_CHUNK else 0}',
    # Every block's forward runs again in the backward pass, as the peer's
    # (gin/tiny.gin keeps its blocks' activations; jade-kept here).
    'reversible.kept_blocks = 0',
  ]


def run_jade(length, steps, vocab, with_eval=False, binds=(), window=0):
  from src import runtime

  runtime.bootstrap()  # XLA flags, quiet logs, the Trax patches: first.
  from prepare_corpus import generate

  from src.config import jsonconfig
  from src.training import trainer

  work = tempfile.mkdtemp(prefix='jade-bench-')
  generate(os.path.join(work, 'data'), 0.004 * max(1, length // 8192), 1)
  times = []

  class Timed(trainer.JadeLoop):
    def _run_one_step(self, task_index, task_changed):
      t = time.perf_counter()
      out = super()._run_one_step(task_index, task_changed)
      import jax

      jax.block_until_ready(out[0])
      times.append(time.perf_counter() - t)
      return out

    if not with_eval:

      def run_evals(self, summary_writers=None):
        pass  # Training speed only.

  trainer.JadeLoop = Timed
  bindings = [*jade_bindings(length), *binds]
  settings = jsonconfig.from_values(
    'train',
    {
      'data': os.path.join(work, 'data'),
      'out-dir': os.path.join(work, 'run'),
      'gin': os.path.join(ROOT, 'gin', 'tiny.gin'),
      'steps': steps,
      'eval-every': 10**6,
      'checkpoint-every': 10**6,
      'vocab-size': vocab,
      'eval-fraction': 0.0,
      'eval-batches': 1,
      'window': window,  # 0: windows of the whole context.
    },
  )
  try:
    trainer.train(settings, gin_bindings=bindings, log=lambda line: None)
    with open(os.path.join(work, 'run', 'tokenizer.json')) as f:
      vocab_used = json.load(f)['vocab_size']
    with open(os.path.join(work, 'run', 'model.gin')) as f:
      found = re.search(r'^output_layer\.shortlist = (\d+)', f.read(), re.M)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  # The run's shortlist: bound, or the trainer's for a large vocabulary.
  shortlist = int(found.group(1)) if found else 0
  return times, (vocab_used, shortlist)


def run_peer(length, steps, vocab, bf16=False):
  """reformer-pytorch's step; `bf16`: its forward and loss under
  torch's CPU autocast to bfloat16 (products in bfloat16 through oneDNN,
  as jade-bf16's; weights and optimizer float32)."""
  import contextlib

  import torch
  from reformer_pytorch import ReformerLM

  torch.set_num_threads(os.cpu_count())
  torch.manual_seed(0)
  model = ReformerLM(
    num_tokens=vocab,
    dim=D,
    depth=LAYERS,
    max_seq_len=length,
    heads=HEADS,
    dim_head=D_HEAD,
    bucket_size=CHUNK,
    n_hashes=1,
    ff_mult=D_FF // D,
    causal=True,
    lsh_dropout=0.0,
    ff_dropout=0.0,
    post_attn_dropout=0.0,
    layer_dropout=0.0,
    axial_position_emb=True,
    axial_position_shape=axial(length),
    reverse_thres=0,  # Reversible layers at every length.
  )
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
  data = torch.randint(0, vocab, (1, length + 1))
  autocast = contextlib.nullcontext
  if bf16:
    autocast = functools.partial(torch.autocast, 'cpu', dtype=torch.bfloat16)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    with autocast():
      logits = model(data[:, :-1])
      loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab), data[:, 1:].reshape(-1)
      )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - t)
  return times, vocab


def run_full(length, steps, vocab):
  from src import runtime

  runtime.bootstrap()  # Quiet logs and the Trax patches first.
  import numpy as np
  import trax
  from trax import layers as tl

  model = trax.models.TransformerLM(
    vocab,
    d_model=D,
    d_ff=D_FF,
    n_layers=LAYERS,
    n_heads=HEADS,
    max_len=length,
    dropout=0.0,
    mode='train',
  )
  loss = tl.WeightedCategoryCrossEntropy()
  with_loss = tl.Serial(model, loss)
  rng = np.random.default_rng(0)
  ids = rng.integers(1, vocab, (1, length)).astype(np.int32)
  batch = (ids, ids, np.ones_like(ids, np.float32))
  with_loss.init(trax.shapes.signature(batch))
  optimizer = trax.optimizers.Adam(1e-4)
  optimizer.tree_init(with_loss.weights)
  trainer = trax.optimizers.Trainer(with_loss, optimizer)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    out = trainer.one_step(batch, trax.fastmath.random.get_prng(0))
    trax.fastmath.numpy.asarray(out[0]).block_until_ready()
    times.append(time.perf_counter() - t)
  return times, vocab


def matmul_peak(bf16: bool = False):
  """GFLOP/s of this machine's best float32 matrix product under JAX (the
  project's XLA flags): 4096 x 4096 x 4096, best of 5. `bf16`: the same
  product with bfloat16 inputs and float32 sums, as the bfloat16
  contenders' products run (YNNPACK's products, which train.py turns on
  for them); None on a CPU without bfloat16 dot instructions, where those
  contenders' products are not bfloat16. One form a process: the flags
  differ."""
  from src import runtime

  runtime.bootstrap(bf16_products=bf16)
  import jax

  from src.model import preflight
  from src.runtime import xla

  if bf16 and not xla.cpu_bf16_dot():
    return None
  dtype = jax.numpy.bfloat16 if bf16 else None
  return preflight.device_flops_per_second(4096, 4096, 4096, 5, dtype) / 1e9


def blas_peak():
  """GFLOP/s of numpy's BLAS (OpenBLAS in numpy's wheels) for the same
  4096^3 float32 product, best of 3: on some CPUs far above JAX's (an AVX2
  Zen 3: 171 against 77-80), so a step's share of it reads truer there."""
  import numpy as np

  a = np.ones((4096, 4096), np.float32)
  out = np.matmul(a, a)
  best = float('inf')
  for _ in range(3):
    t = time.perf_counter()
    np.matmul(a, a, out=out)
    best = min(best, time.perf_counter() - t)
  return 2 * 4096**3 / best / 1e9


def cpu_name():
  """The CPU's model name and vector family (the lines of /proc/cpuinfo
  the compilation cache's key is made of), with its family and model
  numbers (`model` also starts `model name`: the fields are told apart
  by their whole names below): under a hypervisor the name alone ("AMD
  EPYC") does not tell a Zen 3 (family 25, model 1) from a Zen 4 (model
  17)."""
  from src.runtime import compile_cache

  lines = compile_cache.cpu_lines(
    (*compile_cache.KEY_LINES, 'cpu family', 'model')
  )
  pairs = (line.split(':', 1) for line in lines)
  fields = {p[0].strip(): p[1].strip() for p in pairs if len(p) == 2}
  flags = set(fields.get('flags', '').split())
  family = (
    'AVX-512'
    if 'avx512f' in flags
    else 'AVX2'
    if 'avx2' in flags
    else 'no AVX2'
  )
  if 'avx512_bf16' in flags:
    family += ', AVX512-BF16'
  if 'amx_bf16' in flags:
    family += ', AMX'
  name = fields.get('model name', 'unknown CPU')
  if 'cpu family' in fields and 'model' in fields:
    name += f' (family {fields["cpu family"]}, model {fields["model"]})'
  return f'{name} ({family}), {os.cpu_count()} cores'


MEAN = "output_layer.halves = 'mean'"
BF16 = "precision.products = 'bfloat16'"
SHORTLIST = 2048
SHORT = f'output_layer.shortlist = {SHORTLIST}'
FULL = 'output_layer.shortlist = 0'  # Trax's layer at any vocabulary.
KEPT = f'reversible.kept_blocks = {LAYERS}'
JADE_BINDS = {  # Each Jade contender's gin bindings.
  'jade': [],
  'jade-mean': [MEAN],
  'jade-xla-attend': [],
  'jade-bf16': [BF16],
  'jade-bf16-no-amx': [BF16],  # Built without AMX (JADE_AMX=off).
  'jade-mean-bf16': [MEAN, BF16],
  'jade-short': [SHORT],
  'jade-short-bf16': [SHORT, BF16],
  'jade-full': [FULL],
  'jade-full-bf16': [FULL, BF16],
  'jade-kept': [KEPT],
  'jade-kept-bf16': [KEPT, BF16],
}
CONTENDERS = {
  **{name: run_jade for name in JADE_BINDS},
  'peer': run_peer,
  'peer-tuned': run_peer,
  'peer-tuned-bf16': functools.partial(run_peer, bf16=True),
  'full': run_full,
}
JEMALLOC = '/usr/lib/x86_64-linux-gnu/libjemalloc.so.2'
TUNED_ENV = {
  'LD_PRELOAD': JEMALLOC,
  'MALLOC_CONF': 'dirty_decay_ms:-1,muzzy_decay_ms:-1',
}


def child(args):
  if args.child == 'peak':
    print(json.dumps({'gflops': matmul_peak(), 'blas_gflops': blas_peak()}))
    return
  if args.child == 'peak-bf16':
    print(json.dumps({'gflops': matmul_peak(bf16=True)}))
    return
  kwargs = {'with_eval': True} if args.eval else {}
  if args.child == 'jade-xla-attend':
    os.environ['JADE_CHUNK_KERNEL'] = 'off'
  if args.child.startswith('jade'):
    binds = args.bind + JADE_BINDS[args.child]
    kwargs['binds'], kwargs['window'] = binds, args.window
  times, vocab = CONTENDERS[args.child](
    args.length, args.steps, args.vocab, **kwargs
  )
  vocab, shortlist = vocab if isinstance(vocab, tuple) else (vocab, 0)
  print(
    json.dumps(
      {
        'times': times,
        'vocab': vocab,
        'shortlist': shortlist,
        'peak_rss': peak_rss(),
      }
    )
  )


def measure(
  name,
  length,
  steps,
  vocab,
  python,
  timeout,
  with_eval=False,
  binds=(),
  window=0,
):
  """One contender's row. With `window`, Jade trains its `length`-token
  model on windows of `window` tokens (`train.window`) and the others
  train at `window` tokens: tokens/s counts the tokens of a step."""
  tokens = window or length
  jade = name.startswith('jade')
  if window and not jade:
    length = window
  cmd = [python, os.path.abspath(__file__), '--child', name]
  for b in binds if jade else ():
    cmd += ['--bind', b]
  if window and jade:
    cmd += ['--window', str(window)]
  if with_eval:
    cmd.append('--eval')
  cmd += ['--length', str(length), '--steps', str(steps)]
  cmd += ['--vocab', str(vocab)]
  env = dict(os.environ)
  if BF16 in JADE_BINDS.get(name, ()):  # bfloat16 products need YNNPACK's.
    env['XLA_FLAGS'] = f'{env.get("XLA_FLAGS", "")} {YNN_PRODUCTS}'.strip()
  if name.endswith('-no-amx'):
    env['JADE_AMX'] = 'off'
  if name.startswith('peer-tuned'):
    if not os.path.exists(JEMALLOC):
      return {'error': f'no {JEMALLOC} (apt install libjemalloc2)'}
    env.update(TUNED_ENV)
  t = time.time()
  try:
    r = subprocess.run(
      cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
  except subprocess.TimeoutExpired:
    return {'error': f'over {timeout} s'}
  wall = time.time() - t
  if r.returncode:
    tail = (r.stderr.strip().splitlines() or ['?'])[-1]
    if 'RESOURCE_EXHAUSTED' in r.stderr or 'Out of memory' in r.stderr:
      tail = 'out of memory: ' + tail[:160]
    if r.returncode in (-9, 137):
      tail = 'killed (out of memory)'
    return {'error': tail[:240], 'wall': wall}
  out = json.loads(r.stdout.strip().splitlines()[-1])
  times = out['times']
  warm = 2 if len(times) > 3 else 1
  timed = times[warm:] or times[-1:]
  step = statistics.median(timed)
  tokens_per_s = tokens / step
  lsh = name != 'full'
  vocab = out['vocab']  # The tokenizer's, which may be a little smaller.
  return {
    'vocab': vocab,
    'tokens_per_s': tokens_per_s,
    'step_s': step,
    'first_steps_s': [round(x, 2) for x in times[:warm]],
    'timed_steps': len(timed),
    'peak_rss_gb': out['peak_rss'] / 1e9,
    'gflops': tokens_per_s
    * flops_per_token(
      tokens, lsh, vocab, output_features(name), out.get('shortlist', 0)
    )
    / 1e9,
    'wall': wall,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--child', choices=[*CONTENDERS, 'peak', 'peak-bf16'])
  parser.add_argument('--length', type=int, default=8192)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--vocab', type=int, default=VOCAB)
  parser.add_argument(
    '--lengths', type=int, nargs='+', default=[8192, 16384, 32768, 65536]
  )
  parser.add_argument(
    '--contenders',
    nargs='+',
    default=['jade', 'peer', 'peer-tuned', 'full'],
  )
  parser.add_argument('--peer-python', default=sys.executable)
  parser.add_argument('--peak-gflops', type=float, default=None)
  parser.add_argument('--timeout', type=int, default=1200)
  parser.add_argument(
    '--vocabs',
    type=int,
    nargs='+',
    default=[VOCAB],
    help='vocabulary sizes; every contender runs at each',
  )
  parser.add_argument(
    '--window',
    type=int,
    default=0,
    help='jade trains each length on windows of this many tokens '
    '(train.window); the peers train at this length',
  )
  parser.add_argument(
    '--rounds',
    type=int,
    default=1,
    help='run every contender this many times, in turn; report medians',
  )
  parser.add_argument('--smoke', action='store_true')
  parser.add_argument(
    '--eval',
    action='store_true',
    help='jade: keep the evaluation at steps 1 and last (peak RSS)',
  )
  parser.add_argument('--json', default=None, help='write results here')
  parser.add_argument(
    '--bind',
    action='append',
    default=[],
    metavar='GIN',
    help='jade: an extra gin binding, e.g. "output_loss.chunk_size = 512"',
  )
  args = parser.parse_args()
  if args.rounds < 1:
    parser.error(f'--rounds {args.rounds}: give 1 or more')
  if args.child:
    return child(args)
  if args.smoke:
    args.lengths, args.steps, args.vocabs = [1024], 2, [VOCAB]
  results, peaks = [], []
  for turn in range(1, args.rounds + 1):
    for length in args.lengths:
      for vocab in args.vocabs:
        for name in args.contenders:
          if name == 'full' and any(
            r['name'] == 'full' and r['length'] < length and 'error' in r
            for r in results
          ):
            continue  # Already out of memory at a shorter length.
          r = run_row(args, name, length, vocab)
          r['round'] = turn
          results.append(r)
          print(json.dumps(r), flush=True)
    peaks.append((*measured_peak(), measured_peak('peak-bf16')[0]))
  jax_peak, blas, bf16_peak = (median_of(p) for p in zip(*peaks))
  machine = {
    'cpu': cpu_name(),
    'matmul_peak_gflops': jax_peak,
    'blas_peak_gflops': blas,
    'bf16_matmul_peak_gflops': bf16_peak,
  }
  peak = args.peak_gflops or jax_peak
  if args.rounds > 1:
    machine['peaks_by_round'] = peaks
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'machine': machine, 'results': results}, f, indent=2)
  print(
    f'{machine["cpu"]}; matmul peak (4096^3 float32) '
    + (f'{jax_peak:.0f} GFLOP/s under JAX' if jax_peak else 'not measured')
    + (f", {blas:.0f} under numpy's BLAS" if blas else '')
    + (f'; bfloat16 inputs, float32 sums: {bf16_peak:.0f}' if bf16_peak else '')
    + (
      f' (medians of {args.rounds} rounds; float32 '
      + ', '.join(f'{p[0]:.0f}' for p in peaks if p[0])
      + ')'
      if args.rounds > 1
      else ''
    )
  )
  print_table(
    by_median(results) if args.rounds > 1 else results, peak, blas, bf16_peak
  )


def run_row(args, name, length, vocab):
  """One run of one contender (`measure`), labelled with what was asked."""
  python = args.peer_python if 'peer' in name else sys.executable
  r = measure(
    name,
    length,
    args.steps,
    vocab,
    python,
    args.timeout,
    args.eval,
    args.bind,
    args.window,
  )
  r.setdefault('vocab', vocab)
  r.update(name=name, length=length, asked_vocab=vocab)
  if args.window:
    grid = length if name.startswith('jade') else None
    r.update(length=args.window, grid=grid)
  return r


def median_of(values):
  """The median of the values measured (None where none was)."""
  kept = [v for v in values if v is not None]
  return statistics.median(kept) if kept else None


def by_median(results):
  """One row per contender, length and vocabulary from several rounds'
  runs: the median run by tokens/s (its memory, FLOP/s and first steps),
  with every run's tokens/s in `runs`; a contender whose runs all failed
  keeps its last error."""
  groups = {}
  for r in results:
    key = (r['name'], r['length'], r.get('asked_vocab', r.get('vocab')))
    groups.setdefault(key, []).append(r)
  rows = []
  for runs in groups.values():
    good = sorted(
      (r for r in runs if 'error' not in r), key=lambda r: r['tokens_per_s']
    )
    if not good:
      rows.append(runs[-1])
      continue
    row = dict(good[(len(good) - 1) // 2])
    row['tokens_per_s'] = statistics.median(r['tokens_per_s'] for r in good)
    row['gflops'] = statistics.median(r['gflops'] for r in good)
    row['runs'] = [r['tokens_per_s'] for r in good]
    rows.append(row)
  return rows


def measured_peak(which: str = 'peak'):
  """(JAX's, numpy's BLAS's) matmul peak in GFLOP/s, measured in a child
  process (None where it failed); `which` 'peak-bf16': (the bfloat16
  product's under JAX, None)."""
  r = subprocess.run(
    [sys.executable, os.path.abspath(__file__), '--child', which],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  try:
    peaks = json.loads(r.stdout.strip().splitlines()[-1])
    return peaks['gflops'], peaks.get('blas_gflops')
  except (ValueError, IndexError, KeyError):
    return None, None


def _best_peers(results, bf16: bool) -> dict:
  """The fastest float32 peer (peer, peer-tuned) or bfloat16 peer
  (peer-tuned-bf16) per length and vocabulary."""
  best = {}
  for r in results:
    name = r['name']
    if not name.startswith('peer') or 'error' in r:
      continue
    if name.endswith('-bf16') != bf16:
      continue
    at = (r['length'], r.get('asked_vocab', r['vocab']))
    if at not in best or r['tokens_per_s'] > best[at]['tokens_per_s']:
      best[at] = r
  return best


def tokens_cell(r) -> str:
  """A row's tokens/s; from several runs, their median and range."""
  runs = r.get('runs')
  if not runs or len(runs) < 2:
    return f'{r["tokens_per_s"]:.0f}'
  return f'{r["tokens_per_s"]:.0f} ({min(runs):.0f}-{max(runs):.0f})'


def print_table(results, peak, blas=None, bf16_peak=None):
  """The table; a bfloat16 contender's (`-bf16`) FLOP/s are also set
  against the bfloat16 product's peak (`bf16_peak`), where measured."""
  peer, peer_bf16 = _best_peers(results, False), _best_peers(results, True)
  print(
    '| contender | length | vocab | tokens/s | vs best peer | vs bf16 peer | '
    'peak RSS GB | RSS vs best peer | GFLOP/s | % of peak | % of BLAS peak | '
    '% of bf16 peak | compile+first steps s |'
  )
  print('|---|---|---|---|---|---|---|---|---|---|---|---|---|')
  for r in results:
    if 'error' in r:
      print(
        f'| {r["name"]} | {r["length"]} | {r["vocab"]} | {r["error"]} '
        '| | | | | | | | | |'
      )
      continue
    at = (r['length'], r.get('asked_vocab', r['vocab']))
    p, pb = peer.get(at), peer_bf16.get(at)
    ratio = f'{r["tokens_per_s"] / p["tokens_per_s"]:.2f}x' if p else ''
    ratio_bf16 = f'{r["tokens_per_s"] / pb["tokens_per_s"]:.2f}x' if pb else ''
    rss = f'{r["peak_rss_gb"] / p["peak_rss_gb"]:.2f}x' if p else ''
    share = f'{100 * r["gflops"] / peak:.1f}%' if peak else ''
    of_blas = f'{100 * r["gflops"] / blas:.1f}%' if blas else ''
    is_bf16 = bf16_peak and r['name'].endswith('-bf16')
    of_bf16 = f'{100 * r["gflops"] / bf16_peak:.1f}%' if is_bf16 else ''
    print(
      f'| {r["name"]} | {r["length"]} | {r["vocab"]} | '
      f'{tokens_cell(r)} | {ratio} | {ratio_bf16} | '
      f'{r["peak_rss_gb"]:.2f} | {rss} | '
      f'{r["gflops"]:.1f} | {share} | {of_blas} | {of_bf16} | '
      f'{r["first_steps_s"]} |'
    )


if __name__ == '__main__':
  # No bootstrap here: the peer's children run in the peer's venv, which
  # has neither Trax nor TensorFlow; the Jade and Trax contenders
  # bootstrap in their own functions.
  main()
