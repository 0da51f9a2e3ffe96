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


def normalize(text: str) -> str:
  text = re.sub(r'\s+', ' ', text.lower()).strip()
  return text.rstrip('.!?').strip()


def has_loop(text: str, n: int = 4) -> bool:
  words = text.split()
  grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
  return len(grams) != len(set(grams))


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
  from src.inference import decoding, generate, sampling

  train, held = memorization.split(run_dir, data)
  answers, shown = first_exchanges(train)
  rng = np.random.default_rng(0)
  prompts = sorted(answers)
  if len(prompts) > n_prompts:
    prompts = [prompts[i] for i in rng.choice(len(prompts), n_prompts, False)]
  held_prompts = [
    c.turns[0].text for c in held if c.turns and c.turns[0].role == 'user'
  ][:n_prompts]
  decoder = decoding.Decoder.load(run_dir)
  settings = sampling.SamplingSettings(temperature=0.0, max_new_tokens=64)
  context = generate.Context(decoder)

  def answer(prompt):
    context.reset()
    ids = (
      generate.reply(context, prompt, settings, np.random.default_rng(0)) or []
    )
    reply = generate.display(decoder.tokenizer, ids)
    return reply, len(ids) < settings.max_new_tokens

  t0 = time.time()
  samples = []
  for p in prompts:
    reply, _ = answer(p)
    samples.append((p, reply, shown[p], normalize(reply) in answers[p]))
  held_samples, ends = [], []
  for p in held_prompts:
    reply, end = answer(p)
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
