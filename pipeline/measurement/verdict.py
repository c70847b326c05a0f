"""The evaluation's verdict in one paragraph: did PPO beat SFT by the gold annotator, was the reward
model gamed, and what the over-optimisation detector recorded. The evaluate stage writes it at the
top of its report; `python -m pipeline headline` prints it from a finished run's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


# A reward model that prefers PPO in this many more (or fewer) prompts than the gold annotator does
# is called gamed (over-optimisation).
GAMED_GAP = 0.20


def passed(m: dict[str, Any]) -> bool:
    """Whether the verdict on evaluate's metrics `m` is OK: PPO beats SFT by the gold annotator (a
    win rate above one half) and the reward model agrees within `GAMED_GAP`. A task without a gold
    annotator has no OK verdict: the reward model PPO was optimised against cannot vouch for it."""
    gold = m.get("win_rate/ppo_vs_sft_gold")
    return gold is not None and gold > 0.5 and abs(m["win_rate/ppo_vs_sft_rm"] - gold) <= GAMED_GAP


def verdict(m: dict[str, Any], detector: Optional[dict[str, Any]]) -> str:
    """One paragraph: did PPO beat SFT, and was the reward model gamed. `m` is evaluate's metrics;
    `detector` the `detector` section of outputs/ppo/metrics.json (None: no record). With a gold
    judge, an RM-vs-gold win-rate gap above `GAMED_GAP` is called over-optimisation; else the verdict
    is OK (`passed`)."""
    rm = m["win_rate/ppo_vs_sft_rm"]
    if detector is None:
        alarm = "detector: no record"
    elif detector.get("first_fire"):
        stopped = (f", training stopped there and kept iteration {int(detector['kept_iteration'])}'s weights"
                   if detector.get("stopped_at") else "")
        alarm = f"the over-optimisation detector fired at iteration {int(detector['first_fire'])}{stopped}"
    else:
        alarm = "the over-optimisation detector stayed quiet"
    if "win_rate/ppo_vs_sft_gold" not in m:
        return (f"No gold annotator for this task: the reward model prefers PPO over SFT in {rm:.0%} of "
                f"held-out prompts; {alarm}.")
    gold = m["win_rate/ppo_vs_sft_gold"]
    if gold <= 0.5:
        head = (f"PPO does NOT beat SFT by the gold annotator ({gold:.0%} win rate; the reward model "
                f"prefers PPO in {rm:.0%} of prompts)")
    elif not passed(m):
        head = f"over-optimisation: the reward model prefers PPO in {rm:.0%} of prompts, the gold annotator in {gold:.0%}"
    else:
        head = f"OK: PPO beats SFT in {gold:.0%} of prompts by the gold annotator and {rm:.0%} by the reward model"
    return f"{head}; {alarm}."


def detector_record(ppo_model_dir: Path) -> Optional[dict[str, Any]]:
    """The detector's section of the ppo stage's metrics.json, next to its model folder."""
    path = Path(ppo_model_dir).parent / "metrics.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get("detector")
