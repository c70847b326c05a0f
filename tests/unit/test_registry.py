"""A stage is one module: a throwaway stage module, put on the stages package's path and edited
nowhere else, shows up in the command line, `check --data`, the memory plan, the metric registry,
the MLflow headline, parent params and model registry, and the methods benchmark. The one edit outside its module a real stage also needs is its
params section (config.Params); here a Params subclass with a `toy` section stands in for it."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from dataclasses import field
from pathlib import Path

import pytest

import pipeline.stages
from conftest import REPO
from pipeline import config
from pipeline.__main__ import _parser, commands, main
from pipeline.config import DataConfig, SFTConfig
from pipeline.stages import metric_registry, registry, skeleton
from pipeline.stages.prepare import write as prepare_run

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


@dataclasses.dataclass(frozen=True)
class ToyParams(config.Params):
    toy: SFTConfig = field(default_factory=SFTConfig)   # the toy's params section


@pytest.fixture
def toy_stage(tmp_path, monkeypatch):
    folder = tmp_path / "more_stages"
    folder.mkdir()
    (folder / "toy.py").write_text(TOY)
    monkeypatch.setattr(pipeline.stages, "__path__", [*pipeline.stages.__path__, str(folder)])
    monkeypatch.setattr(config, "Params", ToyParams)
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    yield folder / "toy.py"
    sys.modules.pop("pipeline.stages.toy", None)


def test_a_new_stage_module_is_seen_everywhere_stages_are_listed(toy_stage, tmp_path, monkeypatch, capsys):
    # The registry: a compare-pipeline method, ordered by what it reads (the SFT model, as dpo).
    specs = registry.specs()
    assert list(specs)[-6:] == ["dpo", "kto", "toy", "grpo", "rs", "compare"] and registry.methods()["toy"] == ("sft",)
    # The command line: a subcommand with its folders, defaults from the stages that write them.
    assert commands()["toy"] == ("a throwaway method", {"data": "data/prepared", "sft": "outputs/sft/model",
                                                         "out": "outputs/toy"})
    args = _parser().parse_args(["toy"])
    assert (args.data, args.sft, args.out) == (Path("data/prepared"), Path("outputs/sft/model"), Path("outputs/toy"))

    # Run through the one `run` signature, with the MLflow headline it declares passed to the tracker.
    data = tmp_path / "data"
    prepare_run(DataConfig(n_sft=8, n_sft_eval=4, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=8, n_eval_prompts=4), data)
    params = tmp_path / "params.yaml"
    params.write_text("toy:\n  seed: 2\n")
    seen = {}
    real = skeleton.stage_tracking

    def recording(stage, config_, inputs, **kw):
        seen[stage] = kw["facts"]
        return real(stage, config_, inputs, **kw)
    monkeypatch.setattr(skeleton, "stage_tracking", recording)
    out = tmp_path / "toy"
    assert main(["toy", "--params", str(params), "--data", str(data), "--sft", str(tmp_path / "no-sft"),
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"toy: wrote {out}; eval/toy_score=2.250"
    facts = seen["toy"]
    assert facts.headline == ("eval/toy_score",) and facts.model.registered == "rlhf-toy-policy"
    assert "toy.seed" in facts.parent_params and "sft.lr" in facts.parent_params   # every stage's knobs

    # `check --data` reads its inputs too.
    assert main(["check", "--params", str(params), "--data", str(data)]) == 0
    assert (data / "toy_checked").read_text() == "2"
    capsys.readouterr()
    assert (out / "metrics.json").read_text().count("2.25") == 1

    # The memory plan: `python -m pipeline plan` prints the toy's table (planned from the params alone).
    assert main(["plan", "--params", str(params), "--data", str(data), "--stage", "toy"]) == 0
    assert capsys.readouterr().out.startswith("toy (GiB)")

    # The metric registry and docs/metrics.md: its declaration, its section, its resources.
    names = {(m.stage, m.name) for m in metric_registry.metrics()}
    assert {("toy", "eval/toy_score"), ("toy", "resources/wall_seconds")} <= names
    assert "## toy (`outputs/toy/`, compare/dvc.yaml)\n" in metric_registry.render_metrics()

    # The methods benchmark lists it among the methods it runs.
    spec = importlib.util.spec_from_file_location("compare_methods_toy", REPO / "benchmarks" / "compare_methods.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.METHODS["toy"] == ("sft",)


def test_the_registry_is_the_shipped_stages_in_pipeline_order():
    specs = registry.specs()
    assert list(specs) == ["prepare", "sft", "reward", "ppo", "evaluate", "dpo", "kto", "grpo", "rs", "compare"]
    assert registry.training() == ("sft", "reward", "ppo", "dpo", "kto", "grpo", "rs")
    assert registry.shape_checked("load") == ("sft", "reward", "ppo")
    assert registry.shape_checked("start") == ("dpo", "kto", "grpo", "rs")
    assert registry.cluster_checked() == ("sft", "reward", "ppo", "evaluate")
    assert registry.methods() == {"ppo": ("sft", "reward"), "dpo": ("sft",), "kto": ("sft",),
                                  "grpo": ("sft", "reward"), "rs": ("sft", "reward")}
    # Each section with `distributed` of its own is a distributed stage's, and the reverse.
    assert set(config.distributed_sections()) == set(registry.distributed())


def test_listing_the_stages_loads_no_torch():
    # `python -m pipeline --help`, the docs, the GPU check's list and the tests read every SPEC; a
    # stage module imports what running it needs inside its functions, so reading them stays cheap.
    script = ("import sys, time\n"
              "start = time.perf_counter()\n"
              "from pipeline.stages import registry\n"
              "specs = registry.specs()\n"
              "print(f'{time.perf_counter() - start:.2f}', len(specs),\n"
              "      *sorted(m for m in ('torch', 'transformers', 'deepspeed', 'peft', 'mlflow') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True).stdout.split()
    print(f"registry.specs() in a fresh interpreter: {out[0]} s")
    assert out[1:] == [str(len(registry.specs()))], out
