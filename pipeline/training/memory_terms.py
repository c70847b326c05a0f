"""The terms of a memory plan: bytes one rank holds, from model shapes and `distributed` settings.

A `Plan` has two kinds of device rows (bytes on one rank's device):
- states, held for the whole stage: `weights`, `grads`, `optimizer` of each trained model
  (`model_states`) and `frozen` models (`frozen_states`);
- phases, which never overlap, so only the largest counts: `update` (the stored activations of one
  training micro-batch), `rollout` (PPO's sampling), `scoring` (PPO's forwards without a graph over
  the rollout) and `measurement` (the final sampling on held-out prompts).
total = states + max(phases). The `cpu` column is per node (what offload puts there, times the
node's processes, and `loading`: the checkpoint every local process reads).

Bytes of a weight follow pipeline/training/loading.py (`load_dtype`): a trained model is held in
fp32 under plain PyTorch (bf16 there is autocast over fp32 weights) and DeepSpeed fp32, in 16 bit
under DeepSpeed bf16/fp16; a frozen one in 16 bit under bf16/fp16, fp32 otherwise. Activations,
KV caches and logits are in the working dtype: 16 bit under bf16/fp16 (DeepSpeed's or autocast's),
fp32 otherwise.
- model states: AdamW keeps 2 states. fp32 weights (plain PyTorch, bf16 autocast included, or
  DeepSpeed fp32): 4 weights + 4 grads + 8 states. DeepSpeed mixed precision: 2 weights + 2 grads
  in 16 bit, plus the fp32 copy of the gradients (4), the fp32 master weights (4) and the states
  (8) -- the 18 + 2 bytes DeepSpeed's estimators count
  (Rajbhandari et al. 2020, ZeRO, sec. 3 counts 16; DeepSpeed adds the fp32 gradient copy). ZeRO
  partitions over the N ranks: stage 1 the fp32 optimizer side (states, master weights, fp32 grads),
  stage 2 also the 16-bit grads, stage 3 also the weights, and then one gathered layer (its 16-bit
  weights and grads) is whole on every rank. Under LoRA only the adapter has grads and states.
- frozen: weights only, partitioned at stage 3, on the CPU with `offload_frozen`.
- update: Korthikanti et al. 2022 (eq. 1, no tensor parallelism) store s*b*h*(34 + 5*a*s/h) bytes
  in 16 bit per layer for b sequences of s tokens (width h, a heads); we add 8*s*b*h for what a
  Llama block keeps beyond their GPT block, and count the attention scores only under eager
  attention, as 2*a*s/h (the softmax output; no dropout here; SDPA and flash kernels,
  transformers' default, never store them); in fp32 every stored tensor is twice as wide. With
  gradient checkpointing each layer keeps only its input, s*b*h in the working dtype, and the
  backward recomputes one layer at a time, which then holds that layer's full term (Chen et al.
  2016 trade about one more forward for this; Korthikanti et al.'s "full recomputation", 2sbhL).
  The language-model head adds b*s*V logits in the working dtype plus the fp32 copy and the
  gradient of the cross-entropy (4 + 4 bytes each), b*s capped at one chunk's positions where the
  head is chunked (`logits_bytes`; scoring forwards likewise). PPO's actor and critic are both live.
- rollout: under ZeRO-3 the actor gathered whole for sampling (DeepSpeed's all-gather fills a fresh
  full-size buffer while each rank keeps its partition: zero/partition_parameters.py), the KV cache
  (2 * L * kv_heads * head_dim * tokens * bytes per sequence, prompt + response at their longest),
  the prefill's forward and the sampler's logits. The prefill is counted as one layer's term for
  B x P tokens: a forward without a graph frees each layer's tensors before the next layer runs,
  and holds less than a training layer stores, so this is an upper bound (61 MiB measured on CPU
  for the tiny default's 64 x 256 prefill, 126 by the term). The sampler keeps the logits of the
  last position only (logits_to_keep=1): one (B, V) row in the working dtype, its fp32
  temperature-scaled copy, the fp32 log-softmax and the fp32 probabilities
  (pipeline/models/generation.py). Sampled in calls of `rollout_micro_batch_size` rows, one call's
  rows; in calls by a token budget (`rollout_max_tokens`), the most one call can hold under it
  (`budget_sampling_bytes`).
- scoring: one micro-batch's forward without a graph per model (reference, recomputed actor,
  critic, reward model), one at a time: one layer's term plus (R + 1) x V response logits in the
  working dtype, their fp32 copy and the temperature-scaled fp32 copy
  (pipeline/models/logprobs.py); the reward model scores SCORE_BATCH rollouts per forward, each
  cut to reward.max_length tokens.
- measurement: the larger of sampling GENERATION_BATCH prompts (as the rollout) and the KL
  forward of KL_BATCH responses (as scoring), plus under ZeRO-3 the model in use gathered whole.
- loading (cpu, per node): every local process reads the largest checkpoint a stage loads at once
  into RAM, in the dtype it was saved in (also under ZeRO-3, whose zero.Init partitions only the
  device copy): an upper bound.

Not counted: the CUDA context and allocator fragmentation (a few hundred MiB to ~1 GiB on a GPU:
that is why a plan within 10% of the device warns), DeepSpeed's communication buckets, the (B, R)
per-token tensors of a rollout batch (kilobytes to megabytes) and Python objects.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from ..config import DistributedConfig, LoraConfig, Params
from ..errors import ConfigError
from ..models.logit_chunks import PLAIN_HEAD_TYPES, chunk_positions
from .loading import load_dtype, zero3

GIB = 2 ** 30
STATES = ("weights", "grads", "optimizer", "frozen")
PHASES = ("update", "rollout", "scoring", "measurement")
CPU_ROWS = (*STATES, "loading")
GENERATION_BATCH = 64   # prompts per sampling call (pipeline/models/generation.py's generate_texts)
KL_BATCH = 32           # responses per KL forward (pipeline/measurement/policy.py's sequence_kl)
SCORE_BATCH = 32        # rows per reward-model forward (pipeline/models/reward_model.py's length_sorted_scores)


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
    checkpointing: bool = True   # the class supports gradient checkpointing (engines.enable_checkpointing)
    chunked_logits: bool = False  # its head runs chunk by chunk above LOGITS_CHUNK_BYTES (models/logprobs.py)

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
                      eager_attention=eager,
                      checkpointing=bool(getattr(model, "supports_gradient_checkpointing", False)),
                      chunked_logits=not scalar_head and getattr(hf_config, "model_type", None) in PLAIN_HEAD_TYPES)


def checkpoint_shape(folder: str | Path, scalar_head: bool = False, trust_remote_code: bool = False) -> ModelShape:
    """The shape of a saved model (a folder this pipeline wrote, or a local/hub checkpoint)."""
    from transformers import AutoConfig

    from ..errors import loading
    with loading(folder, "config"):
        cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    # A config without the usual size keys cannot be planned: one line naming the folder.
    with loading(folder, "the model's sizes for the memory plan (num_hidden_layers, hidden_size, ...)"):
        return shape_of(cfg, scalar_head)


def with_attention(m: ModelShape, attn: Optional[str]) -> ModelShape:
    """`model.attn_implementation` (when set) decides whether attention stores its scores. Not
    `model.dtype`: what a rank holds follows the precision (pipeline/training/loading.py)."""
    return replace(m, eager_attention=attn == "eager") if attn is not None else m


def as_saved_by(m: ModelShape, dist: Any) -> ModelShape:
    """`m` as the stage trained under `dist` saves it: in the dtype it trained in."""
    return replace(m, saved_bytes=weight_bytes(dist, trained=True))


def policy_config(params: Params, data_dir: Optional[Path]) -> Any:
    """The transformers config of the SFT starting point as `model` describes it: the tiny model on
    the prepared tokenizer, or `model.name_or_path`'s."""
    cfg = params.model
    if cfg.name_or_path is not None:
        from transformers import AutoConfig

        from ..errors import loading
        with loading(cfg.name_or_path, "config"):
            return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    from ..data.tokenizer import load_tokenizer, prepared_tokenizer
    from ..models.checkpoints import tiny_config
    if data_dir is None:
        raise ConfigError("model.name_or_path: null builds the tiny model on the prepared tokenizer; "
                          "pass --data (the prepare stage's folder)")
    return tiny_config(cfg, load_tokenizer(prepared_tokenizer(data_dir)))


# ---- The plan and its states ---------------------------------------------------------------------


@dataclass
class Plan:
    """One stage's bytes: `device` rows per rank (STATES and PHASES), `cpu` rows per node."""
    stage: str
    processes: int = 1   # processes per node: a rank's CPU bytes count this many times in the node's RAM
    checkpointing: bool = True   # every trained model's class supports gradient checkpointing
    trains: bool = True          # False: a measuring stage's plan (no gradients, no optimizer)
    engine: float = 0.0          # of the rollout phase, the bytes of a colocated rollout engine (vLLM)
    device: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATES + PHASES, 0.0))
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CPU_ROWS, 0.0))

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=lambda p: self.device[p])

    @property
    def total(self) -> float:
        """Bytes per rank on the device: the states plus the largest phase."""
        return sum(self.device[r] for r in STATES) + self.device[self.peak_phase]

    @property
    def beside_engine(self) -> float:
        """Bytes per rank the trainer holds while a colocated rollout engine is awake: the states and
        the rollout phase without the engine's own bytes (the other phases' memory is freed then)."""
        return sum(self.device[r] for r in STATES) + self.device["rollout"] - self.engine

    @property
    def cpu_total(self) -> float:
        """Bytes in the node's RAM."""
        return sum(self.cpu.values())

    def add(self, row: str, nbytes: float, on_cpu: bool = False) -> None:
        """Add `nbytes` one rank holds to `row` (on the CPU: once per local process)."""
        if on_cpu:
            self.cpu[row] += nbytes * self.processes
        else:
            self.device[row] += nbytes


def weight_bytes(dist: DistributedConfig, trained: bool) -> int:
    """Bytes of one weight as a rank holds it (pipeline/training/loading.py's load_dtype)."""
    return load_dtype(dist, trained).itemsize


def compute_bytes(dist: DistributedConfig) -> int:
    """Bytes of an activation, a cached key or a logit: the working dtype."""
    return 2 if dist.precision in ("bf16", "fp16") else 4


def model_states(plan: Plan, params: int, trainable: int, largest_layer: int, dist: DistributedConfig,
                 world_size: int) -> None:
    """Add one trained model's weights, gradients and AdamW states to `plan` (see the module doc)."""
    w = weight_bytes(dist, trained=True)
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


def frozen_states(plan: Plan, params: int, dist: DistributedConfig, world_size: int) -> None:
    """Add a frozen model (PPO's reference or reward model): weights only, placed as
    pipeline/training/engines.py's FrozenModel places them (partitioned at stage 3, on the CPU
    with offload_frozen)."""
    n = world_size if zero3(dist) else 1
    plan.add("frozen", weight_bytes(dist, trained=False) * params / n, on_cpu=dist.offload_frozen)


def loading(plan: Plan, *read: ModelShape) -> None:
    """The `loading` row: every local process reads the largest of the checkpoints `read` whole."""
    plan.add("loading", max((m.saved_bytes * m.params for m in read), default=0), on_cpu=True)


# ---- Phases --------------------------------------------------------------------------------------

# Korthikanti et al. count a GPT block (LayerNorm, learned positions). A Llama-style block also keeps
# its RMSNorm's normalised input and inverse rms (computed in fp32) for each of its two norms, and the
# rotated q and k of RoPE: 8 * s*b*h more bytes in 16-bit units (an overcount of 8 for GPT-2).
LLAMA_EXTRA = 8


def layer_bytes(m: ModelShape, batch: int, seq: int, nbytes: int) -> float:
    """One layer's stored activations for `batch` sequences of `seq` tokens (Korthikanti et al.
    2022, eq. 1, scaled from 16 bit to `nbytes`). Their 5*a*s^2*b term is softmax output (2),
    dropout mask (1) and dropout output (2); these models run without dropout, so eager attention
    keeps only the softmax output, 2*a*s^2*b (measured on CPU: +17.6 MiB for the tiny default's
    32 x 96 batch, against 18.0 planned), and the SDPA and flash kernels keep no (s, s) scores."""
    s, b, h, a = seq, batch, m.hidden, m.heads
    return (s * b * h * (34 + LLAMA_EXTRA) + (2 * a * s * s * b if m.eager_attention else 0)) * nbytes / 2


def logits_bytes(m: ModelShape, positions: int, nbytes: int) -> float:
    """The head's logits at `positions` positions in the working dtype with the loss's fp32 copy and
    its gradient (or the log-softmax's): whole, or one chunk's positions where the head is chunked
    (pipeline/models/logit_chunks.py)."""
    if m.chunked_logits and m.vocab:
        positions = min(positions, chunk_positions(m.vocab))
    return positions * m.vocab * (nbytes + 8)


def activation_bytes(m: ModelShape, micro_batch: int, seq: int, nbytes: int, checkpointing: bool = False) -> float:
    """Stored activations of one training forward plus the head's logits and the loss's fp32 copy
    and gradient; with `checkpointing`, each layer's input and one layer's full term instead of L."""
    s, b = seq, micro_batch
    head = logits_bytes(m, b * s, nbytes)
    if checkpointing:
        return m.layers * s * b * m.hidden * nbytes + layer_bytes(m, b, s, nbytes) + head
    return m.layers * layer_bytes(m, b, s, nbytes) + head


def kv_cache_bytes(m: ModelShape, sequences: int, tokens: int, nbytes: int) -> float:
    """Keys and values of every layer for `sequences` x `tokens` (the sampler's cache)."""
    return 2 * m.layers * m.kv_heads * m.head_dim * tokens * sequences * nbytes


def sampler_logits_bytes(m: ModelShape, sequences: int, nbytes: int) -> float:
    """One decoding step's (B, V) logits: the model's row in the working dtype, then fp32 copies
    scaled by the temperature, as log-softmax and as probabilities."""
    return sequences * m.vocab * (nbytes + 12)


def sampling_bytes(m: ModelShape, sequences: int, prompt_length: int, response_length: int, nbytes: int) -> float:
    """Sampling `sequences` responses: the KV cache at its longest, the prefill's forward and the
    sampler's logits."""
    return (kv_cache_bytes(m, sequences, prompt_length + response_length, nbytes)
            + layer_bytes(m, sequences, prompt_length, nbytes) + sampler_logits_bytes(m, sequences, nbytes))


def budget_sampling_bytes(m: ModelShape, sequences: int, prompt_length: int, response_length: int,
                          budget: int, nbytes: int) -> float:
    """Sampling `sequences` responses in calls of at most `budget` tokens, rows x (longest prompt +
    response_length) (pipeline/models/rollout_engine.py; a prompt longer than the budget alone): the
    largest call's KV cache holds at most max(budget, one row) tokens, its prefill rows x prompt <=
    budget - response_length tokens (counted as rows of `prompt_length`, the longest a prompt is),
    and it has at most budget // (response_length + 1) rows (prompts of one token) of logits. Each
    is capped by the whole rollout's, so a budget above it costs what one call does."""
    seq = prompt_length + response_length
    kv = min(sequences * seq, max(budget, seq))
    prefill = min(sequences * prompt_length, max(budget - response_length, prompt_length))
    rows = min(sequences, max(1, budget // (response_length + 1)))
    return (kv_cache_bytes(m, 1, kv, nbytes) + layer_bytes(m, prefill / prompt_length, prompt_length, nbytes)
            + sampler_logits_bytes(m, rows, nbytes))


def forward_bytes(m: ModelShape, batch: int, seq: int, response_length: int, nbytes: int,
                  packed: bool = False) -> float:
    """A forward without a graph over `batch` sequences of `seq` tokens (`packed`: one row of them
    all, the same but for eager attention's scores): one layer's term, and for a language model the
    (R + 1) x V response logits with their two fp32 copies."""
    rows, width = (1, batch * seq) if packed else (batch, seq)
    return layer_bytes(m, rows, width, nbytes) + logits_bytes(m, batch * (response_length + 1), nbytes)


def engine_bytes(m: ModelShape, sequences: int, tokens: int, weight_nbytes: int, nbytes: int) -> float:
    """A colocated vLLM engine awake for a rollout: its own copy of the policy's weights, a KV pool
    of at least `sequences` x `tokens` (the least it can sample the rollout with; it takes what the
    plan leaves beyond that) and the batch's logits."""
    return (m.params * weight_nbytes + kv_cache_bytes(m, sequences, tokens, nbytes)
            + sampler_logits_bytes(m, sequences, nbytes))


def measurement_bytes(m: ModelShape, prompt_length: int, response_length: int, nbytes: int,
                      packed: bool = False) -> float:
    """The final measurement's work with policy `m`: sampling, then the KL forward (`packed`: in one row)."""
    seq = prompt_length + response_length
    return max(sampling_bytes(m, GENERATION_BATCH, prompt_length, response_length, nbytes),
               forward_bytes(m, KL_BATCH, seq, response_length, nbytes, packed))


# ---- Plans of the trainers ---------------------------------------------------------------------


def supervised_plan(stage: str, m: ModelShape, dist: DistributedConfig, micro_batch: int, seq: int,
                    lora: LoraConfig = LoraConfig(), read: tuple[ModelShape, ...] = (),
                    sampled: Optional[tuple[int, int]] = None, beside: tuple[ModelShape, ...] = (),
                    packed: bool = False) -> Plan:
    """One trained model (SFT's causal LM, or a reward model: m with a scalar head) reading the
    checkpoints `read`. Under ZeRO-3 it is gathered whole at the end (engines.full_model); with
    `sampled` (prompt, response lengths) the trained policy is measured on held-out prompts; `beside`:
    the models its measurement loads whole on each rank beside it, in the trained model's dtype (the
    SFT policy for the KL, a reward model), while its training states are still held; `packed`: the
    measurement's KL forward in one row (the stage's `packing`)."""
    plan = Plan(stage, dist.num_processes, checkpointing=m.checkpointing)
    trainable = m.adapter_params(lora) if lora.enabled else m.params
    whole = m.params + m.adapter_params(lora)
    model_states(plan, whole, trainable, m.largest_layer, dist, dist.world_size)
    c = compute_bytes(dist)
    plan.add("update", activation_bytes(m, micro_batch, seq, c, dist.gradient_checkpointing))
    gathered = weight_bytes(dist, trained=True) * whole if zero3(dist) else 0
    loaded = weight_bytes(dist, trained=True) * sum(b.params for b in beside)
    plan.add("measurement", gathered + loaded + (measurement_bytes(m, *sampled, c, packed) if sampled else 0))
    loading(plan, *read)
    return plan


def rl_plan(stage: str, actor: ModelShape, dist: DistributedConfig, *, micro_batch: int, rollout_batch: int,
            prompt_length: int, response_length: int, critic: Optional[ModelShape] = None,
            reward: Optional[ModelShape] = None, extra_frozen: tuple[ModelShape, ...] = (),
            samples_per_prompt: int = 1, cached_ref_logprobs: bool = False, lora: LoraConfig = LoraConfig(),
            critic_lora: LoraConfig = LoraConfig(), score_micro_batch: Optional[int] = None,
            reward_length: Optional[int] = None, rollout_micro_batch: int = 0,
            rollout_max_tokens: Optional[int] = None, engine: str = "torch", packing: bool = False) -> Plan:
    """PPO and its relatives, per rank (pipeline/ppo/trainer.py's steps). `critic` None: a
    critic-free method (GRPO-like); `samples_per_prompt` k: k responses per prompt (the rollout
    grows k-fold); `cached_ref_logprobs`: no reference model is placed; `reward` None: a reward
    function instead of a model; `rollout_batch` counts prompts, globally; `score_micro_batch`:
    rollouts per scoring forward (None: micro_batch); `reward_length`: the tokens the reward model
    reads of each rollout (None: all); `rollout_micro_batch`: responses per sampling call (0: all),
    or `rollout_max_tokens`: the token budget of a sampling call (`budget_sampling_bytes`);
    `engine`: who samples the rollouts (torch: our sampler; vllm: an engine with weights of its
    own, in bf16 when the stage is, else fp32); `packing`: every forward's micro-batch (update,
    scoring, measurement) as one row of them all (the same activations but for eager attention's
    scores)."""
    plan = Plan(stage, dist.num_processes, checkpointing=actor.checkpointing and (critic or actor).checkpointing)
    n, c, ckpt = dist.world_size, compute_bytes(dist), dist.gradient_checkpointing
    seq = prompt_length + response_length
    actor_whole = actor.params + actor.adapter_params(lora)
    model_states(plan, actor_whole, actor.adapter_params(lora) if lora.enabled else actor.params,
                 actor.largest_layer, dist, n)
    rows, width = (1, micro_batch * seq) if packing else (micro_batch, seq)   # the update's forwards
    plan.add("update", activation_bytes(actor, rows, width, c, ckpt))
    if critic is not None:
        c_trainable = critic.adapter_params(critic_lora) if critic_lora.enabled else critic.params
        model_states(plan, critic.params + critic.adapter_params(critic_lora), c_trainable, critic.largest_layer,
                     dist, n)
        plan.add("update", activation_bytes(critic, rows, width, c, ckpt))
    # Under LoRA the reference is the actor with its adapter off: no second copy.
    ref = not cached_ref_logprobs and not lora.enabled
    measured = ((actor,) if ref else ()) + ((reward,) if reward is not None else ())   # besides the policy
    frozen = measured + extra_frozen
    for model in frozen:
        frozen_states(plan, model.params, dist, n)
    # 1. rollout: the rank's share of the prompts, k responses each, the actor gathered under ZeRO-3.
    sequences = -(-rollout_batch // n) * samples_per_prompt
    if rollout_micro_batch:   # sampled that many at a time; the KV cache is freed between calls
        sequences = min(sequences, rollout_micro_batch)
    w_actor, w_frozen = (weight_bytes(dist, trained=True) * actor_whole, weight_bytes(dist, trained=False)) \
        if zero3(dist) else (0, 0)
    if engine == "vllm":   # its weights and KV pool; the actor gathered (ZeRO-3) is what it loads
        plan.engine = engine_bytes(actor, sequences, prompt_length + response_length,
                                   2 if dist.precision == "bf16" else 4, c)
        plan.add("rollout", w_actor + plan.engine)
    elif rollout_max_tokens is not None:
        plan.add("rollout", w_actor + budget_sampling_bytes(actor, sequences, prompt_length, response_length,
                                                            rollout_max_tokens, c))
    else:
        plan.add("rollout", w_actor + sampling_bytes(actor, sequences, prompt_length, response_length, c))
    # 2. scoring: each model's forward over one micro-batch (the reward model's over SCORE_BATCH rows).
    b = score_micro_batch or micro_batch
    scored = [forward_bytes(m, b, seq, response_length, c, packing) for m in (actor, critic) if m is not None]
    if reward is not None:
        scored.append(forward_bytes(reward, min(SCORE_BATCH, sequences), min(seq, reward_length or seq),
                                    response_length, c, packing))
    plan.add("scoring", max(scored))
    # 6. the held-out measurement: policy, reference and reward model gathered in turn under ZeRO-3.
    gathered = max([w_actor] + [w_frozen * m.params for m in measured])
    plan.add("measurement", gathered + measurement_bytes(actor, prompt_length, response_length, c, packing))
    loading(plan, actor, *((critic,) if critic is not None else ()), *frozen)
    return plan


def inference_plan(stage: str, dist: DistributedConfig, resident: tuple[ModelShape, ...], sampler: ModelShape,
                   prompt_length: int, response_length: int, read: tuple[ModelShape, ...] = (),
                   packed: bool = False) -> Plan:
    """evaluate and compare: the `resident` models whole (replicated) on every rank in the working
    dtype, `sampler` sampling GENERATION_BATCH prompts at a time and its KL forward (`packed`: in one row)."""
    plan = Plan(stage, dist.num_processes, trains=False)
    for model in resident:
        plan.add("frozen", weight_bytes(dist, trained=False) * model.params)
    plan.add("measurement", measurement_bytes(sampler, prompt_length, response_length, compute_bytes(dist), packed))
    loading(plan, *(read or resident))
    return plan
