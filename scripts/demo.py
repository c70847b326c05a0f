"""`make demo`: the whole pipeline on a small param set in minutes, beside the committed run.

The measured time is in the README (`make demo`, rendered from docs/data/demo.json).

    make demo                  # seed 0
    make demo SEED=1           # sft.seed, reward.seed, ppo.seed and evaluate.seed set to 1

Copies the tracked files into .demo/seed-<N>/ (ignored by git; replaced by the next demo of that
seed), merges recipes/demo.yaml into its params.yaml (`python -m pipeline recipe demo`), sets the
seeds, and runs `dvc repro` there: the same dvc.yaml, stages and code as `make pipeline` (prepare,
SFT, reward model, PPO, evaluate with its report and verdict). The checkout's own outputs/,
dvc.lock and MLflow store are not touched; MLflow is off for the demo (`make pipeline` tracks).
Ends by printing the verdict, the time and where the report is, and writes demo.json beside it
(what benchmarks/demo_seeds.py collects over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def copy_project(dest: Path) -> None:
    """The tracked files without the committed run (outputs/, dvc.lock), as a git repository."""
    if dest.exists():
        shutil.rmtree(dest)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for rel in filter(None, files.split("\0")):
        if rel.startswith("outputs/") or rel in ("dvc.lock", "compare/dvc.lock") or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    (dest / ".venv").symlink_to(ROOT / ".venv")   # bin/pipeline runs the checkout's environment
    git = ["git", "-c", "user.name=demo", "-c", "user.email=demo@localhost"]
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "demo"]):
        subprocess.run(git + cmd, cwd=dest, check=True, capture_output=True)


def seeded() -> list[str]:
    """The sections whose `seed` a demo seed sets: those of the default pipeline's stages that train
    or measure (the data stay the task's own)."""
    from pipeline.stages import registry
    return [name for name, spec in registry.specs().items() if spec.pipeline == "default" and spec.distributed]


def set_seeds(params: Path, seed: int) -> None:
    from ruamel.yaml import YAML
    yaml = YAML()                      # round trip: the comments stay
    doc = yaml.load(params.read_text())
    for section in seeded():
        doc[section]["seed"] = seed
    with open(params, "w") as f:
        yaml.dump(doc, f)


def summary(repo: Path, seed: int, seconds: float) -> dict:
    ev = json.loads((repo / "outputs/evaluate/metrics.json").read_text())
    rm = json.loads((repo / "outputs/reward/metrics.json").read_text())
    win = ev["win_rate"]
    return {"seed": seed, "seconds": round(seconds, 1), "threads": int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()),
            "win_rate_gold": win["ppo_vs_sft_gold"], "win_rate_gold_low": win["ppo_vs_sft_gold_low"],
            "win_rate_gold_high": win["ppo_vs_sft_gold_high"], "win_rate_rm": win["ppo_vs_sft_rm"],
            "sft_gold": ev["sft"]["gold"], "ppo_gold": ev["ppo"]["gold"], "ppo_kl": ev["ppo"]["kl"],
            "rm_accuracy_of_ceiling": rm["eval"]["accuracy_of_ceiling"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="the seed of every stage (default: 0)")
    ap.add_argument("--dir", type=Path, default=ROOT / ".demo", help="where the demo runs (default: .demo)")
    args = ap.parse_args(argv)
    repo = args.dir / f"seed-{args.seed}"
    start = time.monotonic()
    print(f"demo: copying the project to {repo} (seed {args.seed}, recipes/demo.yaml)", flush=True)
    copy_project(repo)
    py = str(ROOT / ".venv" / "bin" / "python")
    subprocess.run([py, "-m", "pipeline", "recipe", "demo", "--params", "params.yaml"], cwd=repo, check=True,
                   stdout=subprocess.DEVNULL)
    set_seeds(repo / "params.yaml", args.seed)
    env = {**os.environ, "PIPELINE_TRACKING": "off", "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "dvc"), "repro"], cwd=repo, env=env)
    if proc.returncode != 0:
        print(f"demo: dvc repro failed (exit {proc.returncode}) in {repo}", file=sys.stderr)
        return proc.returncode
    seconds = time.monotonic() - start
    result = summary(repo, args.seed, seconds)
    (repo / "demo.json").write_text(json.dumps(result, indent=1) + "\n")
    from pipeline.config import flatten
    from pipeline.stages import evaluate
    metrics = flatten(json.loads((repo / "outputs/evaluate/metrics.json").read_text()), sep="/")
    print(f"\ndemo: {seconds:.0f} s; {evaluate.verdict(metrics, evaluate.detector_record(repo / 'outputs/ppo/model'))}")
    print(f"  PPO gold {result['ppo_gold']:.2f} vs SFT {result['sft_gold']:.2f} (KL {result['ppo_kl']:.1f}); "
          f"reward model at {result['rm_accuracy_of_ceiling']:.0%} of the label-noise ceiling")
    print(f"  report: {repo / 'outputs/evaluate/report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
