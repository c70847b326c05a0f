"""The hub rehearsal's base (scripts/hub_rehearsal.py, pipeline/workflow/hub_rehearsal.py) and a tiny
run of recipes/hub-rehearsal.yaml from it: a checkpoint packaged as hub checkpoints are (bf16, a
byte-level BPE with a chat template, two end ids, no pad, tied embeddings) goes through SFT, the
reward model, PPO and evaluate, trained as fp32 master weights at the recipe's learning rates."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, merge

spec = importlib.util.spec_from_file_location("hub_rehearsal_script", REPO / "scripts" / "hub_rehearsal.py")
script = importlib.util.module_from_spec(spec)
sys.modules["hub_rehearsal_script"] = script
spec.loader.exec_module(script)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The base built as `scripts/hub_rehearsal.py base` builds it, on the tiny data and a few steps."""
    out = tmp_path_factory.mktemp("hub") / "base"
    return script.build_base(out, data_over=TINY["data"],
                             sft_over={"epochs": 1.0, "batch_size": 16, "n_eval_generations": 4,
                                       "sampling": {"max_new_tokens": 8}})


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_base_is_packaged_as_hub_checkpoints_are(base):
    from transformers import AutoTokenizer

    config, gen, tok = _json(base / "config.json"), _json(base / "generation_config.json"), AutoTokenizer.from_pretrained(base)
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True and config.get("pad_token_id") is None
    assert tok.pad_token is None and tok.eos_token == "<|im_end|>" and type(tok).__name__.startswith("Qwen2Tokenizer")
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.apply_chat_template([{"role": "user", "content": "Review the film Lost River ."}],
                                   add_generation_prompt=True, tokenize=False).endswith("<|im_start|>assistant\n")
    assert not (base.parent / f".{base.name}.build").exists()   # the build's scratch folder is gone


def test_a_tiny_run_of_the_recipe_trains_fp32_master_weights_from_the_bf16_base(base, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from pipeline.config import Params, from_dict
    from pipeline.stages import evaluate, ppo, reward, sft
    from pipeline.stages.prepare import write as prepare_run

    recipe = script._yaml(script.RECIPE)
    lrs = {stage: {"lr": recipe[stage]["lr"]} for stage in ("sft", "reward")}
    assert lrs == {"sft": {"lr": 2e-5}, "reward": {"lr": 2e-5}}
    params = from_dict(Params, merge(merge(TINY, lrs), {"model": {"name_or_path": str(base)},
                                                         "sft": {"max_length": 128}, "reward": {"max_length": 128}}),
                       "tiny hub rehearsal: ")
    prepare_run(params.data, tmp_path / "data")
    sft.run(params, tmp_path / "data", tmp_path / "sft", progress=False)
    reward.run(params, tmp_path / "data", tmp_path / "sft/model", tmp_path / "reward", progress=False)
    ppo.run(params, tmp_path / "data", tmp_path / "sft/model", tmp_path / "reward/model", tmp_path / "ppo",
            progress=False)
    evaluate.run(params, tmp_path / "data", tmp_path / "sft/model", tmp_path / "reward/model", tmp_path / "ppo/model",
                 tmp_path / "evaluate")

    fp32 = {"weights": "float32", "optimizer_states": "float32", "compute": "float32"}
    for stage in ("sft", "reward", "ppo"):
        assert _json(tmp_path / stage / "config.json")["runtime"]["dtypes"] == fp32, stage
    # Trained as fp32 master weights: at 2e-5 nearly every weight moves, where weights trained in
    # bf16 keep most values (an update under half a bf16 ulp rounds away).
    assert script.share_moved(base, tmp_path / "sft/model") > 0.99
    saved = AutoTokenizer.from_pretrained(tmp_path / "ppo/model")
    hub = AutoTokenizer.from_pretrained(base)
    assert len(saved) == len(hub) and saved.pad_token == "<|vision_pad|>"   # one of its own tokens, no new row
    for stage in ("sft", "ppo"):
        assert GenerationConfig.from_pretrained(tmp_path / stage / "model").eos_token_id == \
            _json(base / "generation_config.json")["eos_token_id"], stage
    ev = _json(tmp_path / "evaluate" / "metrics.json")
    assert all(torch.isfinite(torch.tensor(ev[p]["gold"])) for p in ("sft", "ppo"))
    assert 0.0 <= ev["win_rate"]["ppo_vs_sft_gold_low"] <= ev["win_rate"]["ppo_vs_sft_gold_high"] <= 1.0
