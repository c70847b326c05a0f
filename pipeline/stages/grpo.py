"""The `grpo` stage: the PPO stage's code (pipeline/stages/ppo.py) with the `grpo` params section in
place of `ppo`, so a critic-free run (GRPO by default; RLOO, REINFORCE++ with baseline or Dr. GRPO
by its `advantage`, `grpo_scale` and `loss_aggregation`) sits next to PPO in one DAG, fed by the same
SFT and reward models and judged on the same prompts.

The prompts, training and held-out, are the `prompts` section's, as every method's: every method is
trained and measured on the same prompts, and measured as `prompts.sampling` says. Everything else
is the section's own: rollout sampling, prompt length, seed, iterations, the detector; its errors
name `grpo.*` keys.

Outputs under `outputs/grpo/` as the PPO stage's: `model/`, `train.tsv`, `metrics.json` (its
held-out metrics named `grpo/<key>` next to `sft/<key>`), `config.json`, `checkpoint/`
(no critic in it: a critic-free estimator builds none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Params
from ..tracking.model_card import ModelFacts
from . import ppo
from .spec import StageSpec

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per iteration, as ppo's without the critic's columns (`grpo.advantage: "
                 "rloo` writes `objective/baseline`, `reinforce_baseline` `objective/batch_std` "
                 "instead of the group columns)",
    "metrics.json": "as ppo's: the last row of `train.tsv` under `train/`, the detector's record, and"
                    " the held-out comparison of the GRPO policy (`grpo/*`) with SFT (`sft/*`)",
}

SPEC = StageSpec(
    "grpo", help="critic-free online RL against the reward model (GRPO, RLOO, REINFORCE++; the grpo section)",
    inputs=("data", "sft", "reward"), training=True, shape="start", pipeline="compare", policy=True,
    headline=("grpo/gold", "grpo/rm", "grpo/kl", "detector/fired"),
    parent_params=("grpo.seed", "grpo.lr", "grpo.kl_coef", "grpo.advantage"),
    model=ModelFacts("the critic-free RL policy (GRPO family)", "the SFT policy, against the reward model",
                     "rlhf-grpo-policy", "The SFT policy tuned online by a critic-free estimator (GRPO, RLOO, "
                     "REINFORCE++; grpo.advantage) against the reward model (transformers text-generation)."),
    check_inputs=lambda params, data_dir: ppo.check_inputs(params, data_dir),
    metrics=lambda: ppo.declared_metrics("grpo"), files=METRIC_FILES,
    plan=lambda params, shapes: ppo.memory_plan_of(params, shapes, "grpo"), reads=(
    "data.task", "model.trust_remote_code",
    "reward.max_length",         # the reward model scores as it was trained
    "grpo", "distributed",
    "prompts",                   # the prompts every method shares, and how they are measured
))


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, out: Path,
        progress: bool = True) -> dict[str, Any]:
    """The PPO stage run as `grpo` (see the module doc)."""
    return ppo.run(params, data_dir, sft_dir, reward_dir, out, progress, spec=SPEC)
