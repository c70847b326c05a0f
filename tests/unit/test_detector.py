"""The over-optimisation detector on synthetic metric streams: the iteration it fires at, quiet on
noise, warmup, the auditor rule, offline replay equal to the online run, its config, the CLI."""

import csv
import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import DetectorConfig, Params, from_dict
from pipeline.errors import ConfigError
from pipeline.measurement.collapse import collapse_iteration, gold_per_iteration
from pipeline.ppo.detector import Detector, replay, replay_signals, summary, window_signals

ROOT = Path(__file__).resolve().parents[2]
# The synthetic streams below are sized for windows of 5 after a warmup of 10 (rules checked from
# iteration 20); the calibrated defaults are tested on real logged runs at the end.
CFG = DetectorConfig(warmup=10, window=5, entropy_drop=0.3, distinct_drop=0.3)
LOGS = ROOT / "tests" / "data" / "detector"


def stream(n: int, seed: int, kl=lambda t: 4.0, length=lambda t: 30.0, entropy=lambda t: 2.0,
           distinct=lambda t: 0.6, scores=lambda t: 0.0, auditor=None, noise: float = 1.0) -> list[dict]:
    """n iterations of trainer stats (iteration t = 1..n): each series' trend plus Gaussian noise of
    the size a 64-rollout batch shows (KL 0.3 nats, length 1 token, ...), times `noise`."""
    rng = random.Random(seed)
    rows = []
    for t in range(1, n + 1):
        row = {"step": t, "objective/kl": kl(t) + noise * rng.gauss(0, 0.3),
               "objective/response_length": length(t) + noise * rng.gauss(0, 1.0),
               "objective/entropy": entropy(t) + noise * rng.gauss(0, 0.05),
               "objective/distinct_2": distinct(t) + noise * rng.gauss(0, 0.02),
               "objective/scores": scores(t) + noise * rng.gauss(0, 0.1)}
        if auditor is not None:
            row["objective/auditor_scores"] = auditor(t) + noise * rng.gauss(0, 0.1)
        rows.append(row)
    return rows


def test_window_signals_by_hand():
    h = {"objective/kl": [1, 1, 3, 5], "objective/response_length": [10, 10, 5, 5],
         "objective/entropy": [2, 2, 1, 1.5], "objective/distinct_2": [0.5, 0.5, 0.5, 0.5]}
    assert window_signals(h, 2) == {"kl_rise": 3.0, "length_change": 0.5, "entropy_drop": 0.375,
                                    "distinct_drop": 0.0}


def test_fires_on_kl_spike():
    # KL flat at 4 +- 0.3 for 30 iterations, then rising 1.5 nats per iteration from iteration 31:
    # the window difference reaches 1.5 * (1+2+3+4+5) / 5 = 4.5 > 4 at iteration 35 (3.0 at 34).
    rising = lambda t: 4.0 + 1.5 * max(0, t - 30)
    for seed in range(3):
        rows = stream(60, seed, kl=rising, noise=0.0)
        rows = [{**r, "objective/kl": r["objective/kl"] + random.Random(seed * 100 + i).uniform(-0.3, 0.3)}
                for i, r in enumerate(rows)]
        assert replay(rows, CFG) == 35
    det = Detector(CFG)
    out = [det.update(r) for r in rows]
    assert [o["detector/fired"] for o in out[:34]] == [0.0] * 34 and out[34]["detector/fired"] == 1.0
    assert out[-1]["detector/first_fire"] == 35.0
    assert det.message().startswith("iteration 35: over-optimisation suspected: KL rose 4.")


def test_fires_on_length_collapse():
    # 30 tokens until iteration 30, then 4 tokens fewer per iteration down to 10: the window means
    # differ by 27% at iteration 34 and 40% at 35 (noise +-2% of 30).
    rows = stream(50, 0, length=lambda t: max(10.0, 30.0 - 4.0 * max(0, t - 30)))
    first = replay(rows, CFG)
    assert first is not None and 34 <= first <= 36
    assert "response length changed" in " ".join(_reasons(rows, CFG))


def _reasons(rows, cfg):
    det = Detector(cfg)
    for r in rows:
        det.update(r)
    return det.reasons


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_quiet_on_stationary_noise(seed):
    rows = stream(100, seed, auditor=lambda t: 0.0)
    values = replay_signals(rows, CFG)
    assert replay(rows, CFG) is None
    assert all(v["detector/fired"] == 0.0 for v in values)
    assert max(v["detector/kl_rise"] for v in values) < 1.0   # far from the 4-nat threshold


def test_warmup_ignores_the_start():
    # KL climbing fast over the first 10 iterations (PPO's transient), flat afterwards.
    rows = stream(60, 0, kl=lambda t: min(t, 10) * 1.5, noise=0.0)
    assert replay(rows, CFG) is None
    no_warmup = dataclasses.replace(CFG, warmup=0)
    assert replay(rows, no_warmup) == 10    # first check at 0 + 2 * 5: mean(9..15) - mean(1.5..7.5) = 7.5
    values = replay_signals(rows, CFG)
    assert all(v["detector/kl_rise"] == 0.0 for v in values[:19])   # not computed before iteration 20


def test_auditor_rule():
    rm_up = lambda t: 0.05 * t
    # The training RM keeps rising; the auditor rises with it until 40, then falls 0.1 per iteration:
    # its window mean is ~0.5 below its best (~1.92, around iteration 41) at iteration 48.
    rows = stream(70, 0, scores=rm_up, auditor=lambda t: 0.05 * min(t, 40) - 0.1 * max(0, t - 40))
    first = replay(rows, CFG)
    assert first is not None and 47 <= first <= 50
    assert _reasons(rows, CFG)[0].startswith("the auditor RM fell")
    # Both rising: quiet. Both falling (a harder batch of prompts, not the RM being gamed): quiet.
    assert replay(stream(70, 0, scores=rm_up, auditor=rm_up), CFG) is None
    fall = lambda t: 0.05 * min(t, 40) - 0.1 * max(0, t - 40)
    assert replay(stream(70, 0, scores=fall, auditor=fall), CFG) is None


def test_replay_equals_online_and_resume():
    rows = stream(60, 7, kl=lambda t: 4.0 + 1.5 * max(0, t - 30), auditor=lambda t: 0.0)
    online = Detector(CFG)
    logged = [{**r, **online.update(r)} for r in rows]
    # Offline, from the logged rows as train.tsv strings (the detector/* columns are ignored).
    as_text = [{k: f"{v:.6g}" if isinstance(v, float) else str(v) for k, v in r.items()} for r in logged]
    assert replay(as_text, CFG) == online.first_fire == 35
    # Resume: a detector rebuilt from the first 25 logged rows continues exactly as the online one.
    resumed = Detector(CFG)
    for r in logged[:25]:
        resumed.update(r)
    assert [resumed.update(r) for r in rows[25:]] == [{k: v for k, v in r.items() if k.startswith("detector/")}
                                                      for r in logged[25:]]


def test_summary_lists_each_signal_and_the_first_fire():
    text = summary(stream(60, 0, kl=lambda t: 4.0 + 1.5 * max(0, t - 30), noise=0.0), CFG)
    assert "kl_rise" in text and "threshold 4" in text and text.endswith("first fire: iteration 35")
    assert summary(stream(30, 0), CFG).endswith("first fire: none")


def test_config_validation():
    with pytest.raises(ConfigError, match=r"^params.yaml: ppo.detector.kl_rize: unknown key \(known: action, "):
        from_dict(Params, {"ppo": {"detector": {"kl_rize": 1.0}}}, "params.yaml: ")
    with pytest.raises(ConfigError, match=r"^params.yaml: ppo.detector.kl_rise: expected a positive float, got -1.0"):
        from_dict(Params, {"ppo": {"detector": {"kl_rise": -1.0}}}, "params.yaml: ")
    with pytest.raises(ConfigError, match=r"ppo.detector.entropy_drop: expected a float > 0.0 and <= 1.0, got 1.5"):
        from_dict(Params, {"ppo": {"detector": {"entropy_drop": 1.5}}}, "params.yaml: ")
    with pytest.raises(ConfigError, match=r"ppo.detector.action: expected one of 'warn', 'stop', got 'halt'"):
        from_dict(Params, {"ppo": {"detector": {"action": "halt"}}}, "params.yaml: ")
    # stop keeps the last checkpoint before the alarm: one must be written before the first check.
    with pytest.raises(ConfigError, match=r"ppo.detector.action: stop .*ppo.save_every=11\) .* = 11\)"):
        from_dict(Params, {"ppo": {"save_every": 11, "detector": {"action": "stop"}}}, "params.yaml: ")
    p = from_dict(Params, {"ppo": {"save_every": 10, "detector": {"action": "stop", "auditor": "rm2"}}},
                  "params.yaml: ")
    assert p.ppo.detector.auditor == "rm2" and p.ppo.detector.first_check == 11


def test_detect_cli(tmp_path):
    rows = stream(45, 0, kl=lambda t: 4.0 + 1.5 * max(0, t - 30), noise=0.0)
    cols = list(rows[0])
    (tmp_path / "train.tsv").write_text("\n".join(["\t".join(cols)] + ["\t".join(f"{r[c]:.6g}" for c in cols)
                                                                       for r in rows]) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline", "detect", str(tmp_path / "train.tsv"),
                           "--params", str(ROOT / "params.yaml")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("first fire: iteration 35")
    missing = subprocess.run([sys.executable, "-m", "pipeline", "detect", str(tmp_path / "none.tsv")],
                             cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "no such step log" in missing.stderr


def _log(name: str) -> list[dict]:
    with (LOGS / name).open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


# Logged kl_coef=0 runs (benchmarks/seed_grid.py): (log, SFT policy's held-out gold, collapse, first
# alarm). The first two are the 20,000-pair default of 2026-11-30; the d32 ones today's 32,000-pair
# default (2026-12-02, one thread, AMD machine), whose reward model takes longer to exploit.
KL0_RUNS = [("kl0_u0_p0.tsv", 0.327, 14, 14), ("kl0_u0_p1.tsv", 0.327, 14, 11),
            ("kl0_d32_u0_p0.tsv", 0.3338, 58, 58), ("kl0_d32_u0_p1.tsv", 0.3338, 20, 12)]


@pytest.mark.parametrize("name,sft_gold,collapse,first_fire", KL0_RUNS)
def test_default_thresholds_fire_at_or_before_a_real_collapse(name, sft_gold, collapse, first_fire):
    """Without a KL penalty the rollouts' gold rises, then falls below the SFT policy's and stays
    there; the calibrated defaults must fire no later, without a gold judge."""
    rows = _log(name)
    gold = [float(r["objective/gold_scores"]) for r in rows]
    assert collapse_iteration(gold, sft_gold) == collapse
    assert gold_per_iteration(LOGS / name) == gold
    # A real collapse: gold had risen well above SFT's, and stays below it for most of the rest.
    after = gold[collapse - 1:]
    assert max(gold[:collapse - 1]) > sft_gold + 0.5
    assert sum(g < sft_gold for g in after) > 0.8 * len(after)
    first = replay(rows, DetectorConfig())
    assert first == first_fire and first <= collapse


def test_collapse_iteration_by_hand():
    assert collapse_iteration([0.3, 1.0, 2.0, 1.5, 0.2, 0.5, 0.1], 0.4) == 5
    assert collapse_iteration([0.3, 0.2, 2.0, 0.5, 0.1], 0.4) == 5      # a dip before the peak does not count
    assert collapse_iteration([0.3, 0.2, 1.0, 2.0, 2.5], 0.4) == 0      # healthy: never below after the peak
    assert collapse_iteration([], 0.4) == 0


def test_gold_per_iteration_needs_a_judge(tmp_path):
    log = tmp_path / "train.tsv"
    log.write_text("iteration\tobjective/scores\n1\t0.5\n")
    with pytest.raises(ValueError, match="train.tsv: no objective/gold_scores"):
        gold_per_iteration(log)


# (log, margin): the largest value of each rule must stay below threshold / margin. The d32 seed-2
# run came closest of today's grid: its entropy fell 12% against the 15% threshold.
HEALTHY_RUNS = [("healthy_u0_p4.tsv", 1.5), ("healthy_u1_p3.tsv", 1.5), ("healthy_u0_p1_1thread.tsv", 1.5),
                ("healthy_d32_u0_p0_2thread.tsv", 1.5), ("healthy_d32_u1_p1.tsv", 1.5), ("healthy_d32_u0_p2.tsv", 1.2)]


@pytest.mark.parametrize("name,margin", HEALTHY_RUNS)
def test_default_thresholds_quiet_on_real_healthy_runs(name, margin):
    """Logged default runs whose gold rose and held (one with a one-iteration KL spike to 6.5 nats
    at iteration 11, recovered at the next): no alarm, with room below each threshold."""
    cfg = DetectorConfig()
    values = replay_signals(_log(name), cfg)
    assert replay(_log(name), cfg) is None
    for rule in ("kl_rise", "length_change", "entropy_drop", "distinct_drop"):
        assert max(v[f"detector/{rule}"] for v in values) < getattr(cfg, rule) / margin
