"""Evaluation statistics: win rates with bootstrap intervals, best-of-n KL, diversity."""

import math
import random

import pytest

from pipeline.config import EvaluateConfig, from_dict, Params
from pipeline.errors import ConfigError
from pipeline.measurement.stats import best_of_n_choices, best_of_n_kl, best_of_n_kl_exact, distinct_n, mean_ci, win_rate
from pipeline.stages.evaluate import policies, ppo_vs_best_of_n, verdict
from pipeline.measurement.verdict import passed


def test_win_rate_against_itself_is_one_half():
    rng = random.Random(0)
    scores = [rng.gauss(0, 1) for _ in range(300)]
    rate, low, high = win_rate(scores, scores, n_boot=500, seed=0)
    assert (rate, low, high) == (0.5, 0.5, 0.5)        # all ties count half
    other = [rng.gauss(0, 1) for _ in range(300)]      # another sample of the same policy
    rate, low, high = win_rate(other, scores, n_boot=500, seed=0)
    assert low < 0.5 < high and high - low < 0.2


def test_win_rate_counts_ties_half_and_detects_a_better_policy():
    assert win_rate([1, 2, 3, 4], [0, 2, 5, 1], n_boot=200, seed=1)[0] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    rng = random.Random(2)
    better = [rng.gauss(1, 1) for _ in range(300)]
    base = [rng.gauss(0, 1) for _ in range(300)]
    rate, low, high = win_rate(better, base, n_boot=500, seed=0)
    assert 0.5 < low <= rate <= high      # P(N(1,1) > N(0,1)) = Phi(1/sqrt 2) = 0.76
    assert rate == pytest.approx(0.76, abs=0.06)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_best_of_n_kl_formula_matches_exact_kl(n):
    # Many equally likely outcomes with distinct rewards: the tie-free limit of the formula.
    m = 20000
    exact = best_of_n_kl_exact([1 / m] * m, list(range(m)), n)
    assert exact == pytest.approx(best_of_n_kl(n), abs=2e-3)
    assert best_of_n_kl(4) == pytest.approx(math.log(4) - 0.75)


def test_best_of_n_kl_exact_small_case():
    # Two outcomes, p = (0.5, 0.5), n = 2: best-of-2 picks the better one w.p. 3/4.
    kl = best_of_n_kl_exact([0.5, 0.5], [0.0, 1.0], 2)
    assert kl == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))


def test_distinct_n_and_mean_ci():
    assert distinct_n(["a b a b", "a b"], 2) == pytest.approx(2 / 4)   # bigrams ab, ba, ab, ab
    assert distinct_n(["x"], 2) == 0.0
    mean, half = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and half == pytest.approx(1.96 * math.sqrt((5 / 3) / 4))


def test_frontier_collects_points_from_exp_show_rows():
    from pipeline.config import flatten
    from pipeline.measurement.frontier import collect
    rows = [
        {"Experiment": None, "rev": "workspace", "outputs/ppo/metrics.json:ppo.kl": 7.0,   # PPO's own measurement
         "outputs/ppo/metrics.json:ppo.rm": 7.0, "outputs/ppo/metrics.json:ppo.gold": 7.0,  # (not evaluate's)
         "outputs/evaluate/metrics.json:ppo.kl": 3.0,
         "outputs/evaluate/metrics.json:ppo.rm": 1.0, "outputs/evaluate/metrics.json:ppo.gold": 0.8,
         "params.yaml:ppo.kl_coef": 0.05},
        {"Experiment": "exp-a", "rev": "abc", "ppo.kl": 9.0, "ppo.rm": 2.0, "ppo.gold": 0.1, "ppo.kl_coef": 0.0},
        {"Experiment": "queued", "rev": "def", "ppo.kl_coef": 0.2},   # no metrics yet: skipped
        {"Experiment": None, "rev": "main", "ppo.kl": 3.0, "ppo.rm": 1.0, "ppo.gold": 0.8,
         "ppo.kl_coef": 0.05},                                        # the baseline again: once
    ]
    points = collect(rows)
    assert [(p["name"], p["kl_coef"], p["kl"], p["rm"], p["gold"]) for p in points] == [
        ("exp-a", 0.0, 9.0, 2.0, 0.1), ("workspace", 0.05, 3.0, 1.0, 0.8)]
    # Only experiments built on the same SFT model and RM: an older commit with another model size
    # (or a row lacking the param) is left out; 3e-4 written as 0.0003 is the same value.
    for row in rows:
        row.update({"model.num_layers": 4, "params.yaml:reward.lr": 0.0003, "model.name_or_path": "None"})
    rows.append({"Experiment": None, "rev": "old", "ppo.kl": 6.0, "ppo.rm": 1.9, "ppo.gold": 2.3,
                 "ppo.kl_coef": 0.05, "model.num_layers": 2, "reward.lr": 0.0003})
    rows.append({"Experiment": None, "rev": "older", "ppo.kl": 5.0, "ppo.rm": 1.5, "ppo.gold": 2.0, "ppo.kl_coef": 0.1})
    assert len(collect(rows)) == 4
    # A row with the PPO stage's measurement and no evaluate metrics yet: not a point.
    assert collect([{"Experiment": "half", "rev": "x", "outputs/ppo/metrics.json:ppo.kl": 1.0,
                     "outputs/ppo/metrics.json:ppo.rm": 1.0, "outputs/ppo/metrics.json:ppo.gold": 1.0,
                     "params.yaml:ppo.kl_coef": 0.1}]) == []
    fixed = flatten({"num_layers": 4, "name_or_path": None}, "model.") | flatten({"lr": 3e-4}, "reward.")
    assert fixed == {"model.num_layers": 4, "model.name_or_path": None, "reward.lr": 3e-4}
    assert [p["name"] for p in collect(rows, fixed)] == ["exp-a", "workspace"]
    # Under the adaptive controller (the default) the KL target, not kl_coef (its start), names a point;
    # exp_show gives a bool as a bool or as its text.
    sweep = [{"Experiment": name, "rev": name, "ppo.kl": kl, "ppo.rm": 1.0, "ppo.gold": 1.0, "ppo.kl_coef": 0.2,
              "ppo.adaptive_kl": adaptive, "ppo.kl_target": 2.8}
             for name, kl, adaptive in (("t2.8", 3.1, True), ("fixed", 4.2, False), ("again", 3.1, "True"))]
    sweep[0]["ppo.kl_target"] = sweep[2]["ppo.kl_target"] = 2.8
    sweep.append({**sweep[0], "Experiment": "t1", "ppo.kl": 1.2, "ppo.kl_target": 1.0})
    assert [(p["name"], p["label"]) for p in collect(sweep)] == [("fixed", "0.2"), ("t1", "target 1"),
                                                                ("t2.8", "target 2.8")]


def test_best_of_n_keeps_the_favourite_among_the_first_n():
    # scores[k][i]: candidate k on prompt i.
    scores = [[0.1, 5.0, 0.0],
              [0.3, 1.0, 0.0],
              [0.2, 9.0, 2.0],
              [0.9, 0.0, 2.0]]
    assert best_of_n_choices(scores, (1, 2, 3, 4)) == {1: [0, 0, 0], 2: [1, 0, 0], 3: [1, 2, 2], 4: [3, 2, 2]}


def test_best_of_n_config_and_policy_names():
    assert policies(EvaluateConfig()) == ("sft", "best_of_4", "best_of_16", "best_of_64", "ppo")
    assert from_dict(Params, {"evaluate": {"best_of_n": [2, 3]}}, "p.yaml: ").evaluate.best_of_n == (2, 3)
    for bad, msg in (([4, 4], "strictly increasing .* got \\[4, 4\\]"), ([1, 4], "expected an integer >= 2, got 1"),
                     ([], "non-empty"), (4, "expected a list, got 4")):
        with pytest.raises(ConfigError, match=f"^p.yaml: evaluate.best_of_n: .*{msg}"):
            from_dict(Params, {"evaluate": {"best_of_n": bad}}, "p.yaml: ")


def _metrics(rm: float, gold=None) -> dict:
    m = {"win_rate/ppo_vs_sft_rm": rm}
    if gold is not None:
        m["win_rate/ppo_vs_sft_gold"] = gold
    return m


def test_verdict():
    quiet = {"first_fire": 0, "fired": 0, "stopped_at": 0, "kept_iteration": 100}
    lost = verdict(_metrics(0.9, 0.45), quiet)
    assert lost.startswith("PPO does NOT beat SFT by the gold annotator (45% win rate;") and "PPO in 90%" in lost
    over = verdict(_metrics(0.99, 0.60), quiet)
    assert over.startswith("over-optimisation: the reward model prefers PPO in 99% of prompts, "
                           "the gold annotator in 60%")
    ok = verdict(_metrics(0.75, 0.70), None)
    assert ok.startswith("OK: PPO beats SFT in 70% of prompts by the gold annotator and 75% by the reward model")
    assert ok.endswith("detector: no record.")
    assert "NOT" not in over and "over-optimisation" not in ok
    fired = verdict(_metrics(0.8), {"first_fire": 37, "fired": 1, "stopped_at": 0, "kept_iteration": 100})
    assert fired == ("No gold annotator for this task: the reward model prefers PPO over SFT in 80% of held-out "
                     "prompts; the over-optimisation detector fired at iteration 37.")
    stopped = verdict(_metrics(0.8), {"first_fire": 37, "fired": 1, "stopped_at": 37, "kept_iteration": 30})
    assert stopped.endswith("fired at iteration 37, training stopped there and kept iteration 30's weights.")
    assert verdict(_metrics(0.8), quiet).endswith("the over-optimisation detector stayed quiet.")


def test_passed_is_the_ok_verdict():
    """What names the champion (`passed`) is what the verdict calls OK, and nothing else."""
    cases = [(0.75, 0.70), (0.9, 0.45), (0.99, 0.60), (0.8, None), (0.7, 0.5), (0.55, 0.74), (0.5, 0.75)]
    ok = [passed(_metrics(rm, gold)) for rm, gold in cases]
    assert ok == [True, False, False, False, False, True, False]
    assert [verdict(_metrics(rm, gold), None).startswith("OK:") for rm, gold in cases] == ok


def test_ppo_vs_best_of_n_lines():
    m = {"ppo/kl": 2.0, "ppo/gold": 0.5, "best_of_4/kl": best_of_n_kl(4), "best_of_4/gold": 0.3,
         "best_of_16/kl": best_of_n_kl(16), "best_of_16/gold": 0.6}
    lines = ppo_vs_best_of_n(m, (4, 16), "gold")
    assert lines[0] == "- best_of_4 sits at KL 0.64 with gold 0.300; PPO, at KL 2.00 with 0.500, beats it."
    assert lines[1].endswith("does not beat it.")
    assert lines[2] == "- PPO (KL 2.00) vs best-of-n at the nearest KL (best_of_16, KL 1.84): gold 0.500 vs 0.600."


def _below(gap: float, low: float, high: float, rm: float = 0.75, gold: float = 0.70) -> dict:
    m = _metrics(rm, gold)
    m.update({"ppo/gold": 2.09, "ppo/kl": 4.03, "frontier/ppo_gap_gold": gap,
              "frontier/ppo_gap_gold_low": low, "frontier/ppo_gap_gold_high": high,
              "frontier/ppo_beyond_best_of_n": False})
    return m


def test_a_ppo_clearly_below_the_best_of_n_frontier_is_not_ok():
    below = _below(-0.45, -0.60, -0.30)
    assert not passed(below)
    text = verdict(below, None)
    assert text == ("PPO is below the best-of-n frontier: gold 2.09 at 4.03 nats, 0.45 (CI 0.30-0.60) below "
                    "what best-of-n reaches at that KL; it beats SFT in 70% of prompts by the gold annotator "
                    "and 75% by the reward model; detector: no record.")
    # Said beside the other failures too.
    assert verdict(_below(-0.45, -0.60, -0.30, rm=0.9, gold=0.45), None).startswith(
        "PPO does NOT beat SFT by the gold annotator (45% win rate; the reward model prefers PPO in 90% of "
        "prompts); PPO is below the best-of-n frontier: gold 2.09")


@pytest.mark.parametrize("gap, low, high", [
    (-0.08, -0.15, -0.01),             # below, but by less than the margin
    (-0.45, -0.90, 0.02),              # far below, but the interval reaches 0
    (0.12, 0.02, 0.25),                # above the frontier
    (float("nan"), float("nan"), float("nan")),   # beyond best-of-n's range: no gap
    (None, None, None),                # the same, as metrics.json holds it
])
def test_a_ppo_not_clearly_below_the_frontier_keeps_its_ok(gap, low, high):
    m = _below(gap, low, high)
    assert passed(m) and verdict(m, None).startswith("OK: PPO beats SFT in 70%")
    assert "frontier" not in verdict(m, None)


def test_a_ppo_past_best_of_ns_range_and_dominated_by_a_cheaper_best_of_n_is_not_ok():
    # PPO further from SFT than best-of-64 went (no gap: the curve is not extrapolated), yet with
    # less gold than best-of-16 at under half its KL: dominated by a measured point.
    m = _below(float("nan"), float("nan"), float("nan"))
    m.update({"frontier/ppo_beyond_best_of_n": True, "sft/gold": 0.35, "sft/kl": 0.0,
              "best_of_4/gold": 1.33, "best_of_4/kl": 0.64, "best_of_16/gold": 2.26, "best_of_16/kl": 1.84,
              "best_of_64/gold": 2.75, "best_of_64/kl": 3.17,
              "frontier/ppo_margin_gold": 2.09 - 2.75, "frontier/ppo_margin_gold_low": -0.85,
              "frontier/ppo_margin_gold_high": -0.47})
    assert not passed(m)
    assert verdict(m, None).startswith(
        "PPO is below the best-of-n frontier: gold 2.09 at 4.03 nats, 0.66 (CI 0.47-0.85) below best-of-64's "
        "2.75 at 3.17 nats; it beats SFT in 70% of prompts")
    m.update({"frontier/ppo_margin_gold": -0.05, "frontier/ppo_margin_gold_low": -0.2,
              "frontier/ppo_margin_gold_high": 0.1})                     # level with best-of-64: OK
    assert passed(m) and verdict(m, None).startswith("OK: PPO beats SFT in 70%")


def test_the_frontier_rule_needs_a_gold_judge():
    m = _below(-0.45, -0.60, -0.30)
    del m["win_rate/ppo_vs_sft_gold"]
    assert not passed(m) and verdict(m, None).startswith("No gold annotator for this task")
    assert "frontier" not in verdict(m, None)


def _per(n: int = 60, seed: int = 0):
    """Held-out measurements of SFT, best-of-4/16/64 and PPO on `n` prompts, per prompt."""
    from pipeline.measurement.policy import Measured
    rng = random.Random(seed)
    hard = [rng.gauss(0, 0.5) for _ in range(n)]

    def policy(kl: float, gold: float, kl_spread: float = 0.0) -> Measured:
        return Measured(["a b c"] * n, [True] * n,
                        {"rm": [gold + rng.gauss(0, 1) for _ in range(n)],
                         "kl": [max(kl + rng.gauss(0, kl_spread), 0.0) for _ in range(n)],
                         "gold": [gold + h + rng.gauss(0, 0.3) for h in hard]})
    per = {"sft": policy(0.0, 0.59)}
    for k, gold in ((4, 1.75), (16, 2.48), (64, 2.83)):
        per[f"best_of_{k}"] = policy(best_of_n_kl(k), gold)
    per["ppo"] = policy(2.5, 2.2, 0.5)
    return per


def test_evaluate_writes_ppos_gap_to_the_frontier_and_reports_it():
    from pipeline.measurement.frontier_gap import Series, gaps
    from pipeline.stages.evaluate import report_markdown, summarise
    per = _per()
    m = summarise(per, n_boot=200, seed=5)
    series = {name: Series(p.values["kl"], p.values["gold"]) for name, p in per.items()}
    best = [series[f"best_of_{k}"] for k in (4, 16, 64)]
    want = gaps(per["sft"].values["gold"], best, {"ppo": series["ppo"]}, n_boot=200, seed=5)["ppo"]
    assert (m["frontier/ppo_gap_gold"], m["frontier/ppo_gap_gold_low"], m["frontier/ppo_gap_gold_high"],
            m["frontier/ppo_beyond_best_of_n"]) == (want.gap, want.low, want.high, False)
    assert want.gap < -0.1 and want.high < 0          # the data put PPO below the curve
    # The same gap in the reward model's score: the same fit on the `rm` values, the same resamples.
    by_rm = {name: Series(p.values["kl"], p.values["rm"]) for name, p in per.items()}
    rm = gaps(per["sft"].values["rm"], [by_rm[f"best_of_{k}"] for k in (4, 16, 64)], {"ppo": by_rm["ppo"]},
              n_boot=200, seed=5)["ppo"]
    assert (m["frontier/ppo_gap_rm"], m["frontier/ppo_gap_rm_low"], m["frontier/ppo_gap_rm_high"]) == (rm.gap, rm.low, rm.high)
    assert rm.gap != want.gap and rm.low < rm.gap < rm.high
    assert not passed(m)
    lines = ppo_vs_best_of_n(m, (4, 16, 64), "gold")
    assert lines[-1] == (f"- Against the best-of-n curve fitted through SFT and these points (Gao et al. "
                         f"2023: gold - gold(SFT) = d (a - b d), d = sqrt KL), PPO's gold is {-want.gap:.3f} "
                         f"below what best-of-n reaches at PPO's KL: gap {want.gap:+.3f} (95% CI "
                         f"{want.low:+.3f} to {want.high:+.3f}). In the reward model's own score, its curve fitted "
                         f"the same way, PPO's gap is {rm.gap:+.3f} (95% CI {rm.low:+.3f} to {rm.high:+.3f}): "
                         "`frontier/ppo_gap_rm`. Below in both, PPO gets less of the score it optimises per nat of "
                         "KL than best-of-n; below in gold only, its score gains are worth less gold than best-of-n's.")
    report = report_markdown(m, "", True, policies(EvaluateConfig()), (4, 16, 64), verdict(m, None))
    assert lines[-1] in report and "**PPO is below the best-of-n frontier" in report
    # Past best-of-64's KL: flagged, not extrapolated.
    per["ppo"].values["kl"] = [5.0] * 60
    far = summarise(per, n_boot=200, seed=5)
    assert far["frontier/ppo_beyond_best_of_n"] is True and math.isnan(far["frontier/ppo_gap_gold"])
    assert math.isnan(far["frontier/ppo_gap_rm"])
    margin, m_low, m_high = (far[f"frontier/ppo_margin_gold{s}"] for s in ("", "_low", "_high"))
    assert margin == pytest.approx(far["ppo/gold"] - max(far["sft/gold"], *(far[f"best_of_{n}/gold"] for n in (4, 16, 64))))
    assert m_low <= margin <= m_high
    assert ppo_vs_best_of_n(far, (4, 16, 64), "gold")[-1] == (
        "- PPO's KL (5.00) is past best-of-n's largest (best_of_64, KL 3.17): the fitted best-of-n curve is "
        "not extrapolated, so no gap to the frontier is measured (a larger n in `evaluate.best_of_n` reaches "
        f"further). Against the best gold of SFT and best-of-n, all at less KL, PPO's differs by {margin:+.3f} (95% CI "
        f"{m_low:+.3f} to {m_high:+.3f}): `frontier/ppo_margin_gold`.")
    # Without a judge there is no gold, hence no gap.
    for p in per.values():
        del p.values["gold"]
    assert not any(k.startswith("frontier/") for k in summarise(per, n_boot=200, seed=5))


def test_the_headline_gives_ppos_gap_to_the_frontier(tmp_path):
    import json
    from pipeline.measurement.headline import lines
    from pipeline.stages.evaluate import summarise
    from pipeline.tracking.sinks import write_metrics
    m = summarise(_per(), n_boot=200, seed=5)
    (tmp_path / "evaluate").mkdir()
    write_metrics(tmp_path / "evaluate" / "metrics.json", m)
    out = lines(tmp_path)
    assert max(map(len, out)) < 100
    line = next(x for x in out if x.startswith("PPO to the best-of-n frontier"))
    gap, low, high = (m[f"frontier/ppo_gap_gold{s}"] for s in ("", "_low", "_high"))
    assert line == (f"PPO to the best-of-n frontier: gold {gap:+.2f} at KL {m['ppo/kl']:.2f}, "
                    f"95% interval {low:+.2f} to {high:+.2f}")
    assert out[1].startswith("verdict: PPO is below the best-of-n frontier")
    # Beyond the range (NaN written as null): said so; metrics written before the gap: no line.
    path = tmp_path / "evaluate" / "metrics.json"
    ev = json.loads(path.read_text())
    ev["ppo"]["kl"], ev["frontier"] = 4.24, {"ppo_gap_gold": None, "ppo_gap_gold_low": None,
                                             "ppo_gap_gold_high": None, "ppo_beyond_best_of_n": True,
                                             "ppo_margin_gold": -0.12}
    path.write_text(json.dumps(ev))
    beyond = "PPO to the best-of-n frontier: past it, KL 4.24 > best-of-n's largest 3.17; gold -0.12 against it"
    assert beyond in lines(tmp_path)
    # Inside the range but at its end, where too many resamples fall past it for an interval: the
    # margin's interval instead.
    ev["ppo"]["kl"], ev["frontier"] = 3.08, {"ppo_gap_gold": -0.0503, "ppo_gap_gold_low": None,
                                             "ppo_gap_gold_high": None, "ppo_beyond_best_of_n": False,
                                             "ppo_margin_gold": 0.2981, "ppo_margin_gold_low": -0.1184,
                                             "ppo_margin_gold_high": 0.4589}
    path.write_text(json.dumps(ev))
    end = ("PPO to the best-of-n frontier: gold -0.05 at KL 3.08 (no interval: at the end of best-of-n's KL "
           "range); against the best point at less KL +0.30, 95% interval -0.12 to +0.46")
    out = lines(tmp_path)
    first = next(i for i, x in enumerate(out) if x.startswith("PPO to the best-of-n frontier"))
    assert " ".join(x.strip() for x in out[first:first + 2]) == end and max(map(len, out)) < 100
    del ev["frontier"]
    path.write_text(json.dumps(ev))
    assert not any(x.startswith("PPO to the best-of-n") for x in lines(tmp_path))


def test_the_console_gives_the_gap_to_the_frontier(tmp_path):
    from pipeline.stages.evaluate import console_lines, summarise
    m = summarise(_per(), n_boot=200, seed=5)
    lines = console_lines(m, {"out": tmp_path, "ppo": tmp_path / "ppo" / "model"})
    gap, low, high = (m[f"frontier/ppo_gap_gold{s}"] for s in ("", "_low", "_high"))
    assert f"  frontier/ppo_gap_gold = {gap:+.3f} (95% CI {low:+.3f} to {high:+.3f})" in lines
    m.update({"frontier/ppo_gap_gold": float("nan"), "frontier/ppo_beyond_best_of_n": True})
    lines = console_lines(m, {"out": tmp_path, "ppo": tmp_path / "ppo" / "model"})
    assert "  frontier/ppo_gap_gold = none: PPO's KL is past best-of-n's largest" in lines
