"""The supervised loop and its runner: a supervised stage (sft, reward, dpo, kto, rs) gives `run` a
`Recipe` (its model, its examples, its loss and held-out evaluation, its measurement of the
trained model) and the runner does the rest: the engine, the loop, the final model and metrics.

Per optimizer step: the next global batch of the seeded `BatchSampler` (the same on every rank),
this rank's shard of it in micro-batches of `micro` rows, or by the token budget
`distributed.max_tokens_per_micro_batch` (training/token_batches.py; every rank then runs as many
micro-batches as the rank with the most, a rank short of them a zero-weighted repeat, so ZeRO's
collectives pair up: token_batches.agreed_runs), `engine.backward` per micro-batch and one
`engine.step`; the loss's per-step statistics summed over micro-batches and ranks and divided by
the task's normaliser of the global batch; `train.tsv` / `eval.tsv` rows with the learning rate the
step used and the gradient norm; the held-out evaluation every `eval_every` steps and after the
last; the resumable state every `save_every` steps and after the last (resume.SupervisedState: a
killed run continues where the last save left it, drawing the same batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import check_finite
from . import nonfinite
from .nonfinite import NonfiniteGuard, restored_count
from ..models import lora
from ..progress import track
from ..tracking.sinks import StepLog, Tracker
from ..tracking.metric_names import METRICS_JSON, Metric
from . import token_batches
from ..data import padding
from .batches import BatchSampler, total_steps
from ..context import Context
from .engines import TrainEngine, supervised_engine, write_deepspeed_config
from .resume import SupervisedState
from . import restart, stopping


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
    # an item -> the tokens it occupies in a padded micro-batch (its rows x their width): the
    # token budget's measure (distributed.max_tokens_per_micro_batch) and the pad share's
    length: Callable[[Any], int]
    # a micro-batch's item lengths -> the forwards the loss splits it into (index lists); None: one
    forwards: Optional[Callable[[list[int]], list[list[int]]]] = None
    gate: Optional[restart.Gate] = None         # a restart check (training/restart.py); None: none


@dataclass
class SupervisedResult:
    steps: int
    seconds: float          # training time, the interrupted runs' too
    train_log: StepLog
    eval_log: StepLog
    pad_share: float = 0.0  # share of the training forwards' tokens that were padding (`pad_share`)

    def metrics(self) -> dict[str, Any]:
        """The final metrics every supervised stage reports."""
        return {"train/loss": self.train_log.rows[-1]["loss"], "eval/loss": self.eval_log.rows[-1]["loss"],
                "train/steps": self.steps, "train/seconds": self.seconds,
                f"train/{nonfinite.COLUMN}": self.train_log.rows[-1][nonfinite.COLUMN],
                "train/pad_share": self.pad_share}


@dataclass
class Recipe:
    """What a supervised stage gives `run`: its model (built, LoRA-wrapped and the RNG seeded, as the
    stage does it), how many training examples it has (the schedule's length), and three
    functions. `task(engine, micro)`: the loss and held-out evaluation on the engine that trains the
    model (micro: its micro-batch size per process); `measure(engine)`: collective, every rank,
    after training (e.g. sampling the policy); `report(model, result, measured)`: rank 0, the
    stage's own final metrics from the whole trained model."""
    model: torch.nn.Module
    n_examples: int
    task: Callable[[TrainEngine, int], SupervisedTask]
    measure: Callable[[TrainEngine], Any] = lambda engine: None
    report: Callable[[Any, "SupervisedResult", Any], dict[str, Any]] = lambda model, result, measured: measured or {}
    counts: dict[str, int] = field(default_factory=dict)   # data/* metrics: truncated, dropped, ...


def run(name: str, cfg: Any, recipe: Recipe, out: Path, checkpoint: Path, tracker: Tracker, ctx: Context,
        resume_fingerprint: str, progress: bool = True) -> tuple[Any, dict[str, Any]]:
    """Collective. Train `recipe.model` with the stage's section `cfg` (a config.SupervisedConfig):
    its engine (warmup then cosine over the run's steps; `deepspeed_config.json` beside the
    outputs), the loop (`train`), the measurement, and the whole model with the final metrics on
    rank 0 (`finish`); other ranks get (None, {})."""
    engine, micro = supervised_engine(recipe.model, cfg, total_steps(recipe.n_examples, cfg.batch_size, cfg.epochs), ctx)
    if ctx.is_main:
        write_deepspeed_config(out / "deepspeed_config.json", **{name: engine})
    result = train(recipe.task(engine, micro), cfg, engine, micro, out, checkpoint, tracker, ctx, resume_fingerprint,
                   progress)
    measured = recipe.measure(engine)
    model, metrics = finish(engine, result, cfg.lora, out, recipe.counts)
    if model is None:
        return None, {}
    metrics.update(recipe.report(model, result, measured))
    return model, metrics


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


def train(task: SupervisedTask, cfg: Any, engine: TrainEngine, micro: int, out: Path, checkpoint: Path,
          tracker: Tracker, ctx: Context, resume_fingerprint: str, progress: bool = True) -> SupervisedResult:
    """Run (or resume) the loop over `cfg.epochs` of `task.items` in global batches of
    `cfg.batch_size` (`cfg`: the stage's section: batch_size, epochs, seed, eval_every, save_every)."""
    steps = total_steps(len(task.items), cfg.batch_size, cfg.epochs)
    train_log = StepLog(out / "train.tsv", [*task.columns, "lr", "grad_norm", nonfinite.COLUMN], tracker,
                        series="train", write=ctx.is_main)
    eval_log = StepLog(out / "eval.tsv", task.eval_columns, tracker, series="eval", write=ctx.is_main)
    batches = BatchSampler(len(task.items), cfg.batch_size, cfg.seed)   # the same global batches on every rank
    gate = task.gate
    logs = {"train": train_log, "eval": eval_log, **({"restart": gate.log} if gate is not None else {})}
    state = SupervisedState(task.name, checkpoint, resume_fingerprint, engine, batches, logs, ctx,
                            gate.attempt if gate is not None else 0)
    start = state.load()
    if start:
        tracker.mark_resumed(start)
    guard = NonfiniteGuard(task.name, cfg.on_nonfinite, cfg.max_skipped_updates, restored_count(train_log.rows))
    budget = cfg.distributed.max_tokens_per_micro_batch
    engine.train()
    for step in track(range(start + 1, steps + 1), steps, task.name, initial=start,
                      enabled=progress and ctx.is_main):
        batch = [task.items[i] for i in next(batches)]
        mine = ctx.shard(batch)
        parts = padding.micro_batches([task.length(item) for item in mine], micro, budget)
        sums = torch.zeros(len(task.columns), dtype=torch.float64, device="cpu")
        for run in token_batches.agreed_runs(len(parts), budget, ctx):
            filler = run.filler            # this rank has run its share: a repeat that adds nothing
            part = [mine[i] for i in parts[run.part]] if not filler else (mine or batch)[:1]
            with engine.autocast():
                loss, stats = task.loss(part, batch)
            if guard.stops:
                check_finite(f"{task.name} step {step}", "loss", loss.detach())
            engine.backward(guard.poisoned(loss * 0.0 if filler else loss), boundary=run.boundary)
            if not filler:
                sums += torch.tensor(stats, dtype=torch.float64, device="cpu")
        result = engine.step()
        if guard.stops:
            check_finite(f"{task.name} step {step}", "gradient norm", result.grad_norm)
        guard.count(f"{task.name} step {step}", result)
        sums = ctx.sum(sums) / task.normaliser(batch)
        train_log.log(step, {**{c: float(v) for c, v in zip(task.columns, sums)},
                             "lr": result.lr, "grad_norm": result.grad_norm, nonfinite.COLUMN: guard.skipped})
        if step % cfg.eval_every == 0 or step == steps:
            with engine.autocast():
                eval_log.log(step, task.evaluate())
            train_log.flush()
            eval_log.flush()
        if gate is not None:
            with engine.autocast():
                gate.observe(step)
            verdict = gate.verdict(step)
            if verdict is not None:   # this draw has not learnt: the next attempt starts from its marker
                state.mark_restart(gate.attempt + 1, "restart")
                raise verdict
        saved = step % cfg.save_every == 0 or step == steps
        if saved:
            state.save(step)
        signum = stopping.requested(ctx)   # collective: every rank stops at the same step
        if signum:
            if not saved:
                state.save(step)
            raise stopping.stop(task.name, signum, f"after step {step} of {steps}")
    # A run resumed from its final save trains no step, yet DVC removed the stage's outputs before
    # running it: the logs are written here whatever the loop did.
    train_log.flush()
    eval_log.flush()
    return SupervisedResult(steps, state.elapsed(), train_log, eval_log, pad_share(task, cfg, micro, ctx))


def pad_share(task: SupervisedTask, cfg: Any, micro: int, ctx: Context) -> float:
    """Collective. The share of padding in the tokens the training forwards computed over the whole
    run, every rank's micro-batches of every step: its batches drawn again from the seed (index
    lists only), so a resumed run reports the uninterrupted run's."""
    batches = BatchSampler(len(task.items), cfg.batch_size, cfg.seed)
    tokens = [0, 0]                                               # real, computed
    for _ in range(total_steps(len(task.items), cfg.batch_size, cfg.epochs)):
        lengths = [task.length(task.items[i]) for i in ctx.shard(next(batches))]
        parts = padding.micro_batches(lengths, micro, cfg.distributed.max_tokens_per_micro_batch)
        tokens = [a + b for a, b in zip(tokens, token_batches.padded_tokens(lengths, parts, task.forwards))]
    real, computed = ctx.sum(torch.tensor(tokens, dtype=torch.float64, device="cpu")).tolist()
    return 1.0 - real / computed

# ---- Its metric declarations (docs/metrics.md) --------------------------------------------------

def declared_metrics(stage: str, items: str, loss: str, eval_loss: str, trained: str) -> list[Metric]:
    """What the one supervised loop (training/supervised.py) writes for SFT and the RM alike."""
    def m(file: str, name: str, meaning: str, condition: Optional[str] = None) -> Metric:
        return Metric(stage, file, name, meaning, condition)

    return [
        m("train.tsv", "step", "optimizer step"),
        m("train.tsv", "loss", loss),
        m("train.tsv", "lr", "learning rate the step used (linear warmup, then cosine decay)"),
        m("train.tsv", "grad_norm", "global gradient norm before clipping"),
        m("train.tsv", "skipped_updates", nonfinite.SKIPPED),
        m("eval.tsv", "step", f"optimizer step (every `{stage}.eval_every` steps and the last)"),
        m("eval.tsv", "loss", eval_loss),
        m(METRICS_JSON, "train/loss", "`train.tsv`'s last `loss`"),
        m(METRICS_JSON, "train/steps", "optimizer steps of the whole training"),
        m(METRICS_JSON, "train/seconds", "seconds of the training loop, interrupted runs' (resumed) included"),
        m(METRICS_JSON, "train/skipped_updates", "`train.tsv`'s last `skipped_updates`"),
        m(METRICS_JSON, "train/pad_share", "share of the training forwards' tokens that were padding, each "
                                           "row padded to its micro-batch's longest (every step of the run; "
                                           f"0 with `{stage}.packing`)"),
        m(METRICS_JSON, "eval/loss", "`eval.tsv`'s last `loss`"),
        m(METRICS_JSON, "data/truncated", f"training {items} longer than `{stage}.max_length` kept with their "
                                          f"prompt's left end cut (`{stage}.overlong: truncate`)"),
        m(METRICS_JSON, "data/dropped", f"training {items} longer than `{stage}.max_length` left out "
                                        f"(`{stage}.overlong: drop`)"),
        m(METRICS_JSON, "train/trainable_params", f"parameters LoRA trained ({trained})", f"{stage}_lora"),
        m(METRICS_JSON, "train/total_params", "parameters of the model with its adapters", f"{stage}_lora"),
    ]
