"""Does the model chat? Greedy replies to training and held-out prompts.

(a) Training prompts: the first user turn of each training conversation
    (the run's own data by default, without its held-out conversations),
    answered greedily from a fresh context; a hit is a reply equal (case,
    spacing and final punctuation aside) to one of the answers that prompt
    has in the data.
(b) Held-out prompts: the first user turn of each held-out conversation;
    the share of replies that end with the end marker within 64 tokens and
    the share with a loop (a word 4-gram that occurs twice).

`bench/chat_quality.py` prints these figures and a sample transcript.
"""

from __future__ import annotations

import collections
import re
import time

import numpy as np

MAX_NEW_TOKENS = 64
SENSIBLE_SHARE = 0.9
EVERYDAY = ('Hello', 'Good morning!', 'How are you?', 'Thank you!')


def normalize(text: str) -> str:
  text = re.sub(r'\s+', ' ', text.lower()).strip()
  return text.rstrip('.!?').strip()


def has_loop(text: str, n: int = 4) -> bool:
  words = text.split()
  grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
  return len(grams) != len(set(grams))


def greedy_replies(decoder, prompts, max_new_tokens: int = MAX_NEW_TOKENS):
  """Greedy replies to `prompts`, each from a fresh context
  (`generate.fresh_replies`): `[(reply, ended)]`."""
  from src.inference import generate, sampling

  settings = sampling.SamplingSettings(
    temperature=0.0, max_new_tokens=max_new_tokens
  )
  return generate.fresh_replies(generate.Context(decoder), prompts, settings)


def words_of(text: str) -> list[str]:
  """The lowercase words of `text` (letters, inner apostrophes)."""
  return re.findall(r"[a-z]+(?:'[a-z]+)*", text.lower())


def dictionary(*folders: str) -> set[str]:
  """Every word of the conversations in `folders` (folders or files of the
  line format, e.g. a whole ChatterBot import): the words a reply may use
  to count as English."""
  from src.data import chatformat

  found = set()
  for folder in folders:
    for conv in chatformat.read_data(folder):
      for turn in conv.turns:
        found.update(words_of(turn.text))
  return found


def english_share(text: str, words: set[str]) -> float:
  """Share of the words of `text` found in `words` (0 for no words)."""
  said = words_of(text)
  return sum(w in words for w in said) / len(said) if said else 0.0


def sensible(reply: str, ended: bool, words: set[str]) -> bool:
  """A reply in sensible English: it ends, it has no 4-gram loop, and at
  least `SENSIBLE_SHARE` of its words are dictionary words."""
  return (
    ended
    and not has_loop(reply)
    and english_share(reply, words) >= SENSIBLE_SHARE
  )


def everyday(decoder, words: set[str], prompts=EVERYDAY):
  """Greedy replies to everyday openers, judged by `sensible`.

  Returns:
    `[(prompt, reply, english share, sensible)]`.
  """
  return [
    (p, r, english_share(r, words), sensible(r, ended, words))
    for p, (r, ended) in zip(prompts, greedy_replies(decoder, prompts))
  ]


def knows(reply: str, keywords) -> bool:
  """Whether `reply` names the fact: one of `keywords` (lowercase) is one
  of its words or word sequences."""
  said = ' ' + ' '.join(words_of(reply)) + ' '
  return any(f' {k.lower()} ' in said for k in keywords)


def first_exchanges(convs):
  """prompt -> set of normalized answers, for conversations that open with
  a user turn followed by an AI turn."""
  answers = collections.defaultdict(set)
  shown = {}
  for c in convs:
    t = c.turns
    if len(t) >= 2 and t[0].role == 'user' and t[1].role == 'ai':
      answers[t[0].text].add(normalize(t[1].text))
      shown.setdefault(t[0].text, t[1].text)
  return answers, shown


def training_prompts(convs, n_prompts: int):
  """Up to `n_prompts` opening prompts of `convs` (drawn by a fixed seed).

  Returns:
    `(prompts, answers, shown)`: see `first_exchanges`.
  """
  answers, shown = first_exchanges(convs)
  prompts = sorted(answers)
  if len(prompts) > n_prompts:
    rng = np.random.default_rng(0)
    prompts = [prompts[i] for i in rng.choice(len(prompts), n_prompts, False)]
  return prompts, answers, shown


def trained_answers(decoder, prompts, answers, shown):
  """`[(prompt, reply, trained answer, hit)]`: greedy replies to
  `prompts`; a hit equals one of the prompt's `answers` (`normalize`d)."""
  return [
    (p, reply, shown[p], normalize(reply) in answers[p])
    for p, (reply, _) in zip(prompts, greedy_replies(decoder, prompts))
  ]


def measure(run_dir: str, data: str | None = None, n_prompts: int = 200):
  """Greedy replies to training and held-out prompts, scored.

  Returns:
    A dict: `hits`/`n` (training prompts answered with one of their
    training answers), `ended`/`loops`/`n_held` (held-out replies that end
    with the end marker within 64 tokens / hold a 4-gram loop), `samples`
    `[(prompt, reply, trained answer, hit)]`, `held_samples` `[(prompt,
    reply)]`, `seconds`, `step`.
  """
  from src.analysis import memorization
  from src.inference import decoding

  train, held = memorization.split(run_dir, data)
  prompts, answers, shown = training_prompts(train, n_prompts)
  held_prompts = [
    c.turns[0].text for c in held if c.turns and c.turns[0].role == 'user'
  ][:n_prompts]
  decoder = decoding.Decoder.load(run_dir)
  t0 = time.time()
  samples = trained_answers(decoder, prompts, answers, shown)
  held_samples, ends = [], []
  held_replies = greedy_replies(decoder, held_prompts)
  for p, (reply, end) in zip(held_prompts, held_replies):
    held_samples.append((p, reply))
    ends.append(end)
  return {
    'hits': sum(hit for *_, hit in samples),
    'n': len(samples),
    'ended': sum(ends),
    'loops': sum(has_loop(r) for _, r in held_samples),
    'n_held': len(held_samples),
    'samples': samples,
    'held_samples': held_samples,
    'seconds': time.time() - t0,
    'step': decoder.step,
  }


def summary(m: dict) -> list[str]:
  """The three lines of figures."""
  n, held = max(m['n'], 1), max(m['n_held'], 1)
  return [
    f'training prompts: {m["hits"]}/{m["n"]} greedy replies equal a '
    f'training answer ({100 * m["hits"] / n:.1f}%)',
    f'held-out prompts: {m["ended"]}/{m["n_held"]} end within 64 tokens '
    f'({100 * m["ended"] / held:.1f}%), {m["loops"]} with a 4-gram loop '
    f'({100 * m["loops"] / held:.1f}%)',
    f'({m["seconds"]:.0f} s, step {m["step"]})',
  ]
