"""The default pipeline over a grid of seeds: does its result hold on every draw?

    .venv/bin/python benchmarks/seed_grid.py                       # 2 upstream x 5 PPO seeds + 2 one-thread runs
    .venv/bin/python benchmarks/seed_grid.py --runs 0:0 0:1 -S ppo.adaptive_kl=false -S ppo.kl_coef=0   # params changed

A run is `UPSTREAM:PPO[:THREADS]`: `sft.seed` and `reward.seed` set to UPSTREAM (they change
together: another SFT model is another starting point for everything after it), `ppo.seed` to PPO,
and the whole run (SFT and RM too) under OMP_NUM_THREADS=THREADS (default 2). One thread changes
the order of floating-point sums, which stands in for another CPU: the same code on another
machine takes another path. Runs that share upstream seed and threads share one SFT and one RM.

Each run executes the stage commands of dvc.yaml in a copy of the tracked files (MLflow off), and
the grid prints and writes (`--out`, default /tmp/seed_grid.tsv) per run: the evaluate stage's gold
and RM win rates of PPO over SFT, gold, RM score and KL to SFT, PPO's gold gap to the best-of-n
frontier at its KL with its interval and whether its KL is past best-of-n's largest, and its margin
over the best gold SFT or a best-of-n reaches at no more KL with its interval (the evaluate stage's
`frontier/*`; empty where not measured), the detector's first alarm, the collapse iteration
(pipeline/measurement/collapse.py: the first PPO iteration, from the one where the rollouts' mean
gold peaked, whose mean gold is below the SFT policy's held-out gold; 0 for none), and the PPO
stage's wall time. Then the median and range.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.measurement.collapse import collapse_iteration, gold_per_iteration  # noqa: E402

# evaluate's `frontier/*` of PPO: its gold gap to the best-of-n frontier (null where not measured)
FRONTIER = ("ppo_gap_gold", "ppo_gap_gold_low", "ppo_gap_gold_high", "ppo_beyond_best_of_n",
            "ppo_margin_gold", "ppo_margin_gold_low", "ppo_margin_gold_high")
DEFAULT_RUNS = [f"{u}:{p}" for u in (0, 1) for p in range(5)] + ["0:0:1", "0:1:1"]
COLUMNS = ["run", "gold_win", "gold_win_low", "gold_win_high", "rm_win", "ppo_gold", "sft_gold", "ppo_rm", "ppo_kl",
           "ppo_gap_gold", "ppo_gap_gold_low", "ppo_gap_gold_high", "ppo_beyond_best_of_n",
           "ppo_margin_gold", "ppo_margin_gold_low", "ppo_margin_gold_high",
           "rm_accuracy", "rm_accuracy_of_ceiling", "detector_first_fire", "collapse_iteration",
           "sft_seconds", "reward_seconds", "ppo_seconds", "evaluate_seconds"]


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for rel in filter(None, files.split("\0")):
        if rel.startswith("outputs/") or rel == "dvc.lock" or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes((ROOT / rel).read_bytes())


def write_params(src: Path, dest: Path, overrides: dict[str, object]) -> None:
    yaml = YAML()
    doc = yaml.load(src.read_text())
    for key, value in overrides.items():
        node, *path, last = [doc, *key.split(".")]
        for part in path:
            node = node[part]
        node[last] = value
    with dest.open("w") as f:
        yaml.dump(doc, f)


def parse_value(text: str) -> object:
    return YAML(typ="safe").load(text)


def stage(cmd: list[str], cwd: Path, threads: int, log: Path) -> float:
    env = {**os.environ, "PIPELINE_TRACKING": "off", "OMP_NUM_THREADS": str(threads),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    t0 = time.perf_counter()
    with log.open("a") as f:
        proc = subprocess.run([sys.executable, "-m", "pipeline", *cmd, "--no-progress"], cwd=cwd, env=env,
                              stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"stage {cmd[0]} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="UPSTREAM:PPO[:THREADS] per run")
    ap.add_argument("-S", dest="set", action="append", default=[], help="params override KEY=VALUE (as dvc exp run -S)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/seed_grid.tsv"),
                    help="per-run table: TSV, or JSON with the machine and date when it ends in .json")
    ap.add_argument("--keep", type=Path, default=None,
                    help="work folder to keep (default: a temporary one); its SFT and RM models are reused")
    ap.add_argument("--tag", default="", help="suffix of the runs' folder names (runs with other -S values)")
    args = ap.parse_args()
    overrides = dict((k, parse_value(v)) for k, v in (s.split("=", 1) for s in args.set))
    runs = [tuple(int(x) for x in (r.split(":") + ["2"])[:3]) for r in args.runs]

    work = args.keep or Path(tempfile.mkdtemp(prefix="seed_grid."))
    copy_tree(work)
    log = work / "grid.log"
    write_params(work / "params.yaml", work / "params_prepare.yaml", overrides)   # a `data` override counts
    stage(["prepare", "--params", "params_prepare.yaml", "--out", "data/prepared"], work, 2, log)
    rows = []
    for upstream, ppo_seed, threads in runs:
        name = f"u{upstream}_p{ppo_seed}_t{threads}{args.tag}"
        up = work / f"up_u{upstream}_t{threads}"
        params = work / f"params_{name}.yaml"
        write_params(work / "params.yaml", params, {**overrides, "sft.seed": upstream, "reward.seed": upstream,
                                                    "ppo.seed": ppo_seed})
        common = ["--params", str(params), "--data", "data/prepared"]
        if not (up / "reward" / "model").is_dir():
            sft_s = stage(["sft", *common, "--out", str(up / "sft")], work, threads, log)
            reward_s = stage(["reward", *common, "--sft", str(up / "sft/model"), "--out", str(up / "reward")],
                             work, threads, log)
            upstream_seconds = {"sft": round(sft_s, 1), "reward": round(reward_s, 1)}
            (up / "seconds.json").write_text(json.dumps(upstream_seconds))
        upstream_seconds = json.loads((up / "seconds.json").read_text()) if (up / "seconds.json").exists() else {}
        out = work / name
        models = ["--sft", str(up / "sft/model"), "--reward", str(up / "reward/model")]
        seconds = stage(["ppo", *common, *models, "--out", str(out / "ppo")], work, threads, log)
        eval_seconds = stage(["evaluate", *common, *models, "--ppo", str(out / "ppo/model"),
                              "--out", str(out / "evaluate")], work, threads, log)
        ev = json.loads((out / "evaluate/metrics.json").read_text())
        ppo = json.loads((out / "ppo/metrics.json").read_text())
        rm = json.loads((up / "reward/metrics.json").read_text())["eval"]
        get = lambda d, path: d[path.split("/")[0]][path.split("/")[1]]   # noqa: E731
        row = {"run": f"{upstream}:{ppo_seed}:{threads}", "gold_win": get(ev, "win_rate/ppo_vs_sft_gold"),
               "gold_win_low": get(ev, "win_rate/ppo_vs_sft_gold_low"),
               "gold_win_high": get(ev, "win_rate/ppo_vs_sft_gold_high"),
               "rm_win": get(ev, "win_rate/ppo_vs_sft_rm"), "ppo_gold": get(ev, "ppo/gold"),
               "sft_gold": get(ev, "sft/gold"), "ppo_rm": get(ev, "ppo/rm"), "ppo_kl": get(ev, "ppo/kl"),
               **{k: ev.get("frontier", {}).get(k) for k in FRONTIER},
               "rm_accuracy": rm["accuracy"], "rm_accuracy_of_ceiling": rm["accuracy_of_ceiling"],
               "detector_first_fire": ppo.get("detector", {}).get("first_fire", ""),
               "collapse_iteration": collapse_iteration(gold_per_iteration(out / "ppo/train.tsv"), get(ev, "sft/gold")),
               "sft_seconds": upstream_seconds.get("sft"),
               "reward_seconds": upstream_seconds.get("reward"),
               "ppo_seconds": round(seconds, 1), "evaluate_seconds": round(eval_seconds, 1)}
        rows.append(row)
        print("\t".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS), flush=True)
    if args.out.suffix == ".json":   # with the machine and date, for the pages that render it (make docs)
        import datetime

        from demo_seeds import machine
        threads = sorted({r["run"].split(":")[2] for r in rows})
        result = {"machine": machine(), "threads": ",".join(threads), "date": datetime.date.today().isoformat(),
                  "overrides": args.set, "runs": rows}
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
        tmp.replace(args.out)
    else:
        with args.out.open("w") as f:
            w = csv.DictWriter(f, COLUMNS, delimiter="\t")
            w.writeheader()
            w.writerows(rows)
    for col in ("gold_win", "rm_win", "ppo_gold", "ppo_rm", "ppo_kl", "ppo_gap_gold", "ppo_margin_gold"):
        xs = [r[col] for r in rows if isinstance(r[col], (int, float)) and not isinstance(r[col], bool)]
        if not xs:   # the gap: not measured (PPO past best-of-n's KL on every run)
            continue
        print(f"{col:10s} median {statistics.median(xs):.3f}  range {min(xs):.3f} .. {max(xs):.3f}")
    print(f"work folder: {work}; table: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
