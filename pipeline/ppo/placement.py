"""Model placement: the one place that builds PPO's four models and decides where they live.

- actor:     trained (a `TrainEngine`: plain PyTorch, or DeepSpeed with ZeRO 0-3), initialised from
             the SFT checkpoint; with `ppo.lora` only its adapter trains
- critic:    trained, a sequence-classification backbone whose `score` head is read at every position,
             initialised from the reward model (default) or from SFT with a fresh head; with
             `ppo.shared_backbone` a value head on the actor's own trunk instead (one trunk, two heads);
             none at all with a critic-free `ppo.advantage` (grpo, rloo, reinforce_baseline):
             three models, not four
- reference: the SFT policy, frozen: under LoRA the actor with its adapter switched off (no second
             copy of the weights), otherwise a frozen copy, partitioned with ZeRO-3 when training is
             stage 3, replicated otherwise (`offload_frozen` keeps it on the CPU)
- reward:    a RewardSource (the reward model, frozen and placed like the reference; or a function)
- auditor:   optional (`ppo.detector.auditor`): a second reward model, placed like the first, that
             only scores the rollouts for the over-optimisation detector (never optimised against)

The trainer only calls forward/backward/step on what it is handed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import devices
from ..models import lora
from ..models import reward_model as rm
from ..config import Params, PPOConfig
from ..context import SINGLE, Context
from ..training import loading
from ..training.engines import FrozenModel, TrainEngine, make_engine
from ..errors import CheckpointError
from ..models.checkpoints import load_policy, modifying
from ..models.reward_source import RewardModelSource, RewardSource, make_reward_source

if TYPE_CHECKING:   # annotations only (pipeline/models/checkpoints.py says why)
    from transformers import PreTrainedTokenizerBase


@dataclass
class PPOModels:
    actor: TrainEngine
    critic: TrainEngine | None   # None: a critic-free estimator (cfg.uses_critic False)
    ref: torch.nn.Module
    reward: RewardSource
    tok: PreTrainedTokenizerBase
    ctx: Context = SINGLE
    frozen: FrozenModel | None = None   # how the reference/reward models were placed (its DeepSpeed config)
    memory: dict[str, float] | None = None   # GPU GiB each model added when placed (a GPU's only)
    auditor: RewardSource | None = None      # ppo.detector.auditor's reward model, or None
    ref_holder: Any = None   # what holds the reference whole for a measurement (`gathered()`); see reference()

    def reference(self) -> Any:
        """The reference policy as a measurement takes it: something whose `gathered()` gives it whole
        on this rank (the placed frozen model; under LoRA the gathered actor with its adapter off)."""
        return self.ref_holder if self.ref_holder is not None else self.ref


class AdapterOff(torch.nn.Module):
    """The reference policy under LoRA: the actor's forward with its adapter disabled, which is the
    SFT model exactly (the base weights are frozen). The actor is held, not registered, so this
    module owns no parameters."""

    def __init__(self, actor: torch.nn.Module, engine: TrainEngine | None = None):
        super().__init__()
        self._actor = [actor]
        self._engine = [engine]

    @property
    def actor(self) -> torch.nn.Module:
        return self._actor[0]

    @property
    def runs_forward_of(self) -> torch.nn.Module:
        """The model whose forward this view runs (models/logprobs.py asks what it can compute)."""
        return self._actor[0]

    def forward(self, **inputs: Any) -> Any:
        with self.actor.disable_adapter():
            return self.actor(**inputs)

    @contextlib.contextmanager
    def gathered(self):
        """The SFT policy whole on this rank: the actor gathered (ZeRO-3), its adapter off."""
        engine = self._engine[0]
        with (engine.gathered() if engine is not None else contextlib.nullcontext(self.actor)) as actor, \
                actor.disable_adapter():
            yield actor


class SharedValueHead(torch.nn.Module):
    """The critic of a shared actor-critic: a scalar head on the actor's last hidden states.

    One trunk serves both losses (the seeds' shared backbone): half the memory and one model to
    place, but the value loss now moves the policy's features too, so `ppo.vf_coef` trades critic
    accuracy against policy drift (Andrychowicz et al. 2021 found separate networks more robust).
    The trunk's gradients from both losses are applied by the actor's optimizer; this module's
    own parameters are only the head."""

    def __init__(self, actor: torch.nn.Module):
        super().__init__()
        self._actor = [actor]
        hidden = rm.unwrap(actor).config.hidden_size
        self.score = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.score.weight)   # values start at 0: no claim before any data
        torch.nn.init.zeros_(self.score.bias)
        self.config = rm.unwrap(actor).config

    @property
    def base_model(self) -> torch.nn.Module:
        return rm.unwrap(self._actor[0]).base_model

    @property
    def runs_forward_of(self) -> torch.nn.Module:
        """The actor, whose trunk this head's forward runs."""
        return self._actor[0]


def _linear_decay(total: int, schedule: str):
    if schedule == "constant":
        return lambda step: 1.0
    return lambda step: max(0.0, 1.0 - step / total)


def place_models(params: Params, sft_dir: Path, reward_dir: Path, ctx: Context = SINGLE,
                 section: str = "ppo") -> PPOModels:
    """The four models of the RL stage whose params section is `section` (ppo, grpo), placed as its
    `distributed` says."""
    cfg: PPOConfig = getattr(params, section)
    dist = cfg.distributed
    trust = params.model.trust_remote_code
    torch.manual_seed(cfg.seed)
    per_iteration = cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.minibatch_size)   # optimizer steps
    # Actor and critic engines differ in their learning rate, and in their schedule's length when the
    # actor sits out the critic's warm-up (its decay spans the iterations that train it).
    accumulation = cfg.minibatch_size // ctx.world_size // cfg.micro_batch_size
    engine_settings = dict(weight_decay=0.0, schedule=_linear_decay(cfg.iterations * per_iteration, cfg.lr_schedule),
                           max_grad_norm=cfg.max_grad_norm, dist=dist, ctx=ctx,
                           micro_batch_size=cfg.micro_batch_size, accumulation_steps=accumulation)
    actor_schedule = _linear_decay((cfg.iterations - cfg.critic_warmup) * per_iteration, cfg.lr_schedule)
    trained, frozen_dtype = loading.load_dtype(dist, trained=True), loading.load_dtype(dist, trained=False)

    memory = _MemoryMeter(ctx.device)
    with loading.partitioned(dist, ctx):
        actor_model, tok = load_policy(sft_dir, trust, trained)
    actor_model = lora.wrap(actor_model, cfg.lora, "CAUSAL_LM", f"{section}.lora")
    # Dropout off in the trained models too: PPO's ratio must be exactly 1 before the first update.
    actor_model.eval()
    actor = make_engine(actor_model, lr=cfg.lr, **{**engine_settings, "schedule": actor_schedule})
    memory.mark("actor")

    with loading.partitioned(dist, ctx):
        critic = (_critic(cfg, actor, actor_model.config.vocab_size, sft_dir, reward_dir, trust, engine_settings, trained)
                  if cfg.uses_critic else None)
    if critic is not None:
        memory.mark("critic")

    placed: list[FrozenModel] = []

    def place_frozen(model: torch.nn.Module) -> FrozenModel:
        placed.append(FrozenModel(model, dist, ctx, cfg.micro_batch_size))
        return placed[-1]

    with loading.partitioned(dist, ctx, trained=False):
        if lora.is_peft(actor.model):
            ref: torch.nn.Module = AdapterOff(actor.model, actor)
            ref_holder: Any = ref
        else:
            ref_holder = place_frozen(load_policy(sft_dir, trust, frozen_dtype)[0])
            ref = ref_holder.model
        memory.mark("reference")
        reward = make_reward_source(cfg.reward_source, reward_dir, params.reward.max_length, trust, place_frozen,
                                    frozen_dtype, key=f"{section}.reward_source", timeout=cfg.reward_timeout,
                                    unit_variance=f"{section}.normalize_reward" if cfg.normalize_reward else None,
                                    packed=cfg.packing)
        memory.mark("reward")
        auditor = None
        if cfg.detector.enabled and cfg.detector.auditor is not None:
            auditor = RewardModelSource(Path(cfg.detector.auditor), params.reward.max_length, trust, place_frozen,
                                        dtype=frozen_dtype, packed=cfg.packing)
            memory.mark("auditor")
    return PPOModels(actor=actor, critic=critic, ref=ref, reward=reward, tok=tok, ctx=ctx,
                     frozen=placed[0] if placed else None, memory=memory.used or None, auditor=auditor,
                     ref_holder=ref_holder)


def _critic(cfg: PPOConfig, actor: TrainEngine, vocab_size: int, sft_dir: Path, reward_dir: Path, trust: bool,
            engine_settings: dict[str, Any], dtype: torch.dtype) -> TrainEngine:
    """The critic's engine: a value head on the actor's trunk (shared_backbone), or its own model."""
    if cfg.shared_backbone:
        critic_model: torch.nn.Module = SharedValueHead(actor.model)
    else:
        if cfg.critic_init == "reward":
            critic_model, _ = rm.load_reward_model(reward_dir, trust, dtype)
            if cfg.normalize_reward:   # values in the units of the scores they predict (the source checked the scale)
                rescale_head(critic_model, 1.0 / (rm.scale(critic_model) or 1.0))
        else:
            critic_model, _ = rm.init_reward_model(sft_dir, cfg.seed, None, trust, {"dtype": dtype})
        if critic_model.config.vocab_size != vocab_size:
            raise CheckpointError(f"{cfg._section}.critic_init: the critic ({reward_dir}) and the actor ({sft_dir}) have "
                                  "different vocabularies; use critic_init: sft")
        critic_model = lora.wrap(critic_model, cfg.critic_lora, "SEQ_CLS", f"{cfg._section}.critic_lora")
    critic_model.eval()
    return make_engine(critic_model, lr=cfg.critic_lr, **engine_settings)


def rescale_head(model: torch.nn.Module, factor: float) -> None:
    """Multiply a scalar-head model's outputs by `factor` (its head's weight and bias), before any
    engine wraps it."""
    layer = rm.head(model)
    weights = [p for p in (layer.weight, layer.bias) if p is not None]
    with modifying(weights), torch.no_grad():   # ZeRO-3 may have partitioned them as they loaded
        for p in weights:
            p.mul_(factor)


class _MemoryMeter:
    """GPU memory each model adds when placed (weights, and optimizer states for trained ones), on
    `device` where its torch module counts allocations (devices.allocated); nothing elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.used: dict[str, float] = {}
        self.last = devices.allocated(device)

    def mark(self, name: str) -> None:
        now = devices.allocated(self.device)
        if now is not None and self.last is not None:
            self.used[name] = (now - self.last) / 2 ** 30
        self.last = now
