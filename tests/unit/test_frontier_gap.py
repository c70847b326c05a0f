"""The gap to the best-of-n frontier (pipeline/measurement/frontier_gap.py): the fit of Gao et al.'s
form, the gap's sign and value, the end of the measured range, and the paired bootstrap interval."""

from __future__ import annotations

import math
import random

import pytest

from pipeline.measurement.frontier_gap import Curve, Series, fit, gaps, reference
from pipeline.measurement.stats import best_of_n_kl

NS = (4, 16, 64)
G0, A, B = 0.5, 1.6, 0.25   # gold(d) = G0 + d (A - B d): the frontier the synthetic data follow


def curve_gold(kl: float) -> float:
    d = math.sqrt(kl)
    return G0 + d * (A - B * d)


def constant(value: float, n: int) -> list[float]:
    return [value] * n


def noisy_run(n: int, seed: int, policy_kl: float, true_gap: float) -> tuple[list, list, Series]:
    """Per-prompt gold for SFT, best-of-n and a policy, each its frontier value plus a prompt's
    difficulty (shared by every policy: they answer the same prompt) plus the response's own noise;
    the policy's per-prompt KL spread about `policy_kl`."""
    rng = random.Random(seed)
    hard = [rng.gauss(0, 0.8) for _ in range(n)]
    sft = [G0 + h + rng.gauss(0, 0.5) for h in hard]
    best = [Series(constant(best_of_n_kl(k), n),
                   [curve_gold(best_of_n_kl(k)) + h + rng.gauss(0, 0.5) for h in hard]) for k in NS]
    kls = [max(policy_kl + rng.gauss(0, 1.0), 0.0) for _ in range(n)]
    shift = policy_kl - sum(kls) / n    # the sample's mean KL is policy_kl: the true gap is known there
    kls = [k + shift for k in kls]
    policy = Series(kls, [curve_gold(policy_kl) + true_gap + h + rng.gauss(0, 0.5) for h in hard])
    return sft, best, policy


def test_the_fit_recovers_a_and_b_from_points_on_the_curve():
    points = [(best_of_n_kl(k), curve_gold(best_of_n_kl(k))) for k in NS]
    c = fit(G0, points)
    assert c == Curve(G0, pytest.approx(A, abs=1e-12), pytest.approx(B, abs=1e-12), points[-1][0])
    assert c.at(0.0) == G0 and c.at(-0.01) == G0              # a sampled KL below 0 counts as SFT's
    assert c.at(2.0) == pytest.approx(curve_gold(2.0), abs=1e-12)
    assert math.isnan(c.at(points[-1][0] + 1e-9))             # past the last point: not extrapolated
    # Two points determine it too; with noise, three are a least-squares fit: its residuals are
    # orthogonal to both regressors (d and d^2), the normal equations.
    assert fit(G0, points[:2]).a == pytest.approx(A, abs=1e-12)
    noisy = [(kl, g + e) for (kl, g), e in zip(points, (0.1, -0.2, 0.05))]
    c = fit(G0, noisy)
    res = [g - c.at(kl) for kl, g in noisy]
    for power in (1, 2):
        orthogonal = sum(r * math.sqrt(kl) ** power for r, (kl, _) in zip(res, noisy))
        assert orthogonal == pytest.approx(0, abs=1e-12)


def test_no_fit_with_fewer_than_two_points():
    assert fit(G0, []) is None
    assert fit(G0, [(1.0, 2.0)]) is None
    assert fit(G0, [(1.0, 2.0), (1.0, 2.1), (0.0, G0)]) is None    # one distinct positive KL
    n = 10
    one = gaps(constant(G0, n), [Series(constant(1.0, n), constant(2.0, n))],
               {"ppo": Series(constant(0.5, n), constant(1.0, n))}, n_boot=100, seed=0)["ppo"]
    assert math.isnan(one.gap) and math.isnan(one.low) and math.isnan(one.high) and one.beyond is False
    ppo = {"ppo": Series(constant(0.5, n), constant(1.0, n))}
    none = gaps(constant(G0, n), [], ppo, n_boot=100, seed=0)["ppo"]
    assert math.isnan(none.gap) and none.beyond is None


def test_the_gap_is_gold_minus_the_curve_at_the_policys_kl():
    n = 50
    best = [Series(constant(best_of_n_kl(k), n), constant(curve_gold(best_of_n_kl(k)), n)) for k in NS]
    below = Series(constant(2.0, n), constant(curve_gold(2.0) - 0.45, n))
    above = Series(constant(0.3, n), constant(curve_gold(0.3) + 0.2, n))
    out = gaps(constant(G0, n), best, {"below": below, "above": above}, n_boot=200, seed=3)
    assert out["below"].gap == pytest.approx(-0.45, abs=1e-9) and out["below"].beyond is False
    assert out["below"].frontier == pytest.approx(curve_gold(2.0), abs=1e-9)
    assert (out["below"].kl, out["below"].gold) == (pytest.approx(2.0), pytest.approx(curve_gold(2.0) - 0.45))
    assert out["above"].gap == pytest.approx(0.2, abs=1e-9)
    # Every prompt alike: every resample is the sample, the interval a point.
    point = pytest.approx(-0.45, abs=1e-9)
    assert (out["below"].low, out["below"].high) == (point, point)


def test_a_policy_beyond_best_of_ns_largest_kl_is_flagged_not_extrapolated():
    n = 40
    best = [Series(constant(best_of_n_kl(k), n), constant(curve_gold(best_of_n_kl(k)), n)) for k in NS]
    kl_max = best_of_n_kl(64)
    policies = {"far": Series(constant(kl_max + 1.0, n), constant(2.0, n)),
                "edge": Series(constant(kl_max, n), constant(2.0, n))}
    out = gaps(constant(G0, n), best, policies, n_boot=100, seed=0)
    far, edge = out["far"], out["edge"]
    assert far.beyond is True and math.isnan(far.gap) and math.isnan(far.low) and math.isnan(far.high)
    assert math.isnan(far.frontier) and far.kl == pytest.approx(kl_max + 1.0) and far.gold == 2.0
    assert edge.beyond is False and edge.gap == pytest.approx(2.0 - curve_gold(kl_max), abs=1e-9)


def test_the_margin_is_gold_minus_the_best_measured_at_no_more_kl_at_every_kl():
    n = 40
    best = [Series(constant(best_of_n_kl(k), n), constant(curve_gold(best_of_n_kl(k)), n)) for k in NS]
    kl_max = best_of_n_kl(64)
    assert reference(G0, [(best_of_n_kl(k), curve_gold(best_of_n_kl(k))) for k in NS], 0.1) == G0
    policies = {"far": Series(constant(kl_max + 1.0, n), constant(2.0, n)),            # past the range
                "middle": Series(constant(best_of_n_kl(16) + 0.1, n), constant(3.0, n)),
                "near": Series(constant(0.1, n), constant(G0 - 0.2, n))}             # below SFT's gold
    out = gaps(constant(G0, n), best, policies, n_boot=50, seed=0)
    assert out["far"].margin == pytest.approx(2.0 - curve_gold(kl_max))               # best-of-64 dominates
    assert out["far"].margin < 0 and out["far"].margin_low <= out["far"].margin <= out["far"].margin_high
    assert out["middle"].margin == pytest.approx(3.0 - curve_gold(best_of_n_kl(16)))   # best-of-16, not 64
    assert out["near"].margin == pytest.approx(-0.2)                                    # SFT at KL 0
    # constant series: every resample is the same, so is the interval
    assert out["far"].margin_high - out["far"].margin_low == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(gaps(constant(G0, n), [], policies, n_boot=10, seed=0)["far"].margin)


def test_no_interval_where_the_policys_kl_straddles_the_end_of_the_range():
    # Mean KL just inside the range, per-prompt KL spread wide: many resamples land past the end.
    sft, best, _ = noisy_run(200, 0, 2.0, 0.0)
    kl_max = best_of_n_kl(64)
    rng = random.Random(1)
    kls = [rng.uniform(0, 2 * kl_max) for _ in range(200)]
    kls = [k + (kl_max - 0.01) - sum(kls) / 200 for k in kls]
    g = gaps(sft, best, {"p": Series(kls, constant(2.5, 200))}, n_boot=200, seed=0)["p"]
    assert g.beyond is False and not math.isnan(g.gap)
    assert math.isnan(g.low) and math.isnan(g.high)


def test_the_interval_contains_the_true_gap_and_shrinks_with_more_prompts():
    widths = {}
    for n in (200, 2000):
        sft, best, policy = noisy_run(n, seed=n, policy_kl=2.0, true_gap=-0.3)
        g = gaps(sft, best, {"ppo": policy}, n_boot=300, seed=0)["ppo"]
        assert g.low < -0.3 < g.high and g.high < 0
        widths[n] = g.high - g.low
    assert widths[2000] < 0.5 * widths[200]          # about 1/sqrt(10) of it
    # Over independent data sets the 95% interval covers the true gap most of the time.
    covered = 0
    for seed in range(12):
        sft, best, policy = noisy_run(150, seed=100 + seed, policy_kl=1.2, true_gap=0.2)
        g = gaps(sft, best, {"ppo": policy}, n_boot=200, seed=seed)["ppo"]
        covered += g.low <= 0.2 <= g.high
    assert covered >= 10


def test_the_resampling_is_paired_across_policies():
    """A policy whose gold is a best-of-n's plus 0.3 on every prompt, at that best-of-n's KL, is 0.3
    above a curve through that point in every resample (two points: the fit passes through both),
    so its interval has no width; scrambling which prompt its scores belong to keeps the point
    estimate and widens the interval, which an unpaired bootstrap would give in both cases."""
    sft, best, _ = noisy_run(300, seed=7, policy_kl=1.0, true_gap=0.0)
    two = best[:2]
    shifted = Series(two[1].kl, [g + 0.3 for g in two[1].gold])
    scrambled_gold = list(shifted.gold)
    random.Random(0).shuffle(scrambled_gold)
    policies = {"paired": shifted, "scrambled": Series(shifted.kl, scrambled_gold)}
    out = gaps(sft, two, policies, n_boot=300, seed=0)
    paired, scrambled = out["paired"], out["scrambled"]
    assert paired.gap == pytest.approx(0.3, abs=1e-9) and scrambled.gap == pytest.approx(0.3, abs=1e-9)
    assert paired.high - paired.low < 1e-9
    assert scrambled.high - scrambled.low > 0.2


def test_series_of_another_length_are_an_error():
    with pytest.raises(ValueError, match="frontier gap: ppo has 2 KLs and 2 gold scores for 3 prompts"):
        gaps([0.0] * 3, [], {"ppo": Series([1.0, 1.0], [1.0, 1.0])}, n_boot=100, seed=0)
