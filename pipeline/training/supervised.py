"""The supervised loop: SFT and the reward model (and any later offline method) supply a loss on
a micro-batch and a held-out evaluation; the loop does the rest.

Per optimizer step: the next global batch of the seeded `BatchSampler` (the same on every rank),
this rank's shard of it in micro-batches of `micro`, `engine.backward` per micro-batch and one
`engine.step`; the loss's per-step statistics summed over micro-batches and ranks and divided by
the task's normaliser of the global batch; `train.tsv` / `eval.tsv` rows with the learning rate the
step used and the gradient norm; the held-out evaluation every `eval_every` steps and after the
last; the resumable state every `save_every` steps and after the last (resume.SupervisedState: a
killed run continues where the last save left it, drawing the same batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import check_finite
from ..models import lora
from ..progress import track
from ..tracking.sinks import StepLog, Tracker
from .batches import BatchSampler, total_steps
from .distributed import Context
from .engines import TrainEngine
from .resume import SupervisedState


@dataclass
class SupervisedTask:
    """What a supervised stage supplies."""
    name: str                                   # the stage: progress bar, messages, checkpoint
    items: Sequence[Any]                        # training examples (indexed by the batch sampler)
    columns: list[str]                          # per-step statistics of `loss`, e.g. ["loss", "accuracy"]
    # (micro-batch, global batch) -> (loss to backpropagate, already divided by the global batch's
    # size or token count; the statistics' sums over the micro-batch, one per column)
    loss: Callable[[list, list], tuple[torch.Tensor, list[float]]]
    normaliser: Callable[[list], float]         # the global batch -> what the summed statistics are divided by
    eval_columns: list[str]                     # columns of eval.tsv
    evaluate: Callable[[], dict[str, float]]    # held-out statistics (every rank calls it)


@dataclass
class SupervisedResult:
    steps: int
    seconds: float          # training time, the interrupted runs' too
    train_log: StepLog
    eval_log: StepLog

    def metrics(self) -> dict[str, Any]:
        """The final metrics every supervised stage reports."""
        return {"train/loss": self.train_log.rows[-1]["loss"], "eval/loss": self.eval_log.rows[-1]["loss"],
                "train/steps": self.steps, "train/seconds": self.seconds}


def finish(engine: TrainEngine, result: SupervisedResult, lora_cfg: Any, out: Path,
           data_counts: dict[str, int]) -> tuple[Any, dict[str, Any]]:
    """Collective. The trained model, whole and plain (under LoRA its adapter saved in
    `out/adapter`, then merged), on the CPU in eval mode and in the dtype it trained in, with the
    loop's final metrics; on ranks other than 0 of a multi-process run (None, {}). Measure the
    model before (every rank, on its device: pipeline/measurement/policy.py), not after."""
    full = engine.full_model()   # collective under ZeRO-3
    if full is None:
        return None, {}
    model, counts = lora.finish(full, lora_cfg, out)
    return model, {**result.metrics(), **data_counts, **counts}


def train(task: SupervisedTask, cfg: Any, engine: TrainEngine, micro: int, out: Path, tracker: Tracker,
          ctx: Context, resume_fingerprint: str, progress: bool = True) -> SupervisedResult:
    """Run (or resume) the loop over `cfg.epochs` of `task.items` in global batches of
    `cfg.batch_size` (`cfg`: the stage's section: batch_size, epochs, seed, eval_every, save_every)."""
    steps = total_steps(len(task.items), cfg.batch_size, cfg.epochs)
    train_log = StepLog(out / "train.tsv", [*task.columns, "lr", "grad_norm"], tracker, series="train",
                        write=ctx.is_main)
    eval_log = StepLog(out / "eval.tsv", task.eval_columns, tracker, series="eval", write=ctx.is_main)
    batches = BatchSampler(len(task.items), cfg.batch_size, cfg.seed)   # the same global batches on every rank
    state = SupervisedState(task.name, out / "checkpoint", resume_fingerprint, engine, batches,
                            {"train": train_log, "eval": eval_log}, ctx)
    start = state.load()
    if start:
        tracker.mark_resumed(start)
    engine.train()
    for step in track(range(start + 1, steps + 1), steps, task.name, initial=start,
                      enabled=progress and ctx.is_main):
        batch = [task.items[i] for i in next(batches)]
        mine = ctx.shard(batch)
        sums = torch.zeros(len(task.columns), dtype=torch.float64, device="cpu")
        for first in range(0, len(mine), micro):
            with engine.autocast():
                loss, stats = task.loss(mine[first:first + micro], batch)
            check_finite(f"{task.name} step {step}", "loss", loss.detach())
            engine.backward(loss)
            sums += torch.tensor(stats, dtype=torch.float64, device="cpu")
        result = engine.step()
        check_finite(f"{task.name} step {step}", "gradient norm", result.grad_norm)
        sums = ctx.sum(sums) / task.normaliser(batch)
        train_log.log(step, {**{c: float(v) for c, v in zip(task.columns, sums)},
                             "lr": result.lr, "grad_norm": result.grad_norm})
        if step % cfg.eval_every == 0 or step == steps:
            with engine.autocast():
                eval_log.log(step, task.evaluate())
            train_log.flush()
            eval_log.flush()
        if step % cfg.save_every == 0 or step == steps:
            state.save(step)
    # A run resumed from its final save trains no step, yet DVC removed the stage's outputs before
    # running it: the logs are written here whatever the loop did.
    train_log.flush()
    eval_log.flush()
    return SupervisedResult(steps, state.elapsed(), train_log, eval_log)
