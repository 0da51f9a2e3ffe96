"""The sampler is a pure function of logits: tested with stub logits."""

import numpy as np
import pytest

from src.core.errors import UserError
from src.inference import sampling

LOGITS = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05]))


def settings(**kw):
  base = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
  base.update(kw)
  return sampling.SamplingSettings(**base)


def draws(s, n=3000, recent=()):
  rng = np.random.default_rng(0)
  return (
    np.bincount(
      [sampling.next_token(LOGITS, s, rng, recent) for _ in range(n)],
      minlength=5,
    )
    / n
  )


def test_temperature_zero_is_greedy():
  s = settings(temperature=0)
  assert all(
    sampling.next_token(LOGITS, s, np.random.default_rng(i)) == 1
    for i in range(20)
  )


def test_temperature_one_follows_the_distribution():
  np.testing.assert_allclose(draws(settings()), np.exp(LOGITS), atol=0.03)


def test_top_k_keeps_only_k():
  freq = draws(settings(top_k=2))
  assert freq[0] == freq[3] == freq[4] == 0
  assert freq[1] == pytest.approx(0.5 / 0.8, abs=0.04)


def test_top_p_keeps_the_nucleus():
  # 0.5 + 0.3 = 0.8 >= 0.75: tokens 1 and 2 only.
  freq = draws(settings(top_p=0.75))
  assert set(np.flatnonzero(freq)) == {1, 2}
  kept = sampling.filter_logits(LOGITS, top_p=0.4)
  assert np.isfinite(kept).sum() == 1  # The top token is always kept.


def test_repetition_penalty():
  logits = np.array([2.0, -1.0, 0.5])
  out = sampling.apply_repetition_penalty(logits, [0, 1, 1], 2.0)
  np.testing.assert_allclose(out, [1.0, -2.0, 0.5])
  # Greedy would pick token 1; penalising it (and only recent ids) flips it.
  s = settings(temperature=0, repetition_penalty=10.0, repetition_window=1)
  assert sampling.next_token(LOGITS, s, None, recent=[2, 1]) == 2
  assert sampling.next_token(LOGITS, s, None, recent=[1, 2]) == 1


def test_same_seed_same_draws():
  s = settings()
  a = [sampling.next_token(LOGITS, s, np.random.default_rng(7)) for _ in '12']
  b = [sampling.next_token(LOGITS, s, np.random.default_rng(7)) for _ in '12']
  assert a == b


def test_set_checks_names_types_and_ranges():
  s = sampling.SamplingSettings()
  s.set('temperature', '0.5')
  s.set('top-k', '10')
  assert s.temperature == 0.5 and s.top_k == 10
  with pytest.raises(UserError, match='unknown setting'):
    s.set('temp', '1')
  with pytest.raises(UserError, match='top_p must be above 0'):
    s.set('top_p', '0')
  with pytest.raises(UserError, match='needs a float'):
    s.set('temperature', 'hot')
  assert s.top_p == 0.95  # Unchanged after a refused value.


def test_presence_and_frequency_penalties_are_openais():
  logits = np.zeros(5)
  out = sampling.apply_presence_frequency(logits, [1, 1, 3], 0.5, 0.25)
  np.testing.assert_allclose(out, [0, -1.0, 0, -0.75, 0])
  assert sampling.apply_presence_frequency(logits, [], 1, 1) is logits
  settings = sampling.SamplingSettings(presence_penalty=3)
  with pytest.raises(UserError, match='between -2 and 2'):
    settings.check()
