"""Memory pre-flight: refuses what cannot fit, matches measured peaks."""

import os
import subprocess
import sys

import pytest

from src.core.errors import UserError
from src.model import ginconf, preflight

from .conftest import DATA, ROOT, TINY_GIN


def long_bindings(length, axial):
  return (
    f'ReformerLM.max_len = {length}',
    f'ReformerLM.pos_axial_shape = {axial}',
    f'LSHSelfAttention.n_buckets = {length // 32}',
    f'LSHSelfAttention.predict_mem_len = {length}',
  )


def test_refuses_an_impossible_config_and_accepts_a_small_one(monkeypatch):
  setup = ginconf.parse(TINY_GIN)
  monkeypatch.setattr(
    preflight, 'device_limit', lambda: (4e9, 'the test device has 4.0 GB')
  )
  est, limit = preflight.check(setup, 300, 1, 2048)
  assert est.total < limit
  with pytest.raises(UserError) as e:
    preflight.check(setup, 300, 512, 2048)  # 512 chunks per device.
  message = str(e.value)
  assert message.startswith(f'{TINY_GIN}: this run needs about ')
  assert 'per device (activations ' in message  # Biggest part first.
  assert 'but the test device has 4.0 GB; lower the per-device batch' in message
  assert '\n' not in message
  # A vocabulary of a million with unchunked logits: the logits dominate.
  with pytest.raises(UserError, match=r'needs about .* \(logits '):
    preflight.check(setup, 1_000_000, 1, 0)


def test_chunked_logits_are_cheaper_than_full_ones():
  setup = ginconf.parse(TINY_GIN, long_bindings(32768, (128, 256)))
  full = preflight.estimate(setup, 32000, 1, 0, n_weights=10**6)
  chunked = preflight.estimate(setup, 32000, 1, 2048, n_weights=10**6)
  # The logits of one chunk instead of the whole context, the output
  # kernel's gradient summed over the chunks and its transposed copy, and
  # the rows transposed.
  features = 2 * setup.model['d_model']
  want = (3 * 2048 * 32000 + 3 * 32000 * features + 32768 * features) * 4
  assert chunked.logits == want < full.logits / 15


def test_an_output_tied_only_holds_fewer_weights_and_multiplies_as_many():
  """`output_layer.tied = 'only'` holds no kernel of its own (fewer
  weights to keep), yet training makes one from the embedding and
  multiplies it: the step's products are those of `tied = True`."""
  both = ginconf.parse(TINY_GIN, ('output_layer.tied = True',))
  only = ginconf.parse(TINY_GIN, ("output_layer.tied = 'only'",))
  features = 2 * only.model['d_model']
  held = preflight.count_weights(both, 500) - preflight.count_weights(only, 500)
  assert held == features * 500
  assert preflight.step_flops(only, 500, 4, 128) == preflight.step_flops(
    both, 500, 4, 128
  )


MEASURE = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(r.stderr[-3000:])
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.mark.parametrize(
  'length,axial',
  [(1024, (32, 32)), pytest.param(16384, (128, 128), marks=pytest.mark.slow)],
)
def test_estimate_is_within_35_percent_of_measured_peak(
  length, axial, tmp_path
):
  out = str(tmp_path / 'run')
  binds = long_bindings(length, axial)
  args = [sys.executable, 'train.py', '--gin', TINY_GIN, '--out-dir', out]
  args += ['--data', DATA]
  args += ['--steps', '2', '--eval-every', '10', '--vocab-size', '300']
  for b in binds:
    args += ['--bind', b]
  result = subprocess.run(
    [sys.executable, '-c', MEASURE, *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    # A cold start, as the estimate is: a cached compilation takes less.
    env={**os.environ, 'JADE_COMPILE_CACHE': 'off'},
  )
  code, peak_kb = result.stdout.split()
  assert code == '0', result.stderr
  measured = int(peak_kb) * 1024
  setup = ginconf.parse(TINY_GIN, binds)
  estimate = preflight.estimate(setup, 300, 1, 512).total
  assert abs(estimate - measured) / measured < 0.35, (estimate, measured)


def test_weight_count_is_close_to_the_models():
  import jax
  import numpy as np
  import trax

  setup = ginconf.parse(TINY_GIN)
  m = ginconf.model(300, 'train')
  sig = trax.shapes.ShapeDtype((1, setup.max_len), np.int32)
  weights, _ = m.weights_and_state_signature(sig, unsafe=True)
  exact = sum(
    int(np.prod(w.shape))
    for w in jax.tree_util.tree_leaves(weights)
    if hasattr(w, 'shape')
  )
  assert abs(preflight.count_weights(setup, 300) - exact) < 0.2 * exact


def test_time_preflight_counts_flops_and_warns_past_a_day():
  from src.training import progress

  tiny = ginconf.parse(TINY_GIN)
  full = ginconf.parse(os.path.join(ROOT, 'gin', 'reformer_32k.gin'))
  small, big = (preflight.step_flops(s, 500, 1) for s in (tiny, full))
  assert 0 < small < big
  # 64x the tokens, more layers, wider: thousands of times the work.
  assert big / small > 1000
  assert preflight.step_flops(tiny, 500, 2) == 2 * small
  assert preflight.device_flops_per_second() > 0
  lines = progress.time_lines(70.0, 0, 20000)
  assert lines[0].startswith('time estimate: about 70 s a step')
  assert '16 days for steps 1..20000' in lines[0]
  assert 'more than 16 day(s)' in lines[1] and 'gin/tiny.gin' in lines[1]
  assert len(progress.time_lines(0.05, 0, 1500)) == 1


def test_the_time_estimate_weighs_long_attention_chunks(monkeypatch):
  """The attention's products run at a smaller share of the matrix rate
  than the dense ones, XLA's at less than the fused kernel's: on the
  walkthrough's runs (float32, an AVX2 Zen 4 whose products ran at 98
  GFLOP/s, the kernel built and skipping the tiles the mask zeroes) one
  window of 4,096 with chunks of 2,048 took 2.1x the step of 16 windows of
  256 with chunks of 256 (0.816 s against 0.390)."""
  from src.model import chunk_attention, kernels

  monkeypatch.setattr(preflight, 'device_flops_per_second', lambda: 9.8e10)

  def by_size(rows, chunk, before):  # As where the kernels are built.
    return rows * chunk * (before + 1) >= chunk_attention.MIN_SCORES

  monkeypatch.setattr(chunk_attention, 'takes', by_size)
  gin = os.path.join(ROOT, 'gin', 'long_memory.gin')
  # As measured: values of 32 a head (the gin's 64 came later).
  measured = ('ReformerLM.d_attention_value = 32',)
  short = ginconf.parse(gin, measured)
  long = ginconf.parse(gin, measured + ('LSHSelfAttention.chunk_len = 2048',))
  first = preflight.step_seconds(short, 1000, 16, 256)
  last = preflight.step_seconds(long, 1000, 1, 4096)
  assert 0.8 < first / 0.390 < 1.25 and 0.8 < last / 0.816 < 1.25
  dense, attention = preflight.step_parts(long, 1000, 1, 4096)
  assert dense + attention == preflight.step_flops(long, 1000, 1, 4096)
  # 8,192 keys a query in the LSH block, about half of their tiles skipped.
  assert attention > 0.8 * dense
  # Every call of both runs goes to the kernel: the LSH block's (2 x 4,096
  # queries x 4,096 keys), the local blocks' (4,096 x 64), the short run's
  # (256 x 64 the smallest); a call below `MIN_SCORES` stays with XLA.
  by_xla, fused = preflight.attention_parts(long, 4096, 4096)
  assert by_xla == 0 and fused == attention
  assert preflight.attention_parts(short, 4096, 256)[0] == 0
  small = ginconf.parse(gin, ('SelfAttention.chunk_len = 8',))
  by_xla, fused = preflight.attention_parts(small, 4096, 256)
  assert by_xla > 0 and fused > 0  # Local 256 x 16 by XLA, LSH fused.
  # bfloat16 products: the same step at the bfloat16 rate; on AMX the
  # kernel's passes take 32 rows, not 16, so more of their tiles are live.
  fast = preflight.step_seconds(long, 1000, 1, 4096, 'bfloat16')
  overhead = preflight.STEP_OVERHEAD
  speedup = preflight.BFLOAT16_SPEEDUP
  ratio = (fast - overhead) / ((last - overhead) / speedup)
  if kernels.amx():
    assert 1.001 < ratio < 1.2
  else:
    assert ratio == pytest.approx(1)


def test_the_kernels_live_share_counts_the_tiles_it_scores(monkeypatch):
  """A local layer's chunks in position order: with passes of a whole
  chunk (chunks of 64 or less) every tile of a chunk's own keys is live
  and only the first chunk's look-back (to the last chunk, wrapped) is
  dead; with longer chunks a pass's later key tiles are dead too. LSH's
  bucketed order leaves more dead. `JADE_CHUNK_SKIP=off` scores them all,
  and the estimate then counts them all."""
  from src.model import chunk_attention, kernels

  if not kernels.ready():
    pytest.skip('the CPU kernels are not built here')
  monkeypatch.delenv('JADE_CHUNK_SKIP', raising=False)
  assert chunk_attention.live_share(256, 64, 1) == 1 - 1 / 8  # 4 chunks.
  chunk, n = 512, 4
  rows = kernels.pass_rows(chunk, 2 * chunk)
  passes = -(-chunk // rows)
  own = sum(  # Tiles of 16 keys at or before the pass's last row.
    -(-min((p + 1) * rows, chunk) // 16) for p in range(passes)
  )
  expected = ((n - 1) * passes * chunk / 16 + n * own) / (
    2 * n * passes * chunk / 16
  )
  assert chunk_attention.live_share(n * chunk, chunk, 1) == pytest.approx(
    expected
  )
  lsh = chunk_attention.live_share(4096, 2048, 1, n_hashes=2, n_buckets=2)
  assert 0.4 < lsh < 0.6  # The kernel counted 0.52 on the walkthrough's.
  long = ginconf.parse(
    os.path.join(ROOT, 'gin', 'long_memory.gin'),
    ('LSHSelfAttention.chunk_len = 2048',),
  )
  skipping = preflight.attention_parts(long, 4096, 4096)[1]
  monkeypatch.setenv('JADE_CHUNK_SKIP', 'off')
  assert chunk_attention.live_share(4096, 2048, 1, 2, 2) == 1.0
  assert skipping < 0.7 * preflight.attention_parts(long, 4096, 4096)[1]


def test_the_time_estimate_counts_attention_the_kernel_would_not_take(
  monkeypatch,
):
  """Without the kernel (`JADE_CHUNK_KERNEL=off`, no compiler, a GPU) every
  attention product is counted at XLA's share: a slower estimate."""
  from src.model import chunk_attention

  monkeypatch.setattr(preflight, 'device_flops_per_second', lambda: 2e11)
  long = ginconf.parse(
    os.path.join(ROOT, 'gin', 'long_memory.gin'),
    ('LSHSelfAttention.chunk_len = 2048',),
  )
  monkeypatch.setenv('JADE_CHUNK_KERNEL', 'off')
  assert not chunk_attention.takes(8192, 2048, 1)
  assert preflight.attention_parts(long, 4096, 4096)[1] == 0
  slow = preflight.step_seconds(long, 1000, 1, 4096)
  monkeypatch.setenv('JADE_CHUNK_KERNEL', 'always')
  if chunk_attention.takes(8192, 2048, 1):  # The kernels built here.
    assert preflight.step_seconds(long, 1000, 1, 4096) < 0.8 * slow


def test_attention_text_names_each_class_as_bound():
  """The pre-flight line and the model card name the classes the gin binds
  (a smeared model is not called `LSHSelfAttention (directed)`)."""
  smeared = (
    'ReformerLM.attention_type = [@SmearedLocalSelfAttention, '
    '@SmearedDirectedLSHSelfAttention, @SmearedLocalSelfAttention]'
  )
  assert ginconf.parse(TINY_GIN).attention_text == (
    'blocks local, LSH, local (LSH: DirectedLSHSelfAttention; '
    'local: LocalSelfAttention, chunk 32)'
  )
  assert ginconf.parse(TINY_GIN, (smeared,)).attention_text == (
    'blocks local, LSH, local (LSH: SmearedDirectedLSHSelfAttention; '
    'local: SmearedLocalSelfAttention, chunk 32)'
  )
  one = ('ReformerLM.attention_type = @FastLSHSelfAttention',)
  assert ginconf.parse(TINY_GIN, one).attention_text == 'FastLSHSelfAttention'


# tiny.gin: d_model 128, so 256 features; a shortlist's default width 64.
@pytest.mark.parametrize(
  'binding,width,kernel',
  [
    ((), 256, 256 * 32000),
    (("output_layer.tied = 'only'",), 128, 256 * 128 + 128 * 32000),
    (
      ('output_layer.shortlist = 2048',),
      256,
      256 * 2049 + 256 * 64 + 64 * (32000 - 2048),
    ),
  ],
)
def test_the_loss_memory_counts_the_kernels_each_output_layer_scores(
  binding, width, kernel
):
  """Training's chunked loss holds a copy of the gradient and of the
  second layout of the kernels it scores: Trax's `features x vocab`,
  the embedding's matrix through the embedding alone, a shortlist's
  head, projection and narrow tail (not a full kernel's)."""
  bindings = long_bindings(32768, (128, 256)) + binding
  setup = ginconf.parse(TINY_GIN, bindings)
  est = preflight.estimate(setup, 32000, 1, 2048, n_weights=10**6)
  assert setup.model['d_model'] == 128
  assert est.logits == (3 * 2048 * 32000 + 3 * kernel + 32768 * width) * 4
