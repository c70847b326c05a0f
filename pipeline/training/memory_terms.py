"""The terms of a memory plan (pipeline/training/memory_plan.py, whose doc lists them): bytes per
rank of model states, activations and KV caches, from model shapes and `distributed` settings."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import DistributedConfig, LoraConfig

ROWS = ("weights", "grads", "optimizer", "frozen", "activations", "kv_cache")


# ---- Model sizes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model, read from its config (built on the meta device)."""
    params: int                  # all parameters, tied ones once
    largest_layer: int           # parameters of the largest module (own, not its children's): ZeRO-3 gathers it whole
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int                   # logits per position of a language-model head; 0 for a scalar head
    linears: tuple[tuple[str, int, int], ...] = ()   # (name, in, out) of the linears LoRA may target
    saved_bytes: int = 4         # bytes per weight as the checkpoint holds it (float32 4, bf16/fp16 2)
    eager_attention: bool = False  # eager attention stores the (a, s, s) scores; SDPA/flash kernels do not

    def adapter_params(self, lora: LoraConfig) -> int:
        """Trainable parameters of LoRA adapters: r * (in + out) for every targeted linear
        ("all-linear" as PEFT reads it: every linear but the output head)."""
        if not lora.enabled:
            return 0
        names = None if lora.target_modules == "all-linear" else {t.strip() for t in lora.target_modules.split(",")}
        return sum(lora.r * (i + o) for name, i, o in self.linears
                   if names is None or name.rsplit(".", 1)[-1] in names)


def shape_of(hf_config: Any, scalar_head: bool = False) -> ModelShape:
    """A ModelShape from a transformers config, counting parameters on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        if scalar_head:
            cfg = copy.deepcopy(hf_config)
            cfg.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(cfg)
        else:
            model = AutoModelForCausalLM.from_config(hf_config)
    params = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    heads = hf_config.num_attention_heads
    head_names = {"lm_head", "score"}
    # GPT-2's projections are transformers' Conv1D: a linear with its weight stored (in, out).
    linears = tuple((name, m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else (name, *m.weight.shape)
                    for name, m in model.named_modules()
                    if isinstance(m, (torch.nn.Linear, Conv1D)) and name.rsplit(".", 1)[-1] not in head_names)
    dtype = getattr(hf_config, "dtype", None)
    saved = 2 if str(dtype).replace("torch.", "") in ("bfloat16", "float16") else 4
    eager = getattr(hf_config, "_attn_implementation", None) == "eager"
    return ModelShape(params=params, largest_layer=largest, layers=hf_config.num_hidden_layers,
                      hidden=hf_config.hidden_size, heads=heads,
                      kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                      head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                      vocab=0 if scalar_head else hf_config.vocab_size, linears=linears, saved_bytes=saved,
                      eager_attention=eager)


def checkpoint_shape(folder: str | Path, scalar_head: bool = False, trust_remote_code: bool = False) -> ModelShape:
    """The shape of a saved model (a folder this pipeline wrote, or a local/hub checkpoint)."""
    from transformers import AutoConfig

    from ..errors import loading
    with loading(folder, "config"):
        cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    # A config without the usual size keys cannot be planned: one line naming the folder.
    with loading(folder, "the model's sizes for the memory plan (num_hidden_layers, hidden_size, ...)"):
        return shape_of(cfg, scalar_head)


# ---- Bytes per model -----------------------------------------------------------------------------


@dataclass
class Plan:
    """One stage's bytes per rank: `device` rows (see ROWS) and what offload puts on the CPU."""
    stage: str
    device: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROWS, 0.0))
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROWS, 0.0))

    @property
    def total(self) -> float:
        d = self.device
        return d["weights"] + d["grads"] + d["optimizer"] + d["frozen"] + max(d["activations"], d["kv_cache"])

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu.values())

    def add(self, row: str, nbytes: float, on_cpu: bool = False) -> None:
        (self.cpu if on_cpu else self.device)[row] += nbytes


def working_bytes(dist: DistributedConfig, saved_bytes: int = 4) -> int:
    """Bytes of a weight as it computes: 16-bit under DeepSpeed mixed precision; as saved (or as
    `model.dtype` loaded it) in plain PyTorch."""
    if dist.backend == "deepspeed":
        return 4 if dist.precision == "fp32" else 2
    return saved_bytes


def model_states(plan: Plan, params: int, trainable: int, largest_layer: int, dist: DistributedConfig,
                 world_size: int, saved_bytes: int = 4) -> None:
    """Add one trained model's weights, gradients and AdamW states to `plan` (see the module doc)."""
    w = working_bytes(dist, saved_bytes)
    mixed = dist.backend == "deepspeed" and dist.precision != "fp32"
    stage, n = dist.zero_stage, world_size
    part = lambda k: n if stage >= k else 1   # noqa: E731 -- divisor of what stage k partitions
    grad32, master = (4, 4) if mixed else (0, 0)
    # torch AdamW keeps its two states in the parameter's dtype; DeepSpeed in fp32.
    states = 8 if dist.backend == "deepspeed" else 2 * w
    plan.add("weights", w * params / part(3), on_cpu=dist.offload_param)
    if stage == 3:   # one layer gathered whole for its forward and backward: 16-bit weights and grads
        plan.add("weights", 2 * w * largest_layer)
    if dist.offload_optimizer and stage >= 2:
        # ZeRO-Offload reduces gradients in buckets straight into the CPU optimizer's fp32 partition:
        # no 16-bit copy is kept on either side (the buckets are DeepSpeed's, not counted).
        plan.add("grads", (grad32 or w) * trainable / n, on_cpu=True)
    else:   # stage 0/1 hold the whole 16-bit (or fp32) gradient on the device
        plan.add("grads", w * trainable / part(2))
        plan.add("grads", grad32 * trainable / part(1), on_cpu=dist.offload_optimizer)
    plan.add("optimizer", (master + states) * trainable / part(1), on_cpu=dist.offload_optimizer)


def frozen_states(plan: Plan, params: int, dist: DistributedConfig, world_size: int, saved_bytes: int = 4) -> None:
    """Add a frozen model (PPO's reference or reward model): weights only, placed as
    pipeline/ppo/placement.py places them (16-bit under mixed precision, partitioned at stage 3,
    on the CPU with offload_frozen)."""
    n = world_size if dist.zero_stage == 3 else 1
    plan.add("frozen", working_bytes(dist, saved_bytes) * params / n, on_cpu=dist.offload_frozen)


# Korthikanti et al. count a GPT block (LayerNorm, learned positions). A Llama-style block also keeps
# its RMSNorm's normalised input and inverse rms (computed in fp32) for each of its two norms, and the
# rotated q and k of RoPE: 8 * s*b*h more bytes in 16-bit units (an overcount of 8 for GPT-2).
LLAMA_EXTRA = 8


def activation_bytes(m: ModelShape, micro_batch: int, seq: int, nbytes: int) -> float:
    """Stored activations of one training forward (Korthikanti et al. 2022, eq. 2, scaled from
    16 bit to `nbytes`) plus the head's logits and the loss's fp32 copy and gradient. Their
    5*a*s^2*b term is softmax output (2), dropout mask (1) and dropout output (2); these models
    run without dropout, so eager attention keeps only the softmax output, 2*a*s^2*b (measured on
    CPU: +17.6 MiB for the tiny default's 32 x 96 batch, against 18.0 planned), and the SDPA and
    flash kernels (transformers' default) keep O(s) per head, no (s, s) scores at all."""
    s, b, h, a = seq, micro_batch, m.hidden, m.heads
    per_layer = s * b * h * (34 + LLAMA_EXTRA) + (2 * a * s * s * b if m.eager_attention else 0)
    return m.layers * per_layer * nbytes / 2 + b * s * m.vocab * (nbytes + 8)


def kv_cache_bytes(m: ModelShape, sequences: int, tokens: int, nbytes: int) -> float:
    """Keys and values of every layer for `sequences` x `tokens` (the sampler's cache)."""
    return 2 * m.layers * m.kv_heads * m.head_dim * tokens * sequences * nbytes


# ---- Stages --------------------------------------------------------------------------------------


def supervised_plan(stage: str, m: ModelShape, dist: DistributedConfig, micro_batch: int, seq: int,
                    lora: LoraConfig = LoraConfig()) -> Plan:
    """SFT (a causal LM) or the reward model (m with a scalar head): one trained model."""
    plan = Plan(stage)
    trainable = m.adapter_params(lora) if lora.enabled else m.params
    model_states(plan, m.params + m.adapter_params(lora), trainable, m.largest_layer, dist, dist.world_size,
                 m.saved_bytes)
    plan.add("activations", activation_bytes(m, micro_batch, seq, working_bytes(dist, m.saved_bytes)))
    return plan


def rl_plan(stage: str, actor: ModelShape, dist: DistributedConfig, *, micro_batch: int, rollout_batch: int,
            prompt_length: int, response_length: int, critic: Optional[ModelShape] = None,
            reward: Optional[ModelShape] = None, extra_frozen: tuple[ModelShape, ...] = (),
            samples_per_prompt: int = 1, cached_ref_logprobs: bool = False,
            lora: LoraConfig = LoraConfig(), critic_lora: LoraConfig = LoraConfig()) -> Plan:
    """PPO and its relatives, per rank. `critic` None: a critic-free method (GRPO-like);
    `samples_per_prompt` k: k responses per prompt in the rollout (the KV cache grows k-fold);
    `cached_ref_logprobs`: the reference's log-probs were computed ahead, so no reference model is
    placed; `reward` None: a reward function instead of a model. `rollout_batch` is global."""
    plan = Plan(stage)
    n = dist.world_size
    w = working_bytes(dist, actor.saved_bytes)
    seq = prompt_length + response_length
    trainable = actor.adapter_params(lora) if lora.enabled else actor.params
    model_states(plan, actor.params + actor.adapter_params(lora), trainable, actor.largest_layer, dist, n,
                 actor.saved_bytes)
    plan.add("activations", activation_bytes(actor, micro_batch, seq, w))
    if critic is not None:
        c_trainable = critic.adapter_params(critic_lora) if critic_lora.enabled else critic.params
        model_states(plan, critic.params + critic.adapter_params(critic_lora), c_trainable, critic.largest_layer,
                     dist, n, critic.saved_bytes)
        plan.add("activations", activation_bytes(critic, micro_batch, seq, w))
    # Under LoRA the reference is the actor with its adapter off: no second copy.
    if not cached_ref_logprobs and not lora.enabled:
        frozen_states(plan, actor.params, dist, n, actor.saved_bytes)
    for model in ((reward,) if reward is not None else ()) + extra_frozen:
        frozen_states(plan, model.params, dist, n, model.saved_bytes)
    sequences = -(-rollout_batch // n) * samples_per_prompt
    plan.add("kv_cache", kv_cache_bytes(actor, sequences, seq, w))
    return plan


def inference_plan(stage: str, policy: ModelShape, frozen: tuple[ModelShape, ...], batch: int, tokens: int) -> Plan:
    """evaluate: plain PyTorch, the policies and the reward model held at once, sampling `batch`
    sequences of up to `tokens` (the frozen forward's own activations are one layer's, not counted)."""
    plan = Plan(stage)
    for model in frozen:
        plan.add("frozen", model.saved_bytes * model.params)
    plan.add("kv_cache", kv_cache_bytes(policy, batch, tokens, policy.saved_bytes))
    return plan
