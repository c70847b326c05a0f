"""`python -m pipeline frontier`: gold-vs-KL and RM-vs-KL across DVC experiments, as a PNG.

Reads the experiments of the last commits (`dvc.api.exp_show`), takes the PPO policy's KL to SFT,
reward-model score and gold score from the evaluate stage's metrics, and the experiment's
`ppo.kl_coef`, and draws both scores against KL. A sweep over kl_coef traces the frontier; with a
small penalty the RM score keeps rising while the gold score falls (reward over-optimisation,
Gao et al. 2023).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .io import atomic_write_text
from .plots import frontier_plot

METRICS = {"kl": "ppo.kl", "rm": "ppo.rm", "gold": "ppo.gold"}


def _lookup(row: dict[str, Any], suffix: str) -> Optional[float]:
    """A value whose key ends with `suffix` (DVC may prefix keys with their metrics file)."""
    for key, value in row.items():
        if (key == suffix or key.endswith(":" + suffix) or key.endswith("." + suffix)) and isinstance(value, (int, float)):
            return float(value)
    return None


def collect(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per experiment that has the evaluate stage's PPO metrics. The workspace, the
    branch and the commit of one baseline show the same numbers: the first name is kept."""
    points, seen = [], set()
    for row in rows:
        values = {name: _lookup(row, key) for name, key in METRICS.items()}
        coef = _lookup(row, "ppo.kl_coef")
        if values["kl"] is None or values["rm"] is None or coef is None:
            continue
        key = (coef, *values.values())
        if key not in seen:
            seen.add(key)
            points.append({"name": row.get("Experiment") or row.get("rev") or "workspace", "kl_coef": coef, **values})
    return sorted(points, key=lambda p: p["kl_coef"])


def main(out: Path = Path("outputs/frontier.png"), num: int = 10) -> list[dict[str, Any]]:
    import dvc.api

    # Experiments of the last `num` commits: a sweep queued before a later commit still counts.
    points = collect(dvc.api.exp_show(num=num))
    if not points:
        raise SystemExit("frontier: no experiment has evaluate metrics yet (run `dvc exp run` first)")
    frontier_plot(points, out)
    table = ["| experiment | ppo.kl_coef | KL to SFT | RM score | gold score |", "| --- | --- | --- | --- | --- |"]
    for p in points:
        gold = f"{p['gold']:.3f}" if p["gold"] is not None else "n/a"
        table.append(f"| {p['name']} | {p['kl_coef']:g} | {p['kl']:.2f} | {p['rm']:.3f} | {gold} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(table) + "\n")
    print("\n".join(table))
    print(f"frontier: wrote {out} and {out.with_suffix('.md')}")
    return points
