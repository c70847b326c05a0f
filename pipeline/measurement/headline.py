"""A run's headline in under 100 columns: `python -m pipeline headline [--outputs outputs]`.

What a reader of a finished run wants first, read from the stages' metrics.json files: the
verdict, PPO's win rates over SFT by the gold annotator and by the reward model with their 95%
bootstrap intervals, PPO's gold gap to the best-of-n frontier at its KL (a run that measured it),
each policy's gold and RM score and KL to SFT, the reward model's accuracy
against the label-noise ceiling, and what each stage cost. `dvc metrics show` prints every metric
(hundreds of columns); this prints the dozen that decide whether the run worked.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any, Optional

from ..config import flatten
from ..errors import DataError
from .verdict import detector_record, verdict

WIDTH = 99


def _read(path: Path) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not JSON ({err.msg})") from None


def _num(value: Any, fmt: str) -> str:
    return "n/a" if not isinstance(value, (int, float)) else format(value, fmt)


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def shown(path: Path) -> str:
    """`path` as the headline names it: relative to the working directory when inside it, else with
    the home folder as ~, and cut to its last parts (after `...`) to fit WIDTH columns with "run in"."""
    path = Path(path)
    try:
        text = str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        home = str(Path.home())
        text = str(path)
        if text == home or text.startswith(home + os.sep):
            text = "~" + text[len(home):]
    room = WIDTH - len("run in /")
    if len(text) > room:
        parts = Path(text).parts
        while len(parts) > 1 and len(os.sep.join(("...",) + parts)) > room:
            parts = parts[1:]
        text = os.sep.join(("...",) + parts)
    return text


def lines(outputs: Path, stages: tuple[str, ...] = ()) -> list[str]:
    """The headline of the run whose stage folders are in `outputs` (each at most WIDTH columns);
    `stages`: those whose cost it gives, in order (the default pipeline's, from the stage registry)."""
    ev = _read(outputs / "evaluate" / "metrics.json")
    if ev is None:
        raise DataError(f"{outputs / 'evaluate' / 'metrics.json'}: no such file (run the pipeline first: make pipeline)")
    flat = flatten(ev, sep="/")
    out = [f"run in {shown(outputs)}/"]
    out += textwrap.wrap("verdict: " + verdict(flat, detector_record(outputs / "ppo" / "model")), WIDTH,
                         subsequent_indent="  ")
    win = ev.get("win_rate", {})
    out.append("")
    out.append(f"{'PPO over SFT':<26}{'win rate':>10}{'95% interval':>18}")
    for judge, key in (("by the gold annotator", "gold"), ("by the reward model", "rm")):
        name = f"ppo_vs_sft_{key}"
        if name in win:
            out.append(f"  {judge:<24}{_num(win[name], '.1%'):>10}"
                       f"{_num(win.get(name + '_low'), '.1%'):>11}-{_num(win.get(name + '_high'), '.1%')}")
    gap = frontier_line(ev)
    if gap:
        out += textwrap.wrap(gap, WIDTH, subsequent_indent="  ")
    out.append("")
    out.append(f"{'policy':<14}{'gold':>16}{'RM score':>18}{'KL to SFT':>12}{'length':>9}")
    for policy in _policies(ev):
        p = ev[policy]
        out.append(f"  {policy:<12}{_num(p.get('gold'), '.2f'):>10} ± {_num(p.get('gold_ci95'), '.2f'):<4}"
                   f"{_num(p.get('rm'), '.2f'):>12} ± {_num(p.get('rm_ci95'), '.2f'):<4}"
                   f"{_num(p.get('kl'), '.2f'):>11}{_num(p.get('length'), '.1f'):>9}")
    rm = (_read(outputs / "reward" / "metrics.json") or {}).get("eval", {})
    if rm:
        out.append("")
        out.append(f"reward model: accuracy {_num(rm.get('accuracy'), '.1%')} on held-out pairs, "
                   f"{_num(rm.get('accuracy_of_ceiling'), '.1%')} of the label-noise ceiling "
                   f"{_num(rm.get('noise_ceiling'), '.1%')}")
    costs = []
    for stage in stages:
        res = (_read(outputs / stage / "metrics.json") or {}).get("resources", {})
        if res:
            costs.append(f"{stage} {_duration(res.get('wall_seconds'))}")
    if costs:
        out.append("")
        out += textwrap.wrap("time: " + ", ".join(costs), WIDTH, subsequent_indent="  ")
    return out


def frontier_line(ev: dict[str, Any]) -> str:
    """PPO's gold gap to the best-of-n curve at its KL with its interval, or why there is none; ""
    for evaluate metrics written before the gap was measured."""
    f = ev.get("frontier") or {}
    if "ppo_gap_gold" not in f:
        return ""
    kl = (ev.get("ppo") or {}).get("kl")
    if f.get("ppo_beyond_best_of_n"):
        top = max((ev[p].get("kl") for p in _policies(ev) if p.startswith("best_of_")), default=None)
        margin = f.get("ppo_margin_gold")
        against = f"; gold {_num(margin, '+.2f')} against it" if isinstance(margin, (int, float)) else ""
        return (f"PPO to the best-of-n frontier: past it, KL {_num(kl, '.2f')} > best-of-n's largest "
                f"{_num(top, '.2f')}{against}")
    gap, low, high = f.get("ppo_gap_gold"), f.get("ppo_gap_gold_low"), f.get("ppo_gap_gold_high")
    if not isinstance(gap, (int, float)):
        return "PPO to the best-of-n frontier: not measured (fewer than two best-of-n)"
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (low, high)):
        # KL so near best-of-n's largest that too many resamples fall past it for an interval
        # (measurement/frontier_gap.py); the margin over the best point at no more KL has one.
        margin = f.get("ppo_margin_gold")
        against = (f"; against the best point at less KL {_num(margin, '+.2f')}, 95% interval "
                   f"{_num(f.get('ppo_margin_gold_low'), '+.2f')} to {_num(f.get('ppo_margin_gold_high'), '+.2f')}"
                   if isinstance(margin, (int, float)) else "")
        return (f"PPO to the best-of-n frontier: gold {_num(gap, '+.2f')} at KL {_num(kl, '.2f')} (no interval: "
                f"at the end of best-of-n's KL range){against}")
    return (f"PPO to the best-of-n frontier: gold {_num(gap, '+.2f')} at KL {_num(kl, '.2f')}, "
            f"95% interval {_num(low, '+.2f')} to {_num(high, '+.2f')}")


def _policies(ev: dict[str, Any]) -> list[str]:
    """The measured policies of evaluate's metrics: SFT, best-of-n by n, then the trained ones."""
    found = [k for k, v in ev.items() if isinstance(v, dict) and ("gold" in v or "rm" in v)]
    def order(name: str) -> tuple[int, int, str]:
        if name == "sft":
            return (0, 0, name)
        if name.startswith("best_of_") and name[8:].isdigit():
            return (1, int(name[8:]), name)
        return (2, 0, name)
    return sorted(found, key=order)
