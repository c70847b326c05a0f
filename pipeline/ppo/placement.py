"""Model placement: the one place that builds PPO's four models and decides where they live.

This version places all four in one process on the CPU (or the current device) with plain torch.
The algorithm only calls forward/backward on what it is handed, so a distributed placement
(DeepSpeed engines, LoRA adapters) replaces this module without touching the trainer.

- actor:     trained, initialised from the SFT checkpoint
- critic:    trained, a sequence-classification backbone whose `score` head is read at every position,
             initialised from the reward model (default) or from SFT with a fresh head
- reference: the SFT checkpoint, frozen
- reward:    a RewardSource (the reward model, frozen, with its offset; or a Python function)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import reward_model as rm
from ..config import Params
from ..models import load_policy
from ..errors import CheckpointError
from ..reward_source import RewardSource, make_reward_source


@dataclass
class PPOModels:
    actor: PreTrainedModel
    critic: PreTrainedModel
    ref: PreTrainedModel
    reward: RewardSource
    tok: PreTrainedTokenizerBase


def _freeze(model: PreTrainedModel) -> PreTrainedModel:
    return model.eval().requires_grad_(False)


def place_models(params: Params, sft_dir: Path, reward_dir: Path) -> PPOModels:
    cfg = params.ppo
    trust = params.model.trust_remote_code
    torch.manual_seed(cfg.seed)
    actor, tok = load_policy(sft_dir, trust)
    ref, _ = load_policy(sft_dir, trust)
    if cfg.critic_init == "reward":
        critic, _ = rm.load_reward_model(reward_dir, trust)
    else:
        critic, _ = rm.init_reward_model(sft_dir, cfg.seed, None, trust)
    if critic.config.vocab_size != actor.config.vocab_size:
        raise CheckpointError(f"ppo.critic_init: the critic ({reward_dir}) and the actor ({sft_dir}) have different "
                         "vocabularies; use critic_init: sft")
    # Dropout off in the trained models too: PPO's ratio must be exactly 1 before the first update.
    actor.eval()
    critic.eval()
    reward = make_reward_source(cfg.reward_source, reward_dir, params.reward.max_length, trust)
    return PPOModels(actor=actor, critic=critic, ref=_freeze(ref), reward=reward, tok=tok)
