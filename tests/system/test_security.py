"""Security guarantees that can be checked on the code and the workflow files: no pickle loading
of files we did not ask for (safetensors for weights, weights_only=True for torch files), no shell
built from strings in the pipeline, trust_remote_code off unless params turn it on, and params
values never reaching a shell (dvc.yaml and the Snakefile run fixed commands; stages read params
themselves)."""

from __future__ import annotations

import re

from conftest import BIN, REPO, TINY, copy_repo, run, write_params
from pipeline.workflow import stage_graph
from pipeline.config import ModelConfig

SOURCES = sorted((REPO / "pipeline").rglob("*.py")) + sorted((REPO / "scripts").glob("*.py")) + [REPO / "Snakefile"]


def test_no_pickle_loading_and_no_shell_strings_in_our_code():
    for path in SOURCES:
        text = path.read_text()
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, f"{path}: {call}"
        assert not re.search(r"^\s*import pickle|^\s*from pickle", text, flags=re.M), path
        assert "shell=True" not in text and "os.system(" not in text, path
        assert "trust_remote_code=True" not in text, path
    assert ModelConfig().trust_remote_code is False


def test_params_values_with_shell_metacharacters_never_reach_a_shell(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    evil = "x'; touch PWNED; echo \"$(touch PWNED2)\" `touch PWNED3` #"
    write_params(repo / "params.yaml", {**TINY,
                                        "sft": {**TINY["sft"], "dataset": {"prompt_column": evil}},
                                        "prompts": {"dataset": {"conversation_column": evil}}})
    run([str(BIN / "python"), "-m", "pipeline", "check"], repo)                  # valid strings
    dvc_dry = run([str(BIN / "dvc"), "repro", "--dry", "--force"], repo).stdout
    snake_dry = run([str(BIN / "snakemake"), "-n", "-p", "--forceall"], repo).stdout
    for stage in stage_graph.load(repo / "dvc.yaml"):
        assert "$" not in stage.cmd and "{" not in stage.cmd                   # no interpolation of params
        assert stage.cmd in dvc_dry and f"{stage.cmd} > logs/{stage.name}.log 2>&1" in snake_dry
    # The prepare stage runs for real with those params; nothing was executed from them.
    run([str(BIN / "dvc"), "repro", "prepare"], repo)
    assert not any((repo / name).exists() for name in ("PWNED", "PWNED2", "PWNED3"))
