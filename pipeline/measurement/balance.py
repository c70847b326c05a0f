"""How evenly a stage's sharded measurements spread their work over its processes.

A measurement is shared out in batches: a policy's held-out prompts in batches of
GENERATION_BATCH, batch j to rank j mod N (measurement/policy.py `shares`), the reward model's
held-out pairs in spans of equal forwards per rank (`Context.eval_parts`). Where the batches do
not divide evenly, some ranks sample while the others wait in the gather: with fewer batches
than ranks, one rank measures alone. That costs at most one batch's time per measurement, but it
is the shape of "one rank works while the others wait", so metrics.json states it: the stage
skeleton opens a `tallying()` around a stage's body, every sharded measurement `record`s how
many batches each rank ran, and `resources/measure_imbalance` is the largest spread (most batches
on one rank minus the fewest) over the stage's measurements. 0 at one process.

Plain Python (no torch): the stage skeleton imports it.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence


@dataclass
class Tally:
    imbalance: Optional[int] = None   # the largest (most - fewest batches on a rank) so far; None: nothing measured


_current: ContextVar[Optional[Tally]] = ContextVar("measurement_tally", default=None)


def record(batches_per_rank: Sequence[int]) -> None:
    """One sharded measurement's batch count on each rank (the same list on every rank: call it
    after the measurement's gather); nothing happens outside `tallying()`."""
    tally = _current.get()
    if tally is not None and batches_per_rank:
        spread = max(batches_per_rank) - min(batches_per_rank)
        tally.imbalance = spread if tally.imbalance is None else max(tally.imbalance, spread)


@contextlib.contextmanager
def tallying() -> Iterator[Tally]:
    """The measurements recorded inside, tallied (nested: the inner tally only)."""
    tally = Tally()
    token = _current.set(tally)
    try:
        yield tally
    finally:
        _current.reset(token)
