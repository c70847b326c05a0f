"""A restart selected inside a supervised stage (`reward.restart`): a run that has not learnt by a
set step starts again from a fresh draw.

Why: on the default task, whether a reward model learns to read what a review says of the asked
aspect (not only whether it names it) is a draw of its head's initialisation and its batch order.
A run that has by mid-training goes on to 92-97% of the noise ceiling; one that has not stays near
89% to the end (docs/decisions/2026-12-06-what-the-seed-0-reward-model-misses.md). The mean
accuracy over the evaluations up to that step predicts the final model well, so the check is a
window of them.

What it reads: accuracy on validation pairs of the training titles (prepare's pairs_val.jsonl, or a
held-out share of a dataset's training prompts), never the held-out pairs or the gold annotator,
so selecting on it does not leak into any held-out number.

The decision is collective: the validation evaluation sums over ranks, so every rank sees the same
accuracy and restarts at the same step. A restart writes a marker checkpoint (state.json with
step 0 and the next attempt, resume.SupervisedState.mark_restart) in place of the abandoned run's
state, so a run killed after it resumes the new attempt, not the abandoned one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..tracking.sinks import StepLog

# Restart k trains with seed + SEED_STRIDE * k: far from the small seeds a grid of runs sets, so an
# attempt never repeats another run's draw.
SEED_STRIDE = 1000
COLUMNS = ["attempt", "accuracy"]


class Restarted(Exception):
    """Raised by the loop at the check's step when the run falls short; the stage starts the next
    attempt (its marker already saved)."""

    def __init__(self, attempt: int, accuracy: float, bar: float):
        super().__init__(f"attempt {attempt}: validation accuracy {accuracy:.4f} < {bar}")
        self.attempt, self.accuracy, self.bar = attempt, accuracy, bar


def seed_of(seed: int, attempt: int) -> int:
    """The training seed of attempt `attempt` (0: the configured seed)."""
    return seed + SEED_STRIDE * attempt


@dataclass
class Gate:
    """The check of one attempt. `evaluate()` is collective and returns the validation accuracy;
    `log` holds every attempt's evaluations (restart.tsv: step, attempt, accuracy)."""
    at_step: int                         # the check's step
    window: int                          # evaluations averaged, the last at at_step
    every: int                           # steps between them
    bar: float                           # restart below this mean accuracy
    attempts_left: int                   # restarts still allowed after this attempt
    attempt: int                         # this attempt (0: the first)
    evaluate: Callable[[], float]
    log: StepLog

    @property
    def steps(self) -> set[int]:
        return {self.at_step - k * self.every for k in range(self.window)}

    def observe(self, step: int) -> None:
        """Collective at the window's steps: one validation evaluation, logged."""
        if step in self.steps:
            self.log.log(step, {"attempt": self.attempt, "accuracy": self.evaluate()})

    def accuracy(self) -> Optional[float]:
        """This attempt's mean validation accuracy over its window; None before the window is full."""
        rows = [r["accuracy"] for r in self.log.rows if r["attempt"] == self.attempt and r["step"] in self.steps]
        return sum(rows) / len(rows) if len(rows) == self.window else None

    def verdict(self, step: int) -> Optional[Restarted]:
        """At the check's step: the restart to raise when this attempt falls short and restarts are
        left; else None (a last attempt that falls short trains on: it is what there is)."""
        if step != self.at_step or self.attempts_left <= 0:
            return None
        acc = self.accuracy()
        return Restarted(self.attempt, acc, self.bar) if acc is not None and acc < self.bar else None


def active(cfg: Any, total_steps: int) -> bool:
    """Whether `cfg` (a RestartConfig) checks a run of `total_steps`: not when it is off, nor when
    the run ends at or before its step (nothing would be saved by restarting there)."""
    return bool(cfg.at_step) and cfg.min_accuracy is not None and cfg.at_step < total_steps


def gate(cfg: Any, total_steps: int, eval_every: int, attempt: int, evaluate: Callable[[], float],
         log: StepLog) -> Optional[Gate]:
    """The gate of attempt `attempt` of a run of `total_steps` (None: `active` says no check)."""
    if not active(cfg, total_steps):
        return None
    return Gate(cfg.at_step, cfg.window, eval_every, cfg.min_accuracy, cfg.max_restarts - attempt, attempt,
                evaluate, log)


def summary(attempt: int, seed: int, checked: Optional[float]) -> dict[str, Any]:
    """The metrics of the restarts: how many, the seed the kept run trained with, and (when the
    kept run was checked) its window's mean validation accuracy."""
    return {"train/restarts": attempt, "train/seed": seed,
            **({"train/validation_accuracy": checked} if checked is not None else {})}
