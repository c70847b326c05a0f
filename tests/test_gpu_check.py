"""The GPU check on CPU: scripts/gpu_check.sh --tiny runs the check's own code path and prints every
field the GPU run reports; scripts/gpu_wheels.sh carries everything the GPU machine lacks.

The wheel lists are read from the script itself: every third-party module that the check's code
imports (at any depth, imports inside functions too) must be on the GPU machine or carried, and
every requirement of a carried wheel must be met there by a carried wheel or, where the machine's
version is known, by that version."""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import REPO, run_env
from pipeline.workflow import code_deps

WHEELS_SCRIPT = REPO / "scripts" / "gpu_wheels.sh"
# The GPU machine's interpreter, for requirement markers (KINDS.md: Python 3.12 on x86-64 Linux).
MACHINE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def script_block(name: str) -> str:
    match = re.search(rf'^{name}="(.*?)"$', WHEELS_SCRIPT.read_text(), re.S | re.M)
    assert match, f"{WHEELS_SCRIPT}: no {name}=\"...\" block"
    return match.group(1)


def machine_packages() -> set[str]:
    return {canonicalize_name(n) for n in script_block("MACHINE_PACKAGES").split()}


def machine_versions() -> dict[str, Version]:
    return {canonicalize_name(n): Version(v) for n, v in (item.split("==") for item in script_block("MACHINE_VERSIONS").split())}


def carried() -> dict[str, str]:
    """Carried distribution -> how it is fetched (build, pure, binary)."""
    return {canonicalize_name(line.split()[0]): line.split()[1]
            for line in script_block("WHEELS").splitlines() if line.strip()}


def pins() -> dict[str, Version]:
    lines = (REPO / "requirements.lock").read_text().splitlines()
    return {canonicalize_name(n): Version(v) for n, v in (line.split("==") for line in lines if "==" in line)}


def third_party_imports(entry: Path) -> dict[str, set[str]]:
    """Top-level third-party module -> the project files importing it, over every project file
    that `entry` reaches (code_deps follows imports inside functions too)."""
    todo, seen, found = {entry}, set(), {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "pipeline":
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
        todo |= code_deps.imports(REPO, path) - seen
    return found


def uncovered(modules: set[str], machine: set[str], carry: set[str]) -> list[str]:
    """Modules whose distribution is neither on the machine nor carried."""
    dists = md.packages_distributions()
    missing = []
    for module in sorted(modules):
        names = {canonicalize_name(d) for d in dists.get(module, [module])}
        if not names & (machine | carry):
            missing.append(f"{module} ({', '.join(sorted(names))})")
    return missing


def unmet_requirements(carry: set[str], machine: set[str], versions: dict[str, Version],
                       pinned: dict[str, Version]) -> list[str]:
    """Requirements (for the machine's Python, no extras) of the carried wheels, as our pinned
    versions declare them, that the machine plus the carried wheels do not meet."""
    problems = []
    for dist in sorted(carry):
        for text in md.requires(dist) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(MACHINE_ENV):
                continue
            name = canonicalize_name(req.name)
            have = pinned.get(name) if name in carry else versions.get(name)
            if name not in carry and name not in machine:
                problems.append(f"{dist} needs {req}: not on the machine and not carried")
            elif have is not None and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist} needs {req}: {'carried' if name in carry else 'the machine has'} {have}")
    return problems


def test_every_import_of_the_check_is_on_the_gpu_machine_or_carried():
    modules = third_party_imports(REPO / "scripts" / "gpu_check.py")
    # What the check really reaches (a sanity check on the walk itself): DeepSpeed from the engines,
    # ruamel from the params loader, the plan module's psutil.
    assert {"torch", "transformers", "deepspeed", "ruamel", "tokenizers", "safetensors", "psutil"} <= set(modules)
    assert "pipeline/training/engines.py" in modules["deepspeed"]
    assert uncovered(set(modules), machine_packages(), set(carried())) == []
    # The check can fail: without the carried ruamel.yaml the params loader's import is reported.
    assert uncovered(set(modules), machine_packages(), set(carried()) - {"ruamel-yaml"}) == ["ruamel (ruamel-yaml)"]


def test_carried_wheels_requirements_are_met_there_and_pinned_here():
    carry, pinned = carried(), pins()
    assert set(carry) <= set(pinned), f"carried without a pin in requirements.lock: {set(carry) - set(pinned)}"
    # Our pins are what .venv holds, so their metadata is the carried wheels' metadata.
    for dist in carry:
        assert Version(md.version(dist)) == pinned[dist], dist
    assert carry["deepspeed"] == "build" and carry["pydantic-core"] == "binary"
    assert unmet_requirements(set(carry), machine_packages(), machine_versions(), pinned) == []
    # It can fail: an older huggingface-hub there would not meet transformers 5.24's >= 1.31, and
    # without hjson carried, DeepSpeed's requirement would be unmet.
    older = {**machine_versions(), "huggingface-hub": Version("1.20.0")}
    assert any(p.startswith("transformers needs huggingface-hub") for p in
               unmet_requirements(set(carry), machine_packages(), older, pinned))
    assert unmet_requirements(set(carry) - {"hjson"}, machine_packages(), machine_versions(), pinned) == \
        ["deepspeed needs hjson: not on the machine and not carried"]


def test_transformers_is_carried_because_the_machines_version_drops_our_cache_argument():
    # pipeline/models/generation.py passes the KV cache as `cache=`, the name transformers took after
    # 5.17 (which calls it past_key_values and ignores an unknown keyword): the machine's 5.17 would
    # sample from a model that forgets the prompt. So our pin travels, and must be newer than 5.17.
    text = (REPO / "pipeline" / "models" / "generation.py").read_text()
    assert "cache=cache" in text
    assert machine_versions()["transformers"] == Version("5.17.0")
    assert "transformers" in carried() and pins()["transformers"] > Version("5.17.0")


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_flops_and_the_plan_comparison_by_hand():
    check = load_check()
    # N = 1e9, 10 prompt + 20 generated tokens over the batch, 4 models scored, 1 epoch.
    flops = check.model_flops(1e9, 10, 20, 4, 1)
    assert flops == {"rollout": 2e9 * 30, "scoring": 4 * 2e9 * 30, "update": 2 * 6e9 * 30}
    plan = {"trained": 2.0, "frozen": 1.0, "placed": 3.0, "total": 8.0}
    lines = check.comparison(plan, {"placed_trained": 1.0, "peak": 10.0}, "test")
    assert "plan     2.000  measured     1.000  measured/plan 0.50" in lines[1]
    assert "measured n/a" in lines[2] and "measured/plan 1.25" in lines[4]
    # Without the plan module (the hook): every plan cell says n/a, measured ones still print.
    assert all("plan n/a" in line for line in check.comparison(None, {"peak": 1.0}, "test")[1:])


def test_install_wheels_without_wheels_is_one_clear_line(tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--install-wheels", str(tmp_path)], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout.strip() == (f"gpu_check: {tmp_path}: no wheels; run 'bash scripts/gpu_wheels.sh {tmp_path}' "
                                   "first and carry it")


def test_tiny_check_runs_the_gpu_code_path_and_prints_every_field(tmp_path):
    out = tmp_path / "results.json"
    env = {**run_env(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--tiny", "--iterations", "2", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: done" in text and "gpu_check: exit 0" in text
    # The memory plan of the CLI's code for this config, then the comparison with what was measured.
    assert "memory plan (python -m pipeline plan --params" in text
    for row in ("weights", "grads", "optimizer", "frozen", "activations", "kv_cache", "total", "device memory"):
        assert re.search(rf"^  {row}\s+\d+\.\d{{4}}", text, re.M), row
    assert re.search(r"^  peak over an iteration\s+plan\s+\d+\.\d+\s+measured\s+\d+\.\d+\s+measured/plan", text, re.M)
    # One iteration per recompute mode, each with throughput, the mismatch and the first ratio.
    for it, mode in ((1, "on"), (2, "off")):
        line = next(line for line in text.splitlines() if line.startswith(f"iteration {it}: recompute {mode},"))
        for field in ("rollout", "update", "tok/s", "TFLOP/s", "logprob_diff mean", "first minibatch |ratio - 1|"):
            assert field in line, (field, line)
    assert re.search(r"^recompute on : val/logprob_diff_mean \S+, val/logprob_diff_max \S+, first minibatch", text, re.M)
    assert re.search(r"^recompute off: val/logprob_diff_mean", text, re.M)

    results = json.loads(out.read_text())
    on, off = results["iterations"]
    assert (on["recompute"], off["recompute"]) == ("on", "off") and results["precision"] == "fp32"
    # fp32 on this CPU: the KV-cached sampler and the training forward agree (~1e-7), and with
    # recompute the ratio before the first update is 1 (both forwards are the same arithmetic).
    for r in (on, off):
        assert 0 <= r["val/logprob_diff_max"] < 1e-5 and r["tokens_per_second/rollout"] > 0
    assert on["val/first_ratio_max_dev"] < 1e-6 and off["val/first_ratio_max_dev"] < 1e-5
    plan = results["plan_gib"]
    rows = ("weights", "grads", "optimizer", "frozen")
    assert abs(plan["total"] - sum(plan[k] for k in rows) - max(plan["activations"], plan["kv_cache"])) < 1e-9
    assert plan["device_source"] == "available RAM" and plan["total"] < plan["device"]
    assert results["measured_gib"]["peak"] > 0 and results["measured_gib"]["placed_all"] > 0
