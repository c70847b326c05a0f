"""The stages' collectives at N processes, for one rank of tests/helpers/measure_ranks.py (which
joins the group and routes every collective through its NCCL-rule double first). `run`:

- the stop decision (training/stopping.py) with only the last rank asked to stop, then none;
- the PPO trainer's advantage whitening over the global batch (ppo/trainer.py `gae_advantages`) on
  fixed rewards and values, each rank its rows;
- the stages reward, dpo, kto, rs and ppo, whole, on tiny inputs: the sharded training step's sums
  (training/supervised.py), the held-out losses (training/demonstrations.py, dpo, kto, reward), PPO's
  token counts and step statistics, and the barriers of the resumable state and of the stages.

Stand-ins, each where it is made: the stages' session yields the group this process already
joined; the plain engine sums its gradients over ranks (DeepSpeed's part in a multi-process run);
PPO's rollout rows are each drawn from a seed of their own (a rank's stream depends on the number
of ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import Params, from_dict
from pipeline.models import rollout_engine
from pipeline.models.generation import concat
from pipeline.ppo.trainer import PPOTrainer
from pipeline.training import distributed, engines, stopping
from pipeline.context import Context
from pipeline.workflow import code_deps
from conftest import run_stage


class SummedGradients(engines.TorchEngine):
    """The plain engine as data parallelism runs it (DeepSpeed's part in a multi-process run): the
    gradients summed over ranks before each update (every loss is already divided by the global
    batch's size or token count, engines.py), the whole model rank 0's, the resumable weights
    written by rank 0 (the ranks would otherwise write one file at once)."""

    def step(self) -> engines.StepResult:
        for p in self.params:
            if p.grad is not None:
                distributed.dist.all_reduce(p.grad)
        return super().step()

    def full_model(self):
        return self.model if dist.get_rank() == 0 else None

    def save(self, folder: Path, name: str) -> None:
        if dist.get_rank() == 0:
            super().save(folder, name)


class PerPromptRollouts(rollout_engine.TorchSampler):
    """PPO's sampler with each rollout row drawn alone, from a seed and up to a length that its
    prompt sets. A rollout draws a rank's rows from the rank's own stream, so its responses change
    with the number of ranks; these do not, and their lengths differ from row to row (as eos makes
    them), so the ranks hold unequal shares of the global batch's tokens. Measurements (one seed per
    prompt already) sample as before. `lengths`: each rollout's response lengths, in row order."""

    def __init__(self) -> None:
        self.lengths: list[list[int]] = []

    def generate(self, model, request):
        if request.stream is None:
            return super().generate(model, request)
        parts = []
        for ids in request.prompts:
            key = sum((i + 1) * t for i, t in enumerate(ids))
            sampling = dataclasses.replace(request.sampling, max_new_tokens=1 + key % request.sampling.max_new_tokens)
            parts.append(super().generate(model, dataclasses.replace(request, prompts=[ids], sampling=sampling,
                                                                     seeds=[key], stream=None)))
        out = concat(parts, request.pad_id)
        self.lengths.append(out.response_mask.sum(1).tolist())
        return out


def stop_decisions(ctx: Context) -> list[int]:
    """Every rank's stop decision when only the last rank was asked to stop, then when none was."""
    out = []
    for asked in (signal.SIGTERM, 0):
        stopping._requested = asked if ctx.rank == ctx.world_size - 1 else 0
        out.append(stopping.requested(ctx))
    stopping.reset()
    return [row for rank in ctx.gather(out) for row in rank]


def whitened(ctx: Context, params: Params) -> list[list[float]]:
    """The trainer's whitened advantages and returns of 6 fixed rows (rewards, values, a ragged
    mask; rewards whitened too), each rank its share of the rows, gathered in row order."""
    gen = torch.Generator().manual_seed(4)
    rewards, values = (torch.randn(6, 7, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.arange(7) < torch.tensor([7, 3, 5, 1, 6, 4]).unsqueeze(1)
    rows = slice(ctx.rank * 6 // ctx.world_size, (ctx.rank + 1) * 6 // ctx.world_size)
    trainer = type("Whitening", (), {"cfg": dataclasses.replace(params.ppo, whiten_rewards=True), "ctx": ctx})()
    adv, ret = PPOTrainer.gae_advantages(trainer, *(t[rows].to(ctx.device) for t in (rewards, values, mask)), {})
    return [row for rank in ctx.gather(torch.cat([adv, ret], 1).tolist()) for row in rank]


def run(ctx: Context, out: Path, inputs: Path, params_file: Path) -> dict:
    """The module doc's list on `inputs` (data, sft, rm) with the params in `params_file`, each
    stage's folder under `out`; returns the stop decisions, the whitened rows and PPO's rollout
    lengths."""
    params = from_dict(Params, json.loads(params_file.read_text()), f"{params_file}: ")
    engines.TorchEngine = SummedGradients
    rollout_engine.TORCH = rollouts = PerPromptRollouts()
    # The stages' own session would join a group (DeepSpeed) or stay one process (backend none).
    distributed.session = lambda cfg: contextlib.nullcontext(ctx)
    # Each stage's code fingerprint parses the imports of the same files: once per process here
    # (the files do not change while it runs), not once more per stage (about half a second each).
    code_deps.imports = functools.lru_cache(code_deps.imports)
    result = {"stop": stop_decisions(ctx), "whitened": whitened(ctx, params)}
    folders = {"data": inputs / "data", "sft": inputs / "sft", "reward": inputs / "rm"}
    for stage in ("reward", "dpo", "kto", "rs", "ppo"):
        run_stage(stage, params, folders, out / stage)
    result["rollout_lengths"] = ctx.gather(rollouts.lengths)   # [rank][rollout][row]
    return result
