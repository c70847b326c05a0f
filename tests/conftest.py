"""Shared fixtures: tiny params and a throwaway git+DVC copy of this repository."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

# MLflow off unless a test turns it on (tests/unit/test_tracking.py does, against its own stores),
# so in-process stage runs never write the workspace's mlflow.db.
os.environ.setdefault("PIPELINE_TRACKING", "off")

# Under pytest-xdist (make test runs two workers on this 2-core machine) each worker and the stage
# processes it starts run torch at one thread: two processes at two OpenMP threads each on two cores
# spin against each other and run many times slower. Set here, before any test module imports torch;
# a test comparing bits with another run checks that both ran at the same count (TinyRun.threads).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

# tests/ holds three tiers (unit/, stages/, system/) and their helper modules in helpers/. pytest
# puts tests/ on sys.path for this file and each test file's own folder for it, never helpers/; the
# tests import the helpers by their bare names (`import fake_device`), so helpers/ goes on the path
# here, before any test module loads.
HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

# The fake accelerator of the device-discipline tests (tests/helpers/fake_device.py) must be
# registered before the first backward pass of the process: autograd sizes its device queues once,
# at that pass.
import fake_device  # noqa: E402

fake_device.install()

# Rendezvous ports are never fixed numbers: the test workers run process groups side by side, and two
# groups meeting on one port wreck each other (the symptom is an abort at exit, far from the cause).
# The pipeline's own pick of a free port serves (it is what a launcher-less stage uses).
from pipeline.training.distributed import _free_port as free_port  # noqa: E402,F401

import pipeline.stages  # noqa: E402
from pipeline import config  # noqa: E402
from pipeline.config import SFTConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Small enough that a whole `dvc repro` takes seconds; the structure is the default's.
TINY = {
    "data": {"n_sft": 64, "n_sft_eval": 16, "n_pairs": 48, "n_pairs_eval": 16, "n_ppo_prompts": 16,
             "n_eval_prompts": 8, "n_val_pairs": 32},
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
    "sft": {"epochs": 1.0, "batch_size": 16, "eval_every": 2, "n_eval_generations": 8,
            "sampling": {"max_new_tokens": 16}},
    "reward": {"epochs": 1.0, "batch_size": 16, "eval_every": 2, "n_sft_samples": 8},
    "ppo": {"iterations": 3, "rollout_batch_size": 8, "minibatch_size": 4, "micro_batch_size": 2, "ppo_epochs": 2,
            "save_every": 2, "n_eval_prompts": 8, "sampling": {"max_new_tokens": 12}},
    "evaluate": {"n_prompts": 8, "best_of_n": [2, 3], "bootstrap": 200, "n_samples_shown": 3},
    # compare/dvc.yaml's methods
    "dpo": {"batch_size": 16, "epochs": 1.0, "eval_every": 2, "save_every": 2, "n_eval_prompts": 8},
    "grpo": {"iterations": 3, "rollout_batch_size": 8, "minibatch_size": 4, "micro_batch_size": 2, "ppo_epochs": 2,
             "save_every": 2, "n_eval_prompts": 8, "sampling": {"max_new_tokens": 12}},
    "rs": {"n": 2, "n_prompts": 8, "batch_size": 8, "epochs": 1.0, "eval_every": 2, "save_every": 2,
           "n_eval_prompts": 8, "sampling": {"max_new_tokens": 12}},
    "kto": {},   # its defaults: the tiny data's pairs make a few steps
    "compare": {"n_prompts": 8, "best_of_n": [2], "bootstrap": 200},
}


def _tiny_methods() -> None:
    """A training stage TINY does not list (a method added later) at these sizes, each set where its
    params section has the key, so its tiny pipeline runs in seconds with no entry above."""
    import dataclasses
    from pipeline.config import Params
    from pipeline.stages import registry
    sizes = {"batch_size": 8, "epochs": 1.0, "eval_every": 2, "save_every": 2, "n_eval_prompts": 8, "n_prompts": 8,
             "samples_per_prompt": 2, "sampling": {"max_new_tokens": 12}}
    for name in registry.training():
        if name not in TINY:
            keys = {f.name for f in dataclasses.fields(getattr(Params(), name))}
            TINY[name] = {k: v for k, v in sizes.items() if k in keys}


_tiny_methods()


def slurm_available() -> tuple[bool, str]:
    """(a SLURM cluster answers here, why not). The tests never set one up: installing slurm-wlm
    and writing /etc/slurm/slurm.conf change the system, which `make slurm-setup` does on request."""
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        ping = None
    if ping is not None and "is UP" in ping.stdout:
        return True, ""
    return False, ("SLURM tier: no SLURM cluster answers `scontrol ping` "
                   "(`make slurm-setup` starts one here, as root)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The order in which the workers take whole files (`make test` runs pytest-xdist with
    `--dist loadfile --no-loadscope-reorder`): the SLURM tier's files first, then the files with
    the most `long` tests (whole pipelines for a minute or more), then system/, stages/ and unit/, in
    each the files with more tests first. The SLURM tests spend minutes waiting on the cluster
    (scheduling, a one-minute time limit, retries) with one CPU busy at most: started first, those
    waits overlap the other workers' work instead of ending the run alone. Long files next, for the
    same reason: a worker that takes one near the end runs it alone while the others stand idle; the
    short unit files fill the end."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    slurm = {path for path, tests in files.items() if any(t.get_closest_marker("slurm") for t in tests)}
    long = {path: sum(t.get_closest_marker("long") is not None for t in tests) for path, tests in files.items()}
    tiers = {"system": 0, "stages": 1, "unit": 2}
    order = sorted(files, key=lambda path: (path not in slurm, -long[path], tiers.get(path.parent.name, 3),
                                            -len(files[path])))
    items[:] = [item for path in order for item in files[path]]


def tier_unavailable(tier: str, why: str) -> None:
    """Skip a test of `tier` with its reason, or fail it where PIPELINE_TESTS_REQUIRE names the tier
    (CI, whose machine can run it): there a tier that cannot run fails instead of hiding."""
    if tier in os.environ.get("PIPELINE_TESTS_REQUIRE", "").split(","):
        label = {"slurm": "SLURM"}.get(tier, tier)
        pytest.fail(f"{why} (PIPELINE_TESTS_REQUIRE names {tier}: this machine must run the {label} tier)")
    pytest.skip(why)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The `slurm` tier runs where a cluster answers (`make slurm-setup`), the `root` tier as root;
    elsewhere they are skipped with their reason (`tier_unavailable`)."""
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        tier_unavailable("root", "root tier: needs root (it mounts a small tmpfs)")
    if item.get_closest_marker("slurm") is None:
        return
    ok, why = slurm_available()
    if not ok:
        tier_unavailable("slurm", why)


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def flat(nested: dict, prefix: str = "") -> dict:
    """metrics.json as `{"train/loss": ...}`: the names the stages and MLflow use."""
    from pipeline.config import flatten
    return flatten(nested, prefix, sep="/")


# What differs between two runs of the same work: how long they took and what their processes cost.
TIME_KEYS = ("seconds", "time", "tokens_per_second", "peak_rss", "resources")


def without_time(metrics: dict) -> dict:
    """metrics.json's values (flat names) but TIME_KEYS'."""
    return {k: v for k, v in metrics.items() if not any(t in k for t in TIME_KEYS)}


def step_rows(path: Path) -> list[dict]:
    """A step log's rows (strings) but TIME_KEYS' columns."""
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)}
                for r in csv.DictReader(f, delimiter="\t")]


def assert_same_run(one: Path, other: Path, one_metrics: dict, other_metrics: dict) -> None:
    """Two finished runs of a training stage (their folders and returned metrics) are the same run:
    every metric but TIME_KEYS', every weight bit for bit, every step-log value but the times."""
    from safetensors.torch import load_file
    assert without_time(other_metrics) == without_time(one_metrics)
    a, b = (load_file(folder / "model" / "model.safetensors") for folder in (one, other))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)
    for log in ("train.tsv", "eval.tsv"):   # the step logs the stage writes (PPO's: train.tsv alone)
        assert (one / log).exists() == (other / log).exists(), log
        if (one / log).exists():
            assert step_rows(one / log) == step_rows(other / log), log


def tiny_params(override: dict | None = None):
    """TINY's sections but `data` (the prepare stage's, in `tiny_data`), with `override` merged in,
    as the stages read them."""
    from pipeline.config import Params, from_dict
    return from_dict(Params, merge({k: v for k, v in TINY.items() if k != "data"}, override or {}), "params.yaml: ")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """TINY's data, prepared once per test process: read only (a test that changes data makes its own)."""
    from pipeline.config import DataConfig, from_dict
    from pipeline.stages.prepare import write as prepare_run
    out = tmp_path_factory.mktemp("tiny") / "data"
    prepare_run(from_dict(DataConfig, TINY["data"], "params.yaml: "), out)
    return out


@pytest.fixture(scope="session")
def tiny_models(tiny_data, tmp_path_factory) -> tuple[Path, Path]:
    """An untrained tiny policy and a reward model built from it (tiny_policy_and_reward_model): their
    samples differ from draw to draw and the reward model tells them apart, so a sampling stage's
    choice among them matters."""
    return tiny_policy_and_reward_model(tmp_path_factory.mktemp("tiny_models"), tiny_data)


def read_sampled(path: Path) -> tuple[dict, list[dict]]:
    """A sampling stage's sampled file (pipeline/stages/sampled.py): its header and its rows."""
    header, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    return header, rows


@pytest.fixture(scope="session")
def tiny_sft(tiny_data, tmp_path_factory) -> Path:
    """An SFT policy trained on `tiny_data` by TINY's sft params for 2 epochs, a checkpoint every 2
    steps: its model folder (read only)."""
    from pipeline.stages import sft
    out = tmp_path_factory.mktemp("tiny_sft")
    sft.run(tiny_params({"sft": {"epochs": 2.0, "save_every": 2}}), tiny_data, out, progress=False)
    return out / "model"


def write_params(path: Path, override: dict) -> None:
    """params.yaml = the repository's params with `override` merged in."""
    yaml = YAML(typ="safe", pure=True)
    base = yaml.load((REPO / "params.yaml").read_text())
    with open(path, "w") as f:
        yaml.dump(merge(base, override), f)


def run_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's venv first on PATH; a process that dies of a
    signal (an abort in a library's threads) prints its Python stacks first, so a rare failure says where."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def bare_env(repo: Path) -> dict[str, str]:
    """A user's shell without an activated venv: only the system's PATH (whose python has no torch),
    and `repo` holding a `.venv` as a checkout set up by `make` does (a link to this one)."""
    if not (repo / ".venv").exists():
        (repo / ".venv").symlink_to(BIN.parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = "/usr/bin:/bin"
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, timeout: int = 900,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env or run_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until `path` exists (a process reached a point: a checkpoint saved, a hook's marker),
    failing with the process's stderr if it ends first, or after `timeout` seconds."""
    end = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.05)


def load_script(path: Path):
    """The Python file at `path` (a script or benchmark: no package holds it) imported as a module
    named after the file."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_repo(dest: Path) -> Path:
    """A git repository holding this checkout's tracked and unignored files (not outputs, not .venv)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file() and not rel.startswith(("outputs/", "dvc.lock", "compare/dvc.lock")):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    run(["git", "init", "-q", "-b", "main"], dest)
    # An identity of its own: `dvc exp run` commits, and a user without a global git identity
    # (a fresh account) would otherwise see it refused.
    run(["git", "config", "user.name", "pipeline tests"], dest)
    run(["git", "config", "user.email", "tests@localhost"], dest)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A"], dest)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "copy"], dest)
    return dest


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    """A copy of the repository with tiny params committed."""
    repo = copy_repo(tmp_path / "repo")
    write_params(repo / "params.yaml", TINY)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "tiny params"], repo)
    return repo


@dataclass(frozen=True)
class TinyRun:
    repo: Path          # a finished `dvc repro` of TINY: read it, never change it (copy it: `tiny_run_copy`)
    printed: str        # what `dvc repro` printed (stdout, then stderr)
    seconds: float      # its wall time
    threads: str | None  # OMP_NUM_THREADS it ran under: a test comparing bits with it must run the same
                         # (thread count changes PPO's floating-point sums; see `same_threads`)

    def same_threads(self) -> None:
        """Fail clearly, instead of as a bit difference, when this process's OMP_NUM_THREADS (which
        the comparing test's subprocesses inherit) is not the one the shared run had."""
        now = os.environ.get("OMP_NUM_THREADS")
        assert now == self.threads, f"OMP_NUM_THREADS is {now!r} here but the shared run had {self.threads!r}: " \
                                    "a test leaked it into os.environ"


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    """One whole `dvc repro` of the tiny params, as the README writes it (`.venv/bin/dvc repro` from
    a shell without the venv on PATH), in a repository with those params committed. Shared by the
    tests that need a finished run: each reads it or works on its own copy. Each of them used to
    run the same pipeline itself (about a minute each). Made once per pytest run: under
    pytest-xdist the first worker to need it makes it in the run's shared temporary folder (a file
    lock keeps the others waiting for it), and the others read the same one."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base   # the workers' common parent
    root, record = shared / "tiny_run", shared / "tiny_run.json"
    with open(shared / "tiny_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            shutil.rmtree(root, ignore_errors=True)         # a maker that failed half-way
            repo = copy_repo(root / "repo")
            write_params(repo / "params.yaml", TINY)
            run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "tiny params"], repo)
            start = time.monotonic()
            proc = run([str(BIN / "dvc"), "repro"], repo, env=bare_env(repo))
            made = {"printed": proc.stdout + proc.stderr, "seconds": time.monotonic() - start,
                    "threads": os.environ.get("OMP_NUM_THREADS")}
            record.write_text(json.dumps(made))
        made = json.loads(record.read_text())
    return TinyRun(root / "repo", made["printed"], made["seconds"], made["threads"])


def project_copy(tmp_path: Path, name: str, override: dict | None = None, jobs: dict | None = None,
                 profile: dict | None = None) -> Path:
    """A copy of the project on the tiny params (with `override`); `jobs` merged into its SLURM
    profile's set-resources, `profile` over the rest of that profile."""
    repo = copy_repo(tmp_path / name)
    write_params(repo / "params.yaml", merge(TINY, override or {}))
    if jobs or profile:
        path = repo / "profiles/slurm/config.yaml"
        doc = merge(YAML(typ="safe", pure=True).load(path.read_text()), profile or {})
        doc["set-resources"] = merge(doc.get("set-resources") or {}, jobs or {})
        with path.open("w") as f:
            YAML().dump(doc, f)
    return repo


def copy_run(run_: TinyRun, dest: Path) -> Path:
    """A copy of the finished run's repository (git, DVC cache, outputs, the .venv link) at `dest`."""
    shutil.copytree(run_.repo, dest, symlinks=True)
    return dest


@pytest.fixture
def tiny_run_copy(tiny_run: TinyRun, tmp_path: Path) -> Path:
    """The shared finished tiny run, copied for a test that changes it."""
    return copy_run(tiny_run, tmp_path / "repo")


def tiny_ppo_inputs(root: Path, n_ppo_prompts: int = 8, n_eval_prompts: int = 4) -> Path:
    """`root` with PPO's inputs: a small prepared dataset (root/data), an untrained tiny policy
    (root/sft) and a reward model built from it with offset 0.5 (root/rm)."""
    from pipeline.config import DataConfig
    from pipeline.stages.prepare import write as prepare_run
    prepare_run(DataConfig(n_sft=8, n_sft_eval=4, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=n_ppo_prompts,
                           n_eval_prompts=n_eval_prompts), root / "data")
    tiny_policy_and_reward_model(root, root / "data", offset=0.5)
    return root


def tiny_policy_and_reward_model(root: Path, data_dir: Path, offset: float = 0.0) -> tuple[Path, Path]:
    """An untrained tiny 'SFT' policy on the prepared tokenizer and a reward model built from it
    (root/sft, root/rm): enough for the PPO and tracking machinery, which never needs them trained."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pipeline.models import reward_model as rm
    from pipeline.data.tokenizer import load_tokenizer

    tok = load_tokenizer(data_dir / "tokenizer")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "sft")
    tok.save_pretrained(root / "sft")
    model, rtok = rm.init_reward_model(root / "sft", seed=0, head_std=None)
    model.config.reward_offset = offset
    model.save_pretrained(root / "rm")
    rtok.save_pretrained(root / "rm")
    return root / "sft", root / "rm"


def random_policies(cfg, seeds: tuple[int, ...] = (0, 1)) -> tuple[list, Any]:
    """Untrained causal LMs of `cfg`'s shape (a ModelConfig) over the reviews task's word tokenizer,
    one per seed (torch's global seed set to it just before the model is built), in eval mode:
    (the models in the order of `seeds`, the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.data.tokenizer import build_word_tokenizer
    from pipeline.models.checkpoints import tiny_config
    from pipeline.tasks import reviews
    tok = build_word_tokenizer(reviews.vocabulary())
    models = []
    for seed in seeds:
        torch.manual_seed(seed)
        models.append(AutoModelForCausalLM.from_config(tiny_config(cfg, tok)).eval())
    return models, tok


def sampled_alone(policy, tok, prompts: list, sampling, seed: int, max_prompt_length: int | None = None) -> list[str]:
    """Each prompt's response drawn on its own (a batch of one) from the stream the measurement
    seeds it with, (seed, its index): what `measure_policies` must give whatever the batching."""
    import torch

    from pipeline.data.tokenizer import decode_response, encode_prompt, end_ids
    from pipeline.measurement.policy import prompt_seed
    from pipeline.models.generation import sample, stop_ids
    out = []
    for i, prompt in enumerate(prompts):
        gen = torch.Generator().manual_seed(prompt_seed(seed, i))
        s = sample(policy.eval(), [encode_prompt(tok, prompt, max_prompt_length)], tok.pad_token_id,
                   stop_ids(tok, policy, sampling), sampling, row_generators=[gen])
        out.append(decode_response(tok, s.response_ids[0].tolist(), end_ids(tok, policy)))
    return out


# ---- a stage added as one module -------------------------------------------------------------------
# A throwaway method, put on the stages package's path and edited nowhere else, shows up everywhere
# stages are listed (tests/unit/test_registry.py; the GPU check's runs, tests/system/test_gpu_check.py).
# The one edit outside its module a real stage also needs is its params section (config.Params);
# a Params subclass with a `toy` section stands in for it.

TOY = '''
"""A throwaway method: measures nothing, trains nothing."""
from pathlib import Path

from ..training import memory_plan
from ..tracking.metric_names import Metric
from ..tracking.model_card import ModelFacts
from .skeleton import stage_run
from .spec import StageSpec


def plan(params, shapes):
    if not shapes.ready("sft"):
        return None
    sft = shapes.model("sft")
    return memory_plan.supervised_planner("toy", params, sft, (sft,))


def check(params, data_dir):
    (data_dir / "toy_checked").write_text(str(params.toy.seed))


SPEC = StageSpec(
    "toy", help="a throwaway method", inputs=("data", "sft"), pipeline="compare", policy=True,
    headline=("eval/toy_score",), plan=plan, parent_params=("toy.seed",), check_inputs=check,
    model=ModelFacts("the toy policy", "nothing at all", "rlhf-toy-policy", "A toy."),
    metrics=lambda: [Metric("toy", "metrics.json", "eval/toy_score", "how toy it is", "compare")],
    files={"metrics.json": "the toy's score"}, reads=("toy.seed",))


def run(params, data_dir, sft_dir, out, progress=True):
    with stage_run(SPEC, params, out, [data_dir]) as run:
        metrics = {"eval/toy_score": 0.25 + run.params.toy.seed}
        run.finish(metrics)
    return metrics
'''


@dataclass(frozen=True)
class ToyParams(config.Params):
    toy: SFTConfig = field(default_factory=SFTConfig)   # the toy's params section


@pytest.fixture
def toy_stage(tmp_path, monkeypatch):
    """The throwaway stage module on the stages package's path and its section in config.Params,
    for the test's length; yields the module's file (a test may edit it before the registry reads it)."""
    folder = tmp_path / "more_stages"
    folder.mkdir()
    (folder / "toy.py").write_text(TOY)
    monkeypatch.setattr(pipeline.stages, "__path__", [*pipeline.stages.__path__, str(folder)])
    monkeypatch.setattr(config, "Params", ToyParams)
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    yield folder / "toy.py"
    sys.modules.pop("pipeline.stages.toy", None)


def run_stage(stage: str, params, folders: dict[str, Path], out: Path, **options) -> dict:
    """The stage run in this process into `out`, its inputs found by the names its SPEC gives them
    (`folders`: "data", "sft", "reward", ... -> the folder), with the stage's own `options`: its metrics."""
    from pipeline.stages import registry
    inputs = [folders[name] for name in registry.spec(stage).inputs]
    return registry.module(stage).run(params, *inputs, out, progress=False, **options)


def supervised_run(stage: str, params, data_dir: Path, sft_dir: Path):
    """out -> the metrics of the sft or reward stage run on the tiny inputs into `out`."""
    return lambda out: run_stage(stage, params, {"data": data_dir, "sft": sft_dir}, out)


def die_in_step(monkeypatch, where: str) -> None:
    """Interrupt the supervised loop (every supervised stage's) when it checks the first quantity of
    step `where` ("rs step 4"): a kill between two saves."""
    from pipeline.training import supervised
    real = supervised.check_finite

    def dying(at, name, value):
        if at == where:
            raise KeyboardInterrupt
        return real(at, name, value)
    monkeypatch.setattr(supervised, "check_finite", dying)


def die_in_iteration(monkeypatch, iteration: int) -> None:
    """Interrupt the RL trainer (PPO's, GRPO's) as it starts iteration `iteration` + 1."""
    from pipeline.ppo.trainer import PPOTrainer
    real = PPOTrainer.step

    def dying(self):
        if self.iteration == iteration:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(PPOTrainer, "step", dying)


def redrawn(params, data_dir: Path, models: tuple[Path, Path], cfg, n: int) -> tuple[list, list[list[str]], Any]:
    """A sampling stage's samples drawn again by hand: sample k of prompt i is the prompt alone from
    the stream of (cfg.seed + k, i), over the first cfg.n_prompts training prompts, each scored by
    the reward model with score_texts: (prompts, texts by sample, scores (n, N))."""
    import torch
    from pipeline.data import inputs
    from pipeline.models import reward_model as rm
    from pipeline.models.checkpoints import load_policy
    policy, tok = load_policy(models[0])
    reward, rtok = rm.load_reward_model(models[1])
    prompts, _, _ = inputs.fit_prompts(inputs.prompt_records(params, data_dir, "train"), tok,
                                       params.prompts.max_length, params.prompts.overlong, "prompts.max_length")
    prompts = prompts[:cfg.n_prompts]
    texts = [sampled_alone(policy, tok, prompts, cfg.sampling, cfg.seed + k, params.prompts.max_length)
             for k in range(n)]
    scores = torch.stack([rm.score_texts(reward, rtok, prompts, t, params.reward.max_length) for t in texts])  # (n, N)
    return prompts, texts, scores


def write_easy_pairs(data_dir: Path, root: Path) -> str:
    """The prepared pairs made trivially separable (each response cut to its first six words, the
    chosen one ending with "great", the rejected one with "awful"), as a `dataset.path` pattern."""
    for split, name in (("train", "pairs_train.jsonl"), ("test", "pairs_eval.jsonl")):
        rows = [json.loads(line) for line in (data_dir / name).read_text().splitlines()]
        with open(root / f"pairs_{split}.jsonl", "w") as f:
            for r in rows:
                base = " ".join(r["chosen"].split()[:6])
                f.write(json.dumps({"prompt": r["prompt"], "chosen": f"{base} great", "rejected": f"{base} awful"}) + "\n")
    return str(root / "pairs_{split}.jsonl")
