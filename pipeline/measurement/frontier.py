"""`python -m pipeline frontier`: gold-vs-KL and RM-vs-KL across DVC experiments, as a PNG.

Reads the experiments of the last commits (`dvc.api.exp_show`), takes the PPO policy's KL to SFT,
reward-model score and gold score from the evaluate stage's metrics, and the param that set the
experiment's KL: `ppo.kl_target` where the adaptive controller is on (the default), else the fixed
`ppo.kl_coef`; and draws both scores against KL. A sweep over either traces the frontier; with a
small penalty the RM score keeps rising while the gold score falls (reward over-optimisation,
Gao et al. 2023).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional

from ..config import flatten, read_yaml
from ..files import atomic_write_text
from .comparison_plots import frontier_plot
from .plots import close_figure

METRICS = {"kl": "ppo.kl", "rm": "ppo.rm", "gold": "ppo.gold"}
# Where they are read: the PPO stage writes the same names for its own held-out measurement (on
# `ppo.n_eval_prompts`), so DVC names each column by its file and evaluate's must be chosen.
SOURCE = "evaluate/metrics.json"
FIXED_SECTIONS = ("data", "model", "sft", "reward")   # what the SFT policy and the RM depend on


def _lookup(row: dict[str, Any], suffix: str, source: Optional[str] = None) -> Optional[float]:
    """A value whose key ends with `suffix`. DVC prefixes a key with its file (`<file>:<name>`) where
    two files hold the name: then only `source`'s counts; a key without a file is taken as it is."""
    numbers = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if source is not None:
        found = [v for k, v in numbers.items() if k.endswith(f"{source}:{suffix}")]
        if found:
            return found[0]
    for key, value in numbers.items():
        if key == suffix or (":" not in key and key.endswith("." + suffix)) or (source is None and key.endswith(":" + suffix)):
            return value
    return None


def _same(row: dict[str, Any], key: str, want: Any) -> bool:
    """Whether the row's param `key` (possibly file-prefixed) equals `want`; floats compare closely."""
    for k, value in row.items():
        if k == key or k.endswith(":" + key):
            if isinstance(value, (int, float)) and isinstance(want, (int, float)) and not isinstance(want, bool):
                return math.isclose(value, want, rel_tol=1e-9)
            return value == want or str(value) == str(want)   # exp_show renders None and bools as text
    return False


def collect(rows: list[dict[str, Any]], fixed: Optional[Mapping[str, Any]] = None) -> list[dict[str, Any]]:
    """One point per experiment that has the evaluate stage's PPO metrics and whose params equal
    `fixed` (dotted keys): the frontier compares policies trained against the same SFT model and RM.
    The workspace, the branch and the commit of one baseline show the same numbers: the first name
    is kept."""
    points, seen = [], set()
    for row in rows:
        if fixed and not all(_same(row, k, v) for k, v in fixed.items()):
            continue
        values = {name: _lookup(row, key, SOURCE) for name, key in METRICS.items()}
        coef = _lookup(row, "ppo.kl_coef")
        if values["kl"] is None or values["rm"] is None or coef is None:
            continue
        # Under the adaptive controller kl_coef is only its starting value: the target sets the KL.
        target = _lookup(row, "ppo.kl_target") if _same(row, "ppo.adaptive_kl", True) else None
        label = f"{coef:g}" if target is None else f"target {target:g}"
        key = (label, *values.values())
        if key not in seen:
            seen.add(key)
            points.append({"name": row.get("Experiment") or row.get("rev") or "workspace", "kl_coef": coef,
                           "kl_target": target, "label": label, **values})
    # The fixed coefficients first, by value, then the targets, by value
    return sorted(points, key=lambda p: (p["kl_target"] is not None, p["kl_target"] or p["kl_coef"]))


def main(out: Path = Path("outputs/frontier.png"), num: int = 10) -> list[dict[str, Any]]:
    import dvc.api

    # Experiments of the last `num` commits (a sweep queued before a later commit still counts),
    # restricted to those whose SFT and RM were built like the workspace's: an older commit may
    # hold other models (a changed model size would put its baseline on the new frontier).
    params = read_yaml("params.yaml")
    fixed = {k: v for section in FIXED_SECTIONS for k, v in flatten(params[section], f"{section}.").items()}
    points = collect(dvc.api.exp_show(num=num), fixed)
    if not points:
        raise SystemExit("frontier: no experiment has evaluate metrics yet (run `dvc exp run` first)")
    close_figure(frontier_plot(points, out))
    table = ["| experiment | ppo.kl_coef (or adaptive: ppo.kl_target) | KL to SFT | RM score | gold score |",
             "| --- | --- | --- | --- | --- |"]
    for p in points:
        gold = f"{p['gold']:.3f}" if p["gold"] is not None else "n/a"
        table.append(f"| {p['name']} | {p['label']} | {p['kl']:.2f} | {p['rm']:.3f} | {gold} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(table) + "\n")
    print("\n".join(table))
    print(f"frontier: wrote {out} and {out.with_suffix('.md')}")
    return points
