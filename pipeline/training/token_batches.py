"""Micro-batches by a token budget: one process's share of a global batch cut into micro-batches by
what they cost padded (rows x the longest row), not by a fixed number of rows, as verl's
`ppo_max_token_len_per_gpu` and OpenRLHF's packing do. On data whose lengths vary 10x, a fixed
number of rows is sized for the longest ones and pads the rest; a budget fills each micro-batch.

The items are sorted by length (longest first, so the largest micro-batch runs first and a budget
too small fails at once) and cut greedily (data/padding.py's `micro_batches`). The global batch, and so the gradient, is the same: every
loss is normalised by the global batch (pipeline/training/supervised.py), so the micro-batches'
gradients sum to the fixed-row path's, up to the order of float additions. With no budget the
micro-batches are today's: consecutive runs of a fixed number of rows.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

from ..context import Context


class Run(NamedTuple):
    """One micro-batch as a process runs it: `part` indexes its micro-batches (a filler repeats the
    first); `filler`: run only so that every process runs as many, its loss weighted 0; `boundary`:
    whether it ends the step, told to DeepSpeed where the count varies (None: fixed rows)."""
    part: int
    filler: bool
    boundary: Optional[bool]


def agreed_runs(n_parts: int, budget: Optional[int], ctx: Context) -> list[Run]:
    """The micro-batches this process runs for its `n_parts`: with a token budget each process cuts
    its own share into its own count, yet ZeRO's collectives pair up across processes, so all run
    the largest count and the shorter add zero-weighted repeats. Without a budget (or alone) its own."""
    runs = n_parts if budget is None or ctx.world_size == 1 else max(n for [n] in ctx.gather([n_parts]))
    return [Run(k if k < n_parts else 0, k >= n_parts, None if budget is None else k == runs - 1)
            for k in range(runs)]


def padded_tokens(lengths: Sequence[int], parts: list[list[int]],
                  forwards: Optional[Callable[[list[int]], list[list[int]]]] = None) -> tuple[int, int]:
    """(real, computed) tokens of micro-batches `parts` over items of `lengths`: computed counts
    every row padded to the longest of its forward, a micro-batch one forward or, with `forwards`
    (its items' lengths -> index lists), the forwards a task splits it into itself (the reward
    model's length-sorted parts)."""
    real = computed = 0
    for part in parts:
        sizes = [lengths[i] for i in part]
        real += sum(sizes)
        for run in (forwards(sizes) if forwards is not None else [range(len(sizes))]):
            computed += len(run) * max((sizes[i] for i in run), default=0)
    return real, computed


def packed(sizes: list[int]) -> list[list[int]]:
    """The `forwards` of a packed micro-batch for `padded_tokens`: each item its own segment of the
    one row (data.padding.pack), so nothing computed is padding."""
    return [[i] for i in range(len(sizes))]
