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
