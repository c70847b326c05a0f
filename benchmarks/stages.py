"""The default pipeline end to end: wall time of each stage, on a fresh copy of this checkout.

    .venv/bin/python benchmarks/stages.py

Copies the tracked files to a temporary folder and runs every stage command of dvc.yaml in order
(the commands `dvc repro` runs), timing each; MLflow is off so only the stage's own work counts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.workflow import stage_graph  # noqa: E402


def main() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    env = {**os.environ, "PIPELINE_TRACKING": "off", "PIPELINE_PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    total = 0.0
    print(f"default pipeline, stage wall times ({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory() as tmp:
        for rel in filter(None, files.split("\0")):
            if rel.startswith("outputs/") or rel == "dvc.lock":
                continue
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, Path(tmp) / rel)     # keeps bin/pipeline executable
        for stage in stage_graph.load(Path(tmp) / "dvc.yaml"):
            cmd = shlex.split(stage.cmd) + ["--no-progress"]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-3000:])
                return 1
            total += seconds
            print(f"  {stage.name:9s} {seconds:7.1f} s")
    print(f"  {'total':9s} {total:7.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
