"""When did over-optimisation destroy a PPO run? Judged with the gold annotator, after the fact.

The collapse iteration is the first iteration, at or after the one where the
rollouts' mean gold score peaked, whose mean gold is below the SFT policy's. The detector
(pipeline/ppo/detector.py) must fire at or before it without seeing gold; the seed grid and the
detector's calibration tests both measure against this one definition.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

GOLD_COLUMN = "objective/gold_scores"


def collapse_iteration(gold: Sequence[float], sft_gold: float) -> int:
    """The collapse iteration (iterations count from 1) of a run whose rollouts' mean gold per
    iteration is `gold`; 0 if gold never falls below `sft_gold` after its peak. A dip before the
    peak is the SFT policy's own noise in the first iterations, not a collapse."""
    if not gold:
        return 0
    peak = max(range(len(gold)), key=gold.__getitem__)
    return next((i + 1 for i in range(peak, len(gold)) if gold[i] < sft_gold), 0)


def gold_per_iteration(train_tsv: Path) -> list[float]:
    """The rollouts' mean gold of each iteration of a PPO train.tsv (the column a judge fills)."""
    with Path(train_tsv).open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if rows and GOLD_COLUMN not in rows[0]:
        raise ValueError(f"{train_tsv}: no {GOLD_COLUMN} column (the run had no gold judge)")
    return [float(r[GOLD_COLUMN]) for r in rows]
