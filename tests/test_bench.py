"""The benchmark scripts run end to end in smoke mode (slow: -m slow)."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from src.analysis import lsh_views, persona, recall, symbols

from .conftest import DATA, ROOT


@pytest.mark.slow
def test_train_speed_smoke():
  contenders = ['jade', 'full']
  if importlib.util.find_spec('reformer_pytorch'):
    contenders.append('peer')
  result = subprocess.run(
    [sys.executable, 'bench/train_speed.py', '--smoke', '--contenders']
    + contenders,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  for name in contenders:
    assert f'| {name} | 1024 | 500 | ' in result.stdout
  assert 'GFLOP/s under JAX' in result.stdout
  assert "under numpy's BLAS" in result.stdout


@pytest.mark.slow
def test_prepare_corpus_smoke(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      'bench/prepare_corpus.py',
      '--gigabytes',
      '0.003',
      '--files',
      '2',
      '--dir',
      str(tmp_path),
      '--vocab-size',
      '300',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'hit=True' in result.stdout


def test_chat_quality_metrics():
  from src.analysis import chat_quality as q

  assert q.normalize('  Hi  There!! ') == 'hi there'
  assert q.has_loop('we go round and we go round and on')
  assert not q.has_loop('we go round and round and round')
  from src.data import chatformat

  convs = chatformat.parse_text(
    'Hi\n|aigenerationstart|Hello there.|endofgeneration|\n\n'
    'Hi\n|aigenerationstart|Hey|endofgeneration|\n\n'
    '|aigenerationstart|I start.|endofgeneration|\n',
    'x.txt',
  )
  answers, shown = q.first_exchanges(convs)
  assert answers == {'Hi': {'hello there', 'hey'}} and shown['Hi'] == (
    'Hello there.'
  )


def test_english_share_knows_and_sensible():
  from src.analysis import chat_quality as q

  words = {'i', 'am', 'doing', 'well', "don't", 'know'}
  assert q.words_of("I don't KNOW, 42 well-") == ['i', "don't", 'know', 'well']
  assert q.english_share('I am doing well.', words) == 1.0
  assert q.english_share('I amn trainking well', words) == 0.5
  assert q.english_share('?!', words) == 0.0
  assert q.sensible('I am doing well.', True, words)
  assert not q.sensible('I am doing well.', False, words)  # Never ended.
  assert not q.sensible('i am doing well i am doing well', True, words)
  assert not q.sensible('I am doing wel.', True, words)  # 3 of 4 words.
  assert q.knows('I live in Lisbon.', ('lisbon',))
  assert q.knows('By bike!', ('bicycle', 'bike'))
  assert q.knows('I read The Hobbit', ('the hobbit',))
  assert not q.knows('Lisbonia', ('lisbon',))  # Whole words only.


def test_persona_facts_match_the_shipped_chats():
  """src/analysis/persona.py's facts are what data/persona trains: every trained
  way of asking opens a conversation whose answer names the fact, and no
  paraphrase is in the data."""
  from src.analysis import chat_quality as q
  from src.data import chatformat

  facts = persona.FACTS
  assert len(facts) == 12
  convs = chatformat.read_data(os.path.join(ROOT, 'data', 'persona'))
  assert 36 <= len(convs) <= 45
  answers, _ = q.first_exchanges(convs)
  users = {t.text for c in convs for t in c.turns if t.role == 'user'}
  for keywords, trained, paraphrase, reply in facts:
    assert len(trained) == 3
    for prompt in trained:
      assert any(q.knows(a, keywords) for a in answers[prompt]), prompt
    assert paraphrase not in users and q.knows(reply, keywords)


def test_chat_quality_scores_a_trained_model(tiny_run):
  """The figures on a tiny run (the metrics, not the targets): counts in
  range, a hit only where the reply equals a trained answer."""
  from src.analysis import chat_quality as q

  m = q.measure(tiny_run['out'], n_prompts=4)
  assert m['n'] == 4 and 0 <= m['hits'] <= 4
  assert 0 <= m['ended'] <= m['n_held'] and 0 <= m['loops'] <= m['n_held']
  assert m['hits'] == sum(hit for *_, hit in m['samples'])
  from src.analysis import memorization

  answers, _ = q.first_exchanges(memorization.split(tiny_run['out'], None)[0])
  for prompt, reply, _, hit in m['samples']:
    assert hit == (q.normalize(reply) in answers[prompt])
  assert len(q.summary(m)) == 3


def test_recall_samples_hold_the_fact_once_at_the_distance_asked():
  q = recall
  from src.data import chatformat

  filler = chatformat.read_data(DATA)
  rng = np.random.default_rng(0)

  def count(role, text):
    return len(text.split()) + 2

  for distance in (0, 50, 400):
    s = q.make_sample(rng, filler, distance, count)
    statement, question, values = recall.FACTS[s.kind]
    assert s.answer in values
    assert s.turns[0] == ('user', statement.format(s.answer))
    assert s.turns[-2:] == [('user', question), ('ai', s.answer)]
    # The fact is stated once; the filler between holds at least the
    # distance asked, counted the way `count` counts.
    said = [t for r, t in s.turns if t == statement.format(s.answer)]
    assert len(said) == 1
    between = s.turns[2:-2]
    assert sum(count(r, t) for r, t in between) == s.distance >= distance
    roles = [r for r, _ in s.turns]
    assert all(a != b for a, b in zip(roles, roles[1:]))  # Alternating.
    blank = q.make_sample(rng, filler, distance, count, with_fact=False)
    assert all(t != statement.format(blank.answer) for _, t in blank.turns)
  text = recall.to_text([s.turns], chatformat.Markers())
  assert chatformat.parse_text(text, 'x.txt')[0].turns[-1].text == s.answer


def test_recall_training_conversations_ask_what_they_stated():
  q = recall
  from src.data import chatformat

  filler = chatformat.read_data(DATA)
  rng = np.random.default_rng(1)

  def count(role, text):
    return len(text.split()) + 2

  turns, asked = q.make_training_conversation(rng, filler, 300, count)
  assert len(asked) == len(recall.FACTS)  # Every kind, asked once.
  said = {}
  for i, (role, text) in enumerate(turns):
    for kind, (statement, question, values) in recall.FACTS.items():
      for v in values:
        if role == 'user' and text == statement.format(v):
          assert kind not in said  # Stated once,
          said[kind] = v
      if role == 'user' and text == question:
        assert turns[i + 1] == ('ai', said[kind])  # answered after it.
  assert {k: v for k, v, _ in asked} == said
  assert all(d >= 0 for _, _, d in asked)
  roles = [r for r, _ in turns]
  assert all(a != b for a, b in zip(roles, roles[1:]))
  # Loss on the answers only: every other AI turn is context.
  text = recall.to_text([turns], chatformat.Markers(), loss='answers')
  parsed = chatformat.parse_text(text, 'x.txt')[0].turns
  trained = [t.text for t in parsed if t.role == 'ai' and t.train]
  assert sorted(trained) == sorted(said.values())
  everything = chatformat.parse_text(
    recall.to_text([turns], chatformat.Markers()), 'x.txt'
  )[0].turns
  assert all(t.train for t in everything)
  turns, asked = q.make_training_conversation(rng, filler, 300, count, asks=3)
  assert len(asked) == 3 * len(recall.FACTS)
  for i, (role, text) in enumerate(turns):
    if role == 'user' and text in recall.QUESTIONS:
      kind = next(k for k, f in recall.FACTS.items() if f[1] == text)
      assert turns[i + 1] == ('ai', dict((k, v) for k, v, _ in asked)[kind])


def test_recall_scores_a_trained_model(tiny_run):
  """Scoring on the shared tiny run (128 tokens): shares and probabilities
  in range; the stated value's probability is part of its kind's."""
  q = recall
  from src.data import chatformat

  filler = chatformat.read_data(DATA)
  got = q.score(tiny_run['out'], filler, [8, 24], samples=3, n_hashes=2)
  assert set(got) == {'8', '24', 'no fact'}
  for r in got.values():
    assert 0 <= r['accuracy'] <= r['token_accuracy'] <= 1
    assert 0 <= r['value_probability'] <= r['kind_mass'] <= 1 + 1e-5
    assert r['mean_distance'] >= 8
  for d in ('8', '24'):  # LSH: what the answer's query could attend to.
    assert len(got[d]['value_in_view']) == 1  # One share per LSH layer.
    shares = got[d]['value_in_view'] + got[d]['question_in_view']
    assert all(0 <= v <= 1 for v in shares)
    assert 0 <= got[d]['value_in_view_at_random'] <= 1
  assert 'value_in_view' not in got['no fact']
  rows = q.table({'runs': {'lsh': {'by_distance': got}}}, [8, 24])
  assert rows[0] == '| model | 8 | 24 | no fact |' and len(rows) == 7
  assert rows[4].startswith('| value in view') and rows[6].startswith('| lsh')


def test_recall_in_view_follows_trax_lsh_chunking():
  """Sorted by (bucket, position), cut into chunks; a chunk sees itself and
  the chunk before it; causal, never itself."""
  # One bucket: the sorted order is the positions' own.
  one = np.zeros(128, np.int64)
  assert lsh_views.in_view(one, 128, 32, 1, 100) == set(range(64, 100))
  assert lsh_views.in_view(one, 128, 32, 0, 100) == set(range(96, 100))
  # Two hash rounds (offset buckets, as Trax adds): the same view.
  two = np.concatenate([one, one + 1])
  assert lsh_views.in_view(two, 128, 32, 1, 100) == set(range(64, 100))
  # Even positions in bucket 0, odd in bucket 1: an odd query sees only
  # odd positions, back two chunks' worth.
  parity = np.arange(128) % 2
  assert lsh_views.in_view(parity, 128, 32, 1, 101) == set(range(1, 101, 2))
  assert lsh_views.in_view(parity, 128, 16, 1, 101) == set(range(65, 101, 2))


def test_positions_echo_conversations_answer_the_word_asked():
  p = recall
  convs = p.echo_conversations(5, seed=3)
  assert len(convs) == 5
  for turns in convs:
    assert len(turns) == 12
    for (r1, ask), (r2, answer) in zip(turns[::2], turns[1::2]):
      assert (r1, r2) == ('user', 'ai')
      assert ask == f'Repeat {answer}.'
  words = {t for turns in convs for r, t in turns if r == 'ai'}
  assert len(words) > 10  # Drawn at random, not one word.


@pytest.mark.slow
def test_positions_smoke(tmp_path):
  result = subprocess.run(
    [sys.executable, 'bench/positions.py', str(tmp_path), '--steps', '4']
    + ['--variants', 'tokens,fixed', '--attention', 'full'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert (
    '| full, tokens | ' in result.stdout and '| full, fixed | ' in result.stdout
  )


def test_associative_recall_answers_are_the_values_stated_before():
  rng = np.random.default_rng(3)
  x, y, w = next(symbols.recall_batches(rng, 3, 256, pairs=16))
  assert x.shape == y.shape == w.shape == (3, 256)
  assert (x == y).all() and (w.sum(axis=1) == 16).all()
  for seq, weights in zip(x, w):
    stated = dict(zip(seq[1:33:2], seq[2:33:2]))  # key -> value
    assert len(stated) == 16 and all(1 <= k < 64 for k in stated)
    assert (seq[33:128] == 0).all()  # Padding up to the second half.
    answers = np.flatnonzero(weights)
    assert (answers >= 129).all()  # Only in the second half.
    for at in answers:
      assert 64 <= seq[at] < symbols.VOCAB
      assert stated[seq[at - 1]] == seq[at]  # The key before it, stated.
    assert sorted(seq[answers - 1]) == sorted(stated)  # Each asked once.


@pytest.mark.slow
def test_hostile_smoke(tmp_path):
  result = subprocess.run(
    [sys.executable, 'bench/hostile.py', str(tmp_path / 'work'), '--smoke'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  assert 'outside the out-dir after the resumes: unchanged' in result.stdout
  assert 'Traceback' not in result.stdout


def test_blas_ffi_products_and_gradients_equal_xlas():
  """bench/blas_ffi.py (issue 54's FFI experiment): OpenBLAS's products
  from an XLA FFI call equal XLA's in every form, under jit and vmap, with
  their gradients; a failure inside the handler is the call's error, not a
  wrong result."""
  import jax
  import jax.numpy as jnp

  from bench import blas_ffi

  rng = np.random.default_rng(0)
  shapes = {'nn': ((8, 5, 3), (8, 3, 4)), 'nt': ((8, 5, 3), (8, 4, 3))}
  shapes['tn'] = ((8, 3, 5), (8, 3, 4))
  for form, (sa, sb) in shapes.items():
    a = jnp.asarray(rng.standard_normal((2, *sa)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((2, *sb)), jnp.float32)
    mine = jax.jit(jax.vmap(lambda a, b: blas_ffi.matmul(a, b, form)))(a, b)
    want = blas_ffi._reference(a, b, form)
    np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-5)
    grads = [
      jax.grad(lambda a, b: (fn(a, b, form) ** 3).sum(), (0, 1))(a, b)
      for fn in (blas_ffi.matmul, blas_ffi._reference)
    ]
    for g_mine, g_want in zip(*grads):
      np.testing.assert_allclose(g_mine, g_want, rtol=1e-4, atol=1e-4)
  a = jnp.ones((2, 5, 3), jnp.float32)
  wrong = jax.ffi.ffi_call(  # An output the product does not fit.
    blas_ffi._NAME + 'nn', jax.ShapeDtypeStruct((2, 5, 7), jnp.float32)
  )
  with pytest.raises(Exception, match='jade batched matmul'):
    jax.block_until_ready(wrong(a, jnp.ones((2, 3, 4), jnp.float32)))


@pytest.mark.slow
def test_preset_steps_times_each_variant(tmp_path):
  """bench/preset_steps.py: a preset's steps timed under each variant (an
  environment setting, a gin binding), in a fresh process each."""
  import json

  preset = tmp_path / 'preset.json'
  preset.write_text(
    json.dumps({
      'train': {
        'data': DATA, 'gin': os.path.join(ROOT, 'gin', 'tiny.gin'),
        'vocab-size': 300, 'batch-size': 2,
        'gin-bindings': ['ReformerLM.d_ff = 64'],
      }
    })
  )  # fmt: skip
  result = subprocess.run(
    [sys.executable, 'bench/preset_steps.py', str(preset), '--data', DATA]
    + ['--steps', '12', '--skip', '1', '--rounds', '1']
    + ['--trace', str(tmp_path / 'trace')]
    + ['--variant', 'xla|JADE_CHUNK_KERNEL=off']
    + ['--variant', 'bad||ReformerLM.n_layers = -1'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert any(
    ' xla: ' in x and '(11 steps), ' in x and 'page faults a step' in x
    for x in lines
  )
  assert any(' bad: failed' in x for x in lines)
  # The profile of steps 2-11: read back, its heaviest operations named.
  at = next(i for i, x in enumerate(lines) if 'profile of 10 steps' in x)
  assert lines[at + 1].split()[1] == 'ms', lines[at : at + 3]


def test_preset_steps_trace_summary_counts_own_time_and_busy_time(tmp_path):
  """A step's operations: a loop whose body ran two products (its own
  time is the rest), on two threads at once part of the time (the shares
  of the step with none, one and two threads running one)."""
  import gzip
  import json

  spec = importlib.util.spec_from_file_location(
    'preset_steps', os.path.join(ROOT, 'bench', 'preset_steps.py')
  )
  preset_steps = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(preset_steps)

  def x(tid, name, ts, dur):
    return {'ph': 'X', 'pid': 1, 'tid': tid, 'name': name, 'ts': ts, 'dur': dur}

  meta = [
    {'ph': 'M', 'name': 'thread_name', 'pid': 1, 'tid': t, 'args': {'name': n}}
    for t, n in ((1, 'python'), (2, 'tf_XLAEigen/1'), (3, 'tf_XLAEigen/2'))
  ]
  events = meta + [
    x(1, preset_steps.STEP, 0, 10_000),
    x(2, 'ThunkExecutor::Execute', 0, 9_000),  # Bookkeeping: left out.
    x(2, 'while.1', 1_000, 5_000),
    x(2, 'dot.1', 1_500, 1_000),
    x(2, 'dot.2', 3_000, 2_000),
    x(3, 'fusion.1', 4_000, 3_000),
  ]
  folder = tmp_path / 'plugins' / 'profile' / 'run'
  folder.mkdir(parents=True)
  with gzip.open(folder / 'host.trace.json.gz', 'wt') as f:
    json.dump({'traceEvents': events}, f)
  lines = preset_steps.trace_summary(str(tmp_path))
  assert lines[0].split(':')[1].split(',')[:2] == [
    ' 10.0 ms a step',
    ' an operation running 6.0 ms of it',  # 1-6 ms and 4-7 ms: 1-7 ms.
  ], lines
  assert 'own time 8.0 ms' in lines[0]  # The loop's 5 and the fusion's 3.
  # None 0-1 and 7-10 ms, one 1-4 and 6-7 ms, both 4-6 ms.
  assert lines[1].endswith(
    "none 40%, one 40%, two or more 20% of the steps' time"
  ), lines[1]
  own = {line.split()[2]: float(line.split()[0]) for line in lines[2:]}
  assert own == {'fusion.1': 3.0, 'dot.2': 2.0, 'while.1': 2.0, 'dot.1': 1.0}


def test_train_speed_sets_bfloat16_contenders_against_the_bfloat16_peak(
  capsys,
):
  """bench/train_speed.py's table: a bfloat16 contender's FLOP/s are also
  a share of the bfloat16 product's peak (issue 54: 'of peak' counted
  against the rate its products can reach); a float32 one's are not."""
  from bench import train_speed

  row = {'length': 1024, 'vocab': 500, 'peak_rss_gb': 1.0, 'first_steps_s': 1}
  results = [
    dict(row, name='jade', tokens_per_s=100.0, gflops=50.0),
    dict(row, name='jade-bf16', tokens_per_s=160.0, gflops=80.0),
  ]
  train_speed.print_table(results, 100.0, None, 200.0)
  lines = capsys.readouterr().out.splitlines()
  assert '% of bf16 peak' in lines[0]
  assert lines[2].startswith('| jade | ') and '| 50.0% |  |  |' in lines[2]
  assert '| 80.0% |  | 40.0% |' in lines[3]


def test_train_speed_rounds_report_each_contenders_median_run(capsys):
  """bench/train_speed.py --rounds: one row a contender, its median run
  (tokens/s and FLOP/s the medians, memory the median run's) with the
  runs' range, its ratio to the peer's median; a failed run is left out
  and a contender whose runs all failed shows its error."""
  from bench import train_speed

  row = {'length': 1024, 'vocab': 500, 'asked_vocab': 500}
  runs = [
    dict(row, name='peer', tokens_per_s=t, gflops=t / 2, peak_rss_gb=2.0)
    for t in (100.0, 120.0, 90.0)
  ] + [
    dict(row, name='jade', tokens_per_s=t, gflops=t / 2, peak_rss_gb=m)
    for t, m in ((150.0, 1.0), (210.0, 1.3), (180.0, 1.2))
  ]
  runs += [dict(row, name='jade', error='killed (out of memory)')]
  runs += [dict(row, name='full', error='out of memory: x')] * 2
  rows = {r['name']: r for r in train_speed.by_median(runs)}
  assert rows['jade']['tokens_per_s'] == 180.0
  assert rows['jade']['gflops'] == 90.0
  assert rows['jade']['peak_rss_gb'] == 1.2  # The median run's.
  assert rows['jade']['runs'] == [150.0, 180.0, 210.0]
  assert rows['peer']['tokens_per_s'] == 100.0
  assert rows['full']['error'].startswith('out of memory')
  for r in rows.values():
    r.setdefault('first_steps_s', [1])
  train_speed.print_table(list(rows.values()), 100.0)
  out = capsys.readouterr().out
  assert '| jade | 1024 | 500 | 180 (150-210) | 1.80x |' in out
  assert '| peer | 1024 | 500 | 100 (90-120) | 1.00x |' in out
  assert '| full | 1024 | 500 | out of memory: x |' in out
  assert train_speed.median_of([None, 3.0, 1.0]) == 2.0
  assert train_speed.median_of([None]) is None


def test_matmul_rate_of_bfloat16_inputs_is_measured():
  """`preflight.device_flops_per_second` times a product of bfloat16
  inputs (float32 sums) as it times float32 ones."""
  import jax

  from src.model import preflight

  rate = preflight.device_flops_per_second(64, 64, 64, 2, jax.numpy.bfloat16)
  assert rate > 0
