"""What a training loop does when a loss or a gradient stops being finite (`on_nonfinite`).

`stop` (the default) ends the stage at that step with one error line; its last checkpoint is kept.
`skip` drops the step's update instead (weights, optimizer state and learning-rate schedule stay as
they were; the batch is consumed), counts it in the step log's `skipped_updates` column, and ends the
stage once more than `max_skipped_updates` updates were skipped: on a long GPU run one bad batch (an
overflow in a bf16 forward, a corrupt example) costs one update, while a run that keeps producing
NaN is broken and says so.

How every rank skips the same update without a collective of its own: a non-finite loss is
multiplied by NaN before its backward (`poisoned`), so every gradient it reaches is NaN; the global
gradient norm, taken over the gradients summed over ranks, is then NaN on every rank, and every
engine applies no update for a non-finite norm (training/engines.py: `StepResult.skipped`).
"""

from __future__ import annotations

import math

import torch

from ..errors import NumericalError
from .engines import StepResult

# The step logs' column counting skipped updates, supervised and RL alike: its meaning (docs/metrics.md).
SKIPPED = ("updates skipped so far for a NaN or infinite loss or gradient (`on_nonfinite: skip`; always 0 "
           "with `stop`, which ends the stage instead)")

COLUMN = "skipped_updates"   # the step logs' column: updates skipped so far, the interrupted runs' included


class NonfiniteGuard:
    """One training run's `on_nonfinite` policy and its count of skipped updates. `section`: the
    params section whose keys the errors name (`grpo`, not `ppo`, for the grpo stage)."""

    def __init__(self, section: str, mode: str, limit: int, skipped: int = 0):
        self.section, self.mode, self.limit, self.skipped = section, mode, limit, skipped

    @property
    def stops(self) -> bool:
        """`on_nonfinite: stop`: the caller checks each quantity with errors.check_finite."""
        return self.mode == "stop"

    def poisoned(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (skip): itself when finite, else NaN times it, whose
        gradients are NaN wherever the loss reaches (an infinite loss can give finite ones)."""
        if self.stops or bool(torch.isfinite(loss.detach()).all()):
            return loss
        return loss * float("nan")

    def count(self, where: str, result: StepResult) -> None:
        """After an engine's step (skip): count an update skipped for a non-finite gradient norm;
        stop once more than `max_skipped_updates` were. `where` names the step ("sft step 7")."""
        if math.isfinite(result.grad_norm):
            return
        if not result.skipped:   # every engine skips a non-finite norm; one that does not is a bug here
            raise RuntimeError(f"{where}: the engine applied an update with a non-finite gradient norm")
        self.skipped += 1
        if self.skipped > self.limit:
            raise NumericalError(f"{where}: {self.skipped} updates skipped for a NaN or infinite loss or "
                                 f"gradient, more than {self.section}.max_skipped_updates ({self.limit}); stopped, "
                                 f"the last checkpoint is kept")


def restored_count(rows: list[dict]) -> int:
    """The skipped updates of an interrupted run, from the last row of its restored step log."""
    return int(rows[-1][COLUMN]) if rows else 0
