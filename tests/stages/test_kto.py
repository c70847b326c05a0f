"""The `kto` stage (pipeline/stages/kto.py): its loss against the paper's formula written with
floats, its reference point (clamped, detached), the unpaired split and the mismatched pairing, a
step that does not depend on how its batch is split, and a run that learns an easy preference from
unpaired examples alone."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import pytest
import torch

from conftest import TINY, merge, tiny_policy_and_reward_model
from pipeline.config import DataConfig, Params, from_dict
from pipeline.data.preferences import Pair
from pipeline.errors import ConfigError
from pipeline.stages import kto
from pipeline.stages.prepare import write as prepare_run

D = torch.float64


def by_hand(logp, ref, desirable, kl, kl_ref, beta, lam_d, lam_u) -> tuple[float, float]:
    """The paper's loss with floats and loops: (mean over examples, z_ref)."""
    z = max(0.0, sum(a - b for a, b in zip(kl, kl_ref)) / len(kl))
    sig = lambda t: 1.0 / (1.0 + math.exp(-t))  # noqa: E731
    total = 0.0
    for lp, rf, d in zip(logp, ref, desirable):
        r = lp - rf
        total += lam_d * (1 - sig(beta * (r - z))) if d else lam_u * (1 - sig(beta * (z - r)))
    return total / len(logp), z


def random_batch(n: int, seed: int):
    g = random.Random(seed)
    logp = [g.uniform(-40, -5) for _ in range(n)]
    ref = [lp + g.gauss(0, 2) for lp in logp]
    kl = [g.uniform(-60, -10) for _ in range(n)]
    kl_ref = [k - g.gauss(0.3, 1) for k in kl]   # an estimate around 0.3, below 0 for some seeds
    des = [g.random() < 0.5 for _ in range(n)]
    des[0], des[-1] = True, False
    return logp, ref, des, kl, kl_ref


@pytest.mark.parametrize("n,seed,beta,lam_d,lam_u", [(2, 0, 0.1, 1.0, 1.0), (7, 1, 2.0, 1.0, 1.5),
                                                     (32, 2, 0.5, 1.33, 1.0), (5, 3, 5.0, 0.5, 2.0)])
def test_loss_equals_the_formula_by_hand(n, seed, beta, lam_d, lam_u):
    logp, ref, des, kl, kl_ref = random_batch(n, seed)
    z = kto.reference_point(torch.tensor(kl, dtype=D), torch.tensor(kl_ref, dtype=D))
    terms, rewards = kto.kto_loss(torch.tensor(logp, dtype=D), torch.tensor(ref, dtype=D), torch.tensor(des), z,
                                  beta, lam_d, lam_u)
    want, want_z = by_hand(logp, ref, des, kl, kl_ref, beta, lam_d, lam_u)
    assert float(z) == pytest.approx(want_z, abs=1e-12)
    assert float(terms.mean()) == pytest.approx(want, rel=1e-12)
    assert rewards.tolist() == pytest.approx([beta * (a - b) for a, b in zip(logp, ref)], rel=1e-12)


def test_reference_point_is_clamped_and_carries_no_gradient():
    kl = torch.tensor([-10.0, -12.0], dtype=D, requires_grad=True)
    assert float(kto.reference_point(kl, torch.tensor([-9.0, -11.0], dtype=D))) == 0.0   # estimate -1: clamped
    z = kto.reference_point(kl, torch.tensor([-11.0, -13.0], dtype=D))
    assert float(z) == 1.0 and not z.requires_grad
    logp = torch.tensor([-5.0, -6.0], dtype=D, requires_grad=True)
    terms, _ = kto.kto_loss(logp, torch.tensor([-5.0, -5.0], dtype=D), torch.tensor([True, False]), z, 1.0)
    terms.sum().backward()
    assert kl.grad is None
    # A desirable response is pushed up, an undesirable one down.
    assert logp.grad[0] < 0 < logp.grad[1]
    with pytest.raises(ValueError, match="detached scalar"):
        kto.kto_loss(logp, logp.detach(), torch.tensor([True, False]), kl.mean(), 1.0)
    with pytest.raises(ValueError, match=r"\(N,\)"):
        kto.kto_loss(logp[None], logp.detach()[None], torch.tensor([[True, False]]), z, 1.0)


def test_lambdas_weigh_each_kind():
    logp, ref, des, kl, kl_ref = random_batch(9, 4)
    z = kto.reference_point(torch.tensor(kl, dtype=D), torch.tensor(kl_ref, dtype=D))
    args = (torch.tensor(logp, dtype=D), torch.tensor(ref, dtype=D), torch.tensor(des), z, 1.0)
    one, _ = kto.kto_loss(*args, 1.0, 1.0)
    two, _ = kto.kto_loss(*args, 1.0, 2.0)
    undesirable = ~torch.tensor(des)
    assert torch.equal(two[~undesirable], one[~undesirable])
    assert torch.allclose(two[undesirable], 2 * one[undesirable], rtol=0, atol=1e-15)


def test_mismatched_pairs_every_prompt_with_another_response():
    for n in range(2, 40):
        out = kto.mismatched(n)
        assert sorted(out) == list(range(n)) and all(out[i] != i for i in range(n))
    with pytest.raises(ValueError, match="at least 2"):
        kto.mismatched(1)


def test_unpaired_halves_are_disjoint_and_no_example_has_its_partner():
    pairs = [Pair(f"prompt {i}", f"good {i}", f"bad {i}", 0.0, f"pairs:{i + 1}") for i in range(11)]
    examples = kto.unpaired(pairs, seed=3)
    assert len(examples) == 11
    good = [e for e in examples if e.margin > 0]
    assert len(good) == 6 and all(e.chosen.startswith("good") for e in good)              # the odd pair: desirable
    assert all(e.chosen.startswith("bad") for e in examples if e.margin == 0)
    sources = [e.chosen.split()[1] for e in examples]
    assert len(set(sources)) == 11                                    # one response of each pair, never both
    # The mismatched response is another example's own, each exactly once.
    assert sorted(e.rejected for e in examples) == sorted(e.chosen for e in examples)
    assert all(e.rejected != e.chosen for e in examples)
    assert kto.unpaired(pairs, seed=3) == examples and kto.unpaired(pairs, seed=4) != examples


def test_column_sums_are_the_batch_means_however_the_batch_is_split():
    """The loop sums each part's statistics and divides by the batch size: split in parts of any
    size, the per-kind columns come out as the batch's per-kind means."""
    logp, ref, des, _, _ = random_batch(12, 5)
    logp, ref, des = torch.tensor(logp, dtype=D), torch.tensor(ref, dtype=D), torch.tensor(des)
    z = torch.tensor(0.4, dtype=D)
    counts = (12, int(des.sum()), int((~des).sum()))

    def columns(step: int) -> list[float]:
        sums = [0.0] * len(kto.COLUMNS)
        for s in range(0, 12, step):
            terms, rewards = kto.kto_loss(logp[s:s + step], ref[s:s + step], des[s:s + step], z, 2.0)
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
    for split, name in (("train", "pairs_train.jsonl"), ("test", "pairs_eval.jsonl")):
        rows = [json.loads(line) for line in (root / "data" / name).read_text().splitlines()]
        with open(root / f"pairs_{split}.jsonl", "w") as f:
            for r in rows:
                base = " ".join(r["chosen"].split()[:6])
                f.write(json.dumps({"prompt": r["prompt"], "chosen": f"{base} great", "rejected": f"{base} awful"}) + "\n")
    return root / "data", sft, str(root / "pairs_{split}.jsonl")


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
