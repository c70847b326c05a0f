"""A stage is one module: a throwaway stage module, put on the stages package's path and edited
nowhere else, shows up in the command line, `check --data`, the memory plan, the metric registry,
the MLflow headline, parent params and model registry, and the methods benchmark. The one edit outside its module a real stage also needs is its
params section (config.Params); here a Params subclass with a `toy` section stands in for it (the
`toy_stage` fixture of tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML

from conftest import REPO
from pipeline import config
from pipeline.__main__ import _parser, commands, main
from pipeline.config import DataConfig
from pipeline.stages import metric_registry, registry, skeleton
from pipeline.tracking import model_card
from pipeline.stages.prepare import write as prepare_run

def test_a_new_stage_module_is_seen_everywhere_stages_are_listed(toy_stage, tmp_path, monkeypatch, capsys):
    # The registry: a compare-pipeline method, ordered by what it reads (the SFT model, as dpo).
    specs = registry.specs()
    order = list(specs)   # among the methods reading the SFT model alone, by name; before those reading more
    assert order.index("kto") < order.index("toy") < order.index("grpo") and order[-1] == "compare"
    assert registry.methods()["toy"] == ("sft",)
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

    # Its model card's words, and its row of docs/architecture.md's stage table.
    card = model_card.card("toy", registry.spec("toy").model, {"toy": {"seed": 2}}, {"eval/toy_score": 2.25}, "0.1")
    assert "the toy policy" in card and "nothing at all" in card and "2.25" in card
    spec = importlib.util.spec_from_file_location("render_docs_toy", REPO / "scripts" / "render_docs.py")
    docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs)
    assert ("| `toy` (`stages/toy.py`) | compare/dvc.yaml | `data/prepared`, `outputs/sft/model` | `outputs/toy/` | "
            "a throwaway method |") in docs.render_stages(REPO).splitlines()


def test_the_registry_is_the_pipeline_files_stages_in_pipeline_order():
    specs = registry.specs()
    order, yaml = list(specs), YAML(typ="safe")
    default, methods = (list(yaml.load((REPO / f).read_text(encoding="utf-8"))["stages"])
                        for f in ("dvc.yaml", "compare/dvc.yaml"))
    # The default pipeline first, as dvc.yaml runs it; compare/dvc.yaml's after it, compare last.
    assert order[:len(default)] == default == ["prepare", "sft", "reward", "ppo", "evaluate"]
    assert sorted(order[len(default):]) == sorted(methods) and order[-1] == "compare"
    for name, spec in specs.items():   # each after the stages whose folders it reads
        assert all(order.index("prepare" if f == "data" else f) < order.index(name) for f in spec.inputs), name
    assert registry.training() == tuple(n for n, s in specs.items() if s.training)
    assert registry.shape_checked("load") == ("sft", "reward", "ppo")   # the default pipeline's: at load
    assert registry.shape_checked("start") == tuple(n for n in order[len(default):] if specs[n].training)
    assert registry.cluster_checked() == ("sft", "reward", "ppo", "evaluate")
    assert {"ppo", "dpo", "kto", "grpo", "rs"} <= set(registry.methods())
    assert registry.methods()["ppo"] == registry.methods()["rs"] == ("sft", "reward") and registry.methods()["dpo"] == ("sft",)
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
