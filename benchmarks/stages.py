"""The default pipeline end to end: wall time of each stage, and with `--base` the same stages of
another commit beside it, with the ratio of each stage's time and whether its model is identical.

    .venv/bin/python benchmarks/stages.py                   # this checkout's tracked files
    .venv/bin/python benchmarks/stages.py --base a602a5f    # ... and a602a5f's, stage by stage
    .venv/bin/python benchmarks/stages.py --params A.yaml --vs-params B.yaml   # one tree, two params files

Copies the tracked files (this working tree's, and `git archive` of the base) to temporary
folders and runs every stage command of dvc.yaml in order (the commands `dvc repro` runs), timing
each; MLflow is off so only the stage's own work counts. With a base, the two sides alternate stage
by stage (base, then this tree), so a machine whose speed drifts over the run drifts for both
alike; each model's safetensors files are hashed (md5) on both sides. `--out FILE.tsv` writes the
table. `--params FILE` runs another params file (a small one makes the script a quick check);
`--vs-params FILE` runs this tree twice, once with each params file, alternating stage by stage
as with a base (what a param such as `distributed.compile` costs or saves). `--json FILE` writes
the table with the machine, the thread count and the date.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from demo_seeds import machine  # noqa: E402
from pipeline.files import atomic_write_text  # noqa: E402
from pipeline.workflow import stage_graph  # noqa: E402


def copy_tree(dest: Path, base: str | None) -> None:
    """The tracked files of this working tree (base None) or of commit `base`, without the
    committed run's outputs."""
    if base is None:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        for rel in filter(None, files.split("\0")):
            if (ROOT / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)     # keeps bin/pipeline executable
    else:
        archive = subprocess.run(["git", "archive", base], cwd=ROOT, capture_output=True, check=True).stdout
        # The "tar" filter (no absolute paths, nothing outside dest) where this Python has filters
        # (3.11.4 and later; Debian 12's 3.11.2 has none). The archive is git's of our own commit.
        safe = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, **safe)
    shutil.rmtree(dest / "outputs", ignore_errors=True)
    (dest / "dvc.lock").unlink(missing_ok=True)


def model_md5(folder: Path) -> str:
    """md5 of the model's weights (every safetensors file, in name order); '-' without a model."""
    files = sorted((folder / "model").glob("*.safetensors"))
    if not files:
        return "-"
    digest = hashlib.md5()
    for f in files:
        digest.update(f.read_bytes())
    return digest.hexdigest()


def run_stage(tree: Path, cmd: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(shlex.split(cmd) + ["--no-progress"], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def head_label(args: argparse.Namespace) -> str:
    """What the head side ran: beside a base commit, this tree's commit (with "+ uncommitted
    changes" when it has some), so the file says which two commits it timed."""
    if not args.base:
        return str(args.vs_params or args.params or "params.yaml")
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{git('rev-parse', '--short', 'HEAD')}{dirty}" + (f" with {args.params}" if args.params else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="a commit to run beside this working tree, stage by stage")
    ap.add_argument("--params", type=Path, help="a params file to run instead of each tree's params.yaml")
    ap.add_argument("--vs-params", type=Path, help="run this tree a second time with this params file")
    ap.add_argument("--out", type=Path, help="write the table here (TSV)")
    ap.add_argument("--json", type=Path, help="write the table, machine and date here (JSON)")
    args = ap.parse_args()
    if args.base and args.vs_params:
        ap.error("--base and --vs-params: one comparison at a time")
    env = {**os.environ, "PIPELINE_TRACKING": "off", "PIPELINE_PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    sides = ["base", "head"] if args.base or args.vs_params else ["head"]
    threads = os.environ.get("OMP_NUM_THREADS", f"all {os.cpu_count()}")
    print(f"default pipeline, stage wall times ({os.cpu_count()} CPUs, torch threads: {threads})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {side: Path(tmp) / side for side in sides}
        for side, tree in trees.items():
            copy_tree(tree, args.base if side == "base" else None)
            params = args.vs_params if side == "head" and args.vs_params else args.params
            if params is not None:
                shutil.copy2(params, tree / "params.yaml")
        for stage in stage_graph.load(trees["head"] / "dvc.yaml"):
            row = {"stage": stage.name}
            for side, tree in trees.items():
                # each side its own torch.compile cache, empty at its first stage: a first run's cost
                row[f"{side}_s"] = run_stage(tree, stage.cmd, {**env, "TORCHINDUCTOR_CACHE_DIR": str(tree / ".inductor")})
                row[f"{side}_md5"] = model_md5(tree / "outputs" / stage.name)
            if len(sides) == 2:
                row["ratio"] = row["head_s"] / row["base_s"]
                row["same_model"] = row["head_md5"] == row["base_md5"]
                print(f"  {stage.name:9s} base {row['base_s']:7.1f} s  head {row['head_s']:7.1f} s  "
                      f"head/base {row['ratio']:.3f}  model {'identical' if row['same_model'] else 'DIFFERENT'}"
                      f" ({row['head_md5']})", flush=True)
            else:
                print(f"  {stage.name:9s} {row['head_s']:7.1f} s  model {row['head_md5']}", flush=True)
            rows.append(row)
    total = {side: sum(r[f"{side}_s"] for r in rows) for side in sides}
    print("  total     " + "  ".join(f"{side} {total[side]:7.1f} s" for side in sides)
          + (f"  head/base {total['head'] / total['base']:.3f}" if len(sides) == 2 else ""))
    if args.out is not None:
        columns = list(rows[0])
        args.out.write_text("\t".join(columns) + "\n" + "".join(
            "\t".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns) + "\n" for r in rows))
    if args.json is not None:
        atomic_write_text(args.json, json.dumps({
            "machine": machine(), "threads": threads, "date": time.strftime("%Y-%m-%d"),
            "command": "benchmarks/stages.py " + " ".join(sys.argv[1:]),
            "sides": {"base": str(args.base or args.params or "params.yaml"),
                      "head": head_label(args)} if len(sides) == 2 else None,
            "rows": rows, "total": total}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
