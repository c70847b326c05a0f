"""Reward over-optimisation without a gold annotator: alarms from PPO's own iteration statistics.

A real run has no gold judge, so the signs the gold curve would show (Gao et al. 2023: the proxy
reward keeps rising while the true reward turns down) have to be read from what PPO logs anyway:

- `kl_rise`: the policy runs away from the reference (KL to it, nats per response, rising fast);
- `length_change`: responses collapse or balloon (a classic reward hack, Singhal et al. 2023);
- `entropy_drop`, `distinct_drop`: the policy narrows onto a few phrasings (mode collapse);
- `auditor_drop` (opt-in): a second reward model, not optimised against, scores the rollouts; it
  falling from its best while the training RM sits at its own best is the proxy/true split itself,
  with the auditor standing in for the gold annotator.

Each windowed rule compares the mean of the last `window` iterations with the mean of the `window`
iterations before them; both windows must lie after `warmup` (the policy moves fastest at the
start, and a window holding that transient would make every later change look small or large).
Pure logic on floats: fed one stats dict per iteration (the trainer's step-log row), it returns
the signals logged as `detector/<signal>`. Its state is the history it was fed, so a resumed run
rebuilds it exactly by replaying the restored rows.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from ..config import DetectorConfig

KL, LENGTH, ENTROPY, DISTINCT = "objective/kl", "objective/response_length", "objective/entropy", "objective/distinct_2"
SCORES, AUDITOR = "objective/scores", "objective/auditor_scores"
# The training RM counts as "at its best" within this much of its best window mean (RM units: the
# RM is normalised so held-out demonstrations average 0; per-iteration noise is ~0.1).
RM_TOLERANCE = 0.1
# Rule names: each is a DetectorConfig threshold field and a `detector/<rule>` signal.
RULES = ("kl_rise", "length_change", "entropy_drop", "distinct_drop", "auditor_drop")


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _relative(new: float, old: float) -> float:
    """(new - old) / |old|; a zero baseline counts any change as a change of its own size."""
    return (new - old) / max(abs(old), 1e-8)


def window_signals(history: Mapping[str, Sequence[float]], window: int) -> dict[str, float]:
    """The windowed rules' signals from the last 2 * window values of each series (all present):
    KL rise in nats, |relative change| of length, relative drops of entropy and distinct-2."""
    def halves(key: str) -> tuple[float, float]:
        xs = history[key][-2 * window:]
        return _mean(xs[:window]), _mean(xs[window:])

    out: dict[str, float] = {}
    before, now = halves(KL)
    out["kl_rise"] = now - before
    before, now = halves(LENGTH)
    out["length_change"] = abs(_relative(now, before))
    for rule, key in (("entropy_drop", ENTROPY), ("distinct_drop", DISTINCT)):
        if key in history:
            before, now = halves(key)
            out[rule] = -_relative(now, before)
    return out


class Detector:
    """Online detector: `update(stats)` once per iteration, in order, returns that iteration's
    `detector/*` values: each rule's signal (0 until it can be computed), `fired` (1 when any rule
    is over its threshold this iteration) and `first_fire` (the first such iteration, 0 if none)."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.history: dict[str, list[float]] = {}
        self.iteration = 0
        self.first_fire = 0
        self.reasons: list[str] = []          # why it fired the first time, for the warning
        self.best: dict[str, float] = {}      # running best window means of SCORES and AUDITOR
        self.now: dict[str, float] = {}       # their current window means

    def update(self, stats: Mapping[str, Any]) -> dict[str, float]:
        cfg = self.cfg
        self.iteration += 1
        for key in (KL, LENGTH, ENTROPY, DISTINCT, SCORES, AUDITOR):
            if stats.get(key) not in (None, ""):       # a TSV row leaves absent values empty
                self.history.setdefault(key, []).append(float(stats[key]))
        signals = {rule: 0.0 for rule in RULES}
        over: list[str] = []
        if self.iteration >= cfg.warmup + cfg.window and AUDITOR in self.history:
            signals["auditor_drop"] = self._auditor()
        if self.iteration >= cfg.first_check:
            signals.update(window_signals(self.history, cfg.window))
            over = [rule for rule in RULES if signals[rule] > getattr(cfg, rule)]
            if "auditor_drop" in over and self.now[SCORES] < self.best[SCORES] - RM_TOLERANCE:
                over.remove("auditor_drop")   # both fell: a harder batch, not the RM being gamed
        if over and not self.first_fire:
            self.first_fire, self.reasons = self.iteration, [self._reason(r, signals[r]) for r in over]
        return {**{f"detector/{k}": v for k, v in signals.items()},
                "detector/fired": float(bool(over)), "detector/first_fire": float(self.first_fire)}

    def _auditor(self) -> float:
        """The auditor's best window mean minus its current one (updating both running bests)."""
        w = self.cfg.window
        self.now = {key: _mean(self.history[key][-w:]) for key in (SCORES, AUDITOR)}
        for key, value in self.now.items():
            self.best[key] = max(self.best.get(key, value), value)
        return self.best[AUDITOR] - self.now[AUDITOR]

    def _reason(self, rule: str, value: float) -> str:
        w = self.cfg.window
        return {"kl_rise": f"KL rose {value:.2f} nats in {w} iterations",
                "length_change": f"response length changed {value:.0%} in {w} iterations",
                "entropy_drop": f"entropy fell {value:.0%} in {w} iterations",
                "distinct_drop": f"distinct-2 fell {value:.0%} in {w} iterations",
                "auditor_drop": f"the auditor RM fell {value:.2f} below its best while the training RM is at its best",
                }[rule]

    def message(self) -> str:
        """The one warning line of the first alarm."""
        return (f"iteration {self.first_fire}: over-optimisation suspected: " + "; ".join(self.reasons)
                + f" (ppo.detector.action: {self.cfg.action})")

    def state(self) -> str:
        """Short state for the progress bar."""
        return f"FIRED@{self.first_fire}" if self.first_fire else "ok"


def replay(rows: Sequence[Mapping[str, Any]], cfg: DetectorConfig) -> Optional[int]:
    """Run the detector over a PPO step log's rows (train.tsv as dicts, in order): the first
    iteration it fires at, or None. For calibrating thresholds offline on logged runs."""
    det = Detector(cfg)
    for row in rows:
        det.update(row)
    return det.first_fire or None


def replay_signals(rows: Sequence[Mapping[str, Any]], cfg: DetectorConfig) -> list[dict[str, float]]:
    """The detector's values for every row: what an online run would have logged."""
    det = Detector(cfg)
    return [det.update(row) for row in rows]


def summary(rows: Sequence[Mapping[str, Any]], cfg: DetectorConfig) -> str:
    """`python -m pipeline detect`: each signal's largest value over the run against its threshold,
    and the first iteration the detector fires at."""
    values = replay_signals(rows, cfg)
    lines = [f"{len(rows)} iterations; rules checked from iteration {cfg.first_check} "
             f"(warmup {cfg.warmup} + 2 windows of {cfg.window})"]
    for rule in RULES:
        series = [v[f"detector/{rule}"] for v in values]
        peak = max(series, default=0.0)
        at = series.index(peak) + 1 if series else 0
        lines.append(f"  {rule:14s} max {peak:8.3f} at iteration {at:4d}   threshold {getattr(cfg, rule):g}")
    first = values[-1]["detector/first_fire"] if values else 0.0
    lines.append(f"first fire: iteration {int(first)}" if first else "first fire: none")
    return "\n".join(lines)
