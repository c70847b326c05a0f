"""The evaluation's verdict in one paragraph: did PPO beat SFT by the gold annotator, was the reward
model gamed, is PPO clearly below the best-of-n frontier at its own KL, and what the over-optimisation
detector recorded. The evaluate stage writes it at the top of its report; `python -m pipeline
headline` prints it from a finished run's files (where an undefined number reads as null)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .frontier_gap import finite


# A reward model that prefers PPO in this many more (or fewer) prompts than the gold annotator does
# is called gamed (over-optimisation).
GAMED_GAP = 0.20

# PPO's mean gold this far below the best-of-n curve at its own KL (frontier/ppo_gap_gold), with the
# whole 95% interval below 0, is below the frontier: sampling n from SFT and keeping the reward
# model's favourite reaches more gold at the same distance from SFT, for no training at all.
BELOW_FRONTIER = 0.10


def _clearly_below(m: dict[str, Any], key: str) -> bool:
    value, high = m.get(key), m.get(f"{key}_high")
    return finite(value) and finite(high) and value < -BELOW_FRONTIER and high < 0


def below_frontier(m: dict[str, Any]) -> bool:
    """With a gold judge: PPO's gold is more than `BELOW_FRONTIER` below the best-of-n curve at its
    KL with the gap's whole interval below 0; or, wherever it is (past best-of-n's largest KL too,
    where the curve is not extrapolated), more than that below the best gold SFT or a best-of-n
    reaches at no more KL, with that margin's interval below 0 (dominated by a measured point).
    Metrics without either (an older run) are not below it."""
    return "win_rate/ppo_vs_sft_gold" in m and (_clearly_below(m, "frontier/ppo_gap_gold")
                                                 or _clearly_below(m, "frontier/ppo_margin_gold"))


def dominating(m: dict[str, Any]) -> tuple[str, float, float]:
    """(name, mean gold, KL) of the best policy measured at PPO's KL or less: SFT or a best-of-n."""
    kl = m["ppo/kl"]
    names = ["sft", *sorted((k[:-len("/kl")] for k in m if k.startswith("best_of_") and k.endswith("/kl")),
                            key=lambda name: int(name.rsplit("_", 1)[1]))]
    cheaper = [name for name in names if name == "sft" or m[f"{name}/kl"] <= kl]
    best = max(cheaper, key=lambda name: m[f"{name}/gold"])
    return best, m[f"{best}/gold"], (0.0 if best == "sft" else m[f"{best}/kl"])


def passed(m: dict[str, Any]) -> bool:
    """Whether the verdict on evaluate's metrics `m` is OK: PPO beats SFT by the gold annotator (a
    win rate above one half), the reward model agrees within `GAMED_GAP` and PPO is not below the
    best-of-n frontier (`below_frontier`). A task without a gold annotator has no OK verdict: the
    reward model PPO was optimised against cannot vouch for it."""
    return _beats_and_agrees(m) and not below_frontier(m)


def _beats_and_agrees(m: dict[str, Any]) -> bool:
    gold = m.get("win_rate/ppo_vs_sft_gold")
    return gold is not None and gold > 0.5 and abs(m["win_rate/ppo_vs_sft_rm"] - gold) <= GAMED_GAP


def frontier_clause(m: dict[str, Any]) -> str:
    """PPO below the frontier in words: its gold and KL, how far below the curve (or, where the
    curve says nothing, below the policy that dominates it), the interval."""
    if _clearly_below(m, "frontier/ppo_gap_gold"):
        gap, low, high = (m[f"frontier/ppo_gap_gold{s}"] for s in ("", "_low", "_high"))
        return (f"PPO is below the best-of-n frontier: gold {m['ppo/gold']:.2f} at {m['ppo/kl']:.2f} nats, "
                f"{-gap:.2f} (CI {-high:.2f}-{-low:.2f}) below what best-of-n reaches at that KL")
    margin, low, high = (m[f"frontier/ppo_margin_gold{s}"] for s in ("", "_low", "_high"))
    name, gold, kl = dominating(m)
    who = "SFT" if name == "sft" else name.replace("best_of_", "best-of-")
    return (f"PPO is below the best-of-n frontier: gold {m['ppo/gold']:.2f} at {m['ppo/kl']:.2f} nats, "
            f"{-margin:.2f} (CI {-high:.2f}-{-low:.2f}) below {who}'s {gold:.2f} at {kl:.2f} nats")


def verdict(m: dict[str, Any], detector: Optional[dict[str, Any]]) -> str:
    """One paragraph: did PPO beat SFT, and was the reward model gamed. `m` is evaluate's metrics;
    `detector` the `detector` section of outputs/ppo/metrics.json (None: no record). With a gold
    judge, an RM-vs-gold win-rate gap above `GAMED_GAP` is called over-optimisation; else the verdict
    is OK (`passed`) unless PPO is below the best-of-n frontier (`below_frontier`), which is said in
    any case."""
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
    below = [frontier_clause(m)] if below_frontier(m) else []
    if gold <= 0.5:
        head = [f"PPO does NOT beat SFT by the gold annotator ({gold:.0%} win rate; the reward model "
                f"prefers PPO in {rm:.0%} of prompts)", *below]
    elif not _beats_and_agrees(m):
        head = [f"over-optimisation: the reward model prefers PPO in {rm:.0%} of prompts, the gold annotator "
                f"in {gold:.0%}", *below]
    elif below:
        head = [*below, f"it beats SFT in {gold:.0%} of prompts by the gold annotator and {rm:.0%} by the "
                        "reward model"]
    else:
        head = [f"OK: PPO beats SFT in {gold:.0%} of prompts by the gold annotator and {rm:.0%} by the "
                "reward model"]
    return "; ".join([*head, alarm]) + "."


def detector_record(ppo_model_dir: Path) -> Optional[dict[str, Any]]:
    """The detector's section of the ppo stage's metrics.json, next to its model folder."""
    path = Path(ppo_model_dir).parent / "metrics.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get("detector")
