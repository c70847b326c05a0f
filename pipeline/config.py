"""Typed, frozen, validated configuration: one dataclass per `params.yaml` section.

Why our own validator instead of a schema library: the error must name the file and the dotted key
(`params.yaml: sft.lr: expected a positive float, got 'fast'`) and happen before any model is built.
A field's constraints live in its `metadata` (see `num`), so the rule sits next to the default.

YAML is read with ruamel (YAML 1.2), which keeps `3e-05` a float; PyYAML (YAML 1.1) returns it as
a string, and `dvc exp run -S` writes floats in exactly that form.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.events import CollectionEndEvent, CollectionStartEvent


from . import registries
from .errors import ConfigError, shown

# Limits of a params file: its size, and the length of one string value (paths, module names and
# comma lists are far shorter; a megabyte string is a mistake, and would make a megabyte message).
MAX_PARAMS_BYTES = 1 << 20
# The shipped params nest 4 levels; ruamel's pure scanner is quadratic in the nesting depth (5,000
# levels of `[` took 20 s to scan here), so depth is refused while scanning, not after loading.
MAX_PARAMS_DEPTH = 32
MAX_STRING = 4096


def num(default: Any, *, gt: float | None = None, ge: float | None = None,
        le: float | None = None, lt: float | None = None, doc: str = "") -> Any:
    """A numeric field with bounds; the bounds are checked by `from_dict`."""
    return field(default=default, metadata={"gt": gt, "ge": ge, "le": le, "lt": lt, "doc": doc})


def named(kind: str, default: str, *, doc: str = "") -> Any:
    """A string field naming a registered function (pipeline/registries.py) of `kind`; its allowed
    values are the registry's names, checked by `load_params` (given them), so a new one is one
    decorated function and no edit here."""
    return field(default=default, metadata={"registry": kind, "doc": doc})


# ----------------------------------------------------------------------------------------------
# Sections. Every key is documented in params.yaml; defaults here equal the shipped params.yaml.


@dataclass(frozen=True)
class DataConfig:
    """`data`: the task and the sizes of every split `prepare` writes."""
    task: Literal["reviews"] = "reviews"
    seed: int = num(0, ge=0)
    n_sft: int = num(4000, ge=8)
    n_sft_eval: int = num(400, ge=4)
    n_pairs: int = num(32000, ge=8)
    n_pairs_eval: int = num(1000, ge=4)
    n_ppo_prompts: int = num(2000, ge=4)
    n_eval_prompts: int = num(200, ge=4)
    label_temperature: float = num(0.5, gt=0.0)
    eval_title_fraction: float = num(0.2, gt=0.0, lt=1.0)
    aspect_contrast: float = num(0.3, ge=0.0, le=1.0, doc="fraction of training pairs contrasting one review with its aspect swapped")
    corrupt_contrast: float = num(0.15, ge=0.0, le=1.0, doc="fraction of training pairs contrasting one review with a copy with one local fault (aspect_contrast + this <= 1)")
    aspect_exchange: float = num(0.0, ge=0.0, le=1.0, doc="fraction of training pairs contrasting one review with the asked aspect and another it discusses exchanged (aspect_contrast + corrupt_contrast + this <= 1)")
    n_audit_pairs: int = num(0, ge=0, doc="fresh pairs for an auditor reward model (pairs_audit.jsonl; 0: none)")
    n_val_pairs: int = num(2000, ge=0, doc="fresh pairs of training titles the reward model's restart check reads (pairs_val.jsonl; 0: none)")

    def __post_init__(self) -> None:
        total = self.aspect_contrast + self.corrupt_contrast + self.aspect_exchange
        if total > 1:
            raise ConfigError(f"data.corrupt_contrast: {self.corrupt_contrast} + data.aspect_contrast="
                              f"{self.aspect_contrast} + data.aspect_exchange={self.aspect_exchange} exceeds 1 "
                              "(all are fractions of the same training pairs)")


@dataclass(frozen=True)
class ModelConfig:
    """`model`: build a tiny causal LM from a config, or load `name_or_path`."""
    name_or_path: Optional[str] = None
    arch: Literal["llama", "gpt2"] = "llama"
    hidden_size: int = num(96, ge=8)
    num_layers: int = num(4, ge=1)
    num_heads: int = num(4, ge=1)
    intermediate_size: int = num(192, ge=8)
    max_position_embeddings: int = num(128, ge=16)
    trust_remote_code: bool = False
    attn_implementation: Optional[Literal["eager", "sdpa", "flash_attention_2"]] = None  # None: transformers' choice

    # A key that no longer exists, with what took its place: refused by name, never silently ignored.
    _removed: typing.ClassVar[dict[str, str]] = {"dtype": "a model loads in the dtype its role needs, whatever its checkpoint's "
                         "(fp32 master weights when trained, `distributed.precision` computes; "
                         "pipeline/training/loading.py); delete the key"}

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size: {self.hidden_size} is not divisible by "
                              f"model.num_heads={self.num_heads}")


@dataclass(frozen=True)
class SamplingConfig:
    """How a policy samples responses (shared by SFT evaluation, and later PPO and evaluate)."""
    max_new_tokens: int = num(48, ge=1)
    temperature: float = num(1.0, gt=0.0)
    top_k: int = num(0, ge=0, doc="0 disables top-k")
    top_p: float = num(1.0, gt=0.0, le=1.0)
    stop_token: Optional[str] = None  # also end a response at this token (kept); eos always ends it


@dataclass(frozen=True)
class DistributedConfig:
    """`distributed`: how a training stage runs; a stage's own `distributed` mapping overrides keys.

    `backend: none` is plain PyTorch in one process (the laptop default). `deepspeed` trains through
    `deepspeed.initialize` in 1..N processes per node, started by the launcher named here.
    """
    backend: Literal["none", "deepspeed"] = "none"
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    num_processes: int = num(1, ge=1, doc="processes per node (one per GPU)")
    num_nodes: int = num(1, ge=1)
    node_rank: int = num(0, ge=0, doc="this node's index; set per node, e.g. from $SLURM_NODEID")
    master_addr: str = "127.0.0.1"
    master_port: int = num(29500, ge=1024, le=65535)
    hostfile: Optional[str] = None        # deepspeed launcher: hosts and slots for several nodes
    zero_stage: int = num(0, ge=0, le=3)
    offload_optimizer: bool = False       # ZeRO-Offload: optimizer states (and step) on the CPU
    offload_param: bool = False           # ZeRO-Infinity: parameters on the CPU (stage 3 only)
    offload_frozen: bool = False          # PPO: keep the reference and reward models on the CPU
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    gradient_accumulation_steps: int = num(1, ge=1, doc="micro-batches per optimizer step per process")
    # Micro-batches of the supervised stages (sft, reward, dpo, kto, rs, onpolicy_dpo) and of
    # ppo's and grpo's update by what they cost padded, rows x longest, instead of a fixed number
    # of rows (training/token_batches.py): the same global batch (or minibatch) and gradient, fewer
    # pad tokens where lengths vary. None: fixed rows.
    max_tokens_per_micro_batch: Optional[int] = num(None, ge=1, doc="padded tokens per micro-batch; None: fixed rows")
    # Memory one rank may use, for the memory plan (pipeline/training/memory_plan.py) a training stage
    # checks before it builds a model; None: the CUDA device's free memory, else this machine's RAM.
    device_memory_gb: Optional[float] = num(None, gt=0.0, le=1e6, doc="GiB per rank; None: ask the device")
    # Where the models live. auto: this process's GPU when torch sees one (cuda:<local rank>), else the
    # CPU; cpu or cuda insist (cuda without a visible GPU is an error before any model is built).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # How long a collective (all-reduce, gather, barrier) may wait for the other ranks before the job
    # fails; torch's default is 10 minutes under NCCL, 30 under gloo.
    timeout_minutes: float = num(30.0, gt=0.0, le=1e5, doc="collective timeout, minutes")
    # Recompute each layer's activations in the backward pass instead of storing them: about a third
    # more compute for activations of one layer instead of all (Chen et al. 2016).
    gradient_checkpointing: bool = False
    # Each transformer block of a trained model through torch.compile (training/compilation.py):
    # fused element-wise kernels, other rounding than eager, a compile on the first batches.
    compile: bool = False

    def __post_init__(self) -> None:
        if self.backend == "none" and (self.num_processes > 1 or self.num_nodes > 1):
            raise ConfigError("distributed.backend: several processes need backend: deepspeed")
        if self.backend == "none" and (self.zero_stage or self.offload_optimizer or self.offload_param):
            raise ConfigError("distributed.backend: zero_stage and offload need backend: deepspeed")
        if self.backend == "none" and self.precision == "fp16":
            # bf16 without DeepSpeed is autocast over fp32 weights; fp16 would also need loss scaling.
            raise ConfigError("distributed.precision: fp16 needs backend: deepspeed (its loss scaling); "
                              "use bf16, or backend: deepspeed")
        if self.offload_param and self.zero_stage != 3:
            raise ConfigError(f"distributed.offload_param: needs zero_stage 3, got {self.zero_stage}")
        if self.offload_frozen and self.zero_stage != 3:
            # Below stage 3 a frozen model on the CPU would meet the trained models' GPU tensors in
            # every scoring forward; stage 3 offloads its partitions through DeepSpeed instead.
            raise ConfigError(f"distributed.offload_frozen: needs zero_stage 3 (DeepSpeed moves the frozen "
                              f"models' partitions between CPU and GPU), got {self.zero_stage}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ConfigError("distributed.offload_optimizer: needs zero_stage 1, 2 or 3")
        if self.max_tokens_per_micro_batch is not None and self.gradient_accumulation_steps != 1:
            raise ConfigError("distributed.max_tokens_per_micro_batch: micro-batches come from the token budget, "
                              f"so gradient_accumulation_steps must stay 1, got {self.gradient_accumulation_steps}")
        if self.compile and self.zero_stage == 3:
            # ZeRO-3 gathers each block's parameters in hooks around its forward, which a compiled
            # block would trace into its graph.
            raise ConfigError("distributed.compile: not with zero_stage 3; use zero_stage 0-2 or compile: false")
        if self.node_rank >= self.num_nodes:
            raise ConfigError(f"distributed.node_rank: {self.node_rank} must be below num_nodes={self.num_nodes}")

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes


@dataclass(frozen=True)
class LoraConfig:
    """A stage's `lora` section: train low-rank adapters (PEFT) instead of all weights; r: 0 is off."""
    r: int = num(0, ge=0, doc="adapter rank; 0: full fine-tuning")
    alpha: float = num(16.0, gt=0.0)
    dropout: float = num(0.0, ge=0.0, lt=1.0)
    target_modules: str = "all-linear"    # comma-separated module names, or PEFT's "all-linear"

    @property
    def enabled(self) -> bool:
        return self.r > 0


@dataclass(frozen=True)
class SFTDatasetConfig:
    """`sft.dataset`: demonstrations from your own dataset (path null: the prepared default task)."""
    path: Optional[str] = None          # hub id, a folder saved by `datasets`, or a .jsonl/.json/.parquet/.csv file
    train_split: str = "train"
    eval_split: str = "test"            # held-out demonstrations (eval loss; reward normalisation)
    revision: Optional[str] = None      # hub revision
    layout: Literal["auto", "prompt_completion", "text", "messages"] = "auto"
    prompt_column: str = "prompt"
    response_column: str = "completion"
    text_column: str = "text"
    messages_column: str = "messages"
    leakage: Literal["error", "drop"] = "error"   # a held-out record also in the train split


@dataclass(frozen=True)
class PromptDatasetConfig:
    """`prompts.dataset`: prompts for the RL stages (train split) and for every held-out measurement (eval split)."""
    path: Optional[str] = None
    train_split: str = "train"
    eval_split: str = "test"
    revision: Optional[str] = None
    layout: Literal["auto", "prompt", "messages", "conversation"] = "auto"
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    conversation_column: str = "chosen"  # HH-RLHF style: the dialogue up to its last "Assistant:" turn
    leakage: Literal["error", "drop"] = "error"   # a held-out prompt also in the train split


@dataclass(frozen=True)
class PromptsConfig:
    """`prompts`: the prompt set every method shares. Its train split is what ppo, grpo and rs sample
    from (each cutting to its own prompt length where it has one), its eval split the held-out
    prompts every stage's policy is measured on, sampled as `sampling` says, cut to `max_length`.
    `gold_judge` scores those samples with the default task's gold annotator: it knows the default
    task only, so it is refused with a dataset of your own (the stages then report RM scores)."""
    dataset: PromptDatasetConfig = field(default_factory=PromptDatasetConfig)
    max_length: int = num(256, ge=4, doc="held-out prompt tokens (after the chat template); longer ones follow `overlong`")
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)   # how every held-out measurement samples
    gold_judge: bool = True


@dataclass(frozen=True)
class SupervisedConfig:
    """The keys every supervised stage's section shares (sft, reward, dpo, kto, rs): the shared
    loop (training/supervised.py) and engine read them. A section redeclares a key only to give it
    another default; its own keys follow these."""
    seed: int = num(0, ge=0)
    lr: float = num(1e-4, gt=0.0, doc="AdamW peak learning rate")
    weight_decay: float = num(0.0, ge=0.0)
    batch_size: int = num(32, ge=1, doc="examples per optimizer step (the global batch)")
    epochs: float = num(1.0, gt=0.0, doc="passes over the training examples")
    warmup_ratio: float = num(0.05, ge=0.0, lt=1.0)
    max_grad_norm: float = num(1.0, gt=0.0)
    max_length: int = num(96, ge=8, doc="tokens of one training sequence; longer ones follow `overlong`")
    eval_every: int = num(100, ge=1)
    save_every: int = num(100, ge=1, doc="steps between resumable checkpoints")
    overlong: Literal["truncate", "drop", "error"] = "truncate"   # truncate: the prompt loses its left end
    on_nonfinite: Literal["stop", "skip"] = "stop"   # a NaN/inf loss or gradient (training/nonfinite.py)
    max_skipped_updates: int = num(10, ge=0, doc="on_nonfinite: skip: stop once more updates than this were skipped")
    lora: LoraConfig = field(default_factory=LoraConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # merged over the top level


@dataclass(frozen=True)
class DemonstrationConfig(SupervisedConfig):
    """The keys of a stage that learns from demonstrations with SFT's loss (sft, rs:
    training/demonstrations.py)."""
    # Each micro-batch's examples end to end in one row, position ids restarting per example and
    # attention kept within each (training/demonstrations.py): no compute on padding where
    # attention takes packed rows without a dense mask (model.attn_implementation:
    # flash_attention_2). Under SDPA or eager attention the mask is dense, its cost the square of the
    # packed length: slower on this task's short rows on a CPU, so off by default.
    packing: bool = False


@dataclass(frozen=True)
class SFTConfig(DemonstrationConfig):
    """`sft`: supervised fine-tuning on demonstrations, loss on response tokens only."""
    lr: float = num(2e-3, gt=0.0)
    weight_decay: float = num(0.01, ge=0.0)
    epochs: float = num(8.0, gt=0.0)
    n_eval_generations: int = num(200, ge=1)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    dataset: SFTDatasetConfig = field(default_factory=SFTDatasetConfig)


@dataclass(frozen=True)
class PreferenceDataConfig:
    """Where the reward model's preference pairs come from (`reward.dataset`)."""
    path: Optional[str] = None          # None: the pairs written by `prepare`
    train_split: str = "train"
    eval_split: str = "test"
    revision: Optional[str] = None
    layout: Literal["auto", "text", "conversation", "messages"] = "auto"
    margin_column: Optional[str] = None
    leakage: Literal["error", "drop"] = "error"   # a held-out pair also in the train split


@dataclass(frozen=True)
class RestartConfig:
    """`reward.restart`: a training run that has not learnt by `at_step` starts again from a fresh
    draw (training/restart.py). Whether a reward model learns to read what a response says of the
    prompt's aspect is a draw of its head's initialisation and its batch order, and a run that has
    not by mid-training does not later; its accuracy on validation pairs of training titles (never
    the held-out ones) over the evaluations up to `at_step` tells the two apart."""
    at_step: int = num(2500, ge=0, doc="the step of the check (0: off); a run of fewer steps is never checked")
    window: int = num(3, ge=1, doc="validation evaluations averaged, every eval_every steps, the last at at_step")
    min_accuracy: Optional[float] = num(0.775, gt=0.0, le=1.0, doc="restart when the window's mean validation accuracy is below this (null: never)")
    max_restarts: int = num(1, ge=0, doc="restarts at most; restart k trains with seed reward.seed + 1000 k")
    holdout: float = num(0.0, ge=0.0, lt=1.0, doc="with reward.dataset.path: share of training prompts held out as validation pairs")


@dataclass(frozen=True)
class RewardConfig(SupervisedConfig):
    """`reward`: Bradley-Terry reward model on preference pairs."""
    name_or_path: Optional[str] = None  # None: initialise from the SFT checkpoint (InstructGPT)
    lr: float = num(3e-4, gt=0.0)
    epochs: float = num(5.0, gt=0.0)
    eval_every: int = num(250, ge=1)
    save_every: int = num(250, ge=1, doc="steps between resumable checkpoints")
    head_init_std: Optional[float] = num(None, gt=0.0)
    normalize: bool = True
    n_sft_samples: int = num(200, ge=2)
    calibration_bins: int = num(10, ge=2)
    # One row [prompt, chosen, rejected] per pair under a block attention mask instead of two rows:
    # the same scores with the prompt run once (reward_model.branch_scores).
    shared_prompt: bool = True
    # Each training micro-batch's pairs end to end in one row, their two sequences side by side with
    # position ids restarting per sequence (reward_model.packed_scores), as sft.packing: no compute
    # on padding with flash_attention_2, a dense mask under SDPA or eager; the held-out, offset and
    # SFT-sample scoring passes too. Only with shared_prompt
    # false: a rejected branch sees the prompt but not the chosen response, which restarting position
    # ids cannot say.
    packing: bool = False
    dataset: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)

    def __post_init__(self) -> None:
        r = self.restart
        first = r.at_step - (r.window - 1) * self.eval_every      # the window's first evaluation
        if r.at_step and first < 1:
            raise ConfigError(f"reward.restart.at_step: {r.at_step} leaves no room for its window of {r.window} "
                              f"evaluations every reward.eval_every={self.eval_every} steps; set it to at least "
                              f"{(r.window - 1) * self.eval_every + 1}")
        if self.packing and self.shared_prompt:
            raise ConfigError("reward.packing: packs whole sequences, not reward.shared_prompt's branch "
                              "rows; set reward.shared_prompt: false to pack, or reward.packing: false")


@dataclass(frozen=True)
class PairMethodConfig(SupervisedConfig):
    """The keys the offline-pair methods (`dpo`, `kto`: pipeline/stages/pair_method.py) share beyond
    the supervised ones: the SFT policy trained on the preference pairs against its own reference
    log-probs, then sampled on the held-out prompts."""
    # 2.0, not the papers' 0.1 (for 7B models): on the default task (noisy labels, a 4-layer model)
    # DPO's beta 0.1 moves the policy 11.8 nats from SFT with no gold gain, 0.5 reaches gold 1.19 at
    # 3.0 nats, 2.0 gold 1.24 at 0.3 nats (one run each, 2026-12-01; docs/guide/methods.md). KTO's
    # beta plays the same role: the scale of the implicit reward beta (log pi - log pi_ref) in its sigmoid.
    beta: float = num(2.0, gt=0.0, doc="scale of the implicit reward (dpo: DPO's KL strength, IPO's tau, "
                                       "SimPO's reward scale)")
    warmup_ratio: float = num(0.1, ge=0.0, lt=1.0)
    max_length: int = num(96, ge=8, doc="prompt + the longer of its two responses (kto: its own and its "
                                        "mismatched one), in tokens; longer ones follow `overlong`")
    n_eval_prompts: int = num(200, ge=2, doc="held-out prompts the trained policy is measured on (as prompts.sampling)")
    # Each micro-batch's sequences (a pair's two, kto: its own responses and, in the step's KL
    # forward, the mismatched ones) end to end in one row with position ids restarting per sequence
    # (preference.logprobs.packed_sequence_logprobs), as sft.packing: in training, in the reference
    # and held-out passes, and in the measurement's KL forwards.
    packing: bool = False
    dataset: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)   # the RM's pairs by default

    _section: typing.ClassVar[str] = ""   # the params section, for error messages
    _losses: typing.ClassVar[str] = ""    # the losses the section trains with, as its margin error names them

    def __post_init__(self) -> None:
        if self.dataset.margin_column is not None:
            # The RM's loss takes a per-pair margin; none of these losses has a place for one.
            raise ConfigError(f"{self._section}.dataset.margin_column: {self._losses} no per-pair margin; set it to "
                              f"null (got {self.dataset.margin_column!r})")


@dataclass(frozen=True)
class PreferenceOptConfig(PairMethodConfig):
    """`dpo`: offline preference optimisation of the SFT policy on preference pairs: DPO (with
    conservative label smoothing), IPO, or the reference-free SimPO (pipeline/preference/losses.py).

    One `beta` serves all three methods, each in its paper's role: DPO's KL strength, IPO's tau
    (target 1 / (2 beta)), SimPO's reward scale. The papers' values differ: DPO and IPO use about
    0.1, SimPO about 2 to 2.5 with simpo_gamma / beta near 0.5 (Meng et al. 2024's search), so a
    SimPO run sets `beta` itself; nothing is rescaled behind its back."""
    method: str = named("preference loss", "dpo", doc="the loss, by its name in preference.losses.PREFERENCE_LOSSES")
    label_smoothing: float = num(0.0, ge=0.0, lt=0.5, doc="DPO only: assumed probability of a flipped label (cDPO)")
    simpo_gamma: float = num(0.5, ge=0.0, doc="SimPO only: target margin between the two rewards")
    # 20x below sft.lr and equal to ppo.lr: the same tiny model, starting from the same SFT weights,
    # should move a little from them, as PPO's actor does, not re-learn the task (DPO's 5e-7 is for
    # 7B models; a 4-layer model of width 96 needs steps as large as PPO's to move at all).
    lr: float = num(1e-4, gt=0.0)
    batch_size: int = num(32, ge=1, doc="pairs per optimizer step")
    epochs: float = num(1.0, gt=0.0, doc="passes over the pairs; DPO overfits deterministic-looking pairs fast (Azar et al. 2023)")

    _section: typing.ClassVar[str] = "dpo"
    _losses: typing.ClassVar[str] = "DPO, IPO and SimPO use"


@dataclass(frozen=True)
class OnPolicyDPOConfig(PreferenceOptConfig):
    """`onpolicy_dpo`: DPO on pairs the SFT policy samples itself, one round of on-policy preference
    optimisation (Dong et al. 2024, RLHF Workflow; Xiong et al. 2024): `samples_per_prompt` samples
    of each training prompt (the train split of `prompts`, cut to prompts.max_length) scored by the
    reward model, the best against the worst of each prompt one pair, then the loss of `method` on
    those pairs as the `dpo` stage trains (pipeline/stages/onpolicy_dpo.py). `dataset` gives the
    held-out pairs only (its train split is read for the leakage check)."""
    samples_per_prompt: int = num(4, ge=2, le=4, doc="samples per prompt, the RM's best and worst of them one pair")
    n_prompts: Optional[int] = num(None, ge=1, doc="the first this many training prompts (prompts.dataset) are sampled; None: all")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)   # how the SFT policy samples the pairs' responses
    # Two passes over at most one pair per prompt: by the end of the second the training pairs are
    # all ranked right and the held-out pairs' loss has turned up, so more passes overfit.
    epochs: float = num(2.0, gt=0.0, doc="passes over the sampled pairs")
    eval_every: int = num(20, ge=1)
    save_every: int = num(20, ge=1, doc="steps between resumable checkpoints")

    _section: typing.ClassVar[str] = "onpolicy_dpo"


@dataclass(frozen=True)
class KTOConfig(PairMethodConfig):
    """`kto`: Kahneman-Tversky Optimisation (Ethayarajh et al. 2024) of the SFT policy on unpaired
    feedback made from the preference pairs: the chosen responses of one half of the pairs are
    desirable examples, the rejected responses of the other half undesirable ones
    (pipeline/stages/kto.py)."""
    lambda_desirable: float = num(1.0, gt=0.0, doc="weight of a desirable example's loss (the paper's lambda_D)")
    lambda_undesirable: float = num(1.0, gt=0.0, doc="weight of an undesirable example's loss (lambda_U)")
    batch_size: int = num(32, ge=2, doc="examples per optimizer step (the KL reference point is estimated on them)")

    _section: typing.ClassVar[str] = "kto"
    _losses: typing.ClassVar[str] = "KTO uses"


@dataclass(frozen=True)
class RejectionSamplingConfig(DemonstrationConfig):
    """`rs`: rejection-sampling fine-tuning (best-of-n, then SFT on the winners; Touvron et al. 2023,
    sec. 3.2.3; Dong et al. 2023, RAFT): `n` samples of the SFT policy per training prompt (the train
    split of `prompts`, cut to prompts.max_length), the reward model's favourite kept, and a fresh
    copy of the SFT policy fine-tuned on the kept ones with SFT's loss (response tokens only)."""
    n: int = num(8, ge=2, doc="samples per prompt, the RM keeping the best; 1 would be SFT on its own samples")
    n_prompts: Optional[int] = num(None, ge=1, doc="the first this many training prompts (prompts.dataset) are sampled; None: all")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)   # how the SFT policy samples candidates
    min_score: Optional[float] = num(None, doc="a winner with an RM score below this is not kept; None: every winner")
    # Half of sft.lr: training continues from the SFT weights on the SFT policy's own samples. On the
    # default task (one seed, 1000 prompts) 2e-4 barely moved it (gold 1.17 at KL 0.37 to SFT), 1e-3
    # reached 1.72 at KL 0.86, and 2e-3 or 4 epochs added under 0.2 gold for more KL; all 2000
    # prompts: 1.91 at KL 0.89.
    lr: float = num(1e-3, gt=0.0)
    weight_decay: float = num(0.01, ge=0.0)
    epochs: float = num(2.0, gt=0.0, doc="passes over the winners")
    eval_every: int = num(20, ge=1)
    save_every: int = num(20, ge=1, doc="steps between resumable checkpoints")
    n_eval_prompts: int = num(200, ge=2, doc="held-out prompts the trained policy is measured on (as prompts.sampling)")


@dataclass(frozen=True)
class DetectorConfig:
    """`ppo.detector`: signs of reward over-optimisation that need no gold annotator (pipeline/ppo/detector.py).

    Each rule compares the mean of the last `window` iterations with the mean of the `window`
    before them, once both windows lie after `warmup`. The defaults are calibrated on logged runs
    (`python -m pipeline detect outputs/ppo/train.tsv`): each threshold is at least 1.6 times the
    largest value of 12 healthy default runs, and two kl_coef=0 runs trip them at or before their
    gold collapse (docs/guide/overoptimisation.md)."""
    enabled: bool = True
    warmup: int = num(5, ge=0, doc="iterations ignored (the policy moves fastest at the start)")
    window: int = num(3, ge=1, doc="iterations per compared window")
    kl_rise: float = num(4.0, gt=0.0, doc="KL to the reference rising more than this, nats per response")
    length_change: float = num(0.3, gt=0.0, doc="relative change of the response length (either way)")
    entropy_drop: float = num(0.15, gt=0.0, le=1.0, doc="relative drop of the policy's entropy")
    distinct_drop: float = num(0.25, gt=0.0, le=1.0, doc="relative drop of distinct-2 of the rollouts")
    auditor: Optional[str] = None         # a second reward-model folder scoring the rollouts (opt-in)
    auditor_drop: float = num(0.5, gt=0.0, doc="auditor score below its best while the RM is at its best")
    action: Literal["warn", "stop"] = "warn"   # stop: end PPO, keep the last checkpoint before the alarm

    @property
    def first_check(self) -> int:
        """The first iteration a rule can fire: both windows past the warmup."""
        return self.warmup + 2 * self.window


@dataclass(frozen=True)
class PPOConfig:
    """`ppo`: PPO against the reward model (InstructGPT step 3). Names follow TRL where they can.

    `advantage` names a registered estimator (pipeline/ppo/advantages.py's ESTIMATORS: GAE there, the
    critic-free ones in pipeline/ppo/group_advantages.py), whose facts say whether it needs a critic:
    - gae: PPO with a critic (four models: actor, critic, reference, reward);
    - grpo (`grpo_scale: false` is Dr. GRPO), rloo, reinforce_baseline: a baseline from the other
      responses to the same prompt, no critic (three models). They need `samples_per_prompt` k >= 2.
    The critic's keys (critic_lr, critic_init, critic_lora, clip_eps_value, vf_coef, shared_backbone)
    and GAE's (gamma, lam) are unused by a critic-free estimator: accepted, ignored, not an error, so
    one params file can switch estimators with one key.

    `rollout_batch_size` counts responses (rows), not prompts: an iteration samples
    rollout_batch_size / k prompts, each k times, its k rows consecutive. So minibatch and micro-batch
    sizes keep meaning rows, and the same rollout_batch_size generates the same number of responses
    (the cost of an iteration) whatever k is.

    `loss_aggregation` (pipeline/ppo/group_advantages.py's AGGREGATIONS) reduces the per-token policy
    loss (and the KL loss and the entropy bonus, as verl's `agg_loss` does) to a scalar: token_mean
    is PPO as trained here and DAPO; seq_mean is GRPO as published (each response's token mean, then
    the mean over responses); seq_sum_norm is Dr. GRPO (token sum / (responses *
    sampling.max_new_tokens), no length normalisation)."""
    _section: typing.ClassVar[str] = "ppo"   # the params section, for error messages (grpo reuses this class)
    _moved: typing.ClassVar[dict[str, str]] = {"dataset": "prompts.dataset"}
    # kl_horizon counted episodes, as TRL's does; its successor's unit is in its name
    _removed: typing.ClassVar[dict[str, str]] = {
        "kl_horizon": "the adaptive controller's horizon is kl_horizon_iterations, in iterations (an episode "
                      "count divided by rollout_batch_size)"}
    seed: int = num(0, ge=0)
    # 150, not 100: at 100 the adaptive controller is still pulling KL back from its early overshoot,
    # and the extra 50 iterations give back the KL the policy does not need while its reward holds
    # (seed 2:2 from 0.60 below the best-of-n curve to 0.18; docs/decisions/2026-12-07-150-ppo-iterations.md)
    iterations: int = num(150, ge=1, doc="rollout + update rounds")
    rollout_batch_size: int = num(64, ge=2, doc="responses sampled per iteration (prompts x samples_per_prompt)")
    advantage: str = named("advantage estimator", "gae", doc="gae, or a critic-free estimator (see above)")
    samples_per_prompt: int = num(1, ge=1, doc="k responses per prompt, consecutive rows; >= 2 for group estimators")
    grpo_scale: bool = True               # grpo: divide by the group's std; false: Dr. GRPO (Liu et al. 2025)
    loss_aggregation: str = named("loss aggregation", "token_mean", doc="see above (ppo/group_advantages.py)")
    minibatch_size: int = num(32, ge=1, doc="rollouts per optimizer step")
    micro_batch_size: int = num(16, ge=1, doc="rollouts per forward/backward (gradient accumulation)")
    ppo_epochs: int = num(4, ge=1)
    lr: float = num(1e-4, gt=0.0, doc="actor learning rate")
    critic_lr: float = num(3e-4, gt=0.0)
    # constant by default: with a decaying rate the run stops where the rate reaches 0, not where KL
    # reaches its target (docs/decisions/2026-12-06-constant-lr-under-the-adaptive-kl.md)
    lr_schedule: Literal["constant", "linear"] = "constant"
    max_grad_norm: float = num(1.0, gt=0.0)
    clip_eps: float = num(0.2, gt=0.0, lt=1.0)
    clip_eps_value: Optional[float] = num(0.2, gt=0.0, doc="None: unclipped value loss")
    dual_clip: Optional[float] = num(None, gt=1.0)
    entropy_coef: float = num(0.0, ge=0.0)
    gamma: float = num(1.0, gt=0.0, le=1.0)
    lam: float = num(0.95, ge=0.0, le=1.0)
    kl_coef: float = num(0.2, ge=0.0, doc="KL penalty in the reward (initial value when adaptive)")
    kl_loss_coef: float = num(0.0, ge=0.0, doc="KL term in the loss instead (GRPO style)")
    kl_estimator: str = named("KL estimator", "k1", doc="k1, k2 or k3 (Schulman 2020; ppo/advantages.py)")
    # On by default, aimed inside best-of-64's KL (log 64 - 63/64 = 3.17 nats), where the report can
    # still place PPO against the best-of-n frontier; runs end 0.1-0.3 nats above the target.
    adaptive_kl: bool = True
    kl_target: float = num(2.0, gt=0.0)
    # The adaptive controller's horizon in iterations (TRL's and Ziegler et al.'s is in episodes: theirs
    # divided by rollout_batch_size): each iteration moves kl_coef by at most 0.2 / horizon of itself.
    kl_horizon_iterations: float = num(10.0, gt=0.0, doc="adaptive controller horizon, in iterations")
    target_kl: Optional[float] = num(None, gt=0.0, doc="stop the epochs early above this approx KL")
    score_clip: Optional[float] = num(None, gt=0.0)
    whiten_rewards: bool = False
    missing_eos_score: Optional[float] = -3.0
    critic_init: Literal["reward", "sft"] = "reward"
    # The first critic_warmup iterations train the critic only, the actor frozen (OpenRLHF's
    # freezing_actor_steps): its first advantages come from a critic that has seen the policy's returns.
    critic_warmup: int = num(0, ge=0, doc="iterations at the start that train the critic only")
    # Scores divided by the reward model's stored scale (the standard deviation of its held-out
    # demonstration scores; OpenRLHF's --normalize_reward): kl_coef then weighs KL against a unit of spread.
    normalize_reward: bool = False
    # k >= 2: the reward is log F(score), F the SFT policy's distribution of scores on the prompt,
    # estimated from k SFT responses to each training prompt sampled before training; with kl_coef
    # 1/(n-1) PPO's optimum is best-of-n's distribution (pipeline/ppo/quantile_reward.py). 0: off.
    quantile_reward_samples: int = num(0, ge=0, le=1024, doc="SFT responses per training prompt that place "
                                       "each score (the reward is its log CDF); 0: the score itself")
    reward_source: str = "reward_model"
    reward_timeout: float = num(600.0, gt=0.0, le=1e6, doc="seconds one call of a reward_source function may take")
    on_nonfinite: Literal["stop", "skip"] = "stop"   # a NaN/inf loss or gradient (training/nonfinite.py)
    max_skipped_updates: int = num(10, ge=0, doc="on_nonfinite: skip: stop once more updates than this were skipped")
    save_every: int = num(10, ge=1)
    n_eval_prompts: int = num(200, ge=2)
    score_micro_batch_size: Optional[int] = num(None, ge=1, doc="rollouts per scoring forward (reference, "
                                                "critic, reward, recomputed log-probs); None: micro_batch_size")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Our sampler's memory and speed (rollout_engine: torch): responses per sampling call, so long
    # responses' KV cache fits (0: a process's whole rollout batch at once), or calls cut by a token
    # budget, rows x (longest prompt + max_new_tokens), the prompts longest first (verl's
    # token-budget micro-batches; pipeline/models/rollout_engine.py), and ended responses leaving the
    # batch. Each draws the rollouts' one random stream otherwise: other samples, the same training
    # (pipeline/models/generation.py); all off keeps the committed runs' bits.
    rollout_micro_batch_size: int = num(0, ge=0, doc="responses per sampling call; 0: all at once")
    rollout_max_tokens: Optional[int] = num(None, ge=1, doc="tokens per sampling call: rows x (longest "
                                            "prompt + max_new_tokens); None: rollout_micro_batch_size's rows")
    rollout_drop_finished: bool = False
    # Every forward of an iteration but sampling on one packed row per micro-batch, each rollout's
    # prompt and response end to end, position ids restarting (pipeline/ppo/scoring.py's
    # packed_rollout): the scoring pass (actor, reference, critic, reward model) and the update, and
    # the held-out measurement's scoring. As sft.packing: no compute on padding where attention takes
    # packed rows without a dense mask (flash_attention_2). Off by default, as sft.packing.
    packing: bool = False
    max_prompt_length: int = num(256, ge=4, doc="training prompt tokens; longer ones follow `overlong`")
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    # pi_old's log-probs: from a training forward (true), the sampler's (false), or auto: recompute
    # wherever the two can differ (not fp32, or CUDA, or tis_cap set; pipeline/ppo/mismatch.py)
    recompute_logprobs: Literal["auto", True, False] = "auto"
    logprob_check_rows: int = num(8, ge=1, doc="rollouts per process whose sampler log-probs are checked "
                                              "against a training forward when they are not recomputed")
    tis_cap: Optional[float] = num(None, gt=1.0, doc="truncated importance sampling: weight each token's "
                                                     "policy loss by min(pi_old / pi_sampler, tis_cap); None: off")
    # Who samples the rollouts: our own KV-cache sampler, or a vLLM engine in each training process
    # (experimental; CUDA and vLLM installed; pipeline/models/vllm_engine.py). Measurement uses ours.
    rollout_engine: Literal["torch", "vllm"] = "torch"
    shared_backbone: bool = False         # one trunk, two heads: the critic is a value head on the actor
    vf_coef: float = num(1.0, gt=0.0, doc="weight of the value loss (matters with shared_backbone)")
    lora: LoraConfig = field(default_factory=LoraConfig)          # actor adapter (reference = adapter off)
    critic_lora: LoraConfig = field(default_factory=LoraConfig)   # critic adapter
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # merged over the top level

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a critic, as it declares (GAE does; the group estimators take
        their baseline from the other responses)."""
        facts = registries.declared("advantage estimator", self.advantage)
        if facts is None:   # params built without load_params' check of the names
            raise ConfigError(f"{self._section}.advantage: no advantage estimator {self.advantage!r} is registered")
        return facts["critic"]

    def __post_init__(self) -> None:
        # Batch sizes against processes: check_process_shape, when the stage's SPEC says (at load
        # for ppo, at start for grpo; pipeline/stages/registry.py).
        facts = registries.declared("advantage estimator", self.advantage)
        if facts is not None:   # else an unknown name, which load_params' check of the names reports
            self._check_estimator(facts)
        self._check_rest()

    def _check_estimator(self, facts: typing.Mapping[str, Any]) -> None:
        """The keys whose meaning depends on what the estimator declares (pipeline/ppo/advantages.py)."""
        s = self._section
        if facts["group"] and self.samples_per_prompt < 2:
            raise ConfigError(f"{s}.samples_per_prompt: advantage: {self.advantage} takes each response's baseline "
                              f"from the other responses to its prompt, so it needs >= 2, got {self.samples_per_prompt}")
        if not facts["critic"] and self.whiten_rewards:
            raise ConfigError(f"{s}.whiten_rewards: whitens GAE's per-token rewards; advantage: {self.advantage} "
                              "normalises the sequence scores itself; set it to false")

    def _check_vllm(self) -> None:
        """What a vLLM engine would sample or score otherwise than the trainer is refused."""
        s = self._section
        for name, value, off in (("top_k", self.sampling.top_k, 0), ("top_p", self.sampling.top_p, 1.0)):
            if value != off:
                raise ConfigError(f"{s}.sampling.{name}: {value} with {s}.rollout_engine: vllm: vLLM's log-probs are of "
                                  f"the {name}-filtered distribution and the trainer's of the unfiltered one, so the "
                                  f"PPO ratio would compare two policies; set {name}: {off}, or rollout_engine: torch")
        if self.recompute_logprobs is False:
            raise ConfigError(f"{s}.recompute_logprobs: false with {s}.rollout_engine: vllm: pi_old must come from a "
                              "training forward; the engine's log-probs are only measured against it")

    def check_shape(self) -> None:
        """The batch sizes against the process count (each process a whole share of every batch)."""
        dist, s = self.distributed, self._section
        if self.rollout_batch_size % (self.minibatch_size) or self.minibatch_size % dist.world_size:
            raise ConfigError(f"{s}.minibatch_size: {self.minibatch_size} must divide {s}.rollout_batch_size="
                              f"{self.rollout_batch_size} and be divisible by the {dist.world_size} processes")
        if (self.minibatch_size // dist.world_size) % self.micro_batch_size:
            raise ConfigError(f"{s}.micro_batch_size: {self.micro_batch_size} must divide the per-process "
                              f"minibatch {s}.minibatch_size / processes = {self.minibatch_size // dist.world_size}")
        if self.rollout_batch_size % (self.samples_per_prompt * dist.world_size):
            # Each process computes its groups' baselines alone: a group must not straddle two processes.
            raise ConfigError(f"{s}.rollout_batch_size: {self.rollout_batch_size} responses must be divisible by "
                              f"{s}.samples_per_prompt x processes = {self.samples_per_prompt * dist.world_size}")

    def _check_rest(self) -> None:
        dist, s = self.distributed, self._section
        if self.shared_backbone and (dist.backend != "none" or self.critic_lora.enabled):
            raise ConfigError(f"{s}.shared_backbone: runs with distributed.backend: none and without critic_lora "
                              "(the shared trunk is trained by the actor's optimizer)")
        if self.kl_coef > 0 and self.kl_loss_coef > 0:
            raise ConfigError(f"{s}.kl_loss_coef: the KL penalty is already in the reward ({s}.kl_coef="
                              f"{self.kl_coef}); set one of them to 0, never both (double penalty)")
        if self.adaptive_kl and self.kl_coef == 0:
            raise ConfigError(f"{s}.adaptive_kl: needs {s}.kl_coef > 0 as its initial value")
        if self.rollout_max_tokens is not None and self.rollout_micro_batch_size:
            raise ConfigError(f"{s}.rollout_max_tokens: {self.rollout_max_tokens} and "
                              f"{s}.rollout_micro_batch_size: {self.rollout_micro_batch_size} both size the "
                              "sampling calls; set one (rollout_micro_batch_size: 0 or "
                              "rollout_max_tokens: null)")
        if self.critic_warmup and not self.uses_critic:
            raise ConfigError(f"{s}.critic_warmup: {self.advantage} has no critic to warm up; set it to 0")
        if self.critic_warmup and self.shared_backbone:
            raise ConfigError(f"{s}.critic_warmup: with shared_backbone the critic's trunk is the actor, which the "
                              "warm-up freezes; use one or the other")
        if self.critic_warmup >= self.iterations:
            raise ConfigError(f"{s}.critic_warmup: {self.critic_warmup} iterations leave none of the "
                              f"{self.iterations} ({s}.iterations) to train the actor")
        if self.normalize_reward and self.reward_source != "reward_model":
            raise ConfigError(f"{s}.normalize_reward: divides by the reward model's stored scale; "
                              f"{s}.reward_source {self.reward_source!r} is a function (scale it there)")
        if self.quantile_reward_samples == 1:
            raise ConfigError(f"{s}.quantile_reward_samples: one SFT response per prompt places a score only as "
                              "below, tied with or above it; use 0 (off) or >= 2 (16 or more to aim at best-of-16)")
        if self.quantile_reward_samples and self.whiten_rewards:
            raise ConfigError(f"{s}.whiten_rewards: would rescale the log-CDF reward that "
                              f"{s}.quantile_reward_samples makes, and kl_coef = 1/(n-1) aims at best-of-n only "
                              "in its units; set whiten_rewards: false")
        if self.rollout_engine == "vllm":
            self._check_vllm()
        if type(self.recompute_logprobs) is not bool and self.recompute_logprobs != "auto":
            # Literal's check lets 1 and 0.0 through (1 == True); only YAML's true/false are booleans.
            raise ConfigError(f"{s}.recompute_logprobs: expected auto, true or false, got {self.recompute_logprobs!r}")
        if self.tis_cap is not None and self.recompute_logprobs is False:
            raise ConfigError(f"{s}.tis_cap: {self.tis_cap} weights tokens by pi_old / pi_sampler, which is 1 when "
                              f"pi_old is the sampler's; set {s}.recompute_logprobs: auto or true, or tis_cap: null")
        if self.reward_source != "reward_model":
            reward_function(self.reward_source, f"{s}.reward_source")   # importable, a function of (prompts, responses)
        det = self.detector
        if det.enabled and det.action == "stop" and self.save_every >= det.first_check:
            # The weights kept on an alarm are those of the last checkpoint before it: one must exist.
            raise ConfigError(f"{s}.detector.action: stop keeps the last checkpoint before the alarm, but the "
                              f"first checkpoint ({s}.save_every={self.save_every}) comes no earlier than the "
                              f"first possible alarm (warmup + 2 * window = {det.first_check}); lower save_every")


@dataclass(frozen=True)
class GRPOConfig(PPOConfig):
    """`grpo`: the PPO trainer with a critic-free estimator, as its own stage (pipeline/stages/grpo.py),
    so PPO and GRPO (or RLOO, REINFORCE++, Dr. GRPO) sit side by side in one comparison. The keys are
    `ppo`'s; only these defaults differ, so a partial `grpo` section still means GRPO.

    GRPO as published (Shao et al. 2024): k = 4 responses per prompt, the group-std-scaled advantage,
    the per-response token mean (seq_mean), and the KL to the reference in the loss (k3 estimator)
    instead of in the reward at a fixed coefficient (0.15 here, see kl_loss_coef), with a learning
    rate decaying linearly to 0. Everything else equals `ppo`'s defaults: rollout_batch_size counts
    responses, and 100 iterations of 64 responses generate 6400 responses, with 4 epochs of 2
    minibatches per iteration and PPO's peak learning rate; PPO's own default adapts its KL
    coefficient at a constant rate instead, for 150 iterations (GRPO's count and its kl_loss_coef
    were chosen together, at 100).

    The prompts are the `prompts` section's (training and held-out), as for every method."""
    _section: typing.ClassVar[str] = "grpo"
    advantage: str = named("advantage estimator", "grpo", doc="a critic-free estimator, or gae (see PPOConfig)")
    samples_per_prompt: int = num(4, ge=1, doc="k responses per prompt, consecutive rows; >= 2 for group estimators")
    loss_aggregation: str = named("loss aggregation", "seq_mean", doc="see PPOConfig")
    iterations: int = num(100, ge=1, doc="rollout + update rounds")
    kl_coef: float = num(0.0, ge=0.0, doc="KL penalty in the reward (initial value when adaptive)")
    # 0.15, not the paper's 0.04-0.05: at 0.05 the default task's GRPO ends at 7.1-7.7 nats, past
    # every best-of-n baseline, so no frontier gap is measured; 0.15 ends near 2.5 (seed 0;
    # docs/decisions/2026-12-06-grpo-kl-loss-coef.md).
    kl_loss_coef: float = num(0.15, ge=0.0, doc="KL term in the loss instead (GRPO style)")
    kl_estimator: str = named("KL estimator", "k3", doc="k1, k2 or k3 (Schulman 2020; ppo/advantages.py)")
    # GRPO as published: a fixed KL coefficient in the loss and a linearly decaying rate, not PPO's
    # adaptive KL in the reward with a constant rate.
    lr_schedule: Literal["constant", "linear"] = "linear"
    adaptive_kl: bool = False
    kl_target: float = num(6.0, gt=0.0)



@dataclass(frozen=True)
class MeasuringConfig:
    """The keys the measuring stages (`evaluate`, `compare`) share: the held-out prompts they sample
    (as `prompts.sampling` says), the best-of-n baselines drawn from SFT, the win rates' bootstrap."""
    seed: int = num(0, ge=0)
    n_prompts: int = num(200, ge=2)
    best_of_n: tuple[int, ...] = num((4, 16, 64), ge=2, doc="samples per prompt of each best-of-n baseline from SFT")
    bootstrap: int = num(1000, ge=100, doc="bootstrap resamples for win-rate intervals")
    # The scoring forwards (each policy's and SFT's log-probs for the KL, the reward model's scores)
    # in packed rows, as sft.packing: no compute on padding where attention takes packed rows without
    # a dense mask (flash_attention_2); sampling is unchanged. Off by default, as sft.packing.
    packing: bool = False
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # merged over the top level

    _section: typing.ClassVar[str] = ""
    _baselines_required: typing.ClassVar[bool] = False   # whether best_of_n may be empty (no baseline)

    def __post_init__(self) -> None:
        # Nested subsets: best-of-n keeps the RM's favourite among the first n of max(n) samples.
        ns = self.best_of_n
        if (self._baselines_required and not ns) or any(a >= b for a, b in zip(ns, ns[1:])):
            raise ConfigError(f"{self._section}.best_of_n: expected a {'non-empty, ' * self._baselines_required}"
                              f"strictly increasing list of sample counts, got {list(ns)}")


@dataclass(frozen=True)
class EvaluateConfig(MeasuringConfig):
    """`evaluate`: SFT, best-of-n and PPO policies on the held-out prompts (sampled as in `prompts.sampling`)."""
    n_samples_shown: int = num(12, ge=0, doc="rows of the sample table in the report")

    _section: typing.ClassVar[str] = "evaluate"
    _baselines_required: typing.ClassVar[bool] = True   # its report sets PPO against best-of-n


@dataclass(frozen=True)
class CompareConfig(MeasuringConfig):
    """`compare`: every alignment method of compare/dvc.yaml, SFT and best-of-n on the same held-out
    prompts (sampled as in `prompts.sampling`), judged by the same reward model and gold annotator;
    `best_of_n` empty: no baseline."""

    _section: typing.ClassVar[str] = "compare"


@dataclass(frozen=True)
class Params:
    """The whole params file. Stages read only the sections `dvc.yaml` lists for them."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dpo: PreferenceOptConfig = field(default_factory=PreferenceOptConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)
    onpolicy_dpo: OnPolicyDPOConfig = field(default_factory=OnPolicyDPOConfig)
    rs: RejectionSamplingConfig = field(default_factory=RejectionSamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)   # a subclass, so a partial section keeps GRPO's defaults
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        if self.prompts.gold_judge:
            for key, path in (("sft.dataset.path", self.sft.dataset.path), ("reward.dataset.path", self.reward.dataset.path),
                              ("prompts.dataset.path", self.prompts.dataset.path)):
                if path is not None:
                    raise ConfigError(f"prompts.gold_judge: the default task's gold annotator judges the default task's "
                                      f"own data only, and {key} is set; set prompts.gold_judge: false")


def distributed_sections() -> tuple[str, ...]:
    """The params sections with a `distributed` of their own (merged over the top level): the
    sections of the stages that run in a distributed session (their SPECs say which)."""
    hints = typing.get_type_hints(Params)
    return tuple(f.name for f in dataclasses.fields(Params)
                 if f.name != "distributed" and dataclasses.is_dataclass(hints[f.name])
                 and "distributed" in {g.name for g in dataclasses.fields(hints[f.name])})


def reward_function(spec: str, key: str = "ppo.reward_source") -> typing.Callable:
    """The function `module:function` names, checked the moment params are read, before any model
    is built: the module imports, the name is a Python function (not a builtin such as `os:system`
    nor a class), and it accepts `(prompts, responses)`. What it returns is checked on one probe
    pair when PPO starts (reward_source.FunctionSource)."""
    import importlib
    import inspect

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: expected 'reward_model' or 'module:function', got {shown(spec)!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:   # noqa: BLE001 - any failure to import is the user's module
        raise ConfigError(f"{key}: cannot import module {shown(module_name)!r} ({type(err).__name__}: "
                          f"{shown(str(err), 120)})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{key}: module {module_name!r} has no {shown(attr)!r}")
    if not inspect.isfunction(fn):
        raise ConfigError(f"{key}: {shown(spec)!r} is a {type(fn).__name__}, not a Python function "
                          "def f(prompts, responses) -> list of floats")
    try:
        inspect.signature(fn).bind(["prompt"], ["response"])
    except TypeError:
        raise ConfigError(f"{key}: {shown(spec)!r} does not take (prompts, responses): "
                          f"its signature is {shown(str(inspect.signature(fn)))}") from None
    return fn


def check_process_shape(params: "Params", stage: str) -> None:
    """A stage's batch sizes against its process count (when its SPEC's `shape` says: at load for
    the default pipeline's stages, at stage start for compare/dvc.yaml's methods)."""
    section = getattr(params, stage)
    if isinstance(section, PPOConfig):
        section.check_shape()
    else:
        check_batch_split(stage, section.batch_size, section.distributed)


def check_batch_split(section: str, batch_size: int, dist: DistributedConfig) -> None:
    """A global batch must split evenly into processes x micro-batches (same maths as one process)."""
    parts = dist.world_size * dist.gradient_accumulation_steps
    if batch_size % parts:
        raise ConfigError(f"{section}.batch_size: {batch_size} must be divisible by processes x "
                          f"gradient_accumulation_steps = {parts}")


# ----------------------------------------------------------------------------------------------
# Loading and validation.


def _describe(value: Any) -> str:
    return repr(shown(value)) if isinstance(value, str) else f"{shown(value)} ({type(value).__name__})"


def _bounds_text(meta: typing.Mapping[str, Any]) -> str:
    parts = []
    for key, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if meta.get(key) is not None:
            parts.append(f"{sym} {meta[key]}")
    return " and ".join(parts)


def _check_bounds(value: float, meta: typing.Mapping[str, Any], where: str, kind: str) -> None:
    ok = ((meta.get("gt") is None or value > meta["gt"]) and (meta.get("ge") is None or value >= meta["ge"])
          and (meta.get("lt") is None or value < meta["lt"]) and (meta.get("le") is None or value <= meta["le"]))
    if not ok:
        positive = meta.get("gt") == 0 and all(meta.get(k) is None for k in ("ge", "lt", "le"))
        article = "an" if kind[0] in "aeiou" else "a"
        expected = f"a positive {kind}" if positive else f"{article} {kind} {_bounds_text(meta)}"
        raise ConfigError(f"{where}: expected {expected}, got {_describe(value)}")


def _convert(value: Any, tp: Any, meta: typing.Mapping[str, Any], where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], meta, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: expected one of {', '.join(map(repr, choices))}, got {_describe(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is tuple:   # a YAML list of one element type, e.g. tuple[int, ...]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_describe(value)}")
        return tuple(_convert(v, typing.get_args(tp)[0], meta, where) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer{' ' + _bounds_text(meta) if _bounds_text(meta) else ''}, "
                              f"got {_describe(value)}")
        _check_bounds(value, meta, where, "integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            positive = meta.get("gt") == 0
            raise ConfigError(f"{where}: expected a {'positive ' if positive else ''}float, got {_describe(value)}")
        _check_bounds(float(value), meta, where, "float")
        return float(value)
    if tp is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: expected a non-empty string, got {_describe(value)}")
        if len(value) > MAX_STRING:
            raise ConfigError(f"{where}: a string of {len(value)} characters; at most {MAX_STRING}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ConfigError(f"{where}: not valid Unicode (a lone surrogate at character {err.start})") from None
        return value
    raise TypeError(f"unsupported config type {tp!r} at {where}")  # a bug in this module, not user error


def from_dict(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a mapping; `where` is the `file: dotted.key` prefix for errors.
    A section set to null is an error: it reads as "nothing", not as "the defaults" (omit the key,
    or write `{}`, for those)."""
    if data is None:
        raise ConfigError(f"{where.rstrip(': ')}: is null; omit it, or write {{}}, for the defaults")
    if not isinstance(data, typing.Mapping):
        raise ConfigError(f"{where.rstrip(': ')}: expected a mapping of keys, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    sep = "." if not where.endswith(": ") else ""
    for key in data:
        moved = getattr(cls, "_moved", {}).get(key)
        if key not in fields and moved is not None:
            raise ConfigError(f"{where}{sep}{key}: moved to {moved}; write it there (the old key is not read)")
        removed = getattr(cls, "_removed", {}).get(key)
        if key not in fields and removed is not None:
            raise ConfigError(f"{where}{sep}{key}: no longer a key: {removed}")
        if key not in fields:
            raise ConfigError(f"{where}{sep}{key}: unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {name: _convert(data[name], hints[name], f.metadata, f"{where}{sep}{name}")
              for name, f in fields.items() if name in data}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        # A class's own checks name its keys from its usual place (`distributed.backend`); where
        # the mapping sits deeper (a stage's `sft.distributed` override), the key is named from there.
        dotted = where.split(": ", 1)[1] if ": " in where else ""
        last, text = dotted.rsplit(".", 1)[-1], str(err)
        if dotted != last and text.startswith(f"{last}."):
            text = dotted + text[len(last):]
        raise ConfigError(f"{where.split(': ', 1)[0]}: {text}") from None   # the file (its path may hold ':')


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file with the YAML 1.2 loader; a file that is not YAML is a ConfigError."""
    from .files import decode_utf8, read_input
    path = Path(path)
    text = decode_utf8(read_input(path, "params file", ConfigError, MAX_PARAMS_BYTES), str(path), ConfigError)
    yaml = YAML(typ="safe", pure=True)
    try:
        # Anchors and aliases let a few lines expand into billions of values ("billion laughs");
        # params never need them, so they are refused before anything is built. Depth is refused in
        # the same pass (MAX_PARAMS_DEPTH), so loading never recurses deeply.
        depth = 0
        for event in yaml.parse(text):
            if getattr(event, "anchor", None) is not None:
                raise ConfigError(f"{path}:{event.start_mark.line + 1}: YAML anchors and aliases (&{shown(event.anchor, 40)} "
                                  "/ *...) are not allowed in a params file; write the values out")
            depth += isinstance(event, CollectionStartEvent) - isinstance(event, CollectionEndEvent)
            if depth > MAX_PARAMS_DEPTH:
                raise ConfigError(f"{path}:{event.start_mark.line + 1}: not valid YAML: nested deeper than "
                                  f"{MAX_PARAMS_DEPTH} levels")
        return yaml.load(text)
    except ConfigError:
        raise
    except YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML: {shown(getattr(err, 'problem', None) or err, 200)}") from None
    except ValueError as err:   # e.g. an integer with more digits than Python converts
        raise ConfigError(f"{path}: not valid YAML: {shown(str(err), 200)}") from None


def merge_distributed(data: Any, where: str) -> Any:
    """Give each training stage the top-level `distributed` mapping with its own keys on top.

    The top level is validated first, so its errors name `distributed.<key>`, a stage's own
    override names `<stage>.distributed.<key>`."""
    if not isinstance(data, typing.Mapping):
        return data
    for key, value in data.items():
        if value is None:
            raise ConfigError(f"{where}{key}: is null; omit it, or write {{}}, for the defaults")
    top = data.get("distributed", {})
    from_dict(DistributedConfig, top, f"{where}distributed")
    merged = dict(data)
    for stage in distributed_sections():
        section = merged.get(stage, {})
        if not isinstance(section, typing.Mapping):
            continue  # from_dict reports it
        own = section.get("distributed", {})
        if own is None:
            raise ConfigError(f"{where}{stage}.distributed: is null; omit it, or write {{}}, for the defaults")
        if not isinstance(own, typing.Mapping):
            continue
        from_dict(DistributedConfig, {**top, **own}, f"{where}{stage}.distributed")
        merged[stage] = {**section, "distributed": {**top, **own}}
    return merged


def load_params(path: str | Path, shapes: typing.Sequence[str] = (),
                registered: typing.Mapping[str, typing.Sequence[str]] | None = None) -> Params:
    """Load and validate the whole params file before any compute (`validated` says what is checked)."""
    data = read_yaml(path)
    if data is None:
        raise ConfigError(f"{path}: the params file is empty (write {{}} for every default, or start from the "
                          "repository's params.yaml)")
    return validated(data, f"{path}: ", shapes, registered)   # the path as given, as the YAML errors name it


def validated(data: Any, where: str, shapes: typing.Sequence[str] = (),
              registered: typing.Mapping[str, typing.Sequence[str]] | None = None) -> Params:
    """Params from a params file's data, every key checked; `where` prefixes every error (the file).
    `shapes`: the stages whose batch sizes are checked against their processes now, `registered`: the
    registered names of each kind (pipeline.stages.registry.load_params passes the stages whose
    SPEC says "load" and every registry's names; without them a key naming an unregistered
    function fails where it is used)."""
    if isinstance(data, typing.Mapping) and "cluster" in data:
        raise ConfigError(f"{where}cluster: job resources are Snakemake's, not hyperparameters: move them to "
                          "default-resources/set-resources of profiles/slurm/config.yaml (docs/guide/slurm.md)")
    params = from_dict(Params, merge_distributed(data, where), where)
    if registered is not None:
        check_named(params, registered, where.rstrip(": "))
    for stage in shapes:
        try:
            check_process_shape(params, stage)
        except ConfigError as err:
            raise ConfigError(f"{where}{err}") from None
    if params.reward.shared_prompt and params.model.attn_implementation == "flash_attention_2":
        raise ConfigError(f"{where}reward.shared_prompt: needs an attention that takes a custom mask (eager or "
                          "sdpa); flash_attention_2 does not. Set reward.shared_prompt: false")
    return params


def check_named(cfg: Any, names: typing.Mapping[str, typing.Sequence[str]], where: str) -> None:
    """Every `named` field of `cfg` (a dataclass, searched through its sections) holds one of its
    registry's `names`; a ConfigError naming the key otherwise."""
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{where}.{f.name}" if ": " in where else f"{where}: {f.name}"
        if dataclasses.is_dataclass(value):
            check_named(value, names, key)
        elif "registry" in f.metadata:
            allowed = names.get(f.metadata["registry"], ())
            if value not in allowed:
                raise ConfigError(f"{key}: expected one of {', '.join(map(repr, allowed))}, got {_describe(value)}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data, for writing next to a stage's outputs (tuples as lists,
    as YAML and JSON hold them)."""
    return dataclasses.asdict(cfg, dict_factory=lambda items: {k: list(v) if isinstance(v, tuple) else v
                                                                 for k, v in items})


def flatten(d: typing.Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """`{'sft': {'lr': 1e-3}}` -> `{'sft.lr': 1e-3}`: the keys as `dvc exp run -S` spells them;
    `sep="/"`: metrics.json's nesting undone, `{'eval': {'accuracy': x}}` -> `{'eval/accuracy': x}`,
    the names the stages write and docs/metrics.md defines."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, typing.Mapping):
            out.update(flatten(value, name + sep, sep))
        else:
            out[name] = value
    return out
