"""Two nodes for real: two launches of a stage command on this host, as nodes 0 and 1 of a two-node
job (`num_nodes: 2`, one process each, `--node-rank`, master 127.0.0.1, gloo), rendezvous and train
SFT, the reward model and PPO at ZeRO-2 and ZeRO-3. Each run equals, bit for bit, the one-node
run with two processes: the same two ranks doing the same sums in the same order; only how they
were started differs. (On two real hosts with different CPUs the bits could differ; the maths
would not.)"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY, free_port, merge, run_env, write_params
from test_distributed import stage, tsv

TIMING = ("time/", "tokens_per_second", "seconds")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Prepared tiny data and single-process SFT and RM runs, the inputs of the RM and PPO runs."""
    root = tmp_path_factory.mktemp("nodes")
    base = root / "plain.yaml"
    write_params(base, TINY)
    subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--params", str(base), "--out", "data"],
                   cwd=root, env={**run_env(), "PYTHONPATH": str(REPO)}, check=True, capture_output=True)
    stage("sft", base, root, "sft")
    stage("reward", base, root, "rm")
    return root


def _params(root: Path, name: str, dist: dict) -> Path:
    path = root / f"{name}.yaml"
    write_params(path, merge(TINY, {"distributed": {"backend": "deepspeed", "master_port": free_port(), **dist}}))
    return path


def two_nodes(name: str, params: Path, root: Path, out: str) -> list[str]:
    """The stage command twice at once, as node 1 and node 0 (each starts torchrun with one process);
    what each printed."""
    with_rm = ["--data", "data", "--sft", "sft/model", "--reward", "rm/model"]
    paths = {"sft": ["--data", "data"], "reward": ["--data", "data", "--sft", "sft/model"], "ppo": with_rm}[name]
    cmd = [sys.executable, "-m", "pipeline", name, "--params", str(params), *paths, "--out", out, "--no-progress",
           "--master-addr", "127.0.0.1"]
    env = {**run_env(), "PYTHONPATH": str(REPO)}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    procs = [subprocess.Popen([*cmd, "--node-rank", str(rank)], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    printed = []
    for proc in procs:
        out_, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} node: exit {proc.returncode}\n{out_[-2000:]}\n{err[-4000:]}"
        printed.append(out_ + err)
    return printed


def _md5(folder: Path) -> str:
    return hashlib.md5((folder / "model.safetensors").read_bytes()).hexdigest()


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(t in k for t in TIMING)} for row in tsv(path)]


@pytest.mark.parametrize("zero", [2, 3])
def test_two_nodes_train_sft_rm_and_ppo_as_one_node_of_two_processes_does(root, zero, monkeypatch):
    # torchrun sets OMP_NUM_THREADS=1 for its processes only when it starts several per node: the
    # one-node run would train at 1 thread and the two-node run (one process per node) at all cores,
    # which changes PPO's float sums. Both at 1 thread, as the test workers run.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = _params(root, f"one_z{zero}", {"zero_stage": zero, "num_processes": 2})
    two = _params(root, f"two_z{zero}", {"zero_stage": zero, "num_processes": 1, "num_nodes": 2})
    for name in ("sft", "reward", "ppo"):
        a, b = f"{name}_one_node_z{zero}", f"{name}_two_nodes_z{zero}"
        assert "launching 2 processes" in stage(name, one, root, a).stdout
        node1, node0 = two_nodes(name, two, root, b)
        for printed, rank in ((node0, 0), (node1, 1)):
            assert f"--nnodes=2 --node_rank={rank} --master_addr=127.0.0.1" in printed, printed[-2000:]
        assert f"{name}: wrote {b}" in node0 and f"{name}: wrote" not in node1   # rank 0 writes, on node 0
        assert _md5(root / a / "model") == _md5(root / b / "model"), f"{name} ZeRO-{zero}"
        assert _rows(root / a / "train.tsv") == _rows(root / b / "train.tsv"), f"{name} ZeRO-{zero}"
        rows = _rows(root / b / "train.tsv")   # they trained: the comparison is not of two untouched models
        assert len(rows) >= 3 and rows[0] != rows[-1]
