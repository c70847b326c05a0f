"""Resumable PPO state: saved every `save_every` iterations, atomically; loaded when re-run.

Contents of the checkpoint folder:
- `actor` / `critic` state, written by their engines: plain engines write `<name>.safetensors`
  (weights) and `<name>_optim.pt` (optimizer and schedule: tensors and numbers only, loaded with
  weights_only=True); DeepSpeed engines write their own sharded checkpoint under `<name>/`, every
  rank its shard
- `rng_rank<r>.pt`: each rank's sampling, shuffling and prompt-order generators and torch's RNG
- `state.json`: iteration, KL controller, the prompt sampler's pending order, the step log so far
  (columns in order, and rows), the number of processes, and the fingerprint of the run

The fingerprint hashes the resolved params of the stage (the `distributed` settings included) and
the input checkpoints' weights, so a changed config or a retrained SFT/RM model never resumes from
a stale state.

Atomicity with several writers: every rank writes into one staging folder next to the target,
then rank 0 writes `state.json` last and swaps the folder in; a run killed half-way leaves the
previous checkpoint untouched.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..io import atomic_write_json, swap_in
from ..tracking import StepLog
from .trainer import PPOTrainer


# Bump when the checkpoint's layout changes: it is part of the fingerprint, so an older
# checkpoint is never read with the new layout (the run starts afresh instead).
FORMAT = 3


def fingerprint(config: dict[str, Any], inputs: list[Path]) -> str:
    h = hashlib.sha256(json.dumps({"format": FORMAT, "config": config}, sort_keys=True, default=str).encode())
    for folder in inputs:
        for f in sorted(Path(folder).glob("*.safetensors")):
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def save(trainer: PPOTrainer, step_log: StepLog, path: Path, fp: str) -> None:
    ctx = trainer.ctx
    staging = path.with_name(f".{path.name}.staging")
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    ctx.barrier()
    trainer.m.actor.save(staging, "actor")
    trainer.m.critic.save(staging, "critic")
    sampler = trainer.prompt_sampler.state_dict()
    torch.save({"sample": trainer.sample_gen.get_state(), "shuffle": trainer.shuffle_gen.get_state(),
                "prompts": sampler.pop("gen"), "torch": torch.get_rng_state()}, staging / f"rng_rank{ctx.rank}.pt")
    ctx.barrier()
    if ctx.is_main:
        atomic_write_json(staging / "state.json", {"fingerprint": fp, "iteration": trainer.iteration,
                                                   "world_size": ctx.world_size,
                                                   "kl_controller": trainer.kl_ctl.state_dict(),
                                                   "sampler": sampler,
                                                   "log": {"columns": step_log.columns, "rows": step_log.rows}})
        swap_in(staging, path)
    ctx.barrier()


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
        trainer.m.actor.load(path, "actor")
        trainer.m.critic.load(path, "critic")
        rng = torch.load(path / f"rng_rank{trainer.ctx.rank}.pt", weights_only=True)
    except (OSError, RuntimeError, KeyError) as err:
        raise CheckpointError(f"{path}: unreadable checkpoint ({err}); delete it to start afresh") from None
    trainer.sample_gen.set_state(rng["sample"])
    trainer.shuffle_gen.set_state(rng["shuffle"])
    torch.set_rng_state(rng["torch"])
    trainer.prompt_sampler.load_state_dict({**state["sampler"], "gen": rng["prompts"]})
    trainer.kl_ctl.load_state_dict(state["kl_controller"])
    trainer.iteration = state["iteration"]
    return state["log"]
