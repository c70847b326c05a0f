"""Functions chosen by name in params (pipeline/registries.py): a throwaway advantage estimator,
registered in the test and gone after it, is accepted by `ppo.advantage` when the params load, and
what it declares (no critic, k >= 2, the keys it reads) reaches the config and the trainer; an
unknown name is one ConfigError naming the file, the key and the allowed names; a registry refuses
an unknown lookup and a second function of one name."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from pipeline import registries
from pipeline.errors import ConfigError
from pipeline.ppo.advantages import ESTIMATORS, KL_ESTIMATORS
from pipeline.ppo.group_advantages import AGGREGATIONS
from pipeline.ppo.trainer import estimator_options
from pipeline.registries import Registry
from pipeline.stages import ppo as ppo_stage
from pipeline.stages.registry import load_params


@pytest.fixture
def toy(monkeypatch):
    """`toy`, registered as a critic-free group estimator for the test only (the registry's tables
    are copies the test restores)."""
    monkeypatch.setattr(ESTIMATORS, "_functions", dict(ESTIMATORS._functions))
    monkeypatch.setattr(ESTIMATORS, "_facts", dict(ESTIMATORS._facts))

    @ESTIMATORS.register("toy", critic=False, group=True, options={"scale": "grpo_scale"},
                         columns=(("objective/toy", "a toy column"),))
    def toy_advantages(scores: torch.Tensor, k: int, scale: bool = True):
        centred = scores - scores.reshape(-1, k).mean(dim=1).repeat_interleave(k)
        return centred, {"objective/toy": 0.0}

    return toy_advantages


def load(tmp_path: Path, text: str):
    """`text` loaded as a user's `--params params.yaml`, from the folder holding it."""
    (tmp_path / "params.yaml").write_text(text, encoding="utf-8")
    with contextlib.chdir(tmp_path):
        return load_params("params.yaml")


def load_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    return str(err.value)


def test_a_registered_estimator_is_a_valid_name_and_its_facts_are_used(tmp_path, toy):
    params = load(tmp_path, "ppo:\n  advantage: toy\n  samples_per_prompt: 2\n  grpo_scale: false\n")
    assert params.ppo.advantage == "toy" and not params.ppo.uses_critic
    assert ESTIMATORS[params.ppo.advantage] is toy
    assert estimator_options(params.ppo) == {"scale": False}   # the keys it declared, from its section
    # What it declared is checked with the section's other keys.
    assert load_error(tmp_path, "ppo:\n  advantage: toy\n").startswith(
        "params.yaml: ppo.samples_per_prompt: advantage: toy takes each response's baseline")
    assert load_error(tmp_path, "ppo:\n  advantage: toy\n  samples_per_prompt: 2\n  whiten_rewards: true\n") \
        .startswith("params.yaml: ppo.whiten_rewards: whitens GAE's per-token rewards; advantage: toy")


def test_an_unknown_name_is_one_line_naming_the_file_the_key_and_the_registered_names(tmp_path, toy):
    message = load_error(tmp_path, "ppo:\n  advantage: nope\n")
    assert message == ("params.yaml: ppo.advantage: expected one of 'gae', 'grpo', 'rloo', 'reinforce_baseline', "
                       "'toy', got 'nope'")
    # an unknown name is reported as such, not as a check of what its function would declare
    assert load_error(tmp_path, "grpo:\n  advantage: nope\n  samples_per_prompt: 1\n").startswith(
        "params.yaml: grpo.advantage: expected one of 'gae',")
    assert load_error(tmp_path, "grpo:\n  loss_aggregation: sum\n") == \
        "params.yaml: grpo.loss_aggregation: expected one of 'token_mean', 'seq_mean', 'seq_sum_norm', got 'sum'"
    assert load_error(tmp_path, "ppo:\n  kl_estimator: k4\n") == \
        "params.yaml: ppo.kl_estimator: expected one of 'k1', 'k2', 'k3', got 'k4'"


def test_the_toy_is_gone_after_its_test(tmp_path):
    assert "toy" not in ESTIMATORS and "toy" not in registries.names()["advantage estimator"]
    assert load_error(tmp_path, "ppo:\n  advantage: toy\n").startswith("params.yaml: ppo.advantage: expected one of")


def test_lookup_of_an_unknown_name_names_the_kind_and_the_names():
    with pytest.raises(ValueError, match=r"^advantage estimator must be one of 'gae', 'grpo', 'rloo', "
                                         r"'reinforce_baseline', got 'nope'$"):
        ESTIMATORS["nope"]
    with pytest.raises(ValueError, match=r"^KL estimator must be one of 'k1', 'k2', 'k3', got 'k4'$"):
        KL_ESTIMATORS.facts("k4")
    assert registries.declared("advantage estimator", "nope") is None
    assert registries.declared("no such kind", "gae") is None
    assert AGGREGATIONS.facts("seq_mean") == {"counts": "responses"}


def test_two_functions_of_one_name_and_two_registries_of_one_kind_are_refused(monkeypatch):
    before = ESTIMATORS["gae"]
    with pytest.raises(RuntimeError, match=r"two advantage estimators named 'gae'"):
        ESTIMATORS.register("gae", critic=True, group=False, options={}, columns=())(lambda *a: a)
    assert ESTIMATORS["gae"] is before   # the first one kept
    monkeypatch.setattr(registries, "_ALL", dict(registries._ALL))
    with pytest.raises(RuntimeError, match=r"two registries of 'advantage estimator'"):
        Registry("advantage estimator")
    scratch = Registry("scratch function")
    scratch.register("a", note=1)(len)
    assert (scratch.names(), scratch["a"], dict(scratch.facts("a"))) == (("a",), len, {"note": 1})


def test_the_step_log_columns_are_the_default_estimators_declared_ones(monkeypatch):
    def columns(stage):
        return [m.name for m in ppo_stage.declared_metrics(stage) if m.file == "train.tsv"]
    assert "loss/value" in columns("ppo") and "objective/group_std" not in columns("ppo")   # gae: a critic
    assert "loss/value" not in columns("grpo") and columns("grpo")[-2:] == ["objective/group_std",
                                                                            "objective/zero_std_frac"]
    monkeypatch.setitem(ESTIMATORS._facts, "grpo", {**ESTIMATORS.facts("grpo"), "columns": (("objective/toy", "t"),)})
    assert columns("grpo")[-1] == "objective/toy" and "objective/group_std" not in columns("grpo")


def test_a_section_is_checked_against_its_estimators_facts_whoever_imported_what(tmp_path):
    # In a fresh interpreter that imports config alone: a group estimator with one sample per
    # prompt is refused as the params are built, the registries importing the estimators themselves.
    script = ("from pipeline.config import ConfigError, Params, from_dict\n"
              "try:\n"
              "    from_dict(Params, {'grpo': {'advantage': 'rloo', 'samples_per_prompt': 1}}, 'p.yaml: ')\n"
              "except ConfigError as err:\n"
              "    print(err)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.startswith("p.yaml: grpo.samples_per_prompt: advantage: rloo takes each response's baseline"), out
