"""A memory plan before launch: bytes per rank of every stage, predicted from the configs alone.

Rows of a plan (bytes on one rank's device; what offload moves goes to the `cpu` side instead):
- weights, grads, optimizer of each trained model (`model_states`): AdamW keeps 2 fp32 states
  (8 bytes/param). fp32 training: 4 weights + 4 grads + 8 states. bf16/fp16 mixed precision
  (DeepSpeed): 2 weights + 2 grads in 16 bit, plus the fp32 copy of the gradients (4), the fp32
  master weights (4) and the states (8) -- the same 18 + 2 bytes DeepSpeed's estimators count
  (Rajbhandari et al. 2020, ZeRO, sec. 3 counts 16; DeepSpeed adds the fp32 gradient copy).
  ZeRO partitions over the data-parallel world size N: stage 1 the fp32 optimizer side (states,
  master weights, fp32 grads), stage 2 also the 16-bit grads, stage 3 also the weights, and then
  one gathered layer (its 16-bit weights and grads) is whole on every rank. With LoRA only the
  adapter trains: the base weights count as weights, grads and optimizer only the adapter.
- frozen: PPO's reference and reward models (and evaluate's policies): weights only, in 16 bit
  under mixed precision, partitioned at stage 3, on the CPU with `offload_frozen`.
- activations of one training micro-batch (b sequences of s tokens, model width h, a heads, L
  layers): Korthikanti et al. 2022 (eq. 2, no tensor parallelism) store L * s*b*h*(34 + 5*a*s/h)
  bytes in 16 bit; we add 8*s*b*h per layer for what a Llama block keeps beyond their GPT block,
  and count the attention scores only under eager attention, as 2*a*s/h (the softmax output; no
  dropout here; SDPA and flash kernels, transformers' default, never store the scores); in fp32 every stored tensor is twice as wide, so we double it (an overcount
  for the 1-byte dropout masks, which these models, run without dropout, never allocate). The
  language-model head adds b*s*V logits in the working dtype plus the fp32 copy and the gradient
  of the cross-entropy (4 + 4 bytes each). PPO's actor and critic are both live in one micro-step.
- KV cache of the rollout: 2 * L * kv_heads * head_dim * tokens * bytes for every sequence of the
  rank's rollout batch (prompt + response tokens, the longest allowed).
- total = weights + grads + optimizer + frozen + max(activations, KV cache): sampling and the
  update never overlap (the rollout's cache is freed before the first training forward).

Not counted: the CUDA context and allocator fragmentation (a few hundred MiB to ~1 GiB on a GPU:
that is why a plan within 10% of the device warns), DeepSpeed's communication buckets, the
(B, R) per-token tensors of a rollout batch (kilobytes to megabytes), Python objects, and the
transient fp32 copy each process holds while loading a checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from ..config import DistributedConfig, Params
from ..errors import ConfigError
from .memory_terms import (  # noqa: F401 -- the terms are this module's too
    ROWS, ModelShape, Plan, activation_bytes, checkpoint_shape, frozen_states, inference_plan, kv_cache_bytes,
    model_states, rl_plan, shape_of, supervised_plan, working_bytes,
)

log = logging.getLogger(__name__)

GIB = 2 ** 30
WARN_FRACTION = 0.9   # a plan above 90% of the device warns: allocator and CUDA context are not counted


# ---- Device and verdict --------------------------------------------------------------------------


def device_memory(dist: DistributedConfig) -> tuple[float, str]:
    """Bytes one rank may use, and where the number comes from: `distributed.device_memory_gb`
    when set; else the free memory of this process's CUDA device; else this machine's available RAM."""
    if dist.device_memory_gb is not None:
        return dist.device_memory_gb * GIB, "distributed.device_memory_gb"
    import torch
    if torch.cuda.is_available():
        return float(torch.cuda.mem_get_info()[0]), f"free on {torch.cuda.get_device_name()}"
    import psutil
    return float(psutil.virtual_memory().available), "available RAM"


def advice(stage: str, plan: Plan, dist: DistributedConfig) -> str:
    """The params that would shrink the largest rows, in the order worth trying."""
    section = f"{stage}.distributed" if stage != "evaluate" else "distributed"
    tips = []
    if stage != "evaluate":
        if dist.backend == "none":
            tips.append(f"set {section}.backend: deepspeed with zero_stage and precision: bf16")
        elif dist.zero_stage < 3:
            tips.append(f"raise {section}.zero_stage")
        if dist.backend == "deepspeed" and not dist.offload_optimizer:
            tips.append(f"set {section}.offload_optimizer")
        if stage == "ppo" and plan.device["frozen"] and not dist.offload_frozen:
            tips.append(f"set {section}.offload_frozen")
    batch = {"sft": "sft.batch_size or sft.max_length", "reward": "reward.batch_size or reward.max_length",
             "ppo": "ppo.micro_batch_size or ppo.rollout_batch_size",
             "evaluate": "ppo.max_prompt_length or ppo.sampling.max_new_tokens"}.get(stage, "the batch size")
    tips.append(f"lower {batch}")
    return ", ".join(tips)


def verdict(plan: Plan, available: float, source: str, dist: DistributedConfig) -> Optional[str]:
    """None when the plan fits with 10% to spare; a warning text when it fits narrowly.
    Raises ConfigError (one line naming the params to change) when it does not fit."""
    if plan.total > available:
        raise ConfigError(f"{plan.stage}: plan {plan.total / GIB:.3g} GiB > {available / GIB:.3g} GiB device "
                          f"({source}): {advice(plan.stage, plan, dist)}")
    if plan.total > WARN_FRACTION * available:
        return (f"{plan.stage}: plan {plan.total / GIB:.3g} GiB is within 10% of the {available / GIB:.3g} GiB "
                f"device ({source}), which leaves little for the allocator and CUDA context; to gain room: "
                f"{advice(plan.stage, plan, dist)}")
    return None


def table(plan: Plan, available: float, source: str) -> str:
    """The plan as a text table, GiB per rank."""
    def gib(x: float) -> str:
        return f"{x / GIB:10.4f}"
    lines = [f"{plan.stage + ' (GiB per rank)':<24}{'device':>8} {'cpu':>10}"]
    for row in ROWS:
        lines.append(f"  {row:<20}{gib(plan.device[row])} {gib(plan.cpu[row])}")
    lines.append(f"  {'total':<20}{gib(plan.total)} {gib(plan.cpu_total)}")
    lines.append(f"  {'device memory':<20}{gib(available)}  ({source})")
    lines.append(f"  {'headroom':<20}{gib(available - plan.total)}")
    return "\n".join(lines)


# ---- Plans of the pipeline's stages ----------------------------------------------------------------

STAGES = ("sft", "reward", "ppo", "dpo", "rs", "grpo", "evaluate")
GENERATION_BATCH = 64   # prompts per sampling call of evaluation (pipeline/models/generation.py's default)


def _with_dtype(m: ModelShape, dtype: str, attn: Optional[str] = None) -> ModelShape:
    """`model.dtype` (other than auto) decides the bytes a loaded model's weights take, and
    `model.attn_implementation` (when set) whether attention stores its scores."""
    m = replace(m, eager_attention=attn == "eager") if attn is not None else m
    return m if dtype == "auto" else replace(m, saved_bytes=4 if dtype == "float32" else 2)


def policy_config(params: Params, data_dir: Optional[Path]) -> Any:
    """The transformers config of the SFT starting point as `model` describes it: the tiny model on
    the prepared tokenizer, or `model.name_or_path`'s."""
    cfg = params.model
    if cfg.name_or_path is not None:
        from transformers import AutoConfig

        from ..errors import loading
        with loading(cfg.name_or_path, "config"):
            return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    from ..data.tokenizer import load_tokenizer
    from ..models.checkpoints import tiny_config
    if data_dir is None:
        raise ConfigError("model.name_or_path: null builds the tiny model on the prepared tokenizer; "
                          "pass --data (the prepare stage's folder)")
    return tiny_config(cfg, load_tokenizer(Path(data_dir) / "tokenizer"))


def sft_plan(params: Params, policy: ModelShape) -> Plan:
    cfg = params.sft
    dist = cfg.distributed
    micro = cfg.batch_size // (dist.world_size * dist.gradient_accumulation_steps)
    plan = supervised_plan("sft", policy, dist, micro, cfg.max_length, cfg.lora)
    # Its evaluation samples afterwards (plain forward, cache of GENERATION_BATCH prompts).
    tokens = params.ppo.max_prompt_length + cfg.sampling.max_new_tokens
    plan.add("kv_cache", kv_cache_bytes(policy, GENERATION_BATCH, tokens, working_bytes(dist, policy.saved_bytes)))
    return plan


def reward_plan(params: Params, rm: ModelShape) -> Plan:
    cfg = params.reward
    dist = cfg.distributed
    micro = cfg.batch_size // (dist.world_size * dist.gradient_accumulation_steps)
    # Each pair is two sequences (chosen, rejected) in one forward.
    return supervised_plan("reward", rm, dist, 2 * micro, cfg.max_length, cfg.lora)


def dpo_plan(params: Params, policy: ModelShape) -> Plan:
    """The policy trained on pairs (chosen and rejected of each pair in one forward), then sampled on
    the held-out prompts as in ppo.sampling. The reference log-probs are computed by the same model
    before training, so no second model is resident."""
    cfg = params.dpo
    dist = cfg.distributed
    micro = cfg.batch_size // (dist.world_size * dist.gradient_accumulation_steps)
    plan = supervised_plan("dpo", policy, dist, 2 * micro, cfg.max_length, cfg.lora)
    tokens = params.ppo.max_prompt_length + params.ppo.sampling.max_new_tokens
    plan.add("kv_cache", kv_cache_bytes(policy, GENERATION_BATCH, tokens, working_bytes(dist, policy.saved_bytes)))
    return plan


def rs_plan(params: Params, policy: ModelShape) -> Plan:
    """The policy fine-tuned on the winners as SFT trains, and sampled before (the candidates, as
    rs.sampling) and after (the held-out prompts, as ppo.sampling). The reward model that scores
    the candidates is freed before the first training step; its weights next to the sampler's are
    below the trained policy's weights, gradients and AdamW states."""
    cfg = params.rs
    dist = cfg.distributed
    micro = cfg.batch_size // (dist.world_size * dist.gradient_accumulation_steps)
    plan = supervised_plan("rs", policy, dist, micro, cfg.max_length, cfg.lora)
    tokens = params.ppo.max_prompt_length + max(cfg.sampling.max_new_tokens, params.ppo.sampling.max_new_tokens)
    plan.add("kv_cache", kv_cache_bytes(policy, GENERATION_BATCH, tokens, working_bytes(dist, policy.saved_bytes)))
    return plan


def ppo_plan(params: Params, actor: ModelShape, critic: Optional[ModelShape], reward: Optional[ModelShape],
             extra_frozen: tuple[ModelShape, ...] = (), section: str = "ppo") -> Plan:
    """The PPO trainer as `section` (ppo, or grpo) configures it: no critic with a critic-free
    estimator or a shared backbone; rollout_batch_size counts responses, k per prompt."""
    cfg = getattr(params, section)
    k = cfg.samples_per_prompt
    return rl_plan(section, actor, cfg.distributed, micro_batch=cfg.micro_batch_size,
                   rollout_batch=cfg.rollout_batch_size // k, samples_per_prompt=k,
                   prompt_length=cfg.max_prompt_length, response_length=cfg.sampling.max_new_tokens,
                   critic=None if cfg.shared_backbone or not cfg.uses_critic else critic,
                   reward=reward if cfg.reward_source == "reward_model" else None, extra_frozen=extra_frozen,
                   lora=cfg.lora, critic_lora=cfg.critic_lora)


def evaluate_plan(params: Params, policy: ModelShape, rm: ModelShape) -> Plan:
    """SFT and PPO policies and the reward model, sampling GENERATION_BATCH prompts at a time."""
    tokens = params.ppo.max_prompt_length + params.ppo.sampling.max_new_tokens
    return inference_plan("evaluate", policy, (policy, policy, rm), GENERATION_BATCH, tokens)


def planned(params: Params, data_dir: Optional[Path], stages: tuple[str, ...] = STAGES) -> list[Plan]:
    """Every stage's plan from the params alone (before any checkpoint exists): the reward model is
    `reward.name_or_path` or the policy with a scalar head."""
    hf = policy_config(params, data_dir)
    mc = params.model
    policy, scalar = (_with_dtype(shape_of(hf, head), mc.dtype, mc.attn_implementation) for head in (False, True))
    rcfg = params.reward
    rm = (_with_dtype(checkpoint_shape(rcfg.name_or_path, True, mc.trust_remote_code), mc.dtype, mc.attn_implementation)
          if rcfg.name_or_path is not None else scalar)
    critic = rm if params.ppo.critic_init == "reward" else scalar
    det = params.ppo.detector
    auditors = (rm,) if det.enabled and det.auditor is not None else ()   # a second reward model, same size assumed
    build = {"sft": lambda: sft_plan(params, policy), "reward": lambda: reward_plan(params, rm),
             "ppo": lambda: ppo_plan(params, policy, critic, rm, auditors),
             "dpo": lambda: dpo_plan(params, policy),
             "rs": lambda: rs_plan(params, policy),
             "grpo": lambda: ppo_plan(params, policy, rm if params.grpo.critic_init == "reward" else scalar, rm,
                                      (rm,) if params.grpo.detector.enabled and params.grpo.detector.auditor else (),
                                      section="grpo"),
             "evaluate": lambda: evaluate_plan(params, policy, rm)}
    return [build[s]() for s in stages]


def stage_plan(stage: str, params: Params, folders: dict[str, Any]) -> Optional[Plan]:
    """A training stage's plan from its inputs: the models it will load are read from their
    configs (`folders`: its input folders by name, as its SPEC lists them)."""
    trust = params.model.trust_remote_code
    if stage == "reward":
        needed: tuple[str, ...] = ("sft",) if params.reward.name_or_path is None else ()
    else:
        needed = {"sft": ("data",), "ppo": ("sft", "reward"), "dpo": ("sft",), "rs": ("sft", "reward"), "grpo": ("sft", "reward")}[stage]
    if not all(Path(folders[k], "tokenizer" if k == "data" else "config.json").exists() for k in needed):
        return None   # a missing input: the stage's own loading reports it, with its own message
    if stage == "sft":
        mc = params.model
        return sft_plan(params, _with_dtype(shape_of(policy_config(params, folders["data"])), mc.dtype, mc.attn_implementation))
    if stage == "reward":
        name = params.reward.name_or_path
        rm = checkpoint_shape(name if name is not None else folders["sft"], True, trust)
        mc = params.model
        return reward_plan(params, _with_dtype(rm, mc.dtype, mc.attn_implementation) if name is not None else rm)
    if stage == "dpo":
        return dpo_plan(params, checkpoint_shape(folders["sft"], False, trust))
    if stage == "rs":
        return rs_plan(params, checkpoint_shape(folders["sft"], False, trust))
    cfg = getattr(params, stage)   # ppo, or grpo (the same trainer)
    actor = checkpoint_shape(folders["sft"], False, trust)
    rm = checkpoint_shape(folders["reward"], True, trust) if cfg.reward_source == "reward_model" else None
    critic = (checkpoint_shape(folders["reward"] if cfg.critic_init == "reward" else folders["sft"], True, trust)
              if cfg.uses_critic else None)
    det = cfg.detector
    auditors = (checkpoint_shape(det.auditor, True, trust),) \
        if det.enabled and det.auditor is not None and Path(det.auditor, "config.json").exists() else ()
    return ppo_plan(params, actor, critic, rm, auditors, section=stage)


def check_stage(stage: str, params: Params, folders: dict[str, Any], is_main: bool = True) -> Optional[Plan]:
    """Before a training stage builds a model: refuse (ConfigError) a plan that does not fit the
    device, warn (rank 0) about one within 10% of it."""
    plan = stage_plan(stage, params, folders)
    if plan is None:
        return None
    dist = getattr(params, stage).distributed
    available, source = device_memory(dist)
    warning = verdict(plan, available, source, dist)
    if warning and is_main:
        log.warning(warning)
    return plan


def main(params: Params, data_dir: Optional[Path], stage: Optional[str] = None) -> int:
    """`python -m pipeline plan`: every stage's table (or one stage's); a stage that does not fit
    raises ConfigError after all tables are printed (exit 2)."""
    refusals = []
    for plan in planned(params, data_dir, (stage,) if stage else STAGES):
        dist = params.distributed if plan.stage == "evaluate" else getattr(params, plan.stage).distributed
        available, source = device_memory(dist)
        print(table(plan, available, source))
        try:
            warning = verdict(plan, available, source, dist)
            if warning:
                print(f"warning: {warning}")
        except ConfigError as err:
            refusals.append(str(err))
    if refusals:
        raise ConfigError("; ".join(refusals))
    return 0
