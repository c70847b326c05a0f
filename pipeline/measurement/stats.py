"""Statistics of measured policies: means with intervals, paired win rates, best-of-n's KL and
choices, distinct-n. Pure functions of numbers and texts (no models), shared by every stage that
measures a policy."""

from __future__ import annotations

import math
import random
from typing import Iterator


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its normal-approximation 95% interval."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / max(n - 1, 1)
    return mean, 1.96 * math.sqrt(var / n)


def resamples(n: int, n_boot: int, seed: int) -> Iterator[list[int]]:
    """`n_boot` bootstrap resamples of `n` items: each a list of n indices drawn with replacement,
    from one generator seeded by `seed`. Statistics of several policies on the same prompts resampled
    with the same indices are paired: the prompts' shared difficulty cancels in their differences."""
    rng = random.Random(seed)
    for _ in range(n_boot):
        yield [rng.randrange(n) for _ in range(n)]


def percentile_interval(boots: list[float]) -> tuple[float, float]:
    """The percentile bootstrap 95% interval (Efron & Tibshirani 1993, ch. 13) of `boots`, sorted."""
    k = len(boots)
    return boots[int(0.025 * (k - 1))], boots[int(math.ceil(0.975 * (k - 1)))]


def win_rate(a: list[float], b: list[float], n_boot: int, seed: int) -> tuple[float, float, float]:
    """P(a beats b) on paired items, ties counting half, with a percentile bootstrap 95% interval
    over items (Efron & Tibshirani 1993). Returns (rate, low, high)."""
    wins = [1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(a, b)]
    n = len(wins)
    boots = sorted(sum(wins[i] for i in idx) / n for idx in resamples(n, n_boot, seed))
    return (sum(wins) / n, *percentile_interval(boots))


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || base) = log n - (n - 1) / n for continuous, tie-free rewards."""
    return math.log(n) - (n - 1) / n


def best_of_n_kl_exact(probs: list[float], rewards: list[float], n: int) -> float:
    """Exact KL of best-of-n over a finite set of outcomes with distinct rewards (for testing the
    formula): P_bon(y) = F(y)^n - F(y-)^n with F the base CDF ordered by reward."""
    order = sorted(range(len(probs)), key=lambda i: rewards[i])
    kl, cdf = 0.0, 0.0
    for i in order:
        p_bon = (cdf + probs[i]) ** n - cdf ** n
        cdf += probs[i]
        if p_bon > 0:
            kl += p_bon * math.log(p_bon / probs[i])
    return kl


def best_of_n_choices(scores: list[list[float]], ns: tuple[int, ...]) -> dict[int, list[int]]:
    """Nested best-of-n. scores[k][i]: RM score of candidate k (k < max(ns)) on prompt i. Returns,
    for each n, per prompt the index of the RM's favourite among candidates 0..n-1 (the first on ties)."""
    n_prompts = len(scores[0])
    return {n: [max(range(n), key=lambda k: scores[k][i]) for i in range(n_prompts)] for n in ns}


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams over all n-grams in the responses (Li et al. 2016): 1 = no repetition."""
    grams = [tuple(w[i:i + n]) for w in (t.split() for t in texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0
