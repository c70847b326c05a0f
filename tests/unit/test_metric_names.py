"""The metric-name registry (each stage SPEC's declarations, gathered by pipeline/stages/metric_registry.py)
against docs/metrics.md and the committed run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.stages import metric_registry as registry
from pipeline.tracking import metric_names as mn

METRICS = registry.metrics()
STAGES = [st.stage for st in registry.stage_metrics()]

REPO = Path(__file__).resolve().parents[2]
OUTPUTS = REPO / "outputs"
DOCS = REPO / "docs" / "metrics.md"


def copy_run(tmp_path: Path) -> Path:
    """The committed run's metric files (metrics.json, TSVs, evaluate's config.json), no models."""
    dst = tmp_path / "outputs"
    for stage in STAGES:
        (dst / stage).mkdir(parents=True)
        for path in (OUTPUTS / stage).iterdir():
            if path.is_file() and (path.suffix == ".tsv" or path.name in ("metrics.json", "config.json")):
                shutil.copy(path, dst / stage / path.name)
    return dst


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_docs_are_generated_from_the_registry():
    assert DOCS.read_text(encoding="utf-8") == registry.render_metrics(), (
        f"docs/metrics.md differs from the stages' metric declarations; regenerate it: {registry.REGENERATE}")


def test_registry_is_well_formed():
    keys = [(m.stage, m.file, m.name) for m in METRICS]
    assert len(keys) == len(set(keys)), "a name is registered twice"
    for m in METRICS:
        assert m.stage in STAGES, m
        assert m.file == mn.METRICS_JSON or m.file.endswith(".tsv"), m
        assert m.meaning.strip(), m
        assert m.condition is None or m.condition.lstrip("!") in mn.CONDITIONS, m
        assert set(m.placeholders) <= {"n", "policy"}, m
    # Every documented TSV carries its index column; ppo's metrics.json copies every train.tsv column.
    for stage, file in {(m.stage, m.file) for m in METRICS if m.file != mn.METRICS_JSON}:
        assert any(m.name == "step" for m in METRICS if (m.stage, m.file) == (stage, file)), (stage, file)
    columns = {m.name for m in METRICS if (m.stage, m.file) == ("ppo", "train.tsv")} - {"step"}
    assert {m.copy_of for m in METRICS if m.copy_of and m.stage == "ppo"} == columns


def test_committed_run_matches_the_registry():
    assert registry.check_run(OUTPUTS) == ([], [])


def test_emitted_reads_metrics_json_and_tsv_headers():
    written = mn.emitted(OUTPUTS, STAGES)
    assert {stage for stage, _ in written} == set(STAGES)
    assert "best_of_16/gold" in written[("evaluate", "metrics.json")]
    assert "train/objective_kl" in written[("ppo", "metrics.json")]
    assert "objective/kl" in written[("ppo", "train.tsv")]
    assert written[("sft", "train.tsv")] == ["step", "loss", "lr", "grad_norm", "skipped_updates"]


def test_an_unknown_name_fails_the_check(tmp_path):
    run = copy_run(tmp_path)
    edit_json(run / "reward" / "metrics.json", lambda d: d["eval"].update(surprise=1.0))
    with (run / "sft" / "train.tsv").open("r+") as f:
        lines = f.read().splitlines()
        f.seek(0)
        f.write("\n".join([lines[0] + "\tmystery", *(line + "\t0" for line in lines[1:])]) + "\n")
    undefined, missing = registry.check_run(run)
    assert sorted(undefined) == ["reward/metrics.json: eval/surprise", "sft/train.tsv: mystery"]
    assert missing == []


def test_a_missing_name_fails_the_check(tmp_path):
    run = copy_run(tmp_path)
    edit_json(run / "evaluate" / "metrics.json", lambda d: d["best_of_16"].pop("gold"))
    edit_json(run / "ppo" / "metrics.json", lambda d: d["ppo"].pop("kl"))
    assert registry.check_run(run) == ([], ["ppo/metrics.json: ppo/kl", "evaluate/metrics.json: best_of_16/gold"])


def test_a_missing_file_fails_the_check(tmp_path):
    run = copy_run(tmp_path)
    (run / "reward" / "calibration.tsv").unlink()
    undefined, missing = registry.check_run(run)
    assert undefined == []
    assert missing == [f"reward/calibration.tsv: {c}" for c in ("step", "predicted", "observed", "count")]


def test_conditions_decide_which_names_are_expected():
    # The committed run is CPU-only with a gold judge and the detector on: under other conditions it
    # lacks the names they add and has the names they take away.
    undefined, missing = registry.check_run(OUTPUTS, {"cuda", "auditor"})
    assert undefined == []
    assert missing == ["sft/metrics.json: resources/peak_device_gib", "reward/metrics.json: resources/peak_device_gib",
                       "ppo/train.tsv: objective/auditor_scores", "ppo/train.tsv: memory/peak_gib",
                       "ppo/metrics.json: train/objective_auditor_scores", "ppo/metrics.json: train/memory_peak_gib",
                       "ppo/metrics.json: resources/peak_device_gib", "evaluate/metrics.json: resources/peak_device_gib"]
    # The methods of compare/dvc.yaml are expected only when they ran (the committed run has them).
    assert registry.check_run(OUTPUTS, {"compare"}) == ([], [])
    # Without a judge nothing is required that only a judge writes (an extra name is still defined).
    assert registry.check_run(OUTPUTS, {"no_judge"}) == ([], [])
    with pytest.raises(ValueError, match="unknown conditions"):
        registry.check_run(OUTPUTS, {"gpu"})


def test_placeholders_follow_the_runs_best_of_n(tmp_path):
    run = copy_run(tmp_path)
    edit_json(run / "evaluate" / "config.json", lambda d: d["evaluate"].update(best_of_n=[4, 16, 64, 256]))
    undefined, missing = registry.check_run(run)
    assert undefined == []
    assert len(missing) == 9 and all(line.startswith("evaluate/metrics.json: best_of_256/") for line in missing)
    # Without the config, one best_of_<n> satisfies each pattern.
    (run / "evaluate" / "config.json").unlink()
    assert registry.check_run(run) == ([], [])


def test_pattern_matches_one_segment_piece():
    (m,) = [m for m in METRICS if m.name == "best_of_{n}/rm"]
    assert m.regex().fullmatch("best_of_64/rm")
    assert not m.regex().fullmatch("best_of_x/rm")
    assert not m.regex().fullmatch("best_of_4/rm_ci95")
    assert not m.regex().fullmatch("best_of_4/5/rm")
