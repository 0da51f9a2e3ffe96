"""The long-recall task's generators (src/analysis/long_recall.py): what
the measurement asks is stated once; memory practice asks only for what
it stated, in phrasings the measurement never uses."""

import re

import numpy as np
import pytest

from src.analysis import long_recall

TALK = [[('user', 'how are you'), ('ai', 'fine, thanks')]]


def test_practice_asks_for_what_it_stated_in_phrasings_of_its_own():
  rng = np.random.default_rng(0)
  measured = {
    p.split('{}')[0].strip().lower()
    for group in (long_recall.WORD, long_recall.NUMBER, long_recall.NAME)
    for phrasings in group
    for p in phrasings
    if len(p.split('{}')[0].strip()) > 3
  }
  for _ in range(300):
    turns = long_recall.practice(rng, TALK, ['alpha', 'bravo'], 200)
    roles = [role for role, _ in turns]
    assert roles[0] == 'user' and roles[-1] == 'ai'
    said = ' '.join(text for role, text in turns if role == 'user')
    for _, text in turns:
      assert not any(text.lower().startswith(m) for m in measured), text
    for (r1, question), (r2, answer) in zip(turns, turns[1:]):
      if r1 == 'user' and r2 == 'ai' and question.endswith('?'):
        for value in answer.rstrip('.').replace(',', ' ').split():
          if value.isdigit() or value in ('alpha', 'bravo'):
            assert value in said  # Only what was stated is asked for.
  assert long_recall.invented(rng).isalpha()


def test_a_measured_conversation_states_its_value_once_and_asks_last():
  rng = np.random.default_rng(1)
  conv = long_recall.make(rng, TALK, ['lantern'], 300, 'word')
  text = ' '.join(t for _, t in conv.turns[:-1])
  assert conv.value == 'lantern'
  assert conv.turns[-1][0] == 'ai' and 'lantern' in conv.turns[-1][1]
  assert text.count('lantern') in (1, 2)  # The statement (and its echo).
  assert conv.filler_chars >= 300
  control = long_recall.make(rng, TALK, ['lantern'], 300, 'word', False)
  assert 'lantern' not in ' '.join(t for _, t in control.turns[:-1])


def test_the_probe_scores_the_pieces_that_hold_the_value():
  """`probe`'s value pieces: those whose characters overlap the value,
  whatever the pieces around it (a toy tokenizer of two-letter pieces)."""
  from bench import long_recall as bench

  class Pairs:
    def encode(self, text):
      return [text[i : i + 2] for i in range(0, len(text), 2)]

    def decode(self, ids):
      return ''.join(ids)

  text = 'The word was zuvo.'
  at = bench._value_pieces(Pairs(), text, 'zuvo')
  pieces = Pairs().encode(text)
  assert [pieces[i] for i in at] == [' z', 'uv', 'o.']
  assert bench._value_pieces(Pairs(), 'zuvo, zuvo', 'zuvo') == [3, 4]


def test_the_probe_counts_pieces_by_place_and_by_how_rare():
  """`probe`'s `pieces`: the first piece apart from later ones (the lookup
  finds the first; copying goes on from it), rare pieces (seen fewer than
  `RARE` times in the small talk) apart from common ones."""
  from bench import long_recall as bench

  pieces = {k: [0, 0] for k in ('first', 'later', 'rare', 'common')}
  rare = bench.RARE - 1
  bench._piece_hits(pieces, [rare, 100, bench.RARE], [False, True, False])
  bench._piece_hits(pieces, [100], [True])
  assert pieces == {
    'first': [1, 2],
    'later': [1, 2],
    'rare': [0, 1],
    'common': [2, 3],
  }


@pytest.mark.parametrize('unseen', [False, True])
def test_the_probe_asks_in_the_phrasings_it_is_told(unseen):
  """`probe --unseen` (a model trained on the stand-in) states and asks
  the word in `WORD_UNSEEN`'s phrasings, else in the training ones; the
  control is the same draw without the statement."""
  from bench import long_recall as bench

  asked = []

  def score(turns, value):
    asked.append((turns, value))  # None: nothing to count.

  bench._probe_at(300, 3, TALK, ['lantern'], {}, score, unseen=unseen)
  said = long_recall.WORD_UNSEEN if unseen else long_recall.WORD
  other = long_recall.WORD if unseen else long_recall.WORD_UNSEEN
  stated = [turns for i, (turns, _) in enumerate(asked) if i % 2 == 0]
  assert len(stated) == 3 and all(v == 'lantern' for _, v in asked)
  for turns in stated:
    first = turns[0][1]
    assert first in [p.format('lantern') for p in said[0]]
    assert first not in [p.format('lantern') for p in other[0]]


def test_a_distractor_is_stated_once_beside_the_asked_statement():
  """`with_distractor`: another value said once, right before or right
  after the statement asked about; the question and the answer are the
  conversation's own."""
  places = set()
  for seed in range(8):
    rng = np.random.default_rng(seed)
    conv = long_recall.make(rng, TALK, ['lantern'], 300, 'word')
    turns = long_recall.with_distractor(rng, conv, 'meadow')
    text = ' '.join(t for _, t in turns)
    assert text.count('meadow') == 1 and len(turns) == len(conv.turns) + 2
    assert turns[-2:] == conv.turns[-2:]
    at = next(i for i, (_, t) in enumerate(turns) if 'meadow' in t)
    assert turns[at][0] == 'user' and turns[at + 1][0] == 'ai'
    places.add(at)
  assert places == {0, 2}


def test_lookup_practice_says_several_ordinary_words_and_asks_for_each():
  """`lookup_practice`: 2-4 facts about different things (a thing drawn
  twice is said once), mostly words
  of the list (a copy of "the unusual word" cannot answer), every one
  asked for once, after the small talk; nothing asked that was not
  stated."""
  rng = np.random.default_rng(0)
  words = ['alpha', 'bravo', 'charlie', 'delta', 'echo', 'foxtrot']
  questions = {
    q.format(k=k)
    for q in long_recall.PRACTICE[3]
    for k in long_recall.PRACTICE_KEYS
  }
  values, several = [], 0
  for _ in range(200):
    turns = long_recall.lookup_practice(rng, TALK, words, 200)
    assert turns[0][0] == 'user' and turns[-1][0] == 'ai'
    at = [i for i, (r, t) in enumerate(turns) if r == 'user' and t in questions]
    assert 1 <= len(at) <= 4 and at == list(range(at[0], len(turns), 2))
    several += len(at) >= 2
    assert len({turns[i][1] for i in at}) == len(at)  # Different things.
    before = ' '.join(t for _, t in turns[: at[0]]).lower()
    before = set(re.findall(r'[a-z]+', before))
    for i in at:
      said = [w for w in re.findall(r'[a-z]+', turns[i + 1][1]) if w in before]
      assert said, turns[i + 1]  # Only what was stated is asked for.
      values.append(set(said))
  assert sum(bool(v & set(words)) for v in values) > 0.8 * len(values)
  assert several > 190


def test_the_score_counts_the_word_said_as_a_word_of_its_own():
  """`score`'s hit: the asked word in the reply, not inside a longer one
  ("statement" does not name "state"); any case, any punctuation."""
  from bench import long_recall as bench

  assert bench.said('state', 'It was State.')
  assert bench.said('state', 'state, you told me')
  assert bench.said('c++', 'It was c++!')
  assert not bench.said('state', 'You told me statement.')
  assert not bench.said('rest', 'It was restried.')
  assert not bench.said('rest', 'forest')


def test_the_score_does_not_take_a_word_of_the_answers_frame_for_the_value():
  """A reply in an answer's frame names the value only inside it: a
  control's "sold, right?" does not name "right"; "right, right?", "You
  said right." and "I have it: have." do; a reply in no frame is read
  whole."""
  from bench import long_recall as bench

  assert not bench.said('right', 'sold, right?')
  assert not bench.said('said', 'You said lantern.')
  assert not bench.said('have', 'I have it: lantern.')
  assert bench.said('right', 'right, right?')
  assert bench.said('right', 'You said right.')
  assert bench.said('have', 'I have it: have.')
  assert bench.said('right', 'that is right')
  assert bench.said('rich', 'You said rich, right?')
  assert not bench.said('right', 'You said rich, right?')


def test_run_trains_the_readme_recipe_each_run_from_the_one_before(
  tmp_path, monkeypatch
):
  """`run`'s training: the README's presets in turn, each `--init-from`
  the run before, into WORK/seedS/NAME."""
  from bench import long_recall as bench

  calls = []
  monkeypatch.setattr(
    bench.subprocess, 'run', lambda cmd, check: calls.append(cmd)
  )
  out, seconds = bench.train(str(tmp_path), bench.RECIPE, 'd', 3, ['--x'])
  assert [c[c.index('--config') + 1] for c in calls] == list(bench.RECIPE)
  outs = [c[c.index('--out-dir') + 1] for c in calls]
  assert out == outs[-1] == str(tmp_path / 'seed3' / 'long-4-4k')
  assert '--init-from' not in calls[0]
  for before, cmd in zip(outs, calls[1:]):
    assert cmd[cmd.index('--init-from') + 1] == before
  assert all(c[-3:] == ['--seed', '3', '--x'] for c in calls)
  assert len(seconds) == 4


def test_run_passes_each_bind_to_every_training_run(tmp_path, monkeypatch):
  """`run --bind GIN` trains the recipe with the binding (it is `probe`'s
  option too, so it must not be swallowed by the parser)."""
  from bench import long_recall as bench

  seen = []

  def train(work, configs, data, seed, extra):
    seen.append(extra)
    return 'out', [1.0]

  monkeypatch.setattr(bench, 'train', train)
  monkeypatch.setattr(bench, 'score', lambda *a, **k: [])
  monkeypatch.setattr(bench, 'table', lambda results: '')
  (tmp_path / 'data').mkdir()
  bench.main(
    ['run', str(tmp_path), '--bind', 'A.b = 1', '--bind', 'C.d = 2', '--x']
  )
  assert seen == [['--bind', 'A.b = 1', '--bind', 'C.d = 2', '--x']]


def test_score_and_run_ask_with_the_far_keys_given(tmp_path, monkeypatch):
  """`score --far-keys K` and `run --far-keys K` ask with K far keys (None:
  the model's own `chat.far_keys`); `data` takes no such option."""
  from bench import long_recall as bench

  asked, written = [], []

  def score(*a, **k):
    asked.append(k['far_keys'] if 'far_keys' in k else a[8])
    return []

  monkeypatch.setattr(bench, 'score', score)
  monkeypatch.setattr(bench, 'write_data', lambda *a: written.append(a))
  monkeypatch.setattr(bench, 'train', lambda *a: ('out', [1.0]))
  monkeypatch.setattr(bench, 'table', lambda results: '')
  bench.main(['score', str(tmp_path), '--far-keys', '8'])
  bench.main(['score', str(tmp_path)])
  (tmp_path / 'data').mkdir()
  bench.main(['run', str(tmp_path), '--far-keys', '0'])
  bench.main(['data', str(tmp_path / 'd'), '--unseen'])
  assert asked == [8, None, 0]
  assert len(written) == 1 and written[0][5] is True  # `unseen`, last but one.


def test_a_measured_distance_lands_near_its_tokens_for_any_tokenizer():
  """`score`'s conversations put 0.9-1.2x the asked distance of tokens
  between statement and question, whether the tokenizer writes one token
  a character or one every six (a first guess of 3 characters a token
  overshot a tokenizer of short pieces past the context)."""
  from bench import long_recall as bench

  class Chars:  # `step` characters a token.
    def __init__(self, step):
      self.step = step

    def encode(self, text):
      return list(range(0, len(text), self.step))

  talk = [
    [('user', f'tell me about topic number {i} please'), ('ai', 'sure, ' * i)]
    for i in range(1, 40)
  ]
  for step in (1, 6):
    rng = np.random.default_rng(step)
    for tokens in (300, 2000):
      conv, count = bench._sample(
        rng, talk, ['lantern'], Chars(step), tokens, True
      )
      assert 0.9 * tokens <= count <= 1.2 * tokens, (step, tokens, count)
      assert conv.value == 'lantern'


def test_unseen_phrasings_are_none_that_training_conversations_use():
  """`make(..., unseen=True)`: the word stated and asked in
  `WORD_UNSEEN`'s phrasings, none of which the training data (`WORD`) or
  the practice (`PRACTICE`) writes: the score's stand-in for a user's own
  way of saying it."""

  def bare(p):
    return re.sub(r'\{\w*\}', '', p).strip(' .?:').lower()

  trained = {
    bare(p)
    for group in (long_recall.WORD, long_recall.PRACTICE)
    for phrasings in group
    for p in phrasings
  }
  for phrasings in long_recall.WORD_UNSEEN[:3]:
    for p in phrasings:
      assert bare(p) not in trained, p
  rng = np.random.default_rng(2)
  asked = set()
  for _ in range(40):
    conv = long_recall.make(rng, TALK, ['lantern'], 100, 'word', unseen=True)
    said, ask = conv.turns[0][1], conv.turns[-2][1]
    assert 'lantern' in said and said in {
      p.format('lantern') for p in long_recall.WORD_UNSEEN[0]
    }
    assert ask in long_recall.WORD_UNSEEN[2] and 'lantern' in conv.turns[-1][1]
    asked.add(ask)
  assert len(asked) == len(long_recall.WORD_UNSEEN[2])


def test_memo_practice_asks_for_the_one_value_it_said_to_keep():
  """`practice(..., memo=1)`: a value said to be kept with no name to ask
  it by (`MEMO`), at most one a conversation, asked for in `MEMO`'s
  questions and answered with that value; none of `WORD_UNSEEN`'s
  phrasings, so the score's unseen phrasings stay unseen."""
  rng = np.random.default_rng(3)
  said_asked = long_recall.WORD_UNSEEN[:3]  # What the prompt holds.
  unseen = {p.split('{}')[0] for g in said_asked for p in g}
  asked = 0
  for _ in range(200):
    turns = long_recall.practice(rng, TALK, ['alpha', 'bravo'], 200, memo=1)
    memos = [i for i, (r, t) in enumerate(turns) if t in long_recall.MEMO[3]]
    assert len(memos) <= 1
    for i in memos:
      answer = turns[i + 1][1]
      frame = ' '.join(long_recall.MEMO[4])
      value = next(w for w in re.findall(r'\w+', answer) if w not in frame)
      said = ' '.join(t for r, t in turns[:i] if r == 'user')
      assert value in said, (turns, answer)
      asked += 1
    for _, text in turns:
      assert not any(text.startswith(u) for u in unseen if len(u) > 3), text
  assert asked > 100


def test_variant_practice_copies_a_known_stem_with_a_new_ending():
  """`practice(..., variants=1)`: every dictionary word is said with an
  ending or a beginning (`variant`), never as a word of `avoid` (the
  measurement's), and what is asked for is what was said; without
  `variants` the draws are those of the plain practice (the README's
  data stays the same file)."""
  words = ['passenger', 'kind']
  avoid = frozenset({'passengers', 'unkind'})
  seen = set()
  rng = np.random.default_rng(4)
  for _ in range(300):
    turns = long_recall.practice(
      rng, TALK, words, 200, variants=1.0, avoid=avoid
    )
    said = ' '.join(text for role, text in turns if role == 'user')
    found = set(re.findall(r'[a-z]*(?:passenger|kind)[a-z]*', said))
    assert not found & avoid, found
    seen |= found
  assert 'passengers' not in seen and len(seen) > 10
  assert seen - set(words)  # Endings and beginnings said.
  assert {w for w in seen if w.startswith('passenger') and w != 'passenger'}
  assert {w for w in seen if w.endswith('kind') and w != 'kind'}
  plain = [
    long_recall.practice(np.random.default_rng(5), TALK, words, 200)
    for _ in range(3)
  ]
  off = [
    long_recall.practice(
      np.random.default_rng(5), TALK, words, 200, variants=0.0, avoid=avoid
    )
    for _ in range(3)
  ]
  assert plain == off


def test_run_takes_seeds_with_commas_or_spaces(tmp_path, monkeypatch, capsys):
  """`run --seeds 0,1` and `--seeds 0 1` train the same seeds (the second
  once passed "1" on to train.py, which stopped on it); a seed that is not
  a whole number is one usage line, before anything is written."""
  from bench import long_recall as bench

  trained = []
  monkeypatch.setattr(bench, 'score', lambda *a, **k: [])
  monkeypatch.setattr(
    bench,
    'train',
    lambda w, c, d, seed, extra: trained.append(seed) or ('o', []),
  )
  monkeypatch.setattr(bench, 'table', lambda results: '')
  (tmp_path / 'data').mkdir()
  bench.main(['run', str(tmp_path), '--seeds', '0,1'])
  bench.main(['run', str(tmp_path), '--seeds', '2', '3'])
  assert trained == [0, 1, 2, 3]
  with pytest.raises(SystemExit) as stop:
    bench.main(['run', str(tmp_path / 'new'), '--seeds', '0', 'x'])
  assert stop.value.code == 2
  assert '--seeds 0 x: write seeds as 0,1,2' in capsys.readouterr().err
  assert not (tmp_path / 'new').exists()


def test_the_table_says_whether_a_seed_is_at_the_aim_by_all_and_first_six():
  """`at_aim`: 5, 5, 4 and 4 right of 6 at ~1k, ~4k, ~12k and ~24k, by all
  the conversations a distance (scaled: 15 of 18) and by the first six
  (what the hidden check asks); the table's last column says both
  (seeds 4, 1 and 0 of BENCHMARKS.md "The stand-in's five seeds with
  blocks that keep their activations")."""
  from bench import long_recall as bench

  def result(seed, right, first):
    rows = []
    for d, r, f in zip(sorted(bench.AIM), right, first):
      # The first six replies name the word `f` times; the rest so that
      # all 18 name it `r` times.
      named = [True] * f + [False] * (6 - f) + [True] * (r - f)
      named += [False] * (18 - len(named))
      replies = [('lantern', 'lantern.' if n else 'lamp.', 0.1) for n in named]
      row = {'distance': d, 'samples': 18, 'tokens': d}
      rows += [
        {**row, 'stated': True, 'right': r, 'replies': replies},
        {**row, 'stated': False, 'right': 0, 'replies': []},
      ]
    return {'seed': seed, 'seconds': [60.0], 'rows': rows}

  seeds = [
    result(4, (16, 17, 17, 17), (6, 5, 5, 5)),
    result(1, (17, 15, 15, 15), (6, 4, 3, 4)),
    result(0, (16, 11, 16, 14), (5, 2, 5, 3)),
  ]
  stated = [[r for r in s['rows'] if r['stated']] for s in seeds]
  assert [bench.at_aim(r) for r in stated] == [True, True, False]
  assert [bench.at_aim(r, first=True) for r in stated] == [True, False, False]
  assert bench.at_aim(stated[0][:3]) is None  # ~24k not asked.
  assert [bench.first_right(r) for r in stated[2]] == [5, 2, 5, 3]
  lines = bench.table(seeds).splitlines()
  assert [line.rsplit('|', 2)[1].strip() for line in lines[2:]] == [
    'yes, yes',
    'yes, no',
    'no, no',
  ]
  assert '16/18 (first 6: 6; 1,000)' in lines[2]


def test_no_practice_statement_puts_a_word_a_user_might_keep_before_its_value():
  """A fact's statement (with each of its openings) says its value after
  "is", "now" or a mark, never right after a word of four letters or
  more: that word would be learned as the cue of a value, and said as a
  value itself, answered with what followed it ("the {k} is called
  {v}")."""
  intros, statements = long_recall.PRACTICE[:2]
  for intro in intros:
    for phrasing in statements:
      before = (intro + phrasing).split('{v}')[0]
      before = before.replace('{k}', 'password').rstrip()
      last = re.search(r"[A-Za-z']*$", before).group().replace("'", '')
      assert len(last) < 4, intro + phrasing


def test_score_words_asks_each_given_word_in_turn(tmp_path, monkeypatch):
  """`score --words a,b` asks a, b, a, ... (each as often as the other),
  not the held-out words; without it every conversation draws from them."""
  from bench import long_recall as bench

  held = ['tree', 'lamp', 'cloud']
  assert [bench.asked(['tell', 'river'], held, i) for i in range(4)] == [
    ['tell'],
    ['river'],
    ['tell'],
    ['river'],
  ]
  assert bench.asked(None, held, 3) == held
  got = []
  monkeypatch.setattr(bench, 'score', lambda *a, **k: got.append(a[9]) or [])
  bench.main(['score', str(tmp_path), '--words', 'tell,river,'])
  bench.main(['score', str(tmp_path)])
  assert got == [['tell', 'river'], None]
  monkeypatch.setattr(bench, 'train', lambda *a: ('out', [1.0]))
  (tmp_path / 'data').mkdir()
  with pytest.raises(SystemExit):  # Not taken in silence by `run`.
    bench.main(['run', str(tmp_path), '--words', 'tell'])
