"""One rank of the sharded-measurement tests (tests/unit/test_devices.py): measures two tiny policies on
70 prompts with `measure_policies`, and scores 151 held-out preference pairs with a tiny reward model
as the reward stage's final evaluation does (`reward.score_pairs`), then runs the stages' other
collectives (stage_collectives.py: the stop decision, PPO's whitening, the stages reward, dpo, kto,
rs and ppo on the tiny inputs in INPUTS with the params in PARAMS.json), in a gloo group of
WORLD_SIZE processes, on the fake accelerator, every collective through a double with NCCL's rule
(device tensors only), and writes what it got (rank 0: OUT/result.json, the stages' folders under OUT).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/helpers/measure_ranks.py OUT INPUTS PARAMS.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: conftest's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fake_device  # noqa: E402

DEVICE = fake_device.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

from pipeline.config import ModelConfig, SamplingConfig  # noqa: E402
from pipeline.data.preferences import Pair  # noqa: E402
from pipeline.stages import reward  # noqa: E402
from pipeline.measurement.policy import Policy, measure_policies  # noqa: E402
from pipeline.models.checkpoints import tiny_config  # noqa: E402
from pipeline.tasks import reviews  # noqa: E402
from pipeline.training import distributed  # noqa: E402
from pipeline import context  # noqa: E402
from pipeline.context import Context  # noqa: E402
import stage_collectives  # noqa: E402
from conftest import random_policies  # noqa: E402

PROMPTS = ["Review the film Silent River . Focus on the music .",
           "What did you think of Lost Lantern ? Talk about the acting .",
           "Write a review of the film Bitter Road . Discuss the visuals ."]


class NcclRuleGroup:
    """torch.distributed as the stage code sees it: the real gloo group underneath, but a tensor
    collective refuses tensors that are not on the accelerator, as NCCL does; objects are gathered
    through tensors on the accelerator too (what all_gather_object does under NCCL)."""
    ReduceOp = dist.ReduceOp

    def __init__(self) -> None:
        self.calls = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return dist.is_initialized()

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        self._check(tensor)
        host = fake_device.real(tensor).clone()
        dist.all_reduce(host, op=op)
        tensor.copy_(host)

    def all_gather_object(self, out: list, obj) -> None:
        self._check(torch.zeros(1, device=DEVICE))   # the staging tensor NCCL's object gather builds
        dist.all_gather_object(out, obj)

    def barrier(self) -> None:
        dist.barrier()

    def _check(self, tensor: torch.Tensor) -> None:
        self.calls += 1
        if tensor.device.type != fake_device.NAME:
            raise RuntimeError(f"NCCL rule: a collective on a {tensor.device} tensor")


class Lengths:
    def score(self, prompts, responses):
        return torch.tensor([float(len(r)) for r in responses], device=DEVICE)


def main(out: Path, inputs: Path, params: Path) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = NcclRuleGroup()
    distributed.dist = group   # the module's collectives go through the double,
    context._dist = lambda: group   # and the Context's
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)
    models, tok = random_policies(cfg)
    prompts = (PROMPTS * 24)[:70]   # two batches of 64 and 6: one per rank of two
    torch.manual_seed(2)
    scalar = tiny_config(cfg, tok)
    scalar.num_labels = 1
    scorer = AutoModelForSequenceClassification.from_config(scalar).eval()
    rng = torch.Generator().manual_seed(3)
    words = reviews.vocabulary()
    pairs = [Pair(PROMPTS[i % 3], *(" ".join(words[j] for j in torch.randint(len(words), (n,), generator=rng))
                                     for n in (5 + i % 7, 3 + i % 5))) for i in range(151)]
    with fake_device.use_fake_gpu() as dev:
        policy, ref = (m.to(dev) for m in models)
        ctx = Context(rank=rank, world_size=world, device=dev)
        per = measure_policies([Policy("a", policy, 3), Policy("b", ref, 4, greedy=True)], tok, prompts,
                               SamplingConfig(max_new_tokens=10), ctx=ctx, reward=Lengths(),
                               judge=reviews.gold_score, ref=ref)
        chosen, rejected, imbalance = reward.score_pairs(scorer.to(dev), tok, pairs, 64, ctx, dev, batch_size=32)
        total = float(ctx.sum(torch.tensor([1.0], device="cpu"))[0])
        measured = group.calls
        stages = stage_collectives.run(ctx, out, inputs, params)
    if rank == 0:
        (out / "result.json").write_text(json.dumps({
            "per": {k: [m.texts, m.ended, m.values] for k, m in per.items()},
            "pairs": [chosen.tolist(), rejected.tolist()], "imbalance": imbalance, "ranks": total,
            "collectives": measured, "stages": {**stages, "collectives": group.calls - measured}}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))
