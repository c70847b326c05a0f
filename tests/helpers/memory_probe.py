"""Measured peak memory of one training stage's models and a few of its steps, on CPU.

    python tests/helpers/memory_probe.py STAGE DATA_DIR SFT_DIR RM_DIR

STAGE: sft, reward or ppo; sft-checkpointing is SFT with distributed.gradient_checkpointing.

Run as its own process (tests/unit/test_memory_plan.py starts one per stage, with a fixed glibc mmap
threshold, MALLOC_MMAP_THRESHOLD_, so that RSS follows live tensors: see the test's doc).
Prints one JSON line: `baseline` (resident bytes just before, with the high-water mark reset) and
`peak` (the resident set's high-water mark after, /proc/self/status VmHWM) around building the
stage's models and running its training steps with the tiny default's shapes. Before the baseline, a throwaway 1-layer model of the same
class runs a forward, backward and AdamW step, so torch's one-time costs (autograd engine, kernel
dispatch tables, thread pools) are paid outside the measured window.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pipeline.config import DistributedConfig, Params, PPOConfig, SamplingConfig, SFTConfig
from pipeline.data import inputs
from pipeline.data.tokenizer import load_tokenizer
from pipeline.models import reward_model as rm
from pipeline.models.checkpoints import init_policy
from pipeline.ppo.placement import place_models
from pipeline.ppo.trainer import PPOTrainer
from pipeline.training.demonstrations import ce_sum
from pipeline.training.engines import supervised_engine
from pipeline.context import SINGLE

# The PPO probe's params: the tiny default's batch shapes, with prompts cut to 16 tokens so every
# rollout reaches the longest sequence the plan assumes (prompt + max_new_tokens).
PPO_PROBE = PPOConfig(max_prompt_length=16, iterations=1, sampling=SamplingConfig(max_new_tokens=48))


def status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now; VmHWM: its high-water mark)."""
    with open("/proc/self/status", encoding="ascii") as f:
        return 1024 * int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak() -> int:
    """Start a fresh high-water mark (Linux >= 4.0: writing 5 to clear_refs resets VmHWM), so an
    earlier transient (imports, data loading) cannot hide the measured peak; returns RSS now."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return status("VmRSS")


def warm_up(vocab: int) -> None:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.zeros(2, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()
    with torch.no_grad():
        model(input_ids=torch.zeros(2, 4, dtype=torch.long), use_cache=True)


def supervised(stage: str, params: Params, data_dir: Path, sft_dir: Path) -> None:
    """Three optimizer steps on full-length micro-batches, as the stage's engine runs them."""
    cfg = getattr(params, stage)
    if stage == "sft":
        model, _ = init_policy(params.model, data_dir / "tokenizer", cfg.seed)
    else:
        model, _ = rm.init_reward_model(sft_dir, cfg.seed, None)
    engine, micro = supervised_engine(model, cfg, 10, SINGLE)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        rows = micro if stage == "sft" else 2 * micro   # a pair is two sequences
        ids = torch.randint(4, 150, (rows, cfg.max_length), generator=gen)
        mask = torch.ones_like(ids)
        if stage == "sft":
            loss, n = ce_sum(engine.model, {"input_ids": ids, "attention_mask": mask, "labels": ids})
            loss = loss / n
        else:
            scores = rm.raw_scores(engine.model, ids, mask)
            loss, _ = rm.pairwise_loss(scores[:micro], scores[micro:])
        engine.backward(loss)
        engine.step()


def ppo(params: Params, data_dir: Path, sft_dir: Path, rm_dir: Path) -> None:
    """One PPO iteration of the stage's trainer: rollout, scoring, ppo_epochs of updates."""
    prompts = inputs.prompt_records(params, data_dir, "train")
    models = place_models(params, sft_dir, rm_dir, SINGLE)
    prompts, _, _ = inputs.fit_prompts(prompts, models.tok, params.ppo.max_prompt_length, params.ppo.overlong,
                                      "ppo.max_prompt_length")
    PPOTrainer(params.ppo, models, prompts).step()


def main() -> None:
    stage, data_dir, sft_dir, rm_dir = sys.argv[1], *map(Path, sys.argv[2:5])
    torch.manual_seed(0)
    params = Params(ppo=PPO_PROBE)
    if stage == "sft-checkpointing":
        stage, params = "sft", Params(ppo=PPO_PROBE, sft=SFTConfig(distributed=DistributedConfig(gradient_checkpointing=True)))
    warm_up(len(load_tokenizer(data_dir / "tokenizer")))
    baseline = reset_peak()
    if stage == "ppo":
        ppo(params, data_dir, sft_dir, rm_dir)
    else:
        supervised(stage, params, data_dir, sft_dir)
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))


if __name__ == "__main__":
    main()
