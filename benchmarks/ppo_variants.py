"""PPO variants over seeds, each judged by its distance to the same run's best-of-n frontier.

    .venv/bin/python benchmarks/ppo_variants.py --keep /tmp/variants            # every variant, seeds 0:0 1:1 2:2
    .venv/bin/python benchmarks/ppo_variants.py --keep /tmp/variants --variants fixed norm --runs 3:3 4:4
    .venv/bin/python benchmarks/ppo_variants.py --keep /tmp/variants --collect --out docs/data/ppo-variants.json

A variant is a name and the params it changes (VARIANTS). Each one runs through
benchmarks/seed_grid.py with the same work folder, so the runs of one upstream seed share one SFT
model and one reward model whatever the variant, and only PPO and evaluate run again; each variant's
table lands in the work folder as `variant_<name>.json`. `--collect` merges every table found there
(and with `--base` an earlier collected file's variants and runs, but those measured again) into one
file with the machine and each run's date (`make docs` renders it in the decision record that chose
among them), reading a run's `frontier/*` from its evaluate metrics where an older table lacks a
column. Choose on some seeds and confirm on others that no choice used. `--seed-grid NAME` also
writes that variant's runs as benchmarks/seed_grid.py's JSON (the README's seeds table, once the
variant is the default), without wall times: a variant grid trains each upstream seed once for every
variant, so its stage times are not one run's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from seed_grid import FRONTIER  # noqa: E402

# The PPO default before 2026-12-06, which the first variants were measured against: a fixed
# kl_coef with the learning rate decaying to 0 (params.yaml's kl_coef, 0.2).
FIXED = ["ppo.adaptive_kl=false", "ppo.lr_schedule=linear"]
# name -> params changed from params.yaml (as dvc exp run -S); each names every key it depends on,
# so a variant measures the same thing whatever the shipped default is
VARIANTS: dict[str, list[str]] = {
    "fixed": FIXED,
    "norm": [*FIXED, "ppo.normalize_reward=true"],
    "warm": [*FIXED, "ppo.critic_warmup=10"],
    "adapt": ["ppo.adaptive_kl=true", "ppo.kl_target=3.0", "ppo.lr_schedule=linear"],
    "adaptc": ["ppo.adaptive_kl=true", "ppo.kl_target=3.0", "ppo.lr_schedule=constant"],   # the lr never reaches 0
    # adaptc aimed a little lower: KL ends 0.1-0.3 nats past the target, and best-of-64's is 3.17;
    # the default from the adaptive-KL record until the reward stage's restart check
    "adaptc28": ["ppo.adaptive_kl=true", "ppo.kl_target=2.8", "ppo.lr_schedule=constant"],
    # lower still: the committed run's kl_target sweep (docs/compare_methods.tsv) put 2.0 on the curve;
    # the default from the reward stage's restart check (the decision record of that date) until i150
    "adaptc20": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant"],
    # more optimisation at the default's KL target: twice the iterations (and episodes) under the
    # same controller; and twice the rollout batch for half the iterations with the controller's
    # horizon halved in iterations (the same horizon in episodes)
    "i200": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant", "ppo.iterations=200"],
    # the cheaper middle: half the extra iterations, half the extra time; the default since 2026-12-07
    "i150": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant", "ppo.iterations=150"],
    # 100 iterations with a controller three times as fast (kl_coef moves <= 6.7% per
    # iteration, not 2%): the default overshoots to ~4 nats by iteration 20-60 and is still being
    # pulled back at 100; a controller that catches the overshoot early spends the run at the target
    "h3": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant", "ppo.kl_horizon_iterations=3.0"],
    # 100 iterations with twice the actor's learning rate: more movement per iteration at no cost
    "lr2": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant", "ppo.lr=2.0e-4"],
    "b128i50h5": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant",
                  "ppo.rollout_batch_size=128", "ppo.iterations=50", "ppo.kl_horizon_iterations=5.0"],
    # the default's controller started where it ends: kl_coef climbs from 0.2 to 0.8-1.0 over the
    # default's run, and the 40-60 iterations it takes are the overshoot (KL ~4 nats at a 2-nat target)
    "kc08": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant", "ppo.kl_coef=0.8"],
    # the default (i150) with GAE's lambda at 1: the advantage is the return less the critic's value,
    # the critic a baseline only; at 0.95 a response's early tokens lean on the critic's values of
    # later prefixes, and the critic explains little of the return in the first iterations
    "lam1": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant", "ppo.iterations=150",
             "ppo.lam=1.0"],
    # and the other way: lambda 0.9 leans on the critic more (it explains 0.9 of the return's
    # variance from iteration ~20 on)
    "lam09": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant", "ppo.iterations=150",
              "ppo.lam=0.9"],
    # the default (i150) with minibatches of 16 rollouts: twice the optimiser steps per rollout batch
    # at the same forwards and backwards (the micro-batch is 16 rollouts either way)
    "mb16": ["ppo.adaptive_kl=true", "ppo.kl_target=2.0", "ppo.lr_schedule=constant", "ppo.iterations=150",
             "ppo.minibatch_size=16"],
    # the reward as log CDF among k SFT responses, kl_coef 1/(n-1): aimed at best-of-n (quantile_reward.py)
    "bon16": [*FIXED, "ppo.quantile_reward_samples=16", "ppo.kl_coef=0.0667"],
    "bon32": [*FIXED, "ppo.quantile_reward_samples=32", "ppo.kl_coef=0.0323"],
    "bon16s": [*FIXED, "ppo.quantile_reward_samples=16", "ppo.kl_coef=0.0667", "ppo.critic_init=sft"],
    "bon16r": [*FIXED, "ppo.quantile_reward_samples=16", "ppo.kl_coef=0.0667", "ppo.advantage=rloo",
               "ppo.samples_per_prompt=4"],
}
# Every variant without an iteration count of its own was measured at 100 iterations: named, so
# that each still measures what its rows say whatever the default's count becomes
VARIANTS = {name: settings if any(s.startswith("ppo.iterations=") for s in settings)
            else [*settings, "ppo.iterations=100"] for name, settings in VARIANTS.items()}


def run_variant(name: str, runs: list[str], keep: Path) -> None:
    table = keep / f"variant_{name}.json"
    part = keep / f"variant_{name}.{'_'.join(r.replace(':', '-') for r in runs)}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/seed_grid.py"), "--keep", str(keep), "--tag", f"_{name}",
           "--runs", *runs, "--out", str(part)]
    for setting in VARIANTS[name]:
        cmd += ["-S", setting]
    subprocess.run(cmd, check=True)
    merged = json.loads(table.read_text()) if table.exists() else None
    new = json.loads(part.read_text())
    if merged is not None:   # the same variant on more seeds: one table, later runs replacing earlier ones
        seen = {r["run"] for r in new["runs"]}
        new["runs"] = [r for r in merged["runs"] if r["run"] not in seen] + new["runs"]
    table.write_text(json.dumps(new, indent=1, allow_nan=False) + "\n")
    part.unlink()


def collect(keep: Path, out: Path, base: Path | None = None) -> dict:
    """Every variant table of `keep` in one file; with `base` (an earlier --collect's file, e.g. the
    committed docs/data/ppo-variants.json) its variants and runs too, except the (variant, run) pairs
    `keep` measured again. Each run keeps the date it was measured (`date`)."""
    from demo_seeds import machine
    earlier = {v["name"]: v for v in json.loads(base.read_text())["variants"]} if base is not None else {}
    base_date = json.loads(base.read_text()).get("date") if base is not None else None
    variants = []
    for name, settings in VARIANTS.items():
        table = keep / f"variant_{name}.json"
        old = earlier.get(name)
        kept = [{"date": base_date, **r} for r in (old or {}).get("runs", [])]   # a run's own date first
        if not table.exists():
            if old is not None:   # its overrides as VARIANTS names them now (a default made explicit)
                variants.append({**old, "overrides": settings, "runs": kept})
            continue
        measured = json.loads(table.read_text())
        today = measured.get("date") or datetime.date.today().isoformat()
        runs = [{"date": today, **r} for r in measured["runs"]]
        again = {r["run"] for r in runs}
        runs = sorted([r for r in kept if r["run"] not in again] + runs,
                      key=lambda r: [int(x) for x in r["run"].split(":")])
        for r in runs:
            upstream, ppo, threads = r["run"].split(":")
            metrics = keep / f"u{upstream}_p{ppo}_t{threads}_{name}" / "evaluate" / "metrics.json"
            if any(k not in r for k in FRONTIER) and metrics.exists():
                frontier = json.loads(metrics.read_text()).get("frontier", {})
                r.update({k: frontier.get(k) for k in FRONTIER if k not in r})
        variants.append({"name": name, "overrides": settings, "runs": runs})
    dates = [r["date"] for v in variants for r in v["runs"] if r.get("date")]
    result = {"machine": machine(), "date": max(dates, default=datetime.date.today().isoformat()), "variants": variants}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    tmp.replace(out)
    print(f"{out}: {len(variants)} variants")
    return result


def as_seed_grid(result: dict, name: str, out: Path) -> None:
    """The variant `name`'s runs in seed_grid.py's --out JSON, without the stage times."""
    variant = next((v for v in result["variants"] if v["name"] == name), None)
    if variant is None:
        sys.exit(f"--seed-grid: no variant {name!r} measured in this work folder")
    runs = [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in variant["runs"]]
    runs.sort(key=lambda r: [int(x) for x in r["run"].split(":")])
    threads = ",".join(sorted({r["run"].split(":")[2] for r in runs}))
    grid = {"machine": result["machine"], "threads": threads, "date": result["date"],
            "overrides": variant["overrides"], "runs": runs}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(grid, indent=1, allow_nan=False) + "\n")
    tmp.replace(out)
    print(f"{out}: {name}, {len(runs)} runs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, required=True, help="the work folder shared by every variant")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--runs", nargs="+", default=["0:0", "1:1", "2:2"], help="UPSTREAM:PPO[:THREADS] per run")
    ap.add_argument("--collect", action="store_true", help="only merge the variants' tables into --out")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ppo-variants.json"))
    ap.add_argument("--base", type=Path, default=None,
                    help="an earlier --collect's file whose variants and runs the new file keeps (but those measured again)")
    ap.add_argument("--seed-grid", nargs=2, metavar=("NAME", "OUT"), default=None,
                    help="also write variant NAME's runs as seed_grid.py's JSON to OUT")
    args = ap.parse_args()
    if not args.collect:
        for name in args.variants:
            run_variant(name, args.runs, args.keep)
    result = collect(args.keep, args.out, args.base)
    if args.seed_grid:
        as_seed_grid(result, args.seed_grid[0], Path(args.seed_grid[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
