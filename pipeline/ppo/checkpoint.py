"""Resumable PPO state: saved every `save_every` iterations, atomically; loaded when re-run.

Contents of the checkpoint folder:
- `actor` / `critic` state, written by their engines: plain engines write `<name>.safetensors`
  (weights) and `<name>_optim.pt` (optimizer and schedule: tensors and numbers only, loaded with
  weights_only=True); DeepSpeed engines write their own sharded checkpoint under `<name>/`, every
  rank its shard; no `critic` state for a critic-free estimator (there is no critic)
- `rng_rank<r>.pt`: each rank's sampling, shuffling and prompt-order generators and torch's RNG
- `state.json`: iteration, KL controller, the prompt sampler's pending order, the step log so far
  (columns in order, and rows; its `skipped_updates` column restores the count of skipped updates),
  the number of processes, and the fingerprint of the run

Fingerprint, staging and the swap are shared with SFT and RM: see pipeline/training/resume.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError
from ..training.nonfinite import restored_count
from ..training.resume import load_engine, load_rng, read_state, restoring, save_staged
from ..tracking.sinks import StepLog
from .trainer import PPOTrainer

__all__ = ["load", "restore_actor", "save"]


def save(trainer: PPOTrainer, step_log: StepLog, path: Path, fp: str) -> None:
    ctx = trainer.ctx
    sampler = trainer.prompt_sampler.state_dict()
    prompts_gen = sampler.pop("gen")

    def write(staging: Path) -> None:
        trainer.m.actor.save(staging, "actor")
        if trainer.m.critic is not None:
            trainer.m.critic.save(staging, "critic")
        torch.save({"sample": trainer.sample_gen.get_state(), "shuffle": trainer.shuffle_gen.get_state(),
                    "prompts": prompts_gen, "torch": torch.get_rng_state()}, staging / f"rng_rank{ctx.rank}.pt")

    save_staged(path, ctx, write, {"fingerprint": fp, "iteration": trainer.iteration, "world_size": ctx.world_size,
                                   "kl_controller": trainer.kl_ctl.state_dict(), "sampler": sampler,
                                   "log": {"columns": step_log.columns, "rows": step_log.rows}})


def load(trainer: PPOTrainer, path: Path, fp: str) -> dict | None:
    """Restore `trainer` from `path` when it holds a checkpoint of this run; returns the step log
    state ({"columns", "rows"}), or None when there is nothing to resume."""
    state = read_state(path, fp)
    if state is None:
        return None  # nothing saved, or another config / other input models: start afresh
    load_engine(trainer.m.actor, path, "actor")
    if trainer.m.critic is not None:
        load_engine(trainer.m.critic, path, "critic")
    rng = load_rng(path, trainer.ctx.rank)
    with restoring(path):   # a state.json of this run whose contents do not fit
        trainer.sample_gen.set_state(rng["sample"])
        trainer.shuffle_gen.set_state(rng["shuffle"])
        torch.set_rng_state(rng["torch"])
        trainer.prompt_sampler.load_state_dict({**state["sampler"], "gen": rng["prompts"]})
        trainer.kl_ctl.load_state_dict(state["kl_controller"])
        trainer.iteration = int(state["iteration"])
        trainer.guard.skipped = restored_count(state["log"]["rows"])
        return {"columns": list(state["log"]["columns"]), "rows": list(state["log"]["rows"])}


def restore_actor(trainer: PPOTrainer, path: Path, fp: str) -> int:
    """Collective. Put the actor of the checkpoint at `path` back into `trainer` (the detector's
    `action: stop`: the weights from before the alarm); returns that checkpoint's iteration."""
    state = read_state(path, fp)
    if state is None:
        raise CheckpointError(f"{path}: no checkpoint of this run to restore the actor from "
                              "(ppo.detector.action: stop needs one written before the alarm)")
    load_engine(trainer.m.actor, path, "actor")
    return state["iteration"]
