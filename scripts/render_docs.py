"""Render the measured numbers of README.md and docs/guide/*.md from the committed data files, and
docs/architecture.md's table of stages from the stage registry.

    python scripts/render_docs.py             # rewrite every rendered block in place   (= make docs)
    python scripts/render_docs.py --check     # exit 1 listing the blocks that differ from their data

A rendered block is written between two HTML comments, which Markdown does not show:

    <!-- rendered: NAME -->
    ...generated text, never edited by hand...
    <!-- /rendered -->

NAME is one of `RENDERERS` below; each reads only committed files (the default run in outputs/,
docs/compare_methods.tsv, docs/frontier.md, docs/data/*.json) and writes the same text for the
same files: the output is deterministic and a second run changes nothing. A number measured by a
run belongs in such a block, or in a dated record of docs/decisions/; tests/system/test_docs.py checks
that the pages equal their rendering and that no measured number is written by hand elsewhere.

Standard library only at import; the renderers that list stages read them from dvc.yaml (ruamel)
or from the stage registry (the GPU check's order), as `make docs` runs it in the virtual environment.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- rendered: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /rendered -->)", re.S)
OPENING = re.compile(r"<!-- rendered: ([^ ]*) -->")
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.S | re.M)   # a fenced code block, indented in a list too
DATA_STAGE = "prepare"   # the stage whose output is data, not a metrics.json
NA = "n/a"


def dvc_stages(root: Path, dvc_yaml: str) -> tuple[str, ...]:
    """The stages of a dvc.yaml, in its order, but the one that prepares data."""
    from ruamel.yaml import YAML
    stages = (YAML(typ="safe", pure=True).load((root / dvc_yaml).read_text(encoding="utf-8")) or {}).get("stages", {})
    return tuple(s for s in stages if s != DATA_STAGE)


class RenderError(Exception):
    """A page or a data file that cannot be rendered (one line, no traceback)."""


# ---- reading the data -----------------------------------------------------------------------------


def read_json(root: Path, rel: str) -> Optional[dict[str, Any]]:
    path = root / rel
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RenderError(f"{rel}: not JSON ({e})") from None


def get(node: Any, path: str) -> Any:
    """`node["a"]["b"]` for "a/b"; None where a key is missing (or the value is null)."""
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def num(value: Any, fmt: str, suffix: str = "") -> str:
    """A number as `fmt` formats it, or n/a for a missing or undefined (null, NaN) value."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return NA
    return format(value, fmt) + suffix


def pct(value: Any, digits: int = 1) -> str:
    return NA if num(value, "f") == NA else f"{100 * value:.{digits}f}%"


def interval(low: Any, high: Any) -> str:
    if NA in (num(low, "f"), num(high, "f")):
        return NA
    return f"{100 * low:.1f}-{100 * high:.1f}%"


def frontier_gap(gap: Any, low: Any, high: Any, beyond: Any) -> str:
    """A gold gap to the best-of-n frontier with its interval (`-0.45 (-0.60 to -0.30)`), or that the
    policy's KL is past best-of-n's largest (no gap measured there)."""
    if beyond:
        return "beyond best-of-n"
    if NA in (num(low, "f"), num(high, "f")):
        return num(gap, "+.2f")
    return f"{num(gap, '+.2f')} ({num(low, '+.2f')} to {num(high, '+.2f')})"


# Under a table with a gap shown without its interval (frontier_gap's NA case)
NO_INTERVAL = ("A gap without an interval: the policy's KL is so near best-of-n's largest that too many "
               "bootstrap resamples fall past the curve's end for one.")


def gap_without_interval(gap: Any, low: Any, high: Any, beyond: Any = False) -> bool:
    """Whether a gap is measured (inside best-of-n's range) but its interval is not."""
    return not beyond and num(gap, "f") != NA and NA in (num(low, "f"), num(high, "f"))


def ppo_gap_without_interval(r: dict[str, Any]) -> bool:
    return gap_without_interval(r.get("ppo_gap_gold"), r.get("ppo_gap_gold_low"), r.get("ppo_gap_gold_high"),
                                r.get("ppo_beyond_best_of_n"))


def margin_sentence(f: dict[str, Any], reading: str) -> str:
    """The README's sentence on PPO's margin over the best gold SFT or a best-of-n reaches at less KL."""
    if f.get("ppo_margin_gold") is None:
        return ""
    return (f" Against the best gold that SFT or a best-of-n reaches at less KL, PPO's is "
            f"{num(f.get('ppo_margin_gold'), '+.2f')} (95% CI {num(f.get('ppo_margin_gold_low'), '+.2f')} to "
            f"{num(f.get('ppo_margin_gold_high'), '+.2f')}{reading}).")


def minutes(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 60} min {whole % 60} s"


def policy_label(name: str) -> str:
    return name.replace("best_of_", "best-of-")


def policies(metrics: dict[str, Any]) -> list[str]:
    """The policies of an evaluate or compare metrics.json, in the report's order: SFT, best-of-n by
    n, then the trained ones (PPO first)."""
    names = [k for k, v in metrics.items() if isinstance(v, dict) and ("gold" in v or "rm" in v)]
    best = sorted((k for k in names if k.startswith("best_of_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    trained = sorted((k for k in names if k not in best and k != "sft"), key=lambda k: (k != "ppo", k))
    return (["sft"] if "sft" in names else []) + best + trained


# ---- the blocks -----------------------------------------------------------------------------------


COMMITTED_RUN = "docs/data/committed-run.json"


def lock_md5(root: Path, path: str) -> Optional[str]:
    """The md5 that dvc.lock records for the output `path`, or None (no dvc.lock, or no such out)."""
    if not (root / "dvc.lock").is_file():
        return None
    from ruamel.yaml import YAML
    lock = YAML(typ="safe", pure=True).load((root / "dvc.lock").read_text(encoding="utf-8")) or {}
    for stage in (lock.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if out.get("path") == path:
                return out.get("md5")
    return None


def committed_run(root: Path, threads: Any) -> dict[str, Any]:
    """docs/data/committed-run.json: the machine and date of the run in outputs/, which the run's own
    files do not record. It names the run it describes by dvc.lock's md5 of
    outputs/evaluate/metrics.json; a file of another run (or thread count) is an error, so a new run
    is not described by the last one's machine."""
    run = read_json(root, COMMITTED_RUN)
    if run is None:
        return {}
    recorded, actual = run.get("evaluate_metrics_md5"), lock_md5(root, "outputs/evaluate/metrics.json")
    if actual is not None and recorded != actual:
        raise RenderError(f"{COMMITTED_RUN}: evaluate_metrics_md5 is {recorded}, but dvc.lock's "
                          f"outputs/evaluate/metrics.json is {actual}: it describes another run than outputs/ "
                          "holds (yours?); `make docs ARGS=--this-run` records this machine and your run's threads, "
                          "date and md5 there, or `git checkout -- dvc.lock outputs` goes back to the committed run")
    if threads and run.get("threads") and str(run["threads"]) != str(threads):
        raise RenderError(f"{COMMITTED_RUN}: threads is {run['threads']}, but outputs/evaluate/config.json "
                          f"records {threads}")
    return run


def describe_this_run(root: Path) -> dict[str, Any]:
    """Write docs/data/committed-run.json for the run in outputs/ (`--this-run`): this machine (the
    run is taken to have been made here), the threads its evaluate stage recorded, the date of its
    outputs/evaluate/metrics.json (UTC) and dvc.lock's md5 of that file. Returns what it wrote."""
    import datetime
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from demo_seeds import machine
    from pipeline.files import atomic_write_json
    metrics = root / "outputs/evaluate/metrics.json"
    md5 = lock_md5(root, "outputs/evaluate/metrics.json")
    if md5 is None or not metrics.is_file():
        raise RenderError("--this-run: no run to describe (outputs/evaluate/metrics.json and its entry in "
                          "dvc.lock come from `make pipeline`)")
    threads = (get(read_json(root, "outputs/evaluate/config.json") or {}, "runtime") or {}).get("threads")
    when = datetime.datetime.fromtimestamp(metrics.stat().st_mtime, datetime.timezone.utc).date().isoformat()
    run = {"machine": machine(), "threads": threads, "date": when, "evaluate_metrics_md5": md5}
    atomic_write_json(root / COMMITTED_RUN, run)
    return run


def render_headline(root: Path) -> str:
    """README: the committed default run (outputs/): one run of one seed, its machine and date
    (docs/data/committed-run.json), and which machines the README's other tables ran on."""
    ev = read_json(root, "outputs/evaluate/metrics.json")
    if ev is None:
        return "The default pipeline's outputs are not committed on this commit (`outputs/evaluate/metrics.json`)."
    rm = read_json(root, "outputs/reward/metrics.json") or {}
    ppo = read_json(root, "outputs/ppo/metrics.json") or {}
    cfg = read_json(root, "outputs/evaluate/config.json") or {}
    n_prompts = get(cfg, "evaluate/n_prompts")
    runtime = get(cfg, "runtime") or {}
    threads = runtime.get("threads")
    run = committed_run(root, threads)
    machine = run.get("machine") or f"a machine that {COMMITTED_RUN} does not name"
    shape = [f"torch device {runtime['device']}"] if runtime.get("device") else []
    if runtime.get("processes"):
        shape.append(f"{runtime['processes']} process{'es' if runtime['processes'] != 1 else ''}")
    at = f"at {threads} threads" if threads else "at a thread count the run's `config.json` does not record"
    detail = f" ({', '.join(shape)})" if shape else ""
    where = f"on {machine}{detail} {at}, {run.get('date', 'undated')}"
    lines = [f"One run of `make pipeline` with one seed, committed in `outputs/`: a single draw, not a "
             f"distribution, measured {where}.", "",
             "| policy | gold score ± 95% CI | reward-model score | KL to SFT, nats | length, words |",
             "| --- | --- | --- | --- | --- |"]
    for name in policies(ev):
        p = ev[name]
        lines.append(f"| {policy_label(name)} | {num(p.get('gold'), '.2f')} ± {num(p.get('gold_ci95'), '.2f')} | "
                     f"{num(p.get('rm'), '.2f')} | {num(p.get('kl'), '.2f')} | {num(p.get('length'), '.1f')} |")
    prompts = f"the {n_prompts} held-out prompts" if n_prompts else "the held-out prompts"
    fired = get(ppo, "detector/fired")
    detector = NA if fired is None else ("stayed quiet" if not fired else f"fired (first at iteration {get(ppo, 'detector/first_fire')})")
    lines += ["", f"PPO beats SFT on **{pct(get(ev, 'win_rate/ppo_vs_sft_gold'))}** of {prompts} by the gold "
                  f"annotator (95% CI {interval(get(ev, 'win_rate/ppo_vs_sft_gold_low'), get(ev, 'win_rate/ppo_vs_sft_gold_high'))}) "
                  f"and on {pct(get(ev, 'win_rate/ppo_vs_sft_rm'))} by the reward model; the reward model's held-out "
                  f"accuracy is {num(get(rm, 'eval/accuracy'), '.3f')} against a label-noise ceiling of "
                  f"{num(get(rm, 'eval/noise_ceiling'), '.3f')} ({pct(get(rm, 'eval/accuracy_of_ceiling'))} of it); "
                  f"the over-optimisation detector {detector}.{headline_frontier(ev)}"]
    times = {s: get(read_json(root, f"outputs/{s}/metrics.json") or {}, "resources/wall_seconds")
             for s in dvc_stages(root, "dvc.yaml")}
    known = [v for v in times.values() if isinstance(v, (int, float))]
    parts = ", ".join(f"{s} {num(v, '.0f', ' s')}" for s, v in times.items())
    total = f" (together {minutes(sum(known))}, install and `prepare` not counted)" if len(known) == len(times) else ""
    lines += ["", f"Stage wall time: {parts}{total}."]
    machines = readme_machines(root, run)
    if machines:
        lines += ["", machines]
    return "\n".join(lines)


def headline_frontier(ev: dict[str, Any]) -> str:
    """The README's sentence on PPO's gold gap to the best-of-n frontier (evaluate's `frontier/*`),
    with a leading space; "" for a run that predates it."""
    f = ev.get("frontier")
    if not isinstance(f, dict) or "ppo_gap_gold" not in f:
        return ""
    if f.get("ppo_beyond_best_of_n"):
        return (" PPO's KL to SFT is past best-of-n's largest, so its gap to the best-of-n frontier (the "
                "curve fitted through the best-of-n points) is not measured."
                + margin_sentence(f, "; negative: a cheaper best-of-n does better"))
    if NA in (num(f.get("ppo_gap_gold_low"), "f"), num(f.get("ppo_gap_gold_high"), "f")):
        margin = margin_sentence(f, "")
        return (f" Against the best-of-n frontier (the curve fitted through the best-of-n points) at its own KL, "
                f"PPO's gold is {num(f.get('ppo_gap_gold'), '+.2f')} (negative: below it), without an interval: "
                "its KL is so near best-of-n's largest that too many bootstrap resamples fall past the "
                "curve's end." + margin)
    return (f" Against the best-of-n frontier (the curve fitted through the best-of-n points) at its own KL, "
            f"PPO's gold is {num(f.get('ppo_gap_gold'), '+.2f')} (95% CI "
            f"{num(f.get('ppo_gap_gold_low'), '+.2f')} to {num(f.get('ppo_gap_gold_high'), '+.2f')}; "
            "negative: below it).")


def readme_machines(root: Path, run: dict[str, Any]) -> str:
    """One sentence: which machine each of the README's tables ran on, grouped, and what follows
    where they differ."""
    tables = {"the committed run": run.get("machine"),
              "the seeds table": (read_json(root, "docs/data/seed-grid.json") or {}).get("machine"),
              "the demo table": (read_json(root, "docs/data/demo.json") or {}).get("machine")}
    by_machine: dict[str, list[str]] = {}
    for table, machine in tables.items():
        if machine:
            by_machine.setdefault(machine, []).append(table)
    if not by_machine:
        return ""
    def listed(names: list[str]) -> str:
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    if len(by_machine) == 1:
        machine, names = next(iter(by_machine.items()))
        return f"Machines: {listed(names)} ran on {machine}."
    parts = [f"{listed(names)} on {machine}" for machine, names in by_machine.items()]
    return (f"Machines: {'; '.join(parts)}. Another CPU's vector instructions take another floating-point "
            "path, so the same command and seed give other numbers there.")


def render_demo(root: Path) -> str:
    """README: `make demo` over seeds (docs/data/demo.json, written by benchmarks/demo_seeds.py)."""
    demo = read_json(root, "docs/data/demo.json")
    if demo is None or not demo.get("runs"):
        return ("The demo has not been measured on this commit: `benchmarks/demo_seeds.py` runs it over seeds "
                "and writes `docs/data/demo.json`, which `make docs` renders here.")
    runs = sorted(demo["runs"], key=lambda r: r.get("seed", 0))
    verdicts = any(r.get("verdict") for r in runs)
    head = ["seed", "wall time", "PPO beats SFT, gold (95% CI)", "gold: SFT → PPO", "KL to SFT, nats",
            "reward model, share of the noise ceiling"] + (["verdict"] if verdicts else [])
    threads = demo.get("threads")
    lines = [f"Measured on {demo.get('machine', 'an unrecorded machine')}, "
             f"{threads if threads else 'an unrecorded number of'} threads, {demo.get('date', 'undated')}; "
             f"one `{demo.get('command', 'make demo')}` per seed:", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in runs:
        row = [str(r.get("seed", NA)), num(r.get("seconds"), ".0f", " s"),
               f"{pct(r.get('win_rate_gold'))} ({interval(r.get('win_rate_gold_low'), r.get('win_rate_gold_high'))})",
               f"{num(r.get('sft_gold'), '.2f')} → {num(r.get('ppo_gold'), '.2f')}", num(r.get("ppo_kl"), ".2f"),
               pct(r.get("rm_accuracy_of_ceiling"))] + ([r.get("verdict") or NA] if verdicts else [])
        lines.append("| " + " | ".join(row) + " |")
    share = demo.get("share_required")
    wins = [r.get("win_rate_gold") for r in runs]
    secs = [r["seconds"] for r in runs if isinstance(r.get("seconds"), (int, float))]
    summary = []
    if isinstance(share, (int, float)):
        held = sum(1 for w in wins if isinstance(w, (int, float)) and w >= share)
        summary.append(f"the stated share, PPO beating SFT by gold on at least {pct(share, 0)} of the held-out "
                       f"prompts, held on {held} of {len(runs)} seeds")
    if secs:
        summary.append(f"median wall time {minutes(statistics.median(secs))}")
    if summary:
        lines += ["", summary[0][0].upper() + "; ".join(summary)[1:] + "."]
    return "\n".join(lines)


def render_seeds(root: Path) -> str:
    """README: the full default over seeds (docs/data/seed-grid.json, written by benchmarks/seed_grid.py)."""
    grid = read_json(root, "docs/data/seed-grid.json")
    if grid is None or not grid.get("runs"):
        return ("The default has not been measured over seeds on this commit: `benchmarks/seed_grid.py --out "
                "docs/data/seed-grid.json` runs it, and `make docs` renders it here.")
    runs = grid["runs"]
    threads = grid.get("threads")
    gaps = any("ppo_gap_gold" in r for r in runs)   # a grid written before the gap was measured has none
    timed = any(k.endswith("_seconds") for r in runs for k in r)   # a variant grid's export has no times
    lines = [f"The full default (`dvc repro`, every stage) once per seed, measured on "
             f"{grid.get('machine', 'an unrecorded machine')} at {threads if threads else 'an unrecorded number of'} "
             f"threads, {grid.get('date', 'undated')}; seed `s:p`: s seeds the SFT policy and the reward "
             "model (`sft.seed`, `reward.seed`), p seeds PPO (`ppo.seed`):", "",
             "| seed | PPO beats SFT, gold (95% CI) | by the RM | gold: SFT → PPO | KL to SFT, nats | "
             + ("gold gap to best-of-n (95% CI) | " if gaps else "")
             + "RM accuracy (share of ceiling) |" + (" wall time: sft + reward + ppo + evaluate |" if timed else ""),
             "|" + " --- |" * (6 + gaps + timed)]
    for r in runs:
        stages = [r.get(f"{s}_seconds") for s in dvc_stages(root, "dvc.yaml")]
        known = [v for v in stages if isinstance(v, (int, float))]
        wall = " + ".join(num(v, ".0f") for v in stages) + " s" + (f" = {minutes(sum(known))}" if len(known) == len(stages) else "")
        lines.append(f"| {':'.join(str(r.get('run', NA)).split(':')[:2])} | {pct(r.get('gold_win'))} "
                     f"({interval(r.get('gold_win_low'), r.get('gold_win_high'))}) | {pct(r.get('rm_win'))} | "
                     f"{num(r.get('sft_gold'), '.2f')} → {num(r.get('ppo_gold'), '.2f')} | {num(r.get('ppo_kl'), '.2f')} | "
                     + (f"{seed_gap(r)} | " if gaps else "")
                     + f"{num(r.get('rm_accuracy'), '.3f')} ({pct(r.get('rm_accuracy_of_ceiling'))}) |"
                     + (f" {wall} |" if timed else ""))
    wins = [r["gold_win"] for r in runs if isinstance(r.get("gold_win"), (int, float))]
    if wins:
        lines += ["", f"PPO beats SFT by gold on {pct(min(wins))} to {pct(max(wins))} of the held-out prompts "
                      f"over these {len(runs)} seeds (median {pct(statistics.median(wins))})."
                  + (" " + NO_INTERVAL if gaps and any(ppo_gap_without_interval(r) for r in runs) else "")]
    return "\n".join(lines)


def seed_gap(r: dict[str, Any]) -> str:
    """A seed-grid run's gold gap to the best-of-n frontier; — for a run recorded before it was measured."""
    if "ppo_gap_gold" not in r:
        return "—"
    if "ppo_margin_gold" in r:   # recorded with the margin: the gap, or past best-of-n the margin
        return against_frontier(r)
    return frontier_gap(r.get("ppo_gap_gold"), r.get("ppo_gap_gold_low"), r.get("ppo_gap_gold_high"),
                        r.get("ppo_beyond_best_of_n"))


def render_ppo_variants(root: Path) -> str:
    """docs/guide/ppo.md: PPO variants over seeds against each run's best-of-n frontier
    (docs/data/ppo-variants.json, written by benchmarks/ppo_variants.py --collect)."""
    data = read_json(root, "docs/data/ppo-variants.json")
    if data is None or not data.get("variants"):
        return ("No PPO variants are measured on this commit: `benchmarks/ppo_variants.py` runs them, and "
                "`make docs` renders them here.")
    dates = sorted({r["date"] for v in data["variants"] for r in v.get("runs", []) if r.get("date")}) \
        or [data.get("date", "undated")]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    lines = [f"Measured on {data.get('machine', 'an unrecorded machine')}, {when}, the "
             "full default's SFT and reward model per seed, PPO and evaluate per variant; seed `s:p` as in the "
             "README's seeds table. Against best-of-n: the gold gap to its curve at PPO's own KL, or, past "
             "best-of-n's largest KL, the margin over the best gold SFT or a best-of-n reaches at no more KL "
             "(95% intervals, paired over prompts):", "",
             "| variant | params | seed | measured | gold: SFT → PPO | KL to SFT, nats | against best-of-n (95% CI) | "
             "PPO beats SFT, gold |", "|" + " --- |" * 8]
    for v in data["variants"]:
        params = ", ".join(f"`{o}`" for o in v.get("overrides", [])) or "as committed"
        for r in v.get("runs", []):
            lines.append(f"| {v.get('name', NA)} | {params} | {':'.join(str(r.get('run', NA)).split(':')[:2])} | "
                         f"{r.get('date') or data.get('date', NA)} | {num(r.get('sft_gold'), '.2f')} → {num(r.get('ppo_gold'), '.2f')} | "
                         f"{num(r.get('ppo_kl'), '.2f')} | {against_frontier(r)} | {pct(r.get('gold_win'))} |")
    if any(ppo_gap_without_interval(r) for v in data["variants"] for r in v.get("runs", [])):
        lines += ["", NO_INTERVAL]
    return "\n".join(lines)


def against_frontier(r: dict[str, Any]) -> str:
    """A run's gap to the best-of-n curve, or past best-of-n's KL its margin over the best point at no
    more KL; n/a where neither was measured."""
    if not r.get("ppo_beyond_best_of_n"):
        return "gap " + frontier_gap(r.get("ppo_gap_gold"), r.get("ppo_gap_gold_low"), r.get("ppo_gap_gold_high"), False)
    margin = r.get("ppo_margin_gold")
    if NA in (num(r.get("ppo_margin_gold_low"), "f"), num(r.get("ppo_margin_gold_high"), "f")):
        return f"beyond; margin {num(margin, '+.2f')}"
    return (f"beyond; margin {num(margin, '+.2f')} ({num(r.get('ppo_margin_gold_low'), '+.2f')} to "
            f"{num(r.get('ppo_margin_gold_high'), '+.2f')})")


def render_stage_resources(root: Path) -> str:
    """docs/guide/benchmarks.md: each committed stage's wall time and peak memory."""
    lines = ["| stage | wall time | peak resident memory | device |", "| --- | --- | --- | --- |"]
    found = False
    for stage in (*dvc_stages(root, "dvc.yaml"), *dvc_stages(root, "compare/dvc.yaml")):
        m = read_json(root, f"outputs/{stage}/metrics.json")
        if m is None:
            continue
        found = True
        runtime = get(read_json(root, f"outputs/{stage}/config.json") or {}, "runtime") or {}
        device = runtime.get("device", "not recorded")
        threads = runtime.get("threads")
        lines.append(f"| {stage} | {num(get(m, 'resources/wall_seconds'), '.0f', ' s')} | "
                     f"{num(get(m, 'resources/peak_rss_gib'), '.2f', ' GiB')} | {device}"
                     f"{f', {threads} threads' if threads else ''} |")
    if not found:
        return "No run is committed in `outputs/` on this commit."
    return "\n".join(lines)


def render_throughput(root: Path) -> str:
    """docs/guide/benchmarks.md: tokens/s, padding and MFU at a real shape, fixed rows against a
    token budget (docs/data/throughput-*.json, written by benchmarks/throughput.py)."""
    out = []
    for path in sorted((root / "docs" / "data").glob("throughput-*.json")):
        r = read_json(root, str(path.relative_to(root)))
        m = r["model"]
        out += [f"{r['machine']}, {r['threads']} threads, torch {r['torch']}: a Llama of hidden size {m['hidden']}, "
                f"{m['layers']} layers, vocabulary {m['vocab']} ({m['non_embedding_params'] / 1e6:.1f}M parameters "
                f"without the embedding), global batches of {r['batch']} examples, {r['lengths']}; median of "
                f"{r['steps']} batches; peak {r['peak_flops'] / 1e9:.0f} GFLOP/s ({r['peak_source']}).", "",
                "| stage | fixed rows: tokens/s | padding | MFU | token budget: tokens/s | padding | MFU | speed-up |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in r["stages"]:
            a, b = row["rows"], row["tokens"]
            out.append(f"| {row['stage']} | {a['tokens_per_second']:.0f} ({row['micro_rows']} rows) | {pct(a['pad_share'], 0)} | "
                       f"{pct(a['mfu'])} | {b['tokens_per_second']:.0f} ({row['budget']} tokens) | "
                       f"{pct(b['pad_share'], 0)} | {pct(b['mfu'])} | {row['speedup']:.2f}x |")
        if "sampler" in r:
            smp = r["sampler"]
            out += ["", f"Our sampler on the same model: {smp['tokens_per_second']:.0f} new tokens/s "
                    f"({smp['prompts']} prompts of those lengths, up to {smp['new_tokens']} new tokens each, one call "
                    f"of {smp['seconds_per_call']:.2f} s)."]
        out.append("")
    return "\n".join(out).strip() or "No throughput measurement is committed."


def render_stage_pairs(root: Path, pattern: str = "stages-compile-*.json") -> str:
    """docs/guide/benchmarks.md: the pipeline's stage wall times on two sides, alternating stage by
    stage (docs/data/stages-*.json, written by benchmarks/stages.py --json): two params files
    (stages-compile-*.json), or this tree against an earlier commit (stages-commits-*.json)."""
    out = []
    for path in sorted((root / "docs" / "data").glob(pattern)):
        r = read_json(root, str(path.relative_to(root)))
        base, head = r["sides"]["base"], r["sides"]["head"]
        out += [f"{r['machine']}, torch threads: {r['threads']}, {r['date']}; `{r['command']}` "
                f"(base: `{base}`, head: `{head}`):", "",
                "| stage | base | head | head/base | same model |", "| --- | --- | --- | --- | --- |"]
        for row in r["rows"]:
            same = "-" if row["head_md5"] == "-" else ("yes" if row["same_model"] else "no")
            out.append(f"| {row['stage']} | {row['base_s']:.1f} s | {row['head_s']:.1f} s | {row['ratio']:.2f} | {same} |")
        t = r["total"]
        out += [f"| total | {t['base']:.1f} s | {t['head']:.1f} s | {t['head'] / t['base']:.2f} | |", ""]
    return "\n".join(out).strip() or "No stage-time comparison is committed."


GPU_CHECK_SUITES = {"1": "1 process (plain PyTorch)", "ds1": "1 process (DeepSpeed ZeRO-2 and ZeRO-3)",
                    "2": "2 processes (DeepSpeed ZeRO-3)"}


def gpu_check_order() -> list[str]:
    """The GPU check's runs by name in the order it runs them (scripts/gpu_check.py's `runs`: the
    stage registry's order), with every variant whether or not its module is installed here, so a
    page renders the same on every machine."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check   # dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    return [r.name for r in gpu_check.runs(gpu_check.SUITES["1"], every_variant=True)]


def render_gpu_check(root: Path) -> str:
    """docs/guide/gpu-check.md: each committed GPU check (docs/data/gpu-check-*.json, the `--out` of
    scripts/gpu_check.py), one table per run and suite."""
    runs = sorted((root / "docs" / "data").glob("gpu-check-*.json"),
                  key=lambda p: (-int(get(read_json(root, f"docs/data/{p.name}") or {}, "size/new_tokens") or 0), p.name))
    if not runs:
        return "The check has not been run on a GPU by the project: no page here quotes a GPU number."
    order = gpu_check_order()
    lines: list[str] = []
    for path in runs:
        d = read_json(root, f"docs/data/{path.name}") or {}
        size, versions = d.get("size", {}), d.get("versions", {})
        for procs, suite in sorted(d.get("suites", {}).items()):
            lines += [f"{d.get('device', 'an unrecorded GPU')}, {GPU_CHECK_SUITES.get(procs, procs)}, "
                      f"{d.get('date', 'undated')} (`{d.get('command', 'scripts/gpu_check.py')}`; torch "
                      f"{versions.get('torch', NA)}, transformers {versions.get('transformers', NA)}): a Llama of "
                      f"{num(get(d, 'model/parameters'), ',.0f')} parameters, {size.get('layers', NA)} layers, "
                      f"{size.get('hidden', NA)} wide, responses of {size.get('new_tokens', NA)} tokens.", "",
                      "| stage | time | memory plan | measured peak | tokens/s | TFLOP/s | log-prob diff, mean / max |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for name, r in sorted(suite.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
                if "error" in r:
                    lines.append(f"| {name} | failed | | | | | |")
                    continue
                rate = num(r.get("tokens_per_second"), ",.0f")
                if "update_tokens_per_second" in r:
                    rate = f"rollout {rate}, update {num(r.get('update_tokens_per_second'), ',.0f')}"
                diff = (f"{num(r.get('val/logprob_diff_mean'), '.1e')} / {num(r.get('val/logprob_diff_max'), '.1e')}"
                        if "val/logprob_diff_mean" in r else "")
                lines.append(f"| {name} | {num(r.get('resources/wall_seconds'), '.1f', ' s')} | "
                             f"{num(r.get('plan_gib'), '.2f', ' GiB')} | {num(r.get('resources/peak_device_gib'), '.2f', ' GiB')} | "
                             f"{rate if r.get('tokens_per_second') is not None else ''} | {num(r.get('tflops'), '.2f') if r.get('tflops') is not None else ''} | {diff} |")
            tag = f"{procs}p " if procs.isdigit() else f"{procs} "   # how the check names a suite's runs
            skipped = [s for s in d.get("skipped", []) if s.startswith(tag)]
            if skipped:
                lines.append(f"\nNot run within the time budget: {', '.join(s.split(' ', 1)[1] for s in skipped)}.")
            lines.append("")
    return "\n".join(lines).rstrip()


def render_hub_rehearsal(root: Path) -> str:
    """docs/guide/own-model-and-data.md: the hub rehearsal (docs/data/hub-rehearsal.json, written by
    `scripts/hub_rehearsal.py run --record`) and its master-weights check
    (docs/data/hub-rehearsal-master-weights.json, `scripts/hub_rehearsal.py master-weights --out`)."""
    d = read_json(root, "docs/data/hub-rehearsal.json")
    if d is None:
        return "The rehearsal has not been recorded: run `scripts/hub_rehearsal.py run --record`."
    base, win = d.get("base", {}), d.get("ppo_vs_sft_gold", {})
    lines = [f"One run ({d.get('date', 'undated')}; {d.get('machine', 'an unrecorded CPU')}, {d.get('threads', NA)} threads, "
             f"{minutes(d['seconds']) if isinstance(d.get('seconds'), (int, float)) else NA} in all with the base's build): "
             f"a base saved in {base.get('saved_dtype', NA)}, {base.get('tokenizer', NA)} with a chat template, "
             f"end ids {base.get('eos_token_id', NA)}, pad token {base.get('pad_token') or 'none'}; SFT and the reward "
             f"model at learning rate {num(get(d, 'lr/sft'), 'g')} and {num(get(d, 'lr/reward'), 'g')}, trained as "
             f"{get(d, 'dtypes/sft/weights') or NA} weights with {get(d, 'dtypes/sft/optimizer_states') or NA} "
             "optimizer states.", "",
             "| policy | gold (95% CI) | KL to SFT, nats |", "| --- | --- | --- |"]
    for name in policies(d.get("gold", {})):
        g = d["gold"][name]
        ci = g.get("ci95")
        lines.append(f"| {policy_label(name)} | {num(g.get('gold'), '.2f')} (± {num(ci, '.2f')}) | {num(g.get('kl'), '.2f')} |")
    lines += ["", f"PPO beats SFT by the gold annotator on {pct(win.get('win_rate'))} of the held-out prompts "
                  f"(95% CI {interval(win.get('low'), win.get('high'))}); the reward model's held-out accuracy is "
                  f"{pct(get(d, 'reward/accuracy'))} ({pct(get(d, 'reward/accuracy_of_ceiling'))} of the noise ceiling)."]
    runs = read_json(root, "docs/data/hub-rehearsal-master-weights.json") or []
    if runs:
        lines += ["", "The recipe's SFT stage from the bf16 base and from its exact fp32 upcast, with each version's code:", "",
                  "| code | base | final train loss | held-out loss | weights moved | weights saved as | same weights as from the upcast |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in runs:
            for kind in ("bf16", "fp32_upcast"):
                k = r.get(kind, {})
                same = ({True: "yes", False: "no"}.get(r.get("identical_weights"), NA)) if kind == "bf16" else ""
                lines.append(f"| {r.get('code', NA)} | {kind.replace('_', ' ')} | {num(k.get('train_loss'), '.4f')} | "
                             f"{num(k.get('eval_loss'), '.4f')} | {pct(k.get('share_of_weights_moved'), 3)} | "
                             f"{k.get('saved_dtype') or NA} | {same} |")
    return "\n".join(lines)


def render_compare_run(root: Path) -> str:
    """docs/guide/methods.md: the committed `make compare` (outputs/compare/metrics.json), one seed per method."""
    m = read_json(root, "outputs/compare/metrics.json")
    if m is None:
        return "No comparison is committed in `outputs/` on this commit (`make compare` writes it)."
    n = get(read_json(root, "outputs/compare/config.json") or {}, "compare/n_prompts") or m.get("n_prompts")
    f = m.get("frontier") if isinstance(m.get("frontier"), dict) else None   # None: a run before the gap
    lines = [f"One run of `make compare`, one seed per method, on {n} held-out prompts:", "",
             "| policy | gold ± 95% CI | beats SFT, gold (95% CI) | beats SFT, RM | RM score | KL to SFT, nats | "
             + ("gold gap to best-of-n (95% CI) | " if f is not None else "")
             + "length, words | stage wall time |",
             "|" + " --- |" * (9 if f is not None else 8)]
    for name in policies(m):
        p, w = m[name], m.get("win_rate", {})
        gap = "" if f is None else ("-" if f"{name}_gap_gold" not in f else frontier_gap(
            f[f"{name}_gap_gold"], f.get(f"{name}_gap_gold_low"), f.get(f"{name}_gap_gold_high"),
            f.get(f"{name}_beyond_best_of_n"))) + " | "
        beats = NA if name == "sft" else \
            f"{pct(w.get(f'{name}_vs_sft_gold'))} ({interval(w.get(f'{name}_vs_sft_gold_low'), w.get(f'{name}_vs_sft_gold_high'))})"
        lines.append(f"| {policy_label(name)} | {num(p.get('gold'), '.2f')} ± {num(p.get('gold_ci95'), '.2f')} | {beats} | "
                     f"{NA if name == 'sft' else pct(w.get(f'{name}_vs_sft_rm'))} | {num(p.get('rm'), '.2f')} | "
                     f"{num(p.get('kl'), '.2f')} | {gap}{num(p.get('length'), '.1f')} | "
                     f"{num(p.get('stage_wall_seconds'), '.0f', ' s') if 'stage_wall_seconds' in p else '-'} |")
    return "\n".join(lines)


def read_tsv(root: Path, rel: str) -> Optional[list[dict[str, str]]]:
    path = root / rel
    if not path.is_file():
        return None
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _float(row: dict[str, str], key: str) -> Optional[float]:
    try:
        value = float(row.get(key) or "nan")
    except ValueError:
        return None
    return None if value != value else value


def _median_range(values: list[Optional[float]], fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    xs = [v * scale for v in values if v is not None]
    if not xs:
        return NA
    return f"{statistics.median(xs):{fmt}}{suffix} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def render_compare_seeds(root: Path) -> str:
    """docs/guide/methods.md: every method over seeds (docs/compare_methods.tsv, benchmarks/compare_methods.py)."""
    rows = read_tsv(root, "docs/compare_methods.tsv")
    if rows is None:
        return "`docs/compare_methods.tsv` is not committed on this commit."
    plain = [r for r in rows if not r.get("sweep")]
    methods = sorted({r["method"] for r in plain}, key=lambda k: (k != "ppo", k))
    seeds = sorted({r["seed"] for r in plain}, key=int)
    lines = [f"`benchmarks/compare_methods.py`, seeds {', '.join(seeds)} of each method; median (range) over seeds:", "",
             "| method | gold | 95% CI half-width | beats SFT, gold | RM score | KL to SFT, nats | length, words | "
             "stage wall time, s | peak memory, GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method in methods:
        rs = [r for r in plain if r["method"] == method]
        col = lambda key: [_float(r, key) for r in rs]   # noqa: E731
        lines.append(f"| {method} | {_median_range(col('gold'), '.2f')} | {_median_range(col('gold_ci95'), '.2f')} | "
                     f"{_median_range(col('gold_win'), '.1f', 100, '%')} | {_median_range(col('rm'), '.2f')} | "
                     f"{_median_range(col('kl'), '.2f')} | {_median_range(col('length'), '.1f')} | "
                     f"{_median_range(col('wall_seconds'), '.0f')} | {_median_range(col('peak_rss_gib'), '.2f')} |")
    return "\n".join(lines)


def render_grpo_sweep(root: Path) -> str:
    """docs/guide/methods.md: GRPO's KL in the loss against where it ends (docs/data/grpo-kl-sweep.json)."""
    d = read_json(root, "docs/data/grpo-kl-sweep.json")
    if d is None:
        return "`docs/data/grpo-kl-sweep.json` is not committed on this commit."
    lines = [f"{d['machine']}, {d['date']}, seed {d['seed']}: {d['what']}.", "",
             "| `grpo.kl_loss_coef` | KL to SFT, nats | gold ± 95% CI | gold gain over SFT ± 95% CI | length, words | threads |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(d["rows"], key=lambda r: r["kl_loss_coef"]):
        lines.append(f"| {r['kl_loss_coef']:g} | {r['kl']:.2f} ± {r['kl_ci95']:.2f} | {r['gold']:.2f} ± {r['gold_ci95']:.2f} | "
                     f"{r['gold_gain']:+.2f} ± {r['gold_gain_ci95']:.2f} | {r['length']:.1f} | {r['threads']} |")
    return "\n".join(lines)


def render_compare_sweeps(root: Path) -> str:
    """docs/guide/methods.md: the sweeps of docs/compare_methods.tsv (DPO and KTO beta, PPO kl_target,
    GRPO kl_loss_coef), each row with its gap to the best-of-n frontier where measured."""
    rows = read_tsv(root, "docs/compare_methods.tsv")
    if rows is None:
        return "`docs/compare_methods.tsv` is not committed on this commit."
    swept = [r for r in rows if r.get("sweep")]
    if not swept:
        return "`docs/compare_methods.tsv` holds no sweep."

    def key(r: dict[str, str]) -> tuple[str, float]:
        name, _, value = r["sweep"].partition("=")
        try:
            return name, float(value)
        except ValueError:
            return name, float("inf")

    # best-of-64's KL (log n - (n-1)/n): a row without a gap past it is beyond the measured range;
    # one inside it was measured before the table had the gap (n/a).
    kl_max = math.log(64) - 63 / 64
    lines = ["| run (seed) | gold ± 95% CI | beats SFT, gold (95% CI) | RM score | KL to SFT, nats | "
             "gold gap to best-of-n (95% CI) | length, words |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(swept, key=key):
        win, low, high = (_float(r, k) for k in ("gold_win", "gold_win_low", "gold_win_high"))
        kl, gap = _float(r, "kl"), _float(r, "gap")
        beyond = gap is None and kl is not None and kl > kl_max
        lines.append(f"| `{r['sweep']}` ({r['seed']}) | {num(_float(r, 'gold'), '.2f')} ± {num(_float(r, 'gold_ci95'), '.2f')} | "
                     f"{pct(win)} ({interval(low, high)}) | {num(_float(r, 'rm'), '.2f')} | {num(kl, '.2f')} | "
                     f"{frontier_gap(gap, _float(r, 'gap_low'), _float(r, 'gap_high'), beyond)} | "
                     f"{num(_float(r, 'length'), '.1f')} |")
    if any(gap_without_interval(_float(r, "gap"), _float(r, "gap_low"), _float(r, "gap_high")) for r in swept):
        lines += ["", NO_INTERVAL]
    return "\n".join(lines)


def render_frontier(root: Path) -> str:
    """docs/guide/overoptimisation.md: the kl_coef sweep snapshot of docs/frontier.md (its table)."""
    path = root / "docs/frontier.md"
    if not path.is_file():
        return "`docs/frontier.md` is not committed on this commit."
    table = [line for line in path.read_text().splitlines() if line.startswith("|")]
    if len(table) < 3:
        raise RenderError("docs/frontier.md: no table")
    head = [c.strip() for c in table[0].strip("|").split("|")]
    need = ("ppo.kl_coef", "KL to SFT", "RM score", "gold score")
    if any(h not in head for h in need):
        raise RenderError(f"docs/frontier.md: its table lacks one of the columns {', '.join(need)}")
    rows = []
    for line in table[2:]:
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
        rows.append(cells)
    rows.sort(key=lambda c: float(c["ppo.kl_coef"]))
    dated = re.search(r"^Snapshot, (\d{4}-\d{2}-\d{2})", path.read_text(), re.M)
    when = dated.group(1) if dated else "an unrecorded date"
    out = [f"The snapshot of {when} (`docs/frontier.md`), one run per value:", "",
           "| `ppo.kl_coef` | KL to SFT, nats | RM score | gold score |", "| --- | --- | --- | --- |"]
    for c in rows:
        vals = [float(c[k]) for k in need[1:]]
        out.append(f"| {c['ppo.kl_coef']} | {vals[0]:.2f} | {vals[1]:.2f} | {vals[2]:.2f} |")
    return "\n".join(out)


def render_stages(root: Path) -> str:
    """docs/architecture.md: every stage of the registry (pipeline/stages/registry.py), in its order:
    its pipeline file, the folders it reads, where it writes and its one line of help, so a new
    stage module is on the page with no edit to it."""
    sys.path.insert(0, str(ROOT))   # this checkout's package: its stages are what the page describes
    from pipeline.stages import registry
    from pipeline.stages.spec import default_path
    lines = ["| stage | pipeline file | reads | writes | what it does |", "| --- | --- | --- | --- | --- |"]
    for name, spec in registry.specs().items():
        where = "dvc.yaml" if spec.pipeline == "default" else "compare/dvc.yaml"
        reads = ", ".join(f"`{default_path(f)}`" for f in spec.inputs) or "params only"
        lines.append(f"| `{name}` (`stages/{name}.py`) | {where} | {reads} | `{spec.output}/` | {spec.help} |")
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[Path], str]] = {
    "headline": render_headline,
    "gpu-check": render_gpu_check,
    "stages": render_stages,
    "seeds": render_seeds,
    "demo": render_demo,
    "stage-resources": render_stage_resources,
    "throughput": render_throughput,
    "stage-pairs": render_stage_pairs,
    "stage-commits": lambda root: render_stage_pairs(root, "stages-commits-*.json"),
    "compare-run": render_compare_run,
    "compare-seeds": render_compare_seeds,
    "compare-sweeps": render_compare_sweeps,
    "grpo-sweep": render_grpo_sweep,
    "frontier": render_frontier,
    "hub-rehearsal": render_hub_rehearsal,
    "ppo-variants": render_ppo_variants,
}


# ---- the pages ------------------------------------------------------------------------------------


def pages(root: Path) -> list[Path]:
    """README.md and docs/guide/*.md, in a fixed order."""
    return [p for p in [root / "README.md", *sorted((root / "docs" / "guide").glob("*.md")), root / "docs" / "architecture.md"]
            if p.is_file()]


def render_text(text: str, root: Path, where: str = "page") -> tuple[str, list[str]]:
    """The text with every block rendered, and the names of the blocks whose body changed."""
    for m in OPENING.finditer(text):
        if m.group(1) not in RENDERERS:
            raise RenderError(f"{where}: unknown rendered block {m.group(1)!r} (known: {', '.join(RENDERERS)})")
    if len(OPENING.findall(text)) != len(BLOCK.findall(text)) or text.count("<!-- /rendered -->") != len(BLOCK.findall(text)):
        raise RenderError(f"{where}: a rendered block is not closed by <!-- /rendered --> (or a closing has no opening)")
    changed: list[str] = []
    cache: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in cache:
            cache[name] = RENDERERS[name](root).rstrip("\n") + "\n"
        if m.group("body") != cache[name]:
            changed.append(name)
        return m.group(1) + cache[name] + m.group(4)

    return BLOCK.sub(sub, text), changed


def render(root: Path, check: bool) -> list[str]:
    """Render every page under `root`; returns `page: block` for each block that differed."""
    differ = []
    for page in pages(root):
        rel = page.relative_to(root).as_posix()
        text = page.read_text()
        new, changed = render_text(text, root, rel)
        differ += [f"{rel}: {name}" for name in changed]
        if not check and new != text:
            page.write_text(new)
    return differ


# ---- numbers written by hand (tests/system/test_docs.py) --------------------------------------------

UNIT = r"(?:%|x|×|s|ms|min|h|seconds?|minutes?|hours?|GiB|MiB|KiB|GB|MB|nats?|tokens/s|TFLOP/s)"
DECIMAL = r"(?<![\w.])\d+(?:,\d{3})*\.\d+"
MEASURED_PROSE = [re.compile(DECIMAL + r"\s?" + UNIT + r"(?![\w/])"),          # 92.5%, 1.78x, 0.55 GiB, 3.4 nats
                  re.compile(r"(?<![\w.])\d+\s?min\s\d+\s?s\b"),               # 25 min 26 s
                  re.compile(r"±\s?\d")]                                         # ± 0.13
MEASURED_TABLE = [re.compile(r"(?<![\w.])\d+(?:,\d{3})*\.\d{2,}(?![\w.])"),              # 0.913 in a table row
                  re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?%")]                    # 92% in a table row


def strip_unmeasured(text: str) -> str:
    """The text without what may hold numbers: rendered blocks, fenced code, HTML comments, inline
    code and link targets (line breaks kept, so line numbers stay)."""
    def blank(m: re.Match) -> str:
        return "\n" * m.group(0).count("\n")
    text = BLOCK.sub(blank, text)
    text = FENCE.sub(blank, text)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.S)
    text = re.sub(r"`[^`]*`", lambda m: "``" + blank(m), text)     # a code span may wrap onto the next line
    return re.sub(r"\]\([^)\s]*\)", "]()", text)


def hand_written_numbers(text: str) -> list[tuple[int, str]]:
    """(line number, number) of each measured-looking number outside rendered blocks: a decimal
    with a unit (%, x, s, min, GiB, nats, ...), `N min N s`, a ± interval, and in a table row also
    a decimal with two or more digits after the point or a percentage. Versions (2.13.0), dates,
    code (fenced or inline, so params values) and link targets are not looked at."""
    hits = []
    for i, line in enumerate(strip_unmeasured(text).splitlines(), 1):
        patterns = MEASURED_PROSE + (MEASURED_TABLE if line.lstrip().startswith("|") else [])
        for pattern in patterns:
            hits += [(i, m.group(0)) for m in pattern.finditer(line)]
    return sorted(set(hits))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 listing the blocks that differ")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to render (default: this one)")
    ap.add_argument("--this-run", action="store_true",
                    help=f"first describe the run in outputs/ in {COMMITTED_RUN}: this machine, its threads, "
                         "date and md5 (after a run of your own, made here)")
    args = ap.parse_args(argv)
    try:
        if args.this_run and not args.check:
            run = describe_this_run(args.root)
            print(f"render_docs: {COMMITTED_RUN}: {run['machine']}, {run['threads']} threads, {run['date']}")
        differ = render(args.root, args.check)
    except RenderError as e:
        print(f"render_docs: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if differ:
            print("render_docs: these rendered blocks differ from their data (run `make docs`):", file=sys.stderr)
            for d in differ:
                print(f"  {d}", file=sys.stderr)
            return 1
        return 0
    for d in differ:
        print(f"render_docs: rewrote {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
