"""What each stage reads is declared once (its SPEC) and DVC sees all of it: the params it reads
(dvc.yaml `params:`) and the code it runs (dvc.yaml `deps:` cover its import closure)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from ruamel.yaml import YAML

from conftest import REPO
from pipeline.config import Params
from pipeline.data import inputs
from pipeline.stages import registry
from pipeline.stages.spec import StageSpec, UndeclaredParam, declared, resolve
from pipeline.workflow import code_deps, stage_graph

SPECS = registry.specs()   # every stage module's SPEC
# Every pipeline file's stages: the default pipeline and the methods compared on its outputs.
DVC = {name: spec for f in stage_graph.PIPELINE_FILES
       for name, spec in YAML(typ="safe").load((REPO / f).read_text())["stages"].items()}


def code(deps: list) -> list[str]:
    return [d for d in deps if isinstance(d, str) and d.startswith("pipeline")]


def test_every_dvc_stage_has_a_declaration_and_dvc_params_are_it():
    assert set(DVC) == set(SPECS)
    for name, spec in SPECS.items():
        assert sorted(DVC[name]["params"]) == sorted(spec.reads), name


def test_each_stage_sits_in_the_pipeline_file_its_spec_names_with_the_folders_it_declares():
    """dvc.yaml is hand-written; the registry's facts about a stage hold there: which file, the
    output folder, and (for a method) that compare measures its policy."""
    files = {f: YAML(typ="safe").load((REPO / f).read_text())["stages"] for f in stage_graph.PIPELINE_FILES}
    compare_cmd = DVC["compare"]["cmd"]
    for name, spec in SPECS.items():
        where = next(f for f, stages in files.items() if name in stages)
        assert where == ("dvc.yaml" if spec.pipeline == "default" else "compare/dvc.yaml"), name
        assert f"--out {spec.output}" in DVC[name]["cmd"], name
        assert (f"--policy {name}={spec.output}/model" in compare_cmd) == spec.policy, name


def test_reading_an_undeclared_param_raises_and_names_the_key():
    params = Params()
    view = declared(params, SPECS["sft"])
    assert view.sft.lr == params.sft.lr                       # a declared section, whole
    assert view.prompts.dataset.path is None                 # a declared key below a section
    with pytest.raises(UndeclaredParam, match=r"the sft stage reads `ppo`, which its SPEC"):
        view.ppo.lr
    with pytest.raises(UndeclaredParam, match=r"`evaluate`"):
        view.evaluate
    # Real stage code through a declaration missing one key it needs: the gold judge's switch.
    spec = dataclasses.replace(SPECS["sft"], reads=tuple(k for k in SPECS["sft"].reads if k != "prompts.gold_judge"))
    with pytest.raises(UndeclaredParam, match=r"the sft stage reads `prompts.gold_judge`"):
        inputs.judge(declared(params, spec))


def test_resolved_config_holds_exactly_the_declared_keys():
    params = Params()
    spec = StageSpec("x", reads=("model.arch", "prompts.dataset.path", "evaluate"), inputs=())
    assert resolve(params, spec) == {"evaluate": {**dataclasses.asdict(params.evaluate), "best_of_n": [4, 16, 64]},
                                     "model": {"arch": "llama"}, "prompts": {"dataset": {"path": None}}}
    # The reward stage's config (and so its fingerprint) includes how its backbone is loaded.
    assert resolve(params, SPECS["reward"])["model"] == {"attn_implementation": None, "trust_remote_code": False}


@pytest.mark.parametrize("stage", sorted(SPECS))
def test_dvc_deps_cover_every_project_file_the_stage_imports(stage):
    deps = code(DVC[stage]["deps"])
    assert code_deps.uncovered(REPO, stage, deps) == []
    # No code dep is superfluous: each covers some file the stage reaches.
    reached = code_deps.closure(REPO, stage)
    assert [d for d in deps if not any(code_deps.covered(f, [d]) for f in reached)] == []


def test_code_only_evaluate_uses_reruns_no_training_stage():
    training = set().union(*(code_deps.closure(REPO, s) for s in ("sft", "reward", "ppo")))
    only_evaluate = code_deps.closure(REPO, "evaluate") - training
    assert {"pipeline/stages/evaluate.py", "pipeline/measurement/comparison_plots.py"} <= only_evaluate
    for stage in ("sft", "reward", "ppo"):
        deps = code(DVC[stage]["deps"])
        assert [f for f in only_evaluate if code_deps.covered(f, deps)] == [], stage
    # Shared measurement code re-runs every stage that measures with it.
    for stage in ("sft", "reward", "ppo", "evaluate"):
        assert code_deps.covered("pipeline/measurement/policy.py", code(DVC[stage]["deps"])), stage


def test_closure_follows_imports_inside_functions(tmp_path):
    pkg = tmp_path / "pipeline"
    (pkg / "stages").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "stages" / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("from . import config\n\ndef main():\n    from .stages import other\n")
    (pkg / "config.py").write_text("")
    (pkg / "judge.py").write_text("")
    (pkg / "stages" / "other.py").write_text("")
    (pkg / "stages" / "mine.py").write_text("def f():\n    from ..judge import score\n")
    assert code_deps.closure(tmp_path, "mine") == {
        "pipeline/__init__.py", "pipeline/__main__.py", "pipeline/config.py", "pipeline/judge.py",
        "pipeline/stages/__init__.py", "pipeline/stages/mine.py"}
    assert code_deps.uncovered(tmp_path, "mine", ["pipeline/stages", "pipeline/config.py"]) == [
        "pipeline/__main__.py", "pipeline/judge.py"]


def test_exempt_files_are_listed_with_a_reason():
    for path, reason in code_deps.EXEMPT.items():
        assert (REPO / path).is_file() and len(reason) > 20
    assert re.search(r"cannot change an output|never", " ".join(code_deps.EXEMPT.values()))


def test_declared_inputs_are_the_command_line_folders_dvc_passes():
    from pipeline.__main__ import commands
    for name, spec in SPECS.items():
        assert spec.inputs == tuple(k for k in commands()[name][1] if k != "out"), name
        for folder in spec.inputs:
            assert f"--{folder} " in DVC[name]["cmd"], (name, folder)


def test_readme_stage_table_lists_each_declaration():
    rows = {m.group(1): re.findall(r"`([^`]+)`", m.group(2)) for m in
            re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", (REPO / "README.md").read_text(), re.M)}
    for name, spec in SPECS.items():
        assert sorted(rows[name]) == sorted(spec.reads), name
