"""A policy's distance to the best-of-n frontier: how much gold it reaches against what best-of-n
from the same SFT policy reaches at the same KL, with no training at all.

Gao, Schulman & Hilton 2023 ("Scaling laws for reward model overoptimization") find best-of-n's
gold score, as a function of d = sqrt(KL(best-of-n || SFT)), of the form

    gold(d) - gold_SFT = d (a - b d).

`fit` fits a and b by least squares through the measured best-of-n points, with gold_SFT the SFT
policy's mean gold: the curve passes through SFT at KL 0 (best-of-1 is SFT). A policy's gap is its
mean gold minus the curve at its own mean KL: negative below the frontier, positive above it. The
points span KL 0 to best-of-n's largest KL; a policy further from SFT than that is `beyond` the
measured range and has no gap, because the fitted curve past its last point (its downturn, its peak
at d = a / 2b) is a guess. This is not pipeline/measurement/frontier.py, which plots the policies
of a `ppo.kl_coef` sweep across DVC experiments.

Past that range one statement needs no curve: a policy whose gold is below what SFT or a best-of-n
reaches at no more KL is dominated, worse on both axes than a point that was measured. Its
`margin` is its mean gold minus the best gold measured at its KL or less (SFT's at KL 0 included):
defined at every KL, negative where something cheaper does better. Inside the range the curve's
gap is the finer measure (it credits the frontier between the points); the margin is what is left
when the policy went further than best-of-n did.

The interval is a paired percentile bootstrap over prompts (Efron & Tibshirani 1993): each resample
draws prompt indices with replacement, the same for SFT, every best-of-n and every policy (they
answered the same prompts, so a hard prompt lowers all of them and cancels in the gap), recomputes
every mean, refits the curve and recomputes each gap.

Per-prompt numbers in, floats out; standard library only. Shapes: P prompts; every series (P,).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Sequence

from .stats import percentile_interval, resamples

NAN = float("nan")

# A resample whose policy's mean KL lands past best-of-n's largest has no gap. The interval is
# given only when at least this share of resamples have one: a policy at the end of the measured
# range has no honest interval there (leaving the others out would bias it towards the inside).
MIN_DEFINED = 0.95


class Series(NamedTuple):
    """One policy's per-prompt measurements on the held-out prompts."""
    kl: Sequence[float]     # (P,) sequence-level KL to SFT, nats (best-of-n: log n - (n-1)/n on every prompt)
    gold: Sequence[float]   # (P,) gold score of its response


@dataclass(frozen=True)
class Curve:
    """gold(KL) = g0 + d (a - b d) with d = sqrt(KL), measured for 0 <= KL <= kl_max."""
    g0: float       # SFT's mean gold: the curve at KL 0
    a: float
    b: float
    kl_max: float   # best-of-n's largest KL: the end of the measured range

    def at(self, kl: float) -> float:
        """The curve's gold at `kl` nats; NaN beyond `kl_max` (not extrapolated). A negative mean
        KL (a sampled estimate for a policy next to SFT) counts as 0."""
        if kl > self.kl_max:
            return NAN
        d = math.sqrt(max(kl, 0.0))
        return self.g0 + d * (self.a - self.b * d)


@dataclass(frozen=True)
class Gap:
    """A policy's gap to the best-of-n curve at its own KL, with its paired bootstrap interval."""
    gap: float                # mean gold - curve(mean KL); NaN when beyond or with no curve
    low: float                # 2.5th percentile of the resamples' gaps; NaN where `gap` is, or too few
    high: float               # 97.5th percentile
    beyond: Optional[bool]    # mean KL past best-of-n's largest KL; None without any best-of-n point
    kl: float                 # the policy's mean KL
    gold: float               # its mean gold
    frontier: float           # the curve at its mean KL (NaN where `gap` is)
    margin: float = NAN       # mean gold - the best gold of SFT and best-of-n at no more KL (`reference`)
    margin_low: float = NAN   # paired bootstrap 95% interval of the margin
    margin_high: float = NAN


def finite(x: object) -> bool:
    """A number that is not NaN or infinite: a gap that was measured (metrics.json holds one that
    was not as null, flags as true or false)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fit(g0: float, points: Sequence[tuple[float, float]]) -> Optional[Curve]:
    """The least-squares curve through best-of-n's `points`, each (mean KL, mean gold), anchored at
    SFT's mean gold `g0` at KL 0: minimises sum_i (gold_i - g0 - a d_i + b d_i^2)^2 over a, b, a
    linear problem in (a, b) solved by its 2x2 normal equations. None with fewer than two points of
    distinct positive KL (two unknowns)."""
    if len({kl for kl, _ in points if kl > 0}) < 2:
        return None
    # Regressors u = d, v = -d^2 for y = gold - g0 = a u + b v.
    s_uu = s_uv = s_vv = t_u = t_v = 0.0
    for kl, gold in points:
        d = math.sqrt(max(kl, 0.0))
        u, v, y = d, -d * d, gold - g0
        s_uu, s_uv, s_vv = s_uu + u * u, s_uv + u * v, s_vv + v * v
        t_u, t_v = t_u + u * y, t_v + v * y
    det = s_uu * s_vv - s_uv * s_uv   # > 0 for two distinct d > 0 (Cauchy-Schwarz)
    a = (t_u * s_vv - t_v * s_uv) / det
    b = (s_uu * t_v - s_uv * t_u) / det
    return Curve(g0, a, b, max(kl for kl, _ in points))


def _mean(xs: Sequence[float], idx: Optional[Sequence[int]] = None) -> float:
    if idx is None:
        return sum(xs) / len(xs)
    return sum(xs[i] for i in idx) / len(idx)


def _frontier(curve: Optional[Curve], kl: float) -> float:
    return NAN if curve is None else curve.at(kl)


def reference(sft_gold: float, best_of: Sequence[tuple[float, float]], kl: float) -> float:
    """The best mean gold measured at `kl` nats or less: SFT's (KL 0) or a best-of-n's, each
    (mean KL, mean gold) of `best_of`."""
    return max([sft_gold, *(gold for bkl, gold in best_of if bkl <= kl)])


def gaps(sft_gold: Sequence[float], best_of: Sequence[Series], policies: Mapping[str, Series],
         n_boot: int, seed: int) -> dict[str, Gap]:
    """Each policy's gap to the best-of-n curve (`fit` through `best_of`, anchored at SFT's mean
    gold), with a paired percentile bootstrap 95% interval over the P prompts: `n_boot` resamples
    of the prompt indices (stats.resamples from `seed`), the same for every series. sft_gold: (P,);
    best_of: a Series per n; policies: name -> Series. Every series has the P prompts in one order."""
    n = len(sft_gold)
    if n == 0:
        raise ValueError("frontier gap: no prompts")
    for name, s in [*(("best-of-n", s) for s in best_of), *policies.items()]:
        if len(s.kl) != n or len(s.gold) != n:
            raise ValueError(f"frontier gap: {name} has {len(s.kl)} KLs and {len(s.gold)} gold scores for "
                             f"{n} prompts; every policy answers the same prompts")
    def means(idx: Optional[Sequence[int]]):
        """SFT's mean gold, best-of-n's (mean KL, mean gold) points and their curve, over prompts
        `idx` (None: all): computed once per resample, for every policy's gap and margin."""
        g0, points = _mean(sft_gold, idx), [(_mean(s.kl, idx), _mean(s.gold, idx)) for s in best_of]
        return g0, points, fit(g0, points)

    def gap_and_margin(s: Series, idx: Optional[Sequence[int]], g0, points, c) -> tuple[float, float]:
        kl, gold = _mean(s.kl, idx), _mean(s.gold, idx)
        return gold - _frontier(c, kl), (gold - reference(g0, points, kl) if points else NAN)

    g0, points, curve = means(None)
    kl_max = max((kl for kl, _ in points), default=None)
    boots: dict[str, list[float]] = {name: [] for name in policies}
    margins: dict[str, list[float]] = {name: [] for name in policies}
    if best_of:
        for idx in resamples(n, n_boot, seed):
            resampled = means(idx)
            for name, s in policies.items():
                gap, margin = gap_and_margin(s, idx, *resampled)
                boots[name].append(gap)
                margins[name].append(margin)
    out = {}
    for name, s in policies.items():
        kl, gold = _mean(s.kl), _mean(s.gold)
        frontier = _frontier(curve, kl)
        defined = sorted(g for g in boots[name] if not math.isnan(g))
        low, high = (percentile_interval(defined) if not math.isnan(frontier) and defined
                     and len(defined) >= MIN_DEFINED * n_boot else (NAN, NAN))
        beyond = None if kl_max is None else kl > kl_max
        m_low, m_high = percentile_interval(sorted(margins[name])) if margins[name] else (NAN, NAN)
        margin = gap_and_margin(s, None, g0, points, curve)[1]
        out[name] = Gap(gold - frontier, low, high, beyond, kl, gold, frontier, margin, m_low, m_high)
    return out
