"""Padding token-id lists into batches: the one place every stage pads, or packs.

Prompts are padded on the left (every prompt ends at the same column, so generation appends to all
rows at once); responses and whole training sequences on the right. Masks are bool, True on real
tokens; callers that hand a mask to a Hugging Face model as `attention_mask` convert it with
`.long()`.

Packed (`pack`), the sequences go end to end in one row with no padding and no mask: position ids
restarting at 0 for each are what tells attention where one ends (transformers' masking_utils
starts a sequence wherever a position id is not the one before it plus 1: flash-attention's
variable-length kernel, a block-diagonal mask under SDPA or eager).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def pad(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, W) ids and bool mask, W the longest sequence, each row's tokens at its right end (`left`
    padding) or at its left end."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(seqs), width), dtype=torch.bool, device="cpu")
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.long, device="cpu")
        mask[i, cols] = True
    return ids, mask


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pad(seqs, pad_id, left=True)


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pad(seqs, pad_id, left=False)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids counted from each row's first real token (left pads never shift them)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pack(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, N) ids of `seqs` end to end, N their total length, and (1, N) position ids restarting at
    0 for each: every sequence gets the positions it has alone, as right-padded rows give it."""
    ids = [t for s in seqs for t in s]
    pos = [i for s in seqs for i in range(len(s))]
    return (torch.tensor(ids, dtype=torch.long, device="cpu")[None],     # (1, N)
            torch.tensor(pos, dtype=torch.long, device="cpu")[None])     # (1, N)


def pack_responses(prompts: list[list[int]], responses: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """Each prompt + its response end to end (`pack`): (1, N) ids, (1, N) position ids, and the (K,)
    columns whose next token is a response token, K = the responses' tokens, sequence by sequence
    (the row-major order of the responses' right-padded mask, as `unpack` reads it)."""
    ids, pos = pack([p + r for p, r in zip(prompts, responses)])
    predicting, start = [], 0
    for p, r in zip(prompts, responses):
        predicting += range(start + len(p) - 1, start + len(p) + len(r) - 1)
        start += len(p) + len(r)
    return ids, pos, torch.tensor(predicting, dtype=torch.long, device="cpu")


def unpack(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(K,) `values` of the True entries of (B, R) `mask`, in row-major order, as (B, R), zero
    elsewhere (with a graph to `values`): per-token results of a packed row back in padded rows."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def micro_batches(lengths: Sequence[int], rows: int, max_tokens: Optional[int]) -> list[list[int]]:
    """Indices into `lengths` (one item each: the tokens it occupies in a padded micro-batch) of
    each micro-batch, in the order they run: with `max_tokens` None, consecutive runs of `rows`;
    else the items longest first, a micro-batch closed when one more item would make its rows x
    longest exceed `max_tokens` (an item longer than the budget alone)."""
    if max_tokens is None:
        return [list(range(first, min(first + rows, len(lengths)))) for first in range(0, len(lengths), rows)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])   # stable: ties keep their order
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out
