"""Recall of what was said in a chat: facts stated in a conversation and
asked for later (`bench/recall.py`), and the "Repeat WORD." conversations
(`bench/positions.py`); the conversations, their line-format text, and
the scoring of a trained run by distance.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from src.analysis.lsh_views import in_view, recording_buckets

NAMES = (
  'Alice Bruno Carmen Dmitri Elena Farid Greta Hiro Ines Jonas Kofi Lena '
  'Mateo Nadia Oskar Priya Quinn Rosa Sami Tomas Uma Viktor Wanda Xavier '
  'Yara Zoltan'
).split()


WORDS = (
  'river lantern pepper violin glacier saddle meadow harbor cobalt walnut '
  'falcon marble thunder velvet orchid copper canyon puzzle ember tulip '
  'anchor biscuit comet dolphin'
).split()


NUMBERS = [str(n) for n in range(100, 1000, 37)]


COLORS = (
  'red blue green yellow purple orange pink brown black white grey teal '
  'maroon navy olive silver gold beige coral indigo'
).split()


CITIES = (
  'Paris Lisbon Oslo Cairo Lima Quito Dublin Vienna Prague Madrid Seoul '
  'Tokyo Nairobi Boston Denver Austin Sydney Perth Toronto Havana Athens '
  'Warsaw Zurich Rome'
).split()


PETS = (
  'Biscuit Pepper Shadow Luna Milo Rocky Daisy Oscar Ziggy Coco Buster '
  'Nala Simba Rusty Mochi Pixel Waffles Juno Toby Ginger'
).split()


# kind -> (statement, question, values)
FACTS = {
  'name': ('My name is {}.', 'What is my name?', NAMES),
  'number': (
    'Please remember the number {}.',
    'What number did I ask you to remember?',
    NUMBERS,
  ),
  'code word': ('The code word is {}.', 'What is the code word?', WORDS),
  'color': ('My favorite color is {}.', 'What is my favorite color?', COLORS),
  'city': ('I live in {}.', 'Where do I live?', CITIES),
  'pet': ('My dog is called {}.', 'What is my dog called?', PETS),
}


QUESTIONS = {question for _, question, _ in FACTS.values()}


def to_text(conversations, markers, loss: str = 'ai') -> str:
  """Conversations (lists of `(role, text)`) in the line format.

  `loss`: 'ai' trains on every AI turn; 'answers' only on the answers to
  the questions (the other AI turns are written `|noloss|`: context only).
  """
  from src.data import chatformat

  def turns_of(turns):
    for i, (r, t) in enumerate(turns):
      train = loss == 'ai' or (
        r == 'ai' and i > 0 and turns[i - 1][1] in QUESTIONS
      )
      yield chatformat.Turn(r, t, '', 0, train or r != 'ai')

  convs = [
    chatformat.Conversation(tuple(turns_of(turns))) for turns in conversations
  ]
  return '\n\n'.join(chatformat.format_conversation(c, markers) for c in convs)


def echo_conversations(n: int, seed: int = 0) -> list:
  """`n` conversations of six "Repeat WORD." / "WORD" pairs."""
  rng = np.random.default_rng(seed)
  values = [v for _, _, vs in FACTS.values() for v in vs]
  convs = []
  for _ in range(n):
    turns = []
    for _ in range(6):
      v = values[int(rng.integers(len(values)))]
      turns += [('user', f'Repeat {v}.'), ('ai', v)]
    convs.append(turns)
  return convs


ACK = 'Okay, I will remember that.'


@dataclasses.dataclass
class Sample:
  turns: list[tuple[str, str]]  # (role, text), the answer last
  answer: str
  kind: str
  distance: int  # Tokens between the fact's end and the question.


def make_sample(rng, filler, distance: int, count, with_fact: bool = True):
  """One conversation of the task.

  Args:
    rng: A NumPy Generator.
    filler: Conversations (`chatformat.Conversation`) to draw turns from.
    distance: At least this many tokens of filler between fact and question.
    count: `(role, text) -> tokens` the turn takes in the context.
    with_fact: False for the no-fact baseline (the statement and its
      acknowledgement are left out; the filler and question are the same).
  """
  kind = list(FACTS)[int(rng.integers(len(FACTS)))]
  statement, question, values = FACTS[kind]
  value = values[int(rng.integers(len(values)))]
  turns = []
  if with_fact:
    turns += [('user', statement.format(value)), ('ai', ACK)]
  used = 0
  while used < distance:
    conv = filler[int(rng.integers(len(filler)))]
    if not conv.turns or conv.turns[0].role != 'user':
      continue  # Keep user/AI alternating.
    for t in conv.turns:
      turns.append((t.role, t.text))
      used += count(t.role, t.text)
    if turns[-1][0] == 'user':  # Keep user/AI alternating.
      turns.append(('ai', ACK))
      used += count('ai', ACK)
  turns += [('user', question), ('ai', value)]
  return Sample(turns, value, kind, used)


def _filler_turns(rng, filler):
  """One whole filler conversation's turns, user first and AI last."""
  while True:
    conv = filler[int(rng.integers(len(filler)))]
    if conv.turns and conv.turns[0].role == 'user':
      break
  turns = [(t.role, t.text) for t in conv.turns]
  if turns[-1][0] == 'user':  # Keep user/AI alternating.
    turns.append(('ai', ACK))
  return turns


def make_training_conversation(rng, filler, length: int, count, asks=1):
  """A training conversation of about `length` tokens holding every kind.

  Each kind of fact is stated once at a random point and asked `asks`
  times at random later points (the answer is the stated value), with
  whole real conversations between: one window carries several examples of
  the skill at distances from a few tokens to about `length`.

  Args:
    rng: A NumPy Generator.
    filler: Conversations (`chatformat.Conversation`) to draw turns from.
    length: Tokens of filler in all (as `count` counts them).
    count: `(role, text) -> tokens` the turn takes in the context.

  Returns:
    `(turns, asked)`: `(role, text)` pairs, and `(kind, value, distance)`
    for each question, distance in filler tokens since the statement.
  """
  events = []
  for kind in FACTS:
    said = float(rng.uniform(0, 0.8 * length))
    events.append((said, 0, kind))
    for _ in range(asks):
      events.append((float(rng.uniform(said, length)), 1, kind))
  events.sort()
  values = {k: v[2][int(rng.integers(len(v[2])))] for k, v in FACTS.items()}
  turns, asked, used, said_at = [], [], 0, {}
  for at, is_question, kind in events:
    while used < at:
      for role, text in _filler_turns(rng, filler):
        turns.append((role, text))
        used += count(role, text)
    statement, question, _ = FACTS[kind]
    if is_question:
      turns += [('user', question), ('ai', values[kind])]
      asked.append((kind, values[kind], used - said_at[kind]))
    else:
      turns += [('user', statement.format(values[kind])), ('ai', ACK)]
      said_at[kind] = used
  return turns, asked


def write_training_set(path, filler, n, length, seed=0, loss='ai', asks=1):
  """`n` conversations (`make_training_conversation`), each with about
  `length` tokens of filler (estimated at 4 characters a token; the run's
  tokenizer measures distances when scoring); `loss` as in `to_text`.
  Returns the distances asked."""
  from src.data import chatformat

  rng = np.random.default_rng(seed)
  convs, distances = [], []
  for _ in range(n):
    turns, asked = make_training_conversation(
      rng,
      filler,
      int(rng.integers(length // 4, length + 1)),
      lambda r, t: len(t) // 4 + 2,
      asks,
    )
    convs.append(turns)
    distances += [d for _, _, d in asked]
  with open(path, 'w', encoding='utf-8') as f:
    f.write(to_text(convs, chatformat.Markers(), loss) + '\n')
  return distances


def _fitting_sample(rng, filler, distance, count, stated, ids_of, max_len):
  """A sample (`make_sample`) whose conversation fits the context whole,
  and its token ids."""
  from src.inference import generate

  while True:
    s = make_sample(rng, filler, distance, count, stated)
    ids = list(generate.START)
    for r, t in s.turns:
      ids += ids_of(r, t)
    if len(ids) <= max_len:
      return s, ids


def _in_view_flags(buckets, s, ids, first, ids_of, setup, view, n_hashes, rng):
  """Whether the answer's query could attend to the stated value with
  buckets drawn at random, and, per LSH layer (some head, some hash
  round), to the stated value and to the question's tokens."""
  from src.inference import generate

  max_len, (chunk_len, before) = setup.max_len, view
  # Input positions are the ids' shifted by one (the model's
  # ShiftRight): the answer's query sits at `first`.
  statement = ids_of(*s.turns[0])
  value_at = generate.LEAD + statement.index(ids[first])
  question = ids_of(*s.turns[-2])
  asked_at = range(first - len(question), first)
  layers = {}  # Layer -> what some head of it may attend to.
  for i, b in buckets:
    for head in np.atleast_2d(b):  # Vectorized heads come together.
      seen = in_view(head, max_len, chunk_len, before, first)
      layers[i] = layers.get(i, set()) | seen
  layers = [layers[i] for i in sorted(layers)]
  # The same with buckets drawn at random (what hashing gives when
  # queries and keys are unrelated), for each head of a layer.
  n_buckets, rounds = int(setup.attention['n_buckets']), n_hashes or 1
  random = set()
  for _ in range(int(setup.model['n_heads'])):
    b = rng.integers(0, n_buckets, (rounds, max_len))
    b = (b + n_buckets * np.arange(rounds)[:, None]).reshape(-1)
    random |= in_view(b, max_len, chunk_len, before, first)
  return (
    value_at in random,
    [value_at in v for v in layers],
    [any(a in v for a in asked_at) for v in layers],
  )


def _summary(answers, seen):
  """One distance's figures from its samples' `answers` (`_answer`'s four
  and the distance) and, for LSH, what was in view (`seen`: per sample,
  `_in_view_flags`)."""
  exact, pieces, kind_mass, value_prob, measured = zip(*answers)
  found = {
    'accuracy': sum(exact) / len(answers),
    # Share of the value's tokens predicted right: shows partial recall
    # (a name's first letters) that exact match does not.
    'token_accuracy': float(np.mean(pieces)),
    'kind_mass': float(np.mean(kind_mass)),
    'value_probability': float(np.mean(value_prob)),
    'mean_distance': float(np.mean(measured)),
  }
  if seen:
    # Per LSH layer: the share of samples where the answer's query could
    # attend to the stated value (some head, some hash round), and to
    # the question's tokens right before it.
    at_random, value, question = zip(*seen)
    found['value_in_view'] = np.mean(value, 0).tolist()
    found['question_in_view'] = np.mean(question, 0).tolist()
    found['value_in_view_at_random'] = float(np.mean(at_random))
  return found


def _answer(logits, ids, first, kind_ids):
  """`(exact, token share, kind mass, value probability)` of one answer:
  whether every token from `first` is the most likely one, the share of
  the value's own tokens that are, and where its first token is predicted
  the probability on the asked kind's values (`kind_ids`: knows what is
  asked) and on the stated value (found the fact)."""
  import jax

  guess = np.asarray(logits[0, first : len(ids)]).argmax(-1)
  right = guess == np.asarray(ids[first:])
  p = np.asarray(jax.nn.softmax(logits[0, first].astype(np.float32)))
  return (
    bool(right.all()),
    float(right[:-1].mean()),
    float(p[kind_ids].sum()),
    float(p[ids[first]]),
  )


def _recording_forward(run: str, n_hashes=None):
  """The run's eval model, its forward pass traced once with the LSH
  buckets recorded: `(setup, tokenizer, forward, buckets)`; `buckets`
  fills with each LSH layer's and head's buckets at every later call."""
  import jax

  from src.inference import decoding, scoring

  bindings = []
  if n_hashes is not None:
    bindings.append(f'LSHSelfAttention.n_hashes = {int(n_hashes)}')
  setup, tok, layer, _ = decoding.load_run(run, 'eval', bindings)
  buckets = []
  with recording_buckets(buckets):  # Traced (and so recorded) once here.
    forward = scoring.forward_fn(layer)
    jax.block_until_ready(forward(np.zeros((1, setup.max_len), np.int32)))
  return setup, tok, forward, buckets


def score(run, filler, distances, samples, n_hashes=None, seed=1):
  """Exact-match share of greedy answers by distance (and no fact).

  Teacher-forced: the whole conversation goes through the eval-mode model
  once, and an answer counts when the most likely token at each of its
  positions (its words and the end marker, after the AI start marker) is
  the answer's: exactly when greedy decoding would write the answer and
  stop (one forward pass per sample instead of a decoding loop).
  """
  import jax

  from src.data import chatformat

  setup, tok, forward, buckets = _recording_forward(run, n_hashes)
  max_len = setup.max_len
  lsh = bool(buckets)  # Full attention records nothing.
  view = (
    int(setup.attention.get('chunk_len') or 0),
    int(setup.attention.get('n_chunks_before') or 0),
  )

  def ids_of(role, text):
    return tok.encode_turn(chatformat.Turn(role, text, '', 0))

  def count(role, text):
    return len(ids_of(role, text))

  # First token of each value (after the AI start marker), by kind.
  first_ids = {
    kind: sorted({ids_of('ai', v)[1] for v in values})
    for kind, (_, _, values) in FACTS.items()
  }
  rng = np.random.default_rng(seed)
  view_rng = np.random.default_rng(seed + 1)  # Keeps `rng`'s samples.
  key = jax.random.PRNGKey(seed)
  results = {}
  for d in [*distances, 'no fact']:
    answers, seen = [], []  # Per sample: `_answer` and distance; flags.
    for _ in range(samples):
      distance = distances[-1] if d == 'no fact' else d
      s, ids = _fitting_sample(
        rng, filler, distance, count, d != 'no fact', ids_of, max_len
      )
      first = len(ids) - len(ids_of('ai', s.answer)) + 1  # After the marker.
      x = np.zeros((1, max_len), np.int32)
      x[0, : len(ids)] = ids
      key, sub = jax.random.split(key)
      buckets.clear()
      logits = forward(x, sub)
      if lsh and d != 'no fact':
        jax.block_until_ready(logits)
        seen.append(
          _in_view_flags(
            buckets, s, ids, first, ids_of, setup, view, n_hashes, view_rng
          )
        )
      answer = _answer(logits, ids, first, first_ids[s.kind])
      answers.append((*answer, s.distance))
    results[str(d)] = _summary(answers, seen)
  return results


def table(report, distances) -> list[str]:
  """Markdown rows: per distance, exact answers, then the probability of
  the stated value and (in brackets) on the asked kind's values."""
  head = [str(d) for d in distances] + ['no fact']
  lines = [
    '| model | ' + ' | '.join(head) + ' |',
    '|-|' + '-|' * len(head),
  ]
  for name, r in report['runs'].items():
    cells = []
    for h in head:
      c = r['by_distance'][h]
      cells.append(
        f'{100 * c["accuracy"]:.0f}% · {c["value_probability"]:.2f} '
        f'({c["kind_mass"]:.2f})'
      )
    lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  # LSH: could the answer's query attend to the fact at all?
  views = [
    (name, r)
    for name, r in report['runs'].items()
    if 'value_in_view' in r['by_distance'][head[0]]
  ]
  if views:
    lines += [
      '',
      '| value in view, by layer (random buckets); question in view | '
      + ' | '.join(head[:-1])
      + ' |',
      '|-|' + '-|' * (len(head) - 1),
    ]
    for name, r in views:
      cells = []
      for h in head[:-1]:
        c = r['by_distance'][h]
        cells.append(
          '/'.join(f'{100 * v:.0f}%' for v in c['value_in_view'])
          + f' ({100 * c["value_in_view_at_random"]:.0f}%); '
          + '/'.join(f'{100 * v:.0f}%' for v in c['question_in_view'])
        )
      lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  return lines
