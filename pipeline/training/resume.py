"""Resumable training state shared by every training stage: fingerprint, staging, SFT/RM state.

A stage saves its state every `save_every` steps (and after its last step) into `checkpoint/`
next to its outputs. That folder is gitignored and not a DVC out (see the head of dvc.yaml), so DVC
never deletes it: a stage killed at any point and re-run by `dvc repro` continues from the last
save instead of from step 0.

Atomicity: every rank writes into one staging folder beside the target; rank 0 writes
`state.json` last and swaps the folder in (io.swap_in). A kill before the swap leaves the previous
checkpoint; a kill between the swap's two renames leaves it as `.checkpoint.old`, which `recover`
puts back. So a checkpoint is either the old one or the new one, never a mix.

The fingerprint hashes the stage's resolved params (its `distributed` settings included) and every
file of its input folders, so a changed config, other data or a retrained input model never
resumes from a stale state: the run starts afresh and its first save replaces the stale one.

Contents for SFT and RM (`SupervisedState`): the engine's state (plain engines: `model.safetensors`
and `model_optim.pt` with tensors and numbers only, loaded with weights_only=True; DeepSpeed: its
sharded folder `model/`), `rng_rank<r>.pt` (the batch sampler's and torch's generators), and
`state.json` (step, the sampler's pending order, the step logs so far, the world size, the
fingerprint). PPO's contents are in ppo/checkpoint.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..context import Context
from ..errors import CheckpointError, loading
from ..files import MAX_FILE_BYTES, atomic_write_json, check_folder, content_hash, read_json_object, swap_in, \
    writing
from ..tracking.sinks import StepLog
from .batches import BatchSampler

log = logging.getLogger(__name__)

# Bump when a checkpoint's layout changes: it is part of the fingerprint, so an older checkpoint is
# never read with the new layout (the run starts afresh instead).
FORMAT = 4


def fingerprint(config: dict[str, Any], inputs: list[Path]) -> str:
    """sha256 of the resolved config and every file (relative name and bytes) under the inputs
    (files.content_hash)."""
    h = hashlib.sha256(json.dumps({"format": FORMAT, "config": config}, sort_keys=True, default=str).encode())
    h.update(content_hash(inputs).encode())
    return h.hexdigest()


def input_paths(*paths: str | Path | None) -> list[Path]:
    """The local files and folders among a stage's inputs, for `fingerprint`: None and hub ids are
    left out (their params are in the config), a `{split}` path stands for the files it matches."""
    out: list[Path] = []
    for p in paths:
        if p is None:
            continue
        if "{split}" in str(p):
            pattern = Path(str(p).replace("{split}", "*"))
            out += sorted(pattern.parent.glob(pattern.name)) if pattern.parent.is_dir() else []
        elif Path(p).exists():
            out.append(Path(p))
    return out


def recover(path: Path) -> None:
    """Put back a checkpoint left as `.<name>.old` by a kill between the two renames of a swap."""
    old = path.with_name(f".{path.name}.old")
    if not path.exists() and old.is_dir():
        os.replace(old, path)


def save_staged(path: Path, ctx: Context, write: Callable[[Path], None], state: dict[str, Any]) -> None:
    """Collective: every rank's `write(staging)`, then rank 0's `state.json` and the swap. A write
    that fails (a full disk: one StorageError naming the checkpoint) removes the staging folder;
    the previous checkpoint is untouched."""
    staging = path.with_name(f".{path.name}.staging")

    @contextlib.contextmanager
    def staged() -> Iterator[None]:
        try:
            with writing(path, "checkpoint"):
                yield
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    if ctx.is_main:
        with staged():
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
    ctx.barrier()
    with staged():
        write(staging)
    ctx.barrier()
    if ctx.is_main:
        with staged():
            atomic_write_json(staging / "state.json", state)
        swap_in(staging, path)
    ctx.barrier()


def read_state(path: Path, fp: str) -> dict[str, Any] | None:
    """`state.json` of the checkpoint at `path` when it belongs to this run (same fingerprint)."""
    recover(path)
    state_file = path / "state.json"
    if not state_file.exists():
        return None
    try:
        check_folder(path)   # every file of it regular: a FIFO among the weights would block the load
        # It holds the step logs so far, which grow with the run: the whole-file limit, not a record's.
        state = read_json_object(state_file, "checkpoint state", CheckpointError, MAX_FILE_BYTES)
    except CheckpointError as err:
        # The path once: `err` names state.json in the folder.
        raise CheckpointError(f"{err}; delete the folder holding it to start afresh") from None
    return state if state.get("fingerprint") == fp else None


def restoring(path: Path):
    """The checkpoint guard for resumable state: a corrupt or truncated file says so in one line and
    names the folder to delete (the run then starts afresh; no older save is kept to fall back to)."""
    return loading(path, "the resumable checkpoint", "; delete that folder to start afresh")   # named first


def attempt(path: Path, fp: str) -> int:
    """The restart (training/restart.py) the checkpoint at `path` belongs to, when it belongs to
    this run; 0 otherwise. Read before the model is built: the attempt sets its seed."""
    state = read_state(path, fp)
    value = state.get("attempt", 0) if state is not None else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{path / 'state.json'}: attempt must be a whole number >= 0, got {value!r}; "
                              "delete the folder holding it to start afresh")
    return value


def load_engine(engine: Any, path: Path, name: str) -> None:
    """Restore a training engine's weights, optimizer and schedule saved as `name`."""
    with restoring(path):
        engine.load(path, name)


def load_rng(path: Path, rank: int) -> dict[str, torch.Tensor]:
    with restoring(path):
        rng = torch.load(path / f"rng_rank{rank}.pt", weights_only=True)
        if not isinstance(rng, dict):
            raise TypeError(f"rng_rank{rank}.pt holds a {type(rng).__name__}, not the generators' states")
        return rng


class SupervisedState:
    """Save and restore a supervised loop (SFT, RM): engine, batch sampler, RNG, step logs, and
    the training time of every run that worked on it."""

    def __init__(self, stage: str, path: Path, fp: str, engine: Any, sampler: BatchSampler,
                 logs: dict[str, StepLog], ctx: Context, attempt: int = 0):
        self.stage, self.path, self.fp, self.engine, self.sampler, self.logs, self.ctx = \
            stage, path, fp, engine, sampler, logs, ctx
        self.attempt = attempt             # the restart this run is (training/restart.py; 0: the first)
        self.seconds_before = 0.0          # training time of the interrupted runs (restored by `load`)
        self.t0 = time.perf_counter()      # this run's start of training

    def elapsed(self) -> float:
        """Training seconds so far, this run's and the interrupted runs'."""
        return self.seconds_before + time.perf_counter() - self.t0

    def save(self, step: int) -> None:
        """Collective: flush the step logs and save the state after `step`."""
        for log_ in self.logs.values():
            log_.flush()
        sampler = self.sampler.state_dict()
        gen = sampler.pop("gen")

        def write(staging: Path) -> None:
            self.engine.save(staging, "model")
            torch.save({"sampler": gen, "torch": torch.get_rng_state()}, staging / f"rng_rank{self.ctx.rank}.pt")

        save_staged(self.path, self.ctx, write, {
            "fingerprint": self.fp, "step": step, "seconds": self.elapsed(), "world_size": self.ctx.world_size,
            "sampler": sampler, "attempt": self.attempt,
            "logs": {name: {"columns": log_.columns, "rows": log_.rows} for name, log_ in self.logs.items()}})

    def mark_restart(self, attempt: int, keep: str) -> None:
        """Collective: replace the checkpoint by a marker of restart `attempt` (state.json at step 0,
        no weights) that carries the log `keep` and the training time so far, so a run killed
        before the new attempt's first save starts that attempt, not the abandoned one."""
        for log_ in self.logs.values():
            log_.flush()
        kept = self.logs[keep]
        save_staged(self.path, self.ctx, lambda staging: None, {
            "fingerprint": self.fp, "step": 0, "seconds": self.elapsed(), "world_size": self.ctx.world_size,
            "attempt": attempt, "logs": {keep: {"columns": kept.columns, "rows": kept.rows}}})

    def load(self) -> int:
        """Restore the last save of this run; returns its step (0: nothing to resume; a restart's
        marker gives back only the logs and time it carries)."""
        state = read_state(self.path, self.fp)
        if state is None:
            return 0
        if state["step"] == 0:
            with restoring(self.path):
                for name, saved in state["logs"].items():
                    self.logs[name].restore(saved["rows"], saved["columns"])
                self.seconds_before, self.t0 = float(state["seconds"]), time.perf_counter()
            return 0
        load_engine(self.engine, self.path, "model")
        rng = load_rng(self.path, self.ctx.rank)
        with restoring(self.path):   # a state.json of this run whose contents do not fit
            self.sampler.load_state_dict({**state["sampler"], "gen": rng["sampler"]})
            torch.set_rng_state(rng["torch"])
            for name, log_ in self.logs.items():
                log_.restore(state["logs"][name]["rows"], state["logs"][name]["columns"])
            self.seconds_before, self.t0 = float(state["seconds"]), time.perf_counter()
        log.warning("%s: resuming from %s at step %d", self.stage, self.path, state["step"])
        return int(state["step"])
