"""The `kto` stage (pipeline/stages/kto.py): a step's column sums that do not depend on how its batch
is split, its params, and a run that learns an easy preference from unpaired examples alone. Its
loss and reference point are tested in tests/unit/test_preference_losses.py, the unpaired split and
the mismatched pairing in tests/unit/test_unpaired.py."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import pytest
import torch

from conftest import TINY, merge, tiny_policy_and_reward_model, write_easy_pairs
from pipeline.config import DataConfig, Params, from_dict
from pipeline.errors import ConfigError
from pipeline.preference.losses import kto_loss
from pipeline.stages import kto
from pipeline.stages.prepare import write as prepare_run

D = torch.float64


def random_batch(n: int, seed: int):
    g = random.Random(seed)
    logp = [g.uniform(-40, -5) for _ in range(n)]
    ref = [lp + g.gauss(0, 2) for lp in logp]
    des = [g.random() < 0.5 for _ in range(n)]
    des[0], des[-1] = True, False
    return logp, ref, des


def test_column_sums_are_the_batch_means_however_the_batch_is_split():
    """The loop sums each part's statistics and divides by the batch size: split in parts of any
    size, the per-kind columns come out as the batch's per-kind means."""
    logp, ref, des = random_batch(12, 5)
    logp, ref, des = torch.tensor(logp, dtype=D), torch.tensor(ref, dtype=D), torch.tensor(des)
    z = torch.tensor(0.4, dtype=D)
    counts = (12, int(des.sum()), int((~des).sum()))

    def columns(step: int) -> list[float]:
        sums = [0.0] * len(kto.COLUMNS)
        for s in range(0, 12, step):
            terms, rewards = kto_loss(logp[s:s + step], ref[s:s + step], des[s:s + step], z, 2.0)
            part = kto.stats_sums(terms, rewards, logp[s:s + step], des[s:s + step], z, counts)
            sums = [a + b for a, b in zip(sums, part)]
        return [v / 12 for v in sums]
    whole = columns(12)
    for step in (1, 4, 5):
        assert columns(step) == pytest.approx(whole, rel=1e-12)
    rewards = 2.0 * (logp - ref)
    want = dict(zip(kto.COLUMNS, whole))
    assert want["desirable_reward"] == pytest.approx(float(rewards[des].mean()), rel=1e-12)
    assert want["undesirable_logp"] == pytest.approx(float(logp[~des].mean()), rel=1e-12)
    assert want["kl"] == pytest.approx(0.4) and want["margin"] == pytest.approx(
        want["desirable_reward"] - want["undesirable_reward"])


def test_bad_kto_params_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"kto.batch_size: expected an integer >= 2"):
        from_dict(Params, {"kto": {"batch_size": 1}}, "params.yaml: ")
    with pytest.raises(ConfigError, match=r"kto.dataset.margin_column: KTO uses no per-pair margin"):
        from_dict(Params, {"kto": {"dataset": {"margin_column": "m"}}}, "params.yaml: ")


@pytest.fixture(scope="module")
def easy(tmp_path_factory):
    """Prepared data, an untrained tiny policy, and pairs with an easy preference: both responses
    share the start of a prepared answer, the chosen one ends with "great", the rejected "awful"."""
    root = tmp_path_factory.mktemp("kto")
    prepare_run(from_dict(DataConfig, TINY["data"], "params.yaml: "), root / "data")
    sft, _ = tiny_policy_and_reward_model(root / "models", root / "data")
    return root / "data", sft, write_easy_pairs(root / "data", root)


def test_kto_learns_an_easy_preference_from_unpaired_examples(easy, tmp_path):
    data, sft, pairs = easy
    params = from_dict(Params, merge({k: v for k, v in TINY.items() if k != "data"}, {"kto": {
        "batch_size": 8, "epochs": 3.0, "eval_every": 3, "save_every": 3, "n_eval_prompts": 4, "lr": 3e-3,
        "beta": 0.5, "dataset": {"path": pairs}}}), "params.yaml: ")
    out = tmp_path / "kto"
    metrics = kto.run(params, data, sft, out, progress=False)
    rows = list(csv.DictReader(open(out / "train.tsv"), delimiter="\t"))
    held = list(csv.DictReader(open(out / "eval.tsv"), delimiter="\t"))
    # Step 1: the policy is the reference: every reward 0, z_ref 0, each term lambda sigmoid(0) = 1/2.
    assert float(rows[0]["loss"]) == pytest.approx(0.5, abs=1e-6)
    assert float(rows[0]["kl"]) == 0.0 and float(rows[0]["margin"]) == pytest.approx(0.0, abs=1e-6)
    # Half the pairs gave a desirable "great", the other half an undesirable "awful": no example has its partner.
    n_pairs = len((Path(pairs.replace("{split}", "train"))).read_text().splitlines())
    assert (metrics["data/desirable"], metrics["data/undesirable"]) == ((n_pairs + 1) // 2, n_pairs // 2)
    assert len(rows) == round(math.ceil(n_pairs / 8) * 3)
    # Learned: the held-out loss falls, desirable responses gain reward over the reference, undesirable ones lose it.
    assert metrics["eval/loss"] < float(held[0]["loss"]) and metrics["eval/margin"] > 0
    assert metrics["eval/desirable_reward"] > 0 > metrics["eval/undesirable_reward"]
    assert {"kto/kl", "kto/eos_rate", "resources/wall_seconds"} <= set(metrics)
    assert "kto/gold" not in metrics                             # the user's own pairs: no gold judge
    assert all(math.isfinite(v) for v in metrics.values())
    assert json.loads((out / "config.json").read_text())["kto"]["beta"] == 0.5
    assert (out / "model" / "model.safetensors").is_file()
