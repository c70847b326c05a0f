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


from .errors import ConfigError


def num(default: Any, *, gt: float | None = None, ge: float | None = None,
        le: float | None = None, lt: float | None = None, doc: str = "") -> Any:
    """A numeric field with bounds; the bounds are checked by `from_dict`."""
    return field(default=default, metadata={"gt": gt, "ge": ge, "le": le, "lt": lt, "doc": doc})


# ----------------------------------------------------------------------------------------------
# Sections. Every key is documented in params.yaml; defaults here equal the shipped params.yaml.


@dataclass(frozen=True)
class DataConfig:
    """`data`: the task and the sizes of every split `prepare` writes."""
    task: Literal["reviews"] = "reviews"
    seed: int = num(0, ge=0)
    n_sft: int = num(4000, ge=8)
    n_sft_eval: int = num(400, ge=4)
    n_pairs: int = num(20000, ge=8)
    n_pairs_eval: int = num(1000, ge=4)
    n_ppo_prompts: int = num(2000, ge=4)
    n_eval_prompts: int = num(200, ge=4)
    label_temperature: float = num(0.5, gt=0.0)
    eval_title_fraction: float = num(0.2, gt=0.0, lt=1.0)


@dataclass(frozen=True)
class ModelConfig:
    """`model`: build a tiny causal LM from a config, or load `name_or_path`."""
    name_or_path: Optional[str] = None
    arch: Literal["llama", "gpt2"] = "llama"
    hidden_size: int = num(128, ge=8)
    num_layers: int = num(2, ge=1)
    num_heads: int = num(4, ge=1)
    intermediate_size: int = num(256, ge=8)
    max_position_embeddings: int = num(128, ge=16)
    trust_remote_code: bool = False

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
class SFTConfig:
    """`sft`: supervised fine-tuning on demonstrations, loss on response tokens only."""
    seed: int = num(0, ge=0)
    lr: float = num(2e-3, gt=0.0)
    weight_decay: float = num(0.01, ge=0.0)
    batch_size: int = num(32, ge=1)
    epochs: float = num(8.0, gt=0.0)
    warmup_ratio: float = num(0.05, ge=0.0, lt=1.0)
    max_grad_norm: float = num(1.0, gt=0.0)
    max_length: int = num(96, ge=8)
    eval_every: int = num(100, ge=1)
    n_eval_generations: int = num(200, ge=1)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass(frozen=True)
class PreferenceDataConfig:
    """Where the reward model's preference pairs come from (`reward.dataset`)."""
    path: Optional[str] = None          # None: the pairs written by `prepare`
    train_split: str = "train"
    eval_split: str = "test"
    revision: Optional[str] = None
    layout: Literal["auto", "text", "conversation", "messages"] = "auto"
    margin_column: Optional[str] = None


@dataclass(frozen=True)
class RewardConfig:
    """`reward`: Bradley-Terry reward model on preference pairs."""
    name_or_path: Optional[str] = None  # None: initialise from the SFT checkpoint (InstructGPT)
    seed: int = num(0, ge=0)
    lr: float = num(1e-3, gt=0.0)
    weight_decay: float = num(0.0, ge=0.0)
    batch_size: int = num(32, ge=1)
    epochs: float = num(2.0, gt=0.0)
    warmup_ratio: float = num(0.05, ge=0.0, lt=1.0)
    max_grad_norm: float = num(1.0, gt=0.0)
    max_length: int = num(96, ge=8)
    eval_every: int = num(100, ge=1)
    head_init_std: Optional[float] = num(None, gt=0.0)
    normalize: bool = True
    n_sft_samples: int = num(200, ge=2)
    calibration_bins: int = num(10, ge=2)
    dataset: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)


@dataclass(frozen=True)
class PPOConfig:
    """`ppo`: PPO against the reward model (InstructGPT step 3). Names follow TRL where they can."""
    seed: int = num(0, ge=0)
    iterations: int = num(100, ge=1, doc="rollout + update rounds")
    rollout_batch_size: int = num(64, ge=2, doc="prompts sampled per iteration")
    minibatch_size: int = num(32, ge=1, doc="rollouts per optimizer step")
    micro_batch_size: int = num(16, ge=1, doc="rollouts per forward/backward (gradient accumulation)")
    ppo_epochs: int = num(4, ge=1)
    lr: float = num(1e-4, gt=0.0, doc="actor learning rate")
    critic_lr: float = num(3e-4, gt=0.0)
    lr_schedule: Literal["constant", "linear"] = "linear"
    max_grad_norm: float = num(1.0, gt=0.0)
    clip_eps: float = num(0.2, gt=0.0, lt=1.0)
    clip_eps_value: Optional[float] = num(0.2, gt=0.0, doc="None: unclipped value loss")
    dual_clip: Optional[float] = num(None, gt=1.0)
    entropy_coef: float = num(0.0, ge=0.0)
    gamma: float = num(1.0, gt=0.0, le=1.0)
    lam: float = num(0.95, ge=0.0, le=1.0)
    kl_coef: float = num(0.05, ge=0.0, doc="KL penalty in the reward (initial value when adaptive)")
    kl_loss_coef: float = num(0.0, ge=0.0, doc="KL term in the loss instead (GRPO style)")
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    adaptive_kl: bool = False
    kl_target: float = num(6.0, gt=0.0)
    kl_horizon: float = num(10000.0, gt=0.0)
    target_kl: Optional[float] = num(None, gt=0.0, doc="stop the epochs early above this approx KL")
    score_clip: Optional[float] = num(None, gt=0.0)
    whiten_rewards: bool = False
    missing_eos_score: Optional[float] = -3.0
    critic_init: Literal["reward", "sft"] = "reward"
    reward_source: str = "reward_model"
    save_every: int = num(10, ge=1)
    n_eval_prompts: int = num(200, ge=2)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.kl_coef > 0 and self.kl_loss_coef > 0:
            raise ConfigError("ppo.kl_loss_coef: the KL penalty is already in the reward (ppo.kl_coef="
                              f"{self.kl_coef}); set one of them to 0, never both (double penalty)")
        if self.adaptive_kl and self.kl_coef == 0:
            raise ConfigError("ppo.adaptive_kl: needs ppo.kl_coef > 0 as its initial value")
        if self.rollout_batch_size % self.minibatch_size:
            raise ConfigError(f"ppo.minibatch_size: {self.minibatch_size} must divide "
                              f"ppo.rollout_batch_size={self.rollout_batch_size}")
        if self.minibatch_size % self.micro_batch_size:
            raise ConfigError(f"ppo.micro_batch_size: {self.micro_batch_size} must divide "
                              f"ppo.minibatch_size={self.minibatch_size}")
        if self.reward_source != "reward_model" and ":" not in self.reward_source:
            raise ConfigError(f"ppo.reward_source: expected 'reward_model' or 'module:function', "
                              f"got {self.reward_source!r}")


@dataclass(frozen=True)
class EvaluateConfig:
    """`evaluate`: SFT, best-of-n and PPO policies on the held-out prompts (sampled as in `ppo.sampling`)."""
    seed: int = num(0, ge=0)
    n_prompts: int = num(200, ge=2)
    best_of_n: int = num(4, ge=2, doc="samples per prompt for the best-of-n baseline")
    bootstrap: int = num(1000, ge=100, doc="bootstrap resamples for win-rate intervals")
    n_samples_shown: int = num(12, ge=0, doc="rows of the sample table in the report")


@dataclass(frozen=True)
class Params:
    """The whole params file. Stages read only the sections `dvc.yaml` lists for them."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)


# ----------------------------------------------------------------------------------------------
# Loading and validation.


def _describe(value: Any) -> str:
    return repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


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
        return value
    raise TypeError(f"unsupported config type {tp!r} at {where}")  # a bug in this module, not user error


def from_dict(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a mapping; `where` is the `file: dotted.key` prefix for errors."""
    if data is None:
        data = {}
    if not isinstance(data, typing.Mapping):
        raise ConfigError(f"{where.rstrip(': ')}: expected a mapping of keys, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    sep = "." if not where.endswith(": ") else ""
    for key in data:
        if key not in fields:
            raise ConfigError(f"{where}{sep}{key}: unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {name: _convert(data[name], hints[name], f.metadata, f"{where}{sep}{name}")
              for name, f in fields.items() if name in data}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{where.split(':')[0]}: {err}") from None


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file with the YAML 1.2 loader; a file that is not YAML is a ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such params file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        return YAML(typ="safe", pure=True).load(text)
    except YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML: {getattr(err, 'problem', None) or err}") from None


def load_params(path: str | Path) -> Params:
    """Load and validate the whole params file before any compute."""
    return from_dict(Params, read_yaml(path), f"{Path(path).name}: ")


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data, for writing next to a stage's outputs."""
    return dataclasses.asdict(cfg)


def flatten(d: typing.Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{'sft': {'lr': 1e-3}}` -> `{'sft.lr': 1e-3}`: the keys as `dvc exp run -S` spells them."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, typing.Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
