"""Long conversations that test memory: something is said once at the
start (a word, a number, a name), small talk follows for a chosen number
of characters, and at the end the user asks for it.

`bench/long_recall.py` writes such conversations for training (the
long-conversations walkthrough of the README) and for measuring recall by
distance through the chat engine (their line-format text:
`recall.to_text`). The phrasings are many and drawn at
random, so a model learns to find what was said, not one sentence; the
words of the measurement can be held out of the training ones (`split`).
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np

from src.analysis import recall
from src.data import chatformat

# (statement, acknowledgement, question, answer) phrasings for each kind;
# `{}` is the value. An acknowledgement may repeat the value or not.
WORD = (
  (
    'Remember this word for me: {}.',
    'The secret word is {}.',
    'Here is a word to keep in mind: {}',
    'Please remember the word {}, I will ask you later.',
    "I'll give you a word to remember. It is {}.",
    'Keep this word for later: {}',
    'My word of the day is {}.',
    'Can you remember a word for me? {}',
  ),
  (
    'Okay, I will remember it.',
    'Got it: {}.',
    'Sure, I will keep it in mind.',
    'Noted. {} it is.',
    'All right.',
    "I won't forget.",
  ),
  (
    'What was the word I asked you to remember?',
    'Which word did I give you at the start?',
    'Do you still remember the word I told you?',
    'Tell me the secret word.',
    'What was my word of the day?',
    'So, what was that word from earlier?',
  ),
  (
    '{}',
    'The word was {}.',
    'You told me {}.',
    'It was {}.',
    '{}. I remembered.',
  ),
)

# A word stated and asked for in phrasings no training conversation
# uses (neither `WORD` nor the practice's `PRACTICE`): the measurement's
# stand-in for a user's own ways of saying it (`make(..., unseen=True)`).
WORD_UNSEEN = (
  (
    "Don't let me forget this: {}.",
    'Hold on to {} for me.',
    "I'm going to quiz you later, so memorise {}.",
    'Store this somewhere safe: {}',
    "Today's magic word? {}",
    'Before we chat, one thing to note down: {}.',
  ),
  (
    'Will do.',
    'Stored.',
    'Consider it done.',
    '{}, understood.',
    'Absolutely.',
  ),
  (
    'Quick quiz: which word did I want you to memorise?',
    'Earlier I gave you a word. Which one was it?',
    'What did I ask you to hold on to, again?',
    'What word did I mention right at the start?',
    'Memory test! What was the word from the beginning of our chat?',
  ),
  ('{}', 'You said {}.', 'I have it: {}.', '{}, right?'),
)

NUMBER = (
  (
    'Please remember the number {}.',
    'My locker number is {}.',
    'Here is a number to keep: {}',
  ),
  WORD[1],
  (
    'What number did I ask you to remember?',
    'What was that number again?',
    'Which number did I tell you?',
  ),
  ('{}', 'The number was {}.', 'It was {}.'),
)

NAME = (
  ('My name is {}.', "Hi, I'm {}.", 'You can call me {}.'),
  ('Nice to meet you, {}.', 'Hello {}!', 'Nice to meet you.'),
  ("What's my name?", 'Do you remember my name?', 'Who am I?'),
  ('{}', 'Your name is {}.', 'You are {}.'),
)

NAMES = (
  recall.NAMES
  + (
    'Amara Bjorn Chiara Dario Esme Felix Gwen Hugo Ilse Jasper Kira Lucas '
    'Maren Nico Olga Pavel Rhea Soren Talia Ugo Vera Wes Zane'
  ).split()
)


@dataclasses.dataclass
class Conversation:
  turns: list  # (role, text) pairs, user first; the answer last.
  kind: str  # 'word', 'number' or 'name'.
  value: str  # What was said once and is asked for.
  filler_chars: int  # Characters of small talk between statement and question.


def word_list(conversations) -> list[str]:
  """Distinct lowercase words of 4-10 letters in `conversations`'
  text, sorted: the words a conversation may ask to remember."""
  found = set()
  for turn in chatformat.iter_turns(conversations):
    found.update(re.findall(r'\b[a-z]{4,10}\b', turn.text))
  return sorted(found)


def split(words, held_share: float = 0.2):
  """`(train, held)`: the words divided by a hash of each (the same on
  every machine): the measurement asks for words no training
  conversation stated."""
  held = [w for w in words if zlib.crc32(w.encode()) % 1000 < held_share * 1000]
  kept = set(held)
  return [w for w in words if w not in kept], held


def small_talk(conversations) -> list[list[tuple[str, str]]]:
  """The conversations as `(role, text)` lists that start with the user
  and end with the AI (others are left out)."""
  out = []
  for c in conversations:
    turns = [(t.role, t.text) for t in c.turns]
    if len(turns) >= 2 and turns[0][0] == 'user' and turns[-1][0] == 'ai':
      out.append(turns)
  return out


def _pick(rng, options):
  return options[int(rng.integers(len(options)))]


def _small_talk_for(rng, talk, chars: int):
  """`(turns, characters)`: whole small-talk conversations drawn at random
  until they hold at least `chars` characters."""
  turns, used = [], 0
  while used < chars:
    for turn in _pick(rng, talk):
      turns.append(turn)
      used += len(turn[1])
  return turns, used


def make(
  rng,
  talk,
  words,
  filler_chars: int,
  kind: str = 'word',
  stated=True,
  unseen=False,
):
  """One conversation: the statement and its acknowledgement, whole small
  talk conversations of at least `filler_chars` characters, the question
  and (last) the answer.

  Args:
    rng: A NumPy Generator.
    talk: `small_talk(...)` conversations.
    words: Values for kind 'word'.
    kind: 'word', 'number' or 'name'.
    stated: False for the control (the statement and its acknowledgement
      are left out; the rest is drawn alike).
    unseen: a word stated and asked in `WORD_UNSEEN`'s phrasings.
  """
  phrasing = {'word': WORD, 'number': NUMBER, 'name': NAME}[kind]
  phrasing = WORD_UNSEEN if unseen and kind == 'word' else phrasing
  if kind == 'word':
    value = _pick(rng, words)
  elif kind == 'number':
    value = str(int(rng.integers(10, 10000)))
  else:
    value = _pick(rng, NAMES)
  said, ack, ask, answer = (_pick(rng, p) for p in phrasing)
  turns = [('user', said.format(value)), ('ai', ack.format(value))]
  turns = turns if stated else []
  filler, used = _small_talk_for(rng, talk, filler_chars)
  turns += filler + [('user', ask), ('ai', answer.format(value))]
  return Conversation(turns, kind, value, used)


DISTRACTOR = (
  'My cat is called {}.',
  'Our street is {}.',
  'The name of my boat is {}.',
  'My password is {}.',
)


def with_distractor(rng, conv: Conversation, other: str) -> list:
  """`conv`'s turns with a second statement of another thing (`other`, a
  value of the same kind, with an acknowledgement) just after the asked
  one, or just before it (drawn alike): a model that finds the statement
  the question asks about answers `conv.value`; one that copies whatever
  unusual word was said is as likely to answer `other`."""
  said = [('user', _pick(rng, DISTRACTOR).format(other)), ('ai', 'Okay.')]
  turns = list(conv.turns)
  at = 2 if rng.random() < 0.5 else 0
  return turns[:at] + said + turns[at:]


KINDS = ('word', 'word', 'word', 'number', 'name')  # Drawn alike: words 3/5.


def training_set(
  rng, talk, words, n: int, most_chars: int, short=0.85, unseen=False
):
  """`n` conversations, kinds drawn from `KINDS`. A share `short` of them
  have 50-2,000 characters of small talk (statement and question in one
  training window: many different examples of finding what was said),
  the others 2,000 to `most_chars`, log-uniform (as many at each scale:
  what a long conversation looks like, its start spliced to its end in
  training). `unseen`: words in `WORD_UNSEEN`'s phrasings (a stand-in
  for a user's data in phrasings of their own)."""
  out = []
  for _ in range(n):
    lo, hi = (50, 2000) if rng.random() < short else (2000, most_chars)
    chars = int(np.exp(rng.uniform(np.log(lo), np.log(max(hi, lo + 1)))))
    out.append(make(rng, talk, words, chars, _pick(rng, KINDS), True, unseen))
  return out


# ---- Memory practice ---------------------------------------------------------
# Conversations dense in copying, in phrasings of their own (none of the
# measurement's above): facts stated ("the door code is zuvo"), small talk,
# then each asked for; and "repeat after me" lists. Values are invented
# words, dictionary words, numbers and names, so a model that gets them
# right copies them (an invented word cannot be guessed). Mixed into
# training (`train.py --replay FOLDER --replay-share X`; BENCHMARKS.md
# "Recall in a long chat"). A statement puts no word of four letters or
# more right before its value ("is", "now", ":"): the word before a value
# is learned as a cue, word by word, and such a word said as a value is
# then answered with what came after it ("the dog is called zuvo" once
# made "called" a word no seed could keep; BENCHMARKS.md "No word a user
# might keep as the practice's cue").
PRACTICE_KEYS = (
  "password,door code,wifi password,dog's name,cat's name,favourite colour,"
  "code name,sister's name,brother's name,lucky word,street,team name,"
  "project name,boat's name,plant's name,hotel,meeting place,restaurant,"
  'book title,movie,favourite band,nickname,city,village,answer,key word,'
  "label,item,password hint,horse's name,car's name,bakery,shop,island,"
  "river,mountain,teacher's name,neighbour's name,cafe,song"
).split(',')
PRACTICE = (
  ('', 'Just so you know, ', 'By the way, ', 'Note: ', 'FYI, ',
   'Quick thing: ', 'Oh, and ', 'Listen, '),
  ('the {k} is {v}.', '{v} is the {k}.', 'the {k}: {v}', 'my {k} is {v}.',
   'the {k} will be {v}.', "the {k}? It's {v}.", 'for the {k}, it is {v}.',
   'the {k} is now {v}.'),
  ('OK.', 'Okay.', 'Noted, thanks.', 'Got it.', 'Sure.', 'Understood.',
   'Thanks for telling me.', 'Good to know.', 'Alright.'),
  ('What is the {k}?', 'What was the {k} again?', 'Remind me of the {k}.',
   'Do you recall the {k}?', 'Tell me the {k}.',
   'What did I say the {k} was?', 'And the {k}?',
   'Which {k} did I mention?', 'The {k}, what was it?'),
  ('{v}', 'The {k} is {v}.', 'It is {v}.', 'You said {v}.',
   '{v}, you told me.', 'That would be {v}.', '{v}.'),
  ('Repeat after me: {}', 'Say this back: {}', 'Can you say {}?',
   'Echo: {}', 'Copy this: {}', 'Please write {}'),
)  # fmt: skip
# A value said to be kept, with no name to ask it by ("Remember zuvo."),
# asked for as what was said ("What did I ask you to keep?"): (intro,
# statement, acknowledgement, question, answer). None of `WORD`'s or
# `WORD_UNSEEN`'s phrasings: a model that answers `WORD_UNSEEN` after
# this practice answers phrasings it never read.
MEMO = (
  ('', 'Okay, ', 'Hey, ', 'One more thing: ', 'Listen, ', 'So, '),
  ('remember {v}.', 'please keep {v} in mind.', 'can you remember {v}?',
   "the word I'm thinking of is {v}.", "here's one for you: {v}.",
   "{v}. That's the word.", 'your word for today: {v}',
   'I picked a word: {v}.', 'save this word: {v}', 'write down {v}.',
   'keep track of {v} for me.', 'a word for later: {v}',
   'mark this one: {v}', "I'll test you on this: {v}.", 'my pick is {v}.'),
  PRACTICE[2] + ('Remembered.', 'I will keep it.'),
  ('What was it?', 'What did I tell you at first?', 'Which word did I pick?',
   'What was the word I was thinking of?',
   'Do you remember what I said first?', 'What did I ask you to keep?',
   'Can you repeat the word from before?',
   'What did I want you to write down?', 'And my word from earlier?',
   'What was my pick?', 'Test time: what was it?',
   'What did I give you to remember?'),
  ('{v}', 'It was {v}.', '{v}, you told me.', 'You said {v}.',
   'The word is {v}.'),
)  # fmt: skip
_C, _V = 'bdfghklmnprstvz', 'aeiou'


def invented(rng) -> str:
  """A word of 2-3 invented syllables ("zuvo", "hebito")."""
  n = int(rng.integers(2, 4))
  return ''.join(_pick(rng, _C) + _pick(rng, _V) for _ in range(n))


# Endings and beginnings a practice word may take (`practice(...,
# variants=)`): a familiar stem whose ending must be copied, not completed
# as the word the model knows ("passenger" -> "passengers").
SUFFIXES = (
  's', 'es', 'ed', 'ing', 'er', 'ers', 'ly', 'less', 'ness', 'ful', 'able',
  'al', 'ist', 'ish', 'ment', 'ship',
)  # fmt: skip
PREFIXES = ('un', 're', 'dis', 'over', 'out', 'pre', 'non', 'mis', 'sub')


def variant(rng, word: str, avoid=frozenset()) -> str:
  """`word` with a drawn ending (7 in 10) or beginning; `word` itself
  where that gives a word of `avoid`."""
  if rng.random() < 0.7:
    out = word + _pick(rng, SUFFIXES)
  else:
    out = _pick(rng, PREFIXES) + word
  return word if out in avoid else out


def _value(rng, words, variants=0.0, avoid=frozenset()) -> str:
  r = rng.random()
  if r < 0.35:
    return invented(rng)
  if r < 0.85:
    word = _pick(rng, words)
    if variants and rng.random() < variants:
      return variant(rng, word, avoid)
    return word
  if r < 0.95:
    return str(int(rng.integers(10, 10000)))
  return _pick(rng, NAMES)


def practice(
  rng,
  talk,
  words,
  most_chars: int = 3000,
  memo=0.0,
  variants=0.0,
  avoid=frozenset(),
) -> list:
  """One practice conversation's `(role, text)` turns: 1-3 facts or
  repeats, 30 to `most_chars` characters of small talk (log-uniform),
  then the facts asked for in a random order. `memo`: the share of facts
  said to be kept with no name to ask them by (`MEMO`; one a conversation
  at most, as its question could not tell two apart). `variants`: the
  share of dictionary words given an ending or a beginning (`variant`;
  none a word of `avoid`)."""
  repeat = PRACTICE[5]
  turns, facts = [], []

  def value():
    return _value(rng, words, variants, avoid)

  for _ in range(int(rng.integers(1, 4))):
    if rng.random() < 0.3:
      said = ' '.join(value() for _ in range(rng.integers(1, 4)))
      turns += [('user', _pick(rng, repeat).format(said)), ('ai', said)]
      continue
    if memo and rng.random() < memo and None not in dict(facts):
      v = value()
      facts.append((None, v))
      text = _pick(rng, MEMO[0]) + _pick(rng, MEMO[1]).format(v=v)
      text = text if text.startswith(v) else text[0].upper() + text[1:]
      turns += [('user', text), ('ai', _pick(rng, MEMO[2]))]
      continue
    k = _pick(rng, PRACTICE_KEYS)
    if k in dict(facts):
      continue
    v = value()
    facts.append((k, v))
    turns += _statement(rng, k, v)
  return _asked(rng, talk, turns, facts, most_chars)


def lookup_practice(rng, talk, words, most_chars: int = 3000) -> list:
  """One conversation of lookup practice: 2-4 facts drawn about different
  things (a thing drawn twice is said once), each value a word of
  `words` (one in ten invented), with short small talk between some of
  them, 30 to `most_chars` characters of small talk (log-uniform), then
  every fact asked for in a random order. With several ordinary words
  said, copying "the unusual word" cannot answer: the statement the
  question asks about must be found (BENCHMARKS.md "What formed is a
  copy")."""
  turns, facts = [], []
  for _ in range(int(rng.integers(2, 5))):
    k = _pick(rng, PRACTICE_KEYS)
    if k in dict(facts):
      continue
    v = invented(rng) if rng.random() < 0.1 else _pick(rng, words)
    facts.append((k, v))
    turns += _statement(rng, k, v)
    if rng.random() < 0.5:
      turns += _small_talk_for(rng, talk, int(rng.integers(20, 200)))[0]
  return _asked(rng, talk, turns, facts, most_chars)


def _statement(rng, k: str, v: str) -> list:
  """A practice statement of fact `k` = `v` and its acknowledgement."""
  intro, state, ack = PRACTICE[:3]
  text = _pick(rng, intro) + _pick(rng, state).format(k=k, v=v)
  return [('user', text[0].upper() + text[1:]), ('ai', _pick(rng, ack))]


def _asked(rng, talk, turns, facts, most_chars: int) -> list:
  """`turns`, then 30 to `most_chars` characters of small talk
  (log-uniform), then each of `facts` asked for and answered in a
  random order; a user turn first."""
  ask, answer = PRACTICE[3:5]
  chars = int(np.exp(rng.uniform(np.log(30), np.log(most_chars))))
  turns = turns + _small_talk_for(rng, talk, chars)[0]
  for i in rng.permutation(len(facts)):
    k, v = facts[i]
    asks, answers = (MEMO[3], MEMO[4]) if k is None else (ask, answer)
    turns.append(('user', _pick(rng, asks).format(k=k)))
    turns.append(('ai', _pick(rng, answers).format(k=k, v=v)))
  if turns[0][0] != 'user':
    turns.insert(0, ('user', 'Hi.'))
  return turns
