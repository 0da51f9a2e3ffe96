"""Chatting with a trained model: decoding, the session, evaluate.py."""

import io
import itertools
import os
import re
import signal

import jax
import numpy as np
import pytest
import trax

import evaluate
from src.apps import chat
from src.apps.cli import run_main
from src.core.errors import UserError
from src.data import chatformat, tokenizer
from src.inference import decoding, sampling, scoring
from src.inference.generate import display
from src.model import attention, ginconf, reformer
from src.storage import checkpoints, modelfolder

from .conftest import DATA, EXACT_LSH, assert_chat_reads_as_eval


@pytest.fixture(scope='module')
def decoder(tiny_run):
  return decoding.Decoder.load(tiny_run['out'])


def session(decoder, out=None, **kw):
  decoder.reset()
  s = sampling.SamplingSettings(**{'max_new_tokens': 6, 'seed': 1, **kw})
  return chat.ChatSession(decoder, s, out=out or io.StringIO())


def scripted(tokens):
  """A stand-in for the sampler that returns `tokens` in order."""
  it = iter(tokens)
  return lambda logits, settings, rng, recent=(): next(it)


def exact_decoder(out, bindings=()):
  """A decoder for the tiny run with attention made exact: chunk_len =
  max_len / 2 and one chunk before (see the test below)."""
  ginconf.parse(
    os.path.join(out, 'model.gin'),
    (*EXACT_LSH, *bindings),
  )
  tok = tokenizer.load(out)
  predict = ginconf.model(tok.vocab_size, 'predict')
  one = trax.shapes.ShapeDtype((1, 1), np.int32)
  checkpoints.set_weights(out, predict, one, modelfolder.read_weights(out)[0])
  return decoding.Decoder(predict, 128, tok)


def test_greedy_incremental_equals_full_forward(tiny_run):
  """Incremental (predict-mode) decoding matches re-running the whole model.

  LSH attention is approximate, so both modes are made exact for this test:
  with chunk_len = max_len / 2 and one chunk before, every query's window in
  the full forward pass spans the whole 128-token context, and the predict
  step's candidate set (n_hashes * chunk_len * 2 = 128) holds every earlier
  position. Both then compute full causal attention with the same weights
  (the bucket settings have no weights), so greedy tokens must agree.
  """
  out = tiny_run['out']
  inc_decoder = exact_decoder(out)
  tok = inc_decoder.tokenizer
  full_model = ginconf.model(tok.vocab_size, 'eval')
  flat, _ = modelfolder.read_weights(out)
  checkpoints.set_weights(
    out, full_model, trax.shapes.ShapeDtype((1, 128), np.int32), flat
  )
  # Compiled once (calling the layer runs it op by op, ~5 s a call).
  w, st, key = full_model.weights, full_model.state, jax.random.PRNGKey(0)
  forward = jax.jit(lambda x: full_model.pure_fn(x, w, st, key)[0])
  prefix = tok.encode('Good morning!') + [tok.ai_start_id]
  logits, incremental = inc_decoder.feed(prefix), []
  for _ in range(10):
    incremental.append(int(np.argmax(logits)))
    logits = inc_decoder.feed(incremental[-1:])
  seq, full = list(prefix), []
  for _ in range(10):
    x = np.zeros((1, 128), np.int32)
    x[0, : len(seq)] = seq
    # The model shifts inputs right: output i predicts token i.
    nxt = int(np.argmax(np.asarray(forward(x))[0, len(seq)]))
    full.append(nxt)
    seq.append(nxt)
  assert incremental == full


def test_reply_stops_at_end_marker_and_closes_the_turn(decoder, monkeypatch):
  tok = decoder.tokenizer
  word = tok.encode('morning')
  monkeypatch.setattr(sampling, 'draw', scripted(word + [tok.ai_end_id, 99]))
  s = session(decoder)
  assert s.reply('Good morning!') == 'morning'
  assert s.turns[-1].ids == [tok.ai_start_id] + word + [tok.ai_end_id]
  # Pad, EOS, the user's tokens, start marker, reply, end marker: all fed.
  fed = 2 + len(tok.encode('Good morning!')) + 1 + len(word) + 1
  assert decoder.position == fed
  assert s.out.getvalue() == 'morning\n'


def test_line_breaks_in_and_out(decoder, monkeypatch):
  tok = decoder.tokenizer
  monkeypatch.setattr(
    sampling,
    'draw',
    scripted(tok.encode('a |br| b') + [tok.ai_end_id]),
  )
  s = session(decoder)
  assert s.reply('first line\nsecond line') == 'a\nb'
  assert s.turns[0].text == 'first line |br| second line'
  assert tok.line_break_id in s.turns[0].ids


def test_second_turn_does_not_recompile(decoder):
  s = session(decoder, temperature=0.0)
  s.reply('Hello')
  traces = decoder.traces
  s.reply('How are you doing?')
  s.reply('What is your last name?')
  # One program for a token, one per block length (`Decoder.padded`: at
  # most three), compiled once.
  assert decoder.traces == traces <= 4


def test_stdin_repl_with_commands_and_save(decoder, tmp_path, monkeypatch):
  tok = decoder.tokenizer
  # Replies that do not depend on what the tiny model learned.
  reply = itertools.cycle(tok.encode('fine') + [tok.ai_end_id])
  monkeypatch.setattr(sampling, 'draw', lambda *args, **kwargs: next(reply))
  out = io.StringIO()
  s = session(decoder, out=out, temperature=0.0)
  saved = tmp_path / 'chat.txt'
  lines = [
    'Hello',
    '',
    '/set max_new_tokens 4',
    '/show',
    'How are you?',
    f'/save {saved}',
    '/nope',
    '/quit',
    'never read',
  ]
  chat.run_repl(s, interactive=False, stdin=io.StringIO('\n'.join(lines)))
  text = out.getvalue()
  assert 'max_new_tokens=4' in text and 'turns' in text
  assert 'error: unknown command /nope' in text
  assert len(s.turns) == 4  # Two user turns, two replies; empty line skipped.
  convs = chatformat.read_file(str(saved))  # Valid training data.
  turns = list(chatformat.iter_turns(convs))
  assert turns[0].role == 'user' and turns[0].text.startswith('Hello')
  assert turns[-1].role == 'ai'
  with pytest.raises(Exception, match='exists; choose another'):
    s.save(str(saved))


def test_saved_conversation_leaves_out_empty_replies(decoder, tmp_path):
  s = session(decoder)
  s.turns = [
    chat.Turn('user', 'Hi', []),
    chat.Turn('ai', '', []),
    chat.Turn('user', 'Anyone?', []),
    chat.Turn('ai', 'Yes.', []),
    chat.Turn('user', 'Good', []),
  ]
  s.save(str(tmp_path / 'c.txt'))
  text = (tmp_path / 'c.txt').read_text()
  assert text == 'Hi |br| Anyone?\n|aigenerationstart| Yes. |endofgeneration|\n'
  s.turns = s.turns[:2]
  with pytest.raises(UserError, match='nothing to save yet'):
    s.save(str(tmp_path / 'd.txt'))


def test_reset_and_load(decoder, tmp_path):
  s = session(decoder, temperature=0.0)
  s.reply('Hello')
  s.command('/reset')
  assert s.turns == [] and decoder.position == 0
  s.load(os.path.join(DATA, '01_greetings.txt'))
  assert decoder.position > 0 and s.turns[-1].role == 'ai'
  assert decoder.position <= decoder.max_len


def test_a_chat_context_starts_like_a_conversation_in_training(
  decoder, monkeypatch
):
  """[pad, EOS, user turn, start marker]: in training every conversation
  follows the EOS of the one before it."""
  fed = []
  step, block = decoder._step, decoder._read_block
  monkeypatch.setattr(decoder, '_step', lambda i: fed.append(i) or step(i))
  monkeypatch.setattr(
    decoder, '_read_block', lambda ids: fed.extend(ids) or block(ids)
  )
  s = session(decoder, temperature=0.0, max_new_tokens=3)
  s.reply('Hello')
  tok = decoder.tokenizer
  hello = tok.encode('Hello')
  assert fed[: 3 + len(hello)] == [0, 1, *hello, tok.ai_start_id]
  fed.clear()
  s.reply('Again')  # Later turns follow on, with no second start.
  assert fed[: len(tok.encode('Again'))] == tok.encode('Again')
  fed.clear()
  s.load(os.path.join(DATA, '01_greetings.txt'))
  assert fed[:2] == [0, 1] and fed.count(1) == 1


def test_context_overflow_drops_whole_oldest_turns(decoder):
  s = session(decoder, temperature=0.0, max_new_tokens=12)
  for i in range(12):
    s.reply(f'Tell me something about number {i} please')
    assert decoder.position <= decoder.max_len
  text = s.out.getvalue()
  assert 'context full: dropped the' in text
  assert s.turns[0].role == 'user'
  # In context: exactly the kept turns, after the leading pad and EOS.
  assert decoder.position == 2 + sum(len(t.ids) for t in s.turns)


def test_overlong_input_is_cut_not_crashed(decoder):
  s = session(decoder, temperature=0.0)
  s.reply('word ' * 400)
  assert 'only its last' in s.out.getvalue()
  assert decoder.position <= decoder.max_len


def test_ctrl_c_stops_the_reply(decoder, monkeypatch):
  tok = decoder.tokenizer
  calls = []

  def sampler(logits, settings, rng, recent=()):
    calls.append(1)
    if len(calls) == 2:
      os.kill(os.getpid(), signal.SIGINT)
    return tok.encode('yes')[-1]

  monkeypatch.setattr(sampling, 'draw', sampler)
  s = session(decoder, max_new_tokens=50)
  s.reply('Hello')
  assert s.out.getvalue().endswith(' [stopped]\n')
  assert len(calls) == 2 and s.turns[-1].ids[-1] == tok.ai_end_id


def test_evaluate_prompt_is_reproducible_with_seed(tiny_run, capsys):
  args = ['--model-dir', tiny_run['out'], '--prompt', 'Hi there']
  args += ['--max-new-tokens', '8', '--seed', '3', '--temperature', '1.0']
  assert run_main(lambda: evaluate.main(args)) == 0
  first = capsys.readouterr().out
  assert run_main(lambda: evaluate.main(args)) == 0
  assert capsys.readouterr().out == first and first.endswith('\n')


def test_evaluate_far_keys_without_far_from_is_one_line(tiny_run, capsys):
  """`evaluate.py --far-keys 8` on a model whose model.gin names no
  `chat.far_from`: exit 2, one line that names the binding to add;
  `--far-keys 0` chats; --far-keys or --n-hashes out of range (below or
  above) is one line naming the flag, not the model's model.gin."""
  args = ['--model-dir', tiny_run['out'], '--prompt', 'Hi', '--far-keys']
  code = run_main(lambda: evaluate.main(args + ['8']))
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert 'chat.far_keys = 8 needs chat.far_from' in err[0]
  more = ['--max-new-tokens', '2']
  assert run_main(lambda: evaluate.main(args + ['0'] + more)) == 0
  for flags, says in (
    (['--far-keys', '-1'], '--far-keys -1: 0 (every key) to 64'),
    (['--far-keys', '65'], '--far-keys 65: 0 (every key) to 64'),
    (['--n-hashes', '0'], '--n-hashes 0: 1 to 64 hash rounds'),
    (['--n-hashes', '65'], '--n-hashes 65: 1 to 64 hash rounds'),
  ):
    bad = args[:-1] + flags  # Refused before the model loads.
    assert run_main(lambda: evaluate.main(bad)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and 'model.gin' not in err[0], err


@pytest.mark.parametrize('case', ['missing', 'not-a-run', 'no-checkpoint'])
def test_bad_model_dir_one_line(case, tiny_run, tmp_path, capsys):
  if case == 'missing':
    model_dir, expected = str(tmp_path / 'nope'), 'no such folder'
  elif case == 'not-a-run':
    model_dir, expected = str(tmp_path), 'model.gin: missing'
  else:
    model_dir = str(tmp_path / 'run')
    os.makedirs(model_dir)
    for name in ('model.gin', 'tokenizer.model', 'tokenizer.json'):
      with open(os.path.join(tiny_run['out'], name), 'rb') as f:
        data = f.read()
      with open(os.path.join(model_dir, name), 'wb') as f:
        f.write(data)
    expected = 'model.pkl.gz: missing; train a model'
  code = run_main(lambda: evaluate.main(['--model-dir', model_dir]))
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and expected in err[0]


def test_perplexity_is_exp_of_mean_token_loss(tiny_run):
  out = tiny_run['out']
  path = os.path.join(DATA, '02_about_jade.txt')
  report = scoring.evaluate(out, path, show_progress=False)
  # Independently: Trax's own weighted cross-entropy over every window.
  tok = tokenizer.load(out)
  stream = tok.encode_conversations(chatformat.read_file(path))
  ginconf.parse(os.path.join(out, 'model.gin'))
  layer = ginconf.model(tok.vocab_size, 'eval')
  flat, _ = modelfolder.read_weights(out)
  checkpoints.set_weights(
    out, layer, trax.shapes.ShapeDtype((1, 128), np.int32), flat
  )
  loss_layer = trax.layers.WeightedCategoryCrossEntropy()
  # LSH hashing is random per call and flips on float noise, so the forward
  # pass is compiled the way evaluate() compiles it, with its hash seed.
  weights, state, key = layer.weights, layer.state, jax.random.PRNGKey(0)
  forward = jax.jit(lambda x: layer.pure_fn(x, weights, state, key)[0])
  total = count = 0.0
  for start in range(0, len(stream), 128):
    piece = stream[start : start + 128]
    x = np.zeros((1, 128), np.int32)
    w = np.zeros((1, 128), np.float32)
    x[0, : len(piece)], w[0, : len(piece)] = piece, 1.0
    mean = float(loss_layer((forward(x), x, w)))
    total += mean * len(piece)
    count += len(piece)
  assert report['tokens'] == len(stream) == count
  assert report['perplexity'] == pytest.approx(np.exp(total / count), rel=1e-4)
  assert report['bits_per_char'] > 0
  # Loss by position: token-weighted, the ranges add up to the loss.
  by = report['by_position']
  assert [name for name, _, _ in by][-1] == '32-128'
  assert sum(n for _, n, _ in by) == count
  assert sum(n * loss for _, n, loss in by) / count == pytest.approx(
    report['loss'], rel=1e-6
  )


def test_the_chat_never_dies_on_input(decoder, tmp_path, monkeypatch):
  """Each of these was a traceback or an exit; now an error line, and the
  session goes on with its context."""
  tok = decoder.tokenizer
  reply = itertools.cycle(tok.encode('ok') + [tok.ai_end_id])
  monkeypatch.setattr(sampling, 'draw', lambda *args, **kwargs: next(reply))
  out = io.StringIO()
  s = session(decoder, out=out)
  lines = [
    'Hello',
    f'/save {tmp_path}/no/such/folder/chat.txt',
    '/set temperature nan',
    '/set top_k 1e30',
    '/set max_new_tokens 1e12',
    '/set max_new_tokens 100',  # More than half the 128-token context.
    '/set seed -1',
    '/load /proc',
    'caf\udce9 \x00 bytes',  # A lone surrogate: undecodable input.
    'Bye',
  ]
  chat.run_repl(s, interactive=False, stdin=io.StringIO('\n'.join(lines)))
  text = out.getvalue()
  assert 'cannot write it' in text
  assert 'temperature must be a finite number' in text
  assert 'max_new_tokens go up to 1048576' in text
  assert 'more than half the context' in text
  assert 'seed must be 0 or more' in text
  assert s.settings.max_new_tokens == 6 and s.settings.temperature == 0.8
  assert [t.role for t in s.turns] == ['user', 'ai'] * 3
  assert decoder.position == 2 + sum(len(t.ids) for t in s.turns)


def test_ctrl_c_while_feeding_keeps_the_session(decoder, monkeypatch):
  tok = decoder.tokenizer
  monkeypatch.setattr(
    sampling, 'draw', scripted(tok.encode('ok') + [tok.ai_end_id])
  )
  s = session(decoder)
  s.reply('Hello')
  kept = list(s.turns)
  block, calls = decoder._read_block, []

  def interrupted(ids):
    calls.append(ids)
    if len(calls) == 1:  # The message's first block.
      raise KeyboardInterrupt
    return block(ids)

  monkeypatch.setattr(decoder, '_read_block', interrupted)
  chat.run_repl(s, interactive=False, stdin=io.StringIO('a long message\n'))
  assert 'interrupted' in s.out.getvalue()
  assert s.turns == kept  # The cut message is dropped, the rest kept.
  assert decoder.position == 2 + sum(len(t.ids) for t in kept)


def test_a_nan_model_is_reported_not_crashed(decoder, monkeypatch):
  monkeypatch.setattr(
    decoder, 'feed', lambda ids, **kw: np.full([decoder_vocab(decoder)], np.nan)
  )
  s = session(decoder)
  with pytest.raises(UserError, match='NaN/inf: its weights are broken'):
    s.reply('Hello')


def decoder_vocab(decoder):
  return decoder.tokenizer.vocab_size


def test_piped_replies_take_one_line_and_backslash_continues(
  decoder, monkeypatch
):
  tok = decoder.tokenizer
  # Each reply: "one", a line break, "two", the end marker.
  reply = itertools.cycle(
    tok.encode('one') + tok.encode('|br|') + tok.encode('two') + [tok.ai_end_id]
  )
  monkeypatch.setattr(sampling, 'draw', lambda *args, **kwargs: next(reply))
  out = io.StringIO()
  s = session(decoder, out=out, temperature=0.0)
  stdin = io.StringIO('first line \\\nsecond line\nHi\n')
  chat.run_repl(s, interactive=False, stdin=stdin)
  lines = out.getvalue().splitlines()
  assert lines == ['one |br| two', 'one |br| two']  # One line per message.
  assert [t.text for t in s.turns if t.role == 'user'] == [
    'first line |br| second line',
    'Hi',
  ]
  # On a terminal the same reply shows its line break.
  s.one_line = False
  assert display(tok, tok.encode('one |br| two'), s.one_line) == 'one\ntwo'
  # A last line ending in a backslash is still sent at the end of input.
  assert chat.read_message(False, io.StringIO('a\\\n')) == 'a'


@pytest.mark.parametrize('first', [0, 37])
def test_blocks_read_what_each_token_read_alone_would(tiny_run, first):
  """A block (`decode_block`) gives each of its tokens what that token fed
  alone attends to, at any position: the tiny run's own LSH (not made
  exact), blocks from position 0 or after `first` tokens fed one at a
  time (a piece up to the grid, whole blocks, a padded rest), then tokens
  one at a time after them: the same logits, to rounding."""
  d = decoding.Decoder.load(tiny_run['out'])
  tok = d.tokenizer
  assert d.block == 32  # MICRO's LSH chunk 16, tiny.gin's local 32.
  ids = [int(i) for i in np.random.default_rng(1).integers(3, 300, 100)]
  later = [5, 9, 11]
  by_token = [d.feed(ids, blocks=False)]
  by_token += [d.feed([t]) for t in later]
  d.reset()
  traces = d.traces
  for i in ids[:first]:
    d.feed([i])
  by_block = [d.feed(ids[first:], blocks=True)]
  by_block += [d.feed([t]) for t in later]
  assert d.position == 1 + len(ids) + len(later)
  assert d.traces <= traces + 2  # One block program, one token program.
  for a, b in zip(by_block, by_token):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    assert np.argmax(a) == np.argmax(b)
  assert tok.vocab_size == by_block[0].shape[-1]


def test_local_blocks_read_their_training_window_while_chatting():
  """A mixed model's local blocks (32-token chunks and the chunk before)
  must weigh, token by token in predict mode, the same positions the
  training (eval) forward pass does, also past 64 tokens, where Trax's own
  predict step would read the whole memory: the logits at every position
  agree (LSH made exact as in the tests above; random weights)."""
  from .conftest import MICRO

  ginconf.parse(
    os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin'),
    MICRO
    + (
      'SelfAttention.chunk_len = 32',
      *EXACT_LSH,
    ),
  )
  full_model = ginconf.model(300, 'eval')
  full_model.init(trax.shapes.ShapeDtype((1, 128), np.int32))
  predict = ginconf.model(300, 'predict')
  predict.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  predict.weights = full_model.weights
  d = decoding.Decoder(predict, 128)
  chunks = [layer._chunk_len for layer in reformer.local_layers(d.model)]
  assert chunks == [32, 32]
  ids = [int(i) for i in np.random.default_rng(2).integers(3, 300, 127)]
  x = np.zeros((1, 128), np.int32)
  x[0, :127] = ids  # The model shifts right: output i sees ids before i.
  w, st = full_model.weights, full_model.state
  whole = np.asarray(full_model.pure_fn(x, w, st, jax.random.PRNGKey(0))[0])
  d.block = 10**9  # Token by token.
  by_token = [d.feed(ids[:1])] + [d.feed([t]) for t in ids[1:]]
  np.testing.assert_allclose(
    np.stack(by_token), whole[0, 1:], atol=2e-4, rtol=1e-4
  )


def _trained_with(out, binding: str, steps: int):
  """`out`, a micro run of `steps` steps trained with `binding`, which its
  model.gin keeps."""
  from src.training import trainer

  from .conftest import MICRO, train_settings

  trainer.train(
    train_settings(out, steps=steps, **{'eval-every': steps}),
    gin_bindings=(*MICRO, binding),
    log=lambda line: None,
  )
  assert binding in (out / 'model.gin').read_text()
  return out


def test_a_model_reading_the_mean_of_its_halves_chats_what_it_trains(tmp_path):
  """`output_layer.halves = 'mean'` (the output layer reads d_model
  features, not 2 d_model): a run trains with it, saves it with the model
  and the chat reads the model it trained (token by token = the eval
  forward pass; the output kernel is [d_model, vocab])."""
  from src.model import preflight

  from .conftest import MICRO

  mean = ("output_layer.halves = 'mean'",)
  out = _trained_with(tmp_path / 'mean', mean[0], steps=2)
  d = decoding.Decoder.load(str(out))
  kernels = [
    w.shape for w in jax.tree_util.tree_leaves(d.model.weights) if w.ndim == 2
  ]
  assert kernels[-1] == (32, 300)  # d_model x vocab.
  setup = ginconf.parse(
    os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin'),
    MICRO + mean + EXACT_LSH,
  )
  full_model = ginconf.model(300, 'eval')
  full_model.init(trax.shapes.ShapeDtype((1, 128), np.int32))
  exact = reformer.count_params(full_model)
  assert abs(preflight.count_weights(setup, 300) - exact) < 0.01 * exact
  predict = ginconf.model(300, 'predict')
  predict.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  predict.weights = full_model.weights
  d = decoding.Decoder(predict, 128)
  ids = [int(i) for i in np.random.default_rng(3).integers(3, 300, 60)]
  x = np.zeros((1, 128), np.int32)
  x[0, :60] = ids
  w, st = full_model.weights, full_model.state
  whole = np.asarray(full_model.pure_fn(x, w, st, jax.random.PRNGKey(0))[0])
  d.block = 10**9  # Token by token.
  by_token = [d.feed(ids[:1])] + [d.feed([t]) for t in ids[1:]]
  np.testing.assert_allclose(
    np.stack(by_token), whole[0, 1:61], atol=2e-4, rtol=1e-4
  )


@pytest.mark.slow
def test_full_attention_model_trains_samples_and_chats(tmp_path, capsys):
  """A run with Trax's full attention (SelfAttention) samples while it
  trains and chats afterwards: predict mode gets a memory the size of the
  context (decoding.attention_bindings)."""
  from src.training import trainer

  from .conftest import MICRO, train_settings

  out = tmp_path / 'sa'
  lines = []
  trainer.train(
    train_settings(out, steps=2, **{'sample-prompts': ['Hi']}),
    gin_bindings=MICRO
    + (
      'ReformerLM.attention_type = @SelfAttention',
      'SelfAttention.chunk_len = None',  # Full, not local.
      'SelfAttention.n_chunks_before = 0',
    ),
    log=lines.append,
  )
  assert not any('no sample replies' in line for line in lines)
  assert "step 2: sample 'Hi' -> " in capsys.readouterr().out
  d = decoding.Decoder.load(str(out))
  s = session(d, out=io.StringIO(), temperature=0.0, max_new_tokens=5)
  assert isinstance(s.reply('Hello there'), str)


@pytest.mark.parametrize('how', ['True', "'only'"])
def test_a_tied_model_trains_and_chats_through_its_embedding(tmp_path, how):
  """`output_layer.tied = True`: the output layer also scores tokens
  through the token embedding (a learned map of the halves against each
  token's vector); 'only': through it alone (no kernel of its own). A run
  trains it, saves it with the model, and the chat reads it: token by
  token and as a block = the eval forward pass; an export of it gives the
  run's logits."""
  from src.model import preflight, tied

  from .conftest import MICRO

  tie = (f'output_layer.tied = {how}',)
  out = _trained_with(tmp_path / 'tied', tie[0], steps=3)
  setup = ginconf.parse(
    os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin'),
    MICRO + tie + EXACT_LSH,
  )
  flat = modelfolder.read_weights(str(out))[0]
  # The copy map, open (3 steps barely move it).
  flat[-1] = np.random.default_rng(4).normal(size=flat[-1].shape) * 0.1
  full_model = ginconf.model(300, 'eval')
  signature = trax.shapes.ShapeDtype((1, 128), np.int32)
  checkpoints.set_weights(str(out), full_model, signature, flat)
  assert isinstance(full_model.sublayers[-1], tied.TiedOutput)
  exact = reformer.count_params(full_model)
  assert abs(preflight.count_weights(setup, 300) - exact) < 0.01 * exact
  ids = [int(i) for i in np.random.default_rng(3).integers(3, 300, 60)]
  x = np.zeros((1, 128), np.int32)
  x[0, :60] = ids
  w, st = full_model.weights, full_model.state
  whole = np.asarray(full_model.pure_fn(x, w, st, jax.random.PRNGKey(0))[0])
  # The logits: h against the kernel, plus h's copy map against each
  # token's embedding vector.
  *body, head = full_model.sublayers
  h, matrix = trax.layers.Serial(*body).pure_fn(
    x, tuple(w[:-1]), tuple(st[:-1]), jax.random.PRNGKey(0)
  )[0]
  *kernel, bias, copy = w[-1]
  assert len(kernel) == (how == 'True')  # 'only': no kernel of its own.
  want = bias + (h[0] @ copy) @ matrix.T
  want = want + h[0] @ kernel[0] if kernel else want
  np.testing.assert_allclose(whole[0], want, atol=1e-4, rtol=1e-4)
  assert_chat_reads_as_eval(out, flat, ids, whole)
  # Shared as an export, it gives the run's logits.
  from src.storage import export

  export.export(str(out), str(tmp_path / 'shared'))
  logits = [
    np.asarray(decoding.load_run(folder, 'eval')[2](x))
    for folder in (str(out), str(tmp_path / 'shared'))
  ]
  np.testing.assert_array_equal(*logits)


def test_load_refuses_a_file_larger_than_a_context_could_use(decoder, tmp_path):
  big = tmp_path / 'big.txt'
  with open(big, 'wb') as f:
    f.truncate(chat.MAX_LOAD_BYTES + 1)  # Sparse: nothing is written.
  s = session(decoder)
  with pytest.raises(UserError, match='/load reads at most 8 MB'):
    s.load(str(big))
  assert s.turns == []


def test_a_start_block_then_blocks_read_what_tokens_read(tiny_run):
  """A long read at position 0 takes a start block (as Trax reads a
  context's start) and blocks after it; with attention made exact (as in
  test_greedy_incremental_equals_full_forward) it gives the logits of
  reading token by token."""
  d = exact_decoder(tiny_run['out'])
  d.min_start = 64  # The exact context holds 128 tokens.
  ids = [int(i) for i in np.random.default_rng(1).integers(3, 300, 100)]
  by_token = [d.feed(ids, blocks=False)] + [d.feed([t]) for t in (5, 9)]
  d.reset()
  by_block = [d.feed(ids)]
  assert d.start == 64 and d.mark == 64 and d.position == 101
  by_block += [d.feed([t]) for t in (5, 9)]
  for a, b in zip(by_block, by_token):
    np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize('ending', ['stop string', 'cancel', 'length', 'end'])
def test_the_context_holds_every_token_shown_however_a_reply_ends(
  decoder, monkeypatch, ending
):
  """A token is shown as soon as it is drawn and fed to the decoder
  afterwards (`generate.generate`): a reply cut by a stop string, a
  cancel or its length, or ended by the model, leaves the context
  holding exactly the turns' tokens."""
  from src.inference import engine, generate

  tok = decoder.tokenizer
  words = tok.encode('one two three four five six')
  monkeypatch.setattr(sampling, 'draw', scripted(words[:4] + [tok.ai_end_id]))
  decoder.reset()
  context = generate.Context(decoder)
  settings = sampling.SamplingSettings(
    max_new_tokens=3 if ending == 'length' else 8
  )
  logits = context.ask('Hello', settings.max_new_tokens)
  shown = []
  reply = engine.stream_reply(
    context,
    logits,
    settings,
    np.random.default_rng(0),
    stop=lambda: ending == 'cancel' and len(shown) >= 2,
    stops=['three'] if ending == 'stop string' else (),
    emit=shown.append,
  )
  assert decoder.position == 2 + sum(len(t.ids) for t in context.turns)
  assert context.turns[-1].ids[1:-1] == reply.ids


def _random_context_weights(model, rng):
  """The context weights (`w_c`, `w_r`) of `model`'s
  `ContextLSHSelfAttention` layers made random (they start at zero)."""
  for layer in reformer.branch_outputs(model)[0]:
    roles = attention.weight_roles(layer)
    if 'c' not in roles:
      continue
    layer.weights = tuple(
      jax.numpy.asarray(rng.normal(0, 0.3, np.shape(w)), np.float32)
      if role in ('c', 'r')
      else w
      for role, w in zip(roles, layer.weights)
    )


@pytest.mark.parametrize(
  'lsh, extra',
  [
    ('SmearedDirectedLSHSelfAttention', ()),
    (
      'ContextLSHSelfAttention',
      (
        'ContextLSHSelfAttention.query_span = 6',
        'ContextLSHSelfAttention.key_span = 5',
        'ContextLSHSelfAttention.context_scale = 0.5',
      ),
    ),
  ],
)
def test_smeared_attention_reads_while_chatting_what_training_reads(lsh, extra):
  """A model with smeared attention (`SmearedLocalSelfAttention`,
  `SmearedDirectedLSHSelfAttention`: each key and value sees the position
  before; `ContextLSHSelfAttention`: its directed query and key also read
  sums of the last few positions) gives, token by token, in blocks at any
  position, from a start block and after a `rewind`, the logits of the
  training (eval) forward pass (LSH made exact; random weights, so the
  smearing and context weights are not zero)."""
  from .conftest import MICRO

  smeared = (
    'ReformerLM.attention_type = [@SmearedLocalSelfAttention, '
    f'@{lsh}, @SmearedLocalSelfAttention]'
  )
  ginconf.parse(
    os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin'),
    MICRO + ('SelfAttention.chunk_len = 16', *EXACT_LSH, smeared, *extra),
  )
  full_model = ginconf.model(300, 'eval')
  full_model.init(trax.shapes.ShapeDtype((1, 128), np.int32))
  _random_context_weights(full_model, np.random.default_rng(5))
  roles = [attention.weight_roles(a) for a in reformer.branch_outputs(
    full_model)[0]]  # fmt: skip
  assert all(r[-2:] in (('s', 'u'), ('c', 'r')) for r in roles), roles
  predict = ginconf.model(300, 'predict')
  predict.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  predict.weights = full_model.weights
  d = decoding.Decoder(predict, 128)
  assert d.block == 64  # EXACT_LSH chunks of 64.
  ids = [int(i) for i in np.random.default_rng(3).integers(3, 300, 127)]
  x = np.zeros((1, 128), np.int32)
  x[0, :127] = ids
  w, st = full_model.weights, full_model.state
  whole = np.asarray(full_model.pure_fn(x, w, st, jax.random.PRNGKey(0))[0])
  by_token = [d.feed(ids[:1], blocks=False)]
  by_token += [d.feed([t], blocks=False) for t in ids[1:]]
  np.testing.assert_allclose(
    np.stack(by_token), whole[0, 1:], atol=2e-4, rtol=1e-4
  )
  for first, start in ((0, 0), (21, 0), (0, 64)):
    d.reset()
    d.min_start = start or 10**9
    if first:
      d.feed(ids[:first], blocks=False)
    got = d.feed(ids[first:100], blocks=True)
    np.testing.assert_allclose(got, whole[0, 100], atol=2e-4, rtol=1e-4)
    got = d.feed(ids[100:110], blocks=True)
    np.testing.assert_allclose(got, whole[0, 110], atol=2e-4, rtol=1e-4)
  # A token read and taken back: the token after it reads as if never
  # read.
  d.reset()
  d.min_start = 10**9
  d.feed(ids[:63], blocks=True)  # With the start's pad: one block.
  assert d.mark == 64
  d.feed([7], blocks=False)
  d.rewind()
  got = d.feed([ids[63]], blocks=False)
  np.testing.assert_allclose(got, whole[0, 64], atol=2e-4, rtol=1e-4)


def test_blocks_read_a_model_whose_feed_forward_runs_in_chunks():
  """`ReformerLM.ff_chunk_size` (gin/reformer_32k.gin) puts the
  feed-forward in a Trax `Scan`, whose state is not its sublayers': a
  block still reads what tokens read (random weights)."""
  from .conftest import MICRO

  ginconf.parse(
    os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin'),
    MICRO + ('ReformerLM.ff_chunk_size = 16',),
  )
  predict = ginconf.model(300, 'predict')
  predict.init(trax.shapes.ShapeDtype((1, 1), np.int32))
  d = decoding.Decoder(predict, 128)
  assert d.block
  ids = [int(i) for i in np.random.default_rng(4).integers(3, 300, 70)]
  by_token = d.feed(ids, blocks=False)
  d.reset()
  by_block = d.feed(ids, blocks=True)
  np.testing.assert_allclose(by_block, by_token, atol=2e-4, rtol=1e-4)


def test_a_model_carries_the_hash_rounds_its_chat_reads_with(tmp_path):
  """`chat.n_hashes` is kept with the model (model.gin) and read by the
  chat (`Decoder.load`): its LSH layers sample with that many hash rounds,
  training with its own; `--n-hashes` (the argument) overrides it; a
  wrong value is one line naming the binding."""
  from .conftest import MICRO

  out = _trained_with(tmp_path / 'run', 'chat.n_hashes = 3', steps=1)

  def rounds(decoder):
    return {
      layer._n_hashes
      for layer in reformer.all_layers(decoder.model)
      if isinstance(layer, attention.ea.LSHSelfAttention)
    }

  assert rounds(decoding.Decoder.load(str(out))) == {3}
  assert rounds(decoding.Decoder.load(str(out), n_hashes=2)) == {2}
  gin = os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin')
  assert ginconf.parse(gin, MICRO).chat.n_hashes == 0  # As trained.
  with pytest.raises(UserError, match='chat.n_hashes = -1: write a whole'):
    ginconf.parse(gin, MICRO + ('chat.n_hashes = -1',))


def test_a_model_carries_the_far_keys_its_chat_reads(tmp_path):
  """`chat.far_keys` and `chat.far_from` are kept with the model and read
  by the chat's LSH layers (`read_far`); `--far-keys` (the argument)
  overrides them, 0 reads every key; a wrong value, or far keys with no
  `far_from`, is one line naming the binding."""
  from .conftest import MICRO

  out = _trained_with(tmp_path / 'run', 'chat.far_from = 16', steps=1)

  def far(decoder):
    return {
      (layer._far_keys, layer._far_from)
      for layer in reformer.lsh_layers(decoder.model)
    }

  assert far(decoding.Decoder.load(str(out))) == {(0, 0)}  # Every key.
  assert far(decoding.Decoder.load(str(out), far_keys=5)) == {(5, 16)}
  gin = out / 'model.gin'
  gin.write_text(gin.read_text() + '\nchat.far_keys = 3\n')
  assert far(decoding.Decoder.load(str(out))) == {(3, 16)}
  assert far(decoding.Decoder.load(str(out), far_keys=0)) == {(0, 0)}
  tiny = os.path.join(os.path.dirname(__file__), '..', 'gin', 'tiny.gin')
  assert ginconf.parse(tiny, MICRO).chat.far_keys == 0  # All.
  for bindings, says in (
    (('chat.far_keys = 3',), 'chat.far_keys = 3 needs chat.far_from'),
    (('chat.far_keys = -1',), 'chat.far_keys = -1: write a whole number'),
    (('chat.far_from = 2.5',), 'chat.far_from = 2.5: write a whole number'),
    (('chat.far_keys = 65', 'chat.far_from = 8'), 'at most 64'),
  ):
    with pytest.raises(UserError, match=re.escape(says)):
      ginconf.parse(tiny, MICRO + bindings)
