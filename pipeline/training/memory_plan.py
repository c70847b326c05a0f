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

import copy
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from ..config import DistributedConfig, LoraConfig, Params
from ..errors import ConfigError

log = logging.getLogger(__name__)

GIB = 2 ** 30
WARN_FRACTION = 0.9   # a plan above 90% of the device warns: allocator and CUDA context are not counted
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
