"""The `dpo` stage (pipeline/stages/dpo.py): its cached reference log-probs, a DPO run that learns an
easy preference, IPO and SimPO losses against the loss functions by hand, resume, config and bad input."""

from __future__ import annotations

import contextlib
import csv
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY, assert_same_run, merge, tiny_policy_and_reward_model, write_easy_pairs
from pipeline.config import DataConfig, Params, from_dict
from pipeline.data.preferences import Pair, load_pairs
from pipeline.errors import ConfigError, DataError
from pipeline.models.checkpoints import load_policy
from pipeline.preference.logprobs import TokenPair, fit_pairs, pair_logprobs, response_lengths
from pipeline.preference.losses import ipo_loss, simpo_loss
from pipeline.stages import dpo, pair_method
from pipeline.stages.registry import load_params   # the CLI's: `dpo.method` checked against the registered losses
from pipeline.stages.prepare import write as prepare_run
from pipeline.training import supervised



@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo_data")
    prepare_run(from_dict(DataConfig, TINY["data"], "params.yaml: "), root / "data")
    return root / "data"


@pytest.fixture(scope="module")
def sft_dir(data, tmp_path_factory) -> Path:
    """An untrained tiny policy on the prepared tokenizer: DPO only needs a starting point."""
    sft, _ = tiny_policy_and_reward_model(tmp_path_factory.mktemp("dpo_models"), data)
    return sft


@pytest.fixture(scope="module")
def easy_pairs(data, tmp_path_factory) -> str:
    """The prepared prompts with an easy preference: both responses share the start of a prepared
    answer, the chosen one ends with "great", the rejected one with "awful"."""
    return write_easy_pairs(data, tmp_path_factory.mktemp("easy"))


def _params(**dpo) -> Params:
    d = merge({k: v for k, v in TINY.items() if k != "data"},
              {"dpo": merge({"batch_size": 8, "epochs": 1.0, "eval_every": 2, "save_every": 2, "n_eval_prompts": 4,
                             "lr": 3e-3}, dpo)})
    return from_dict(Params, d, "params.yaml: ")


def _rows(path: Path) -> list[dict]:
    return list(csv.DictReader(open(path), delimiter="\t"))


def _tokens(params: Params, data: Path, tok) -> list[TokenPair]:
    train, _, _ = pair_method.read_inputs(dpo.METHOD, params, data)
    return [tokens for _, tokens in fit_pairs(train, tok, params.dpo.max_length, params.dpo.overlong, "dpo")[0]]


# ---- The reference log-probs ---------------------------------------------------------------------

@pytest.mark.parametrize("lora_r", [0, 4])
def test_cached_reference_equals_the_frozen_sft_model_on_the_fly(lora_r, data, sft_dir, easy_pairs, tmp_path,
                                                                 monkeypatch):
    """Every micro-batch the loss sees (training and held-out) carries reference log-probs equal to
    the frozen SFT model's, computed on the fly on that very micro-batch; under LoRA too (the
    reference is the policy's engine with its adapter off, never the trained adapter)."""
    seen: list[tuple[list[TokenPair], torch.Tensor, torch.Tensor]] = []
    real = dpo.preference_loss

    def spy(cfg, part, logp_chosen, logp_rejected):
        seen.append(([s.tokens for s in part], torch.tensor([s.ref_chosen for s in part]),
                     torch.tensor([s.ref_rejected for s in part])))
        return real(cfg, part, logp_chosen, logp_rejected)
    monkeypatch.setattr(dpo, "preference_loss", spy)
    params = _params(epochs=0.5, dataset={"path": easy_pairs}, lora={"r": lora_r})
    dpo.run(params, data, sft_dir, tmp_path / "out", progress=False)

    frozen, tok = load_policy(sft_dir)
    frozen.eval().requires_grad_(False)
    assert len(seen) >= 3 + 2                         # 3 training steps, then held-out evaluations
    with torch.no_grad():
        for tokens, ref_chosen, ref_rejected in seen:
            chosen, rejected = pair_logprobs(frozen, tokens, tok.pad_token_id)
            torch.testing.assert_close(ref_chosen, chosen, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(ref_rejected, rejected, rtol=1e-6, atol=1e-6)
    # The trained policy did move away from it (so the equality above is not that of an untrained run).
    trained, _ = load_policy(tmp_path / "out/model")
    tokens = seen[0][0]
    with torch.no_grad():
        assert not torch.allclose(pair_logprobs(trained, tokens, tok.pad_token_id)[0], seen[0][1], atol=1e-3)


def test_wrong_reference_shape_is_a_clear_error():
    pairs = [TokenPair([1, 2], [3, 4], [5, 4]), TokenPair([1], [3], [5])]
    with pytest.raises(ValueError, match=r"ref_chosen: the reference log-probs of 2 pairs must have shape \(2,\), "
                                         r"got \(2, 1\)"):
        dpo.attach_reference(pairs, torch.zeros(2, 1), torch.zeros(2))
    with pytest.raises(ValueError, match=r"ref_rejected: .* got \(3,\)"):
        dpo.attach_reference(pairs, torch.zeros(2), torch.zeros(3))
    scored = dpo.attach_reference(pairs, torch.tensor([-1.5, -2.0]), torch.tensor([-3.0, -4.0]))
    assert [(s.ref_chosen, s.ref_rejected) for s in scored] == [(-1.5, -3.0), (-2.0, -4.0)]


# ---- Training ------------------------------------------------------------------------------------

def test_dpo_learns_an_easy_preference_and_writes_a_loadable_policy(data, sft_dir, easy_pairs, tmp_path):
    out = tmp_path / "dpo"
    metrics = dpo.run(_params(epochs=2.0, beta=0.1, dataset={"path": easy_pairs}), data, sft_dir, out, progress=False)

    train, held = _rows(out / "train.tsv"), _rows(out / "eval.tsv")
    assert len(train) == 12 and [int(r["step"]) for r in held] == [2, 4, 6, 8, 10, 12]
    # Step 1: the policy is the reference, every implicit reward is 0: loss log 2, accuracy 0 (ties lose).
    assert float(train[0]["loss"]) == pytest.approx(math.log(2), rel=1e-5)
    assert float(train[0]["accuracy"]) == 0.0 and float(train[0]["margin"]) == 0.0
    assert metrics["eval/accuracy"] >= 0.9 > 0.5                       # 16 held-out pairs, chance is 1/2
    assert metrics["eval/margin"] > 0 and metrics["eval/loss"] < math.log(2)
    assert metrics["eval/chosen_reward"] > metrics["eval/rejected_reward"]
    # Drift = the policy's mean log-prob minus the reference's, on the same held-out responses.
    assert metrics["eval/chosen_logp_drift"] - metrics["eval/rejected_logp_drift"] == \
        pytest.approx(metrics["eval/margin"] / 0.1, rel=1e-4)
    expected = {"train/loss", "train/steps", "train/seconds", "train/skipped_updates", "train/accuracy",
                "train/margin", "train/pad_share", "eval/loss", "eval/accuracy", "eval/margin", "eval/chosen_logp", "eval/rejected_logp", "eval/chosen_reward",
                "eval/rejected_reward", "eval/chosen_logp_drift", "eval/rejected_logp_drift", "data/truncated",
                "data/dropped", "data/eval_truncated", "data/eval_dropped", "dpo/kl", "dpo/kl_ci95",
                "dpo/eos_rate", "dpo/length", "dpo/distinct_2",
                "resources/wall_seconds", "resources/peak_rss_gib", "resources/gpus", "resources/measure_imbalance"}
    assert set(metrics) == expected                              # the user's own pairs: no gold judge
    assert all(math.isfinite(v) for v in metrics.values())
    written = json.loads((out / "metrics.json").read_text())
    assert written["eval"]["accuracy"] == metrics["eval/accuracy"]
    assert json.loads((out / "config.json").read_text())["dpo"]["method"] == "dpo"
    assert load_file(out / "model/model.safetensors")
    policy, _ = load_policy(out / "model")
    assert type(policy).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("method", ["ipo", "simpo"])
def test_ipo_and_simpo_first_step_equals_the_loss_by_hand(method, data, sft_dir, easy_pairs, tmp_path):
    """One step on one batch of all 48 training pairs: train.tsv's loss is the loss function applied
    by hand to the SFT model's log-probs of those pairs (for IPO, with the policy as its own
    reference at step 0: h = 0 and the loss is (1 / (2 beta))^2 = 25 exactly)."""
    params = _params(method=method, batch_size=48, beta=0.1 if method == "ipo" else 2.0,
                     dataset={"path": easy_pairs})
    out = tmp_path / method
    metrics = dpo.run(params, data, sft_dir, out, progress=False)
    assert metrics["train/steps"] == 1
    logged = float(_rows(out / "train.tsv")[0]["loss"])

    model, tok = load_policy(sft_dir)
    tokens = _tokens(params, data, tok)
    with torch.no_grad():
        chosen, rejected = pair_logprobs(model.eval(), tokens, tok.pad_token_id)
    if method == "ipo":
        by_hand, _ = ipo_loss(chosen, rejected, chosen, rejected, beta=0.1)
        assert by_hand.item() == pytest.approx(25.0, rel=1e-6)
    else:
        by_hand, _ = simpo_loss(chosen, rejected, *response_lengths(tokens), beta=2.0, gamma=0.5)
    assert math.isfinite(logged) and logged == pytest.approx(by_hand.item(), rel=1e-5)


# ---- Resume --------------------------------------------------------------------------------------


def test_killed_and_resumed_equals_uninterrupted(data, sft_dir, tmp_path, monkeypatch):
    """On the prepared pairs (so the gold judge measures the policy too): killed in step 4 after the
    save of step 2, the re-run resumes and ends with the uninterrupted run's weights, logs and metrics."""
    params = _params()
    full = dpo.run(params, data, sft_dir, tmp_path / "full", progress=False)
    assert "dpo/gold" in full and math.isfinite(full["dpo/gold"])

    real = supervised.check_finite

    def dying(at, name, value):
        if at == "dpo step 4":
            raise KeyboardInterrupt
        return real(at, name, value)
    monkeypatch.setattr(supervised, "check_finite", dying)
    with pytest.raises(KeyboardInterrupt):
        dpo.run(params, data, sft_dir, tmp_path / "resumed", progress=False)
    state = json.loads((tmp_path / "resumed/checkpoint/state.json").read_text())
    assert state["step"] == 2 and not (tmp_path / "resumed/model").exists()
    monkeypatch.undo()
    resumed = dpo.run(params, data, sft_dir, tmp_path / "resumed", progress=False)

    assert_same_run(tmp_path / "full", tmp_path / "resumed", full, resumed)


# ---- Config and bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("section, message", [
    ({"bogus": 1}, "params.yaml: dpo.bogus: unknown key"),
    ({"beta": 0.0}, "params.yaml: dpo.beta: expected a positive float, got 0.0 (float)"),
    ({"beta": -1}, "params.yaml: dpo.beta: expected a positive float, got -1.0 (float)"),
    ({"label_smoothing": 0.5}, "params.yaml: dpo.label_smoothing: expected a float >= 0.0 and < 0.5, got 0.5 (float)"),
    ({"method": "kto"}, "params.yaml: dpo.method: expected one of 'dpo', 'ipo', 'simpo', got 'kto'"),
    ({"dataset": {"margin_column": "m"}}, "params.yaml: dpo.dataset.margin_column: DPO, IPO and SimPO use no "
                                          "per-pair margin"),
])
def test_bad_dpo_params_are_refused_naming_the_key(section, message, tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps({"dpo": section}))              # JSON is YAML
    with pytest.raises(ConfigError) as err, contextlib.chdir(tmp_path):
        load_params("params.yaml")                              # as `--params params.yaml` names it
    assert str(err.value).startswith(message)


def test_params_without_a_dpo_section_load_with_its_defaults(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("distributed: {device_memory_gb: 4.0}\n")
    params = load_params(path)
    assert params.dpo.method == "dpo" and params.dpo.beta == 2.0
    assert params.dpo.distributed.device_memory_gb == 4.0     # the top-level distributed, merged like sft's


def test_overlong_pairs_follow_overlong_and_empty_sides_are_refused(tmp_path):
    from pipeline.data.tokenizer import build_word_tokenizer
    from pipeline.tasks import reviews
    tok = build_word_tokenizer(reviews.vocabulary())
    short = Pair("Review the film Lost River .", "the plot was good .", "the plot was bad .", where="p:1")
    long = Pair("Review the film Lost River .", "the plot was good . " * 6, "the plot was bad .", where="p:2")
    # short: 9 prompt + 6 answer tokens = 15; long: 9 + 31 = 40
    kept, truncated, dropped = fit_pairs([short, long], tok, 34, "truncate", "dpo")
    assert (truncated, dropped) == (1, 0) and len(kept[1][1].prompt) == 3 and len(kept[1][1].chosen) == 31
    assert kept[0][1].prompt == fit_pairs([short], tok, 96, "error", "dpo")[0][0][1].prompt   # fits: whole
    assert fit_pairs([short, long], tok, 34, "drop", "dpo")[1:] == (0, 1)
    with pytest.raises(DataError, match=r"^p:2: 40 tokens exceed dpo.max_length=34"):
        fit_pairs([short, long], tok, 34, "error", "dpo")
    with pytest.raises(DataError, match=r"^p:2: a response of 31 tokens leaves no room for the prompt"):
        fit_pairs([short, long], tok, 31, "truncate", "dpo")
    src = tmp_path / "pairs.jsonl"
    src.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": " "}) + "\n")
    with pytest.raises(DataError, match=r"pairs\.jsonl:1: field 'rejected' is empty"):
        load_pairs(src)


def test_cli_declares_the_stage_with_its_inputs():
    from pipeline.__main__ import _parser
    args = _parser().parse_args(["dpo", "--sft", "s", "--out", "o"])
    assert (args.data, args.sft, args.out, args.params) == (Path("data/prepared"), Path("s"), Path("o"),
                                                             Path("params.yaml"))
    assert dpo.SPEC.inputs == ("data", "sft") and dpo.SPEC.training
