"""Padding token-id lists into batches: the one place every stage pads.

Prompts are padded on the left (every prompt ends at the same column, so generation appends to all
rows at once); responses and whole training sequences on the right. Masks are bool, True on real
tokens; callers that hand a mask to a Hugging Face model as `attention_mask` convert it with
`.long()`.
"""

from __future__ import annotations

import torch


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, W) ids and bool mask, W the longest sequence, each row's tokens at its right end."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = True
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, W) ids and bool mask, W the longest sequence, each row's tokens at its left end."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = True
    return ids, mask


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids counted from each row's first real token (left pads never shift them)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
