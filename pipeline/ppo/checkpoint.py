"""Resumable PPO state: saved every `save_every` iterations, atomically; loaded when re-run.

Contents of the checkpoint folder:
- `actor.safetensors`, `critic.safetensors`: weights (safetensors, shared tensors handled)
- `optim.pt`: both optimizers and schedulers (tensors and numbers only; loaded with weights_only=True)
- `rng.pt`: the sampling, shuffling and prompt-order generators and torch's global RNG
- `state.json`: iteration, KL controller, the prompt sampler's pending order, the step log so far
  (columns in order, and rows), and the fingerprint of the run it belongs to

The fingerprint hashes the resolved params of the stage and the input checkpoints' weights, so a
changed config or a retrained SFT/RM model never resumes from a stale state.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from ..errors import CheckpointError
from ..io import atomic_dir, atomic_write_json
from ..tracking import StepLog
from .trainer import PPOTrainer


# Bump when the checkpoint's layout changes: it is part of the fingerprint, so an older
# checkpoint is never read with the new layout (the run starts afresh instead).
FORMAT = 2


def fingerprint(config: dict[str, Any], inputs: list[Path]) -> str:
    h = hashlib.sha256(json.dumps({"format": FORMAT, "config": config}, sort_keys=True, default=str).encode())
    for folder in inputs:
        for f in sorted(Path(folder).glob("*.safetensors")):
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def save(trainer: PPOTrainer, step_log: StepLog, path: Path, fp: str) -> None:
    with atomic_dir(path) as tmp:
        save_model(trainer.m.actor, str(tmp / "actor.safetensors"))
        save_model(trainer.m.critic, str(tmp / "critic.safetensors"))
        torch.save({"actor_opt": trainer.actor_opt.state_dict(), "critic_opt": trainer.critic_opt.state_dict(),
                    "actor_sched": trainer.actor_sched.state_dict(), "critic_sched": trainer.critic_sched.state_dict()},
                   tmp / "optim.pt")
        sampler = trainer.prompt_sampler.state_dict()
        torch.save({"sample": trainer.sample_gen.get_state(), "shuffle": trainer.shuffle_gen.get_state(),
                    "prompts": sampler.pop("gen"), "torch": torch.get_rng_state()}, tmp / "rng.pt")
        atomic_write_json(tmp / "state.json", {"fingerprint": fp, "iteration": trainer.iteration,
                                               "kl_controller": trainer.kl_ctl.state_dict(),
                                               "sampler": sampler,
                                               "log": {"columns": step_log.columns, "rows": step_log.rows}})


def load(trainer: PPOTrainer, path: Path, fp: str) -> dict | None:
    """Restore `trainer` from `path` when it holds a checkpoint of this run; returns the step log
    state ({"columns", "rows"}), or None when there is nothing to resume."""
    state_file = path / "state.json"
    if not state_file.is_file():
        return None
    state = json.loads(state_file.read_text())
    if state.get("fingerprint") != fp:
        return None  # another config or other input models: start afresh (the stale one is replaced)
    try:
        load_model(trainer.m.actor, str(path / "actor.safetensors"))
        load_model(trainer.m.critic, str(path / "critic.safetensors"))
        optim = torch.load(path / "optim.pt", weights_only=True)
        rng = torch.load(path / "rng.pt", weights_only=True)
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"{path}: unreadable checkpoint ({err}); delete it to start afresh") from None
    trainer.actor_opt.load_state_dict(optim["actor_opt"])
    trainer.critic_opt.load_state_dict(optim["critic_opt"])
    trainer.actor_sched.load_state_dict(optim["actor_sched"])
    trainer.critic_sched.load_state_dict(optim["critic_sched"])
    trainer.sample_gen.set_state(rng["sample"])
    trainer.shuffle_gen.set_state(rng["shuffle"])
    torch.set_rng_state(rng["torch"])
    trainer.prompt_sampler.load_state_dict({**state["sampler"], "gen": rng["prompts"]})
    trainer.kl_ctl.load_state_dict(state["kl_controller"])
    trainer.iteration = state["iteration"]
    return state["log"]
