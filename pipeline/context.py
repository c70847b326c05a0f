"""Who this process is: its rank among the processes of a stage, its device, and the reductions
every rank takes part in.

A single plain process is rank 0 of 1 with no process group (`SINGLE`). The launched processes of
a distributed stage get theirs from pipeline/training/distributed.py's `init`, which starts the
process group; code below training (measurement, the PPO placement) takes a Context and never
starts anything.

Declaring a Context imports no torch (its device may be a name, "cpu" for `SINGLE`): the stage
modules use `SINGLE` as a default argument, and listing the stages must not load torch. Its
reductions import torch when they run, by which time the caller has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Container, Iterator, Sequence, TypeVar

T = TypeVar("T")


def _dist() -> Any:
    """torch.distributed, imported when a reduction runs (the tests put a double of it here)."""
    import torch.distributed as dist
    return dist


@dataclass(frozen=True)
class Context:
    """Who this process is.

    `device` is where this rank's models live, and where its collectives run: NCCL (the backend of a
    CUDA run) takes tensors on the GPU only, gloo on the CPU, so every reduction below moves its
    operands to `device` and hands the result back on the caller's device and dtype."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: Any = "cpu"   # a torch.device, or a name torch reads as one

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        """"cpu", "cuda", ...: the kind of `device` without its index."""
        return str(self.device).partition(":")[0]

    @property
    def active(self) -> bool:
        dist = _dist()
        return dist.is_available() and dist.is_initialized()

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous slice of a global batch (equal slices; sizes are validated)."""
        n = len(items) // self.world_size
        return list(items[self.rank * n:(self.rank + 1) * n])

    def sum(self, x: Any) -> Any:
        """Sum of the tensor `x` over ranks (a new tensor on `x`'s device and dtype; `x` is not
        modified)."""
        if not self.active:
            return x.clone()
        import torch
        dist = _dist()
        y = x.detach().to(self.device, torch.float64, copy=True)
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return y.to(x.device, x.dtype)

    def reduce_stats(self, stats: dict[str, float], sum_keys: Container[str] = (),
                     max_keys: Container[str] = ()) -> dict[str, float]:
        """A dict of per-rank scalars reduced over ranks: summed for `sum_keys`, the largest for
        `max_keys`, averaged otherwise. Every rank must pass the same keys."""
        if not self.active:
            return dict(stats)
        import torch
        dist = _dist()
        keys = list(stats)  # the same insertion order on every rank
        values = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.device)
        total = values.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        peak = values.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        total, peak = total.cpu(), peak.cpu()
        return {k: float(peak[i] if k in max_keys else total[i] if k in sum_keys else total[i] / self.world_size)
                for i, k in enumerate(keys)}

    def eval_parts(self, items: Sequence[T], batch_size: int) -> Iterator[list[T]]:
        """This rank's parts of an evaluation pass in batches of `batch_size` per rank. Every rank
        gets the same number of parts (some may be empty: the caller runs a dummy forward then,
        because under ZeRO-3 each forward is a collective)."""
        span = batch_size * self.world_size
        for start in range(0, len(items), span):
            chunk = items[start:start + span]
            n = math.ceil(len(chunk) / self.world_size)
            yield list(chunk[self.rank * n:(self.rank + 1) * n])

    def gather(self, part: list[T]) -> list[list[T]]:
        """Every rank's `part` (picklable objects), in rank order, on every rank."""
        if not self.active:
            return [list(part)]
        dist = _dist()
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, list(part))
        return out

    def barrier(self) -> None:
        if self.active:
            _dist().barrier()


SINGLE = Context()
