"""Reading the stages' inputs with validation, and tokenizing them for training.

Every record is checked before any compute: a malformed line, a missing field or an empty text
stops the stage with `file:line: what is wrong`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from pathlib import Path

import torch

from ..errors import DataError
from ..files import read_records
from .padding import pack, right_pad
from .tokenizer import cut_prompt, encode_prompt, encode_response

if TYPE_CHECKING:   # annotations only (pipeline/models/checkpoints.py says why)
    from transformers import PreTrainedTokenizerBase

IGNORE = -100  # label value that HF causal-LM losses skip


def load_demonstrations(path: Path) -> list[dict]:
    """{prompt, response, where} of the prepared task's demonstrations (fields prompt, response, id)."""
    return [{"prompt": r["prompt"], "response": r["response"], "where": where}
            for where, r in read_records(path, required=("prompt", "response"), nonempty=("prompt", "response"),
                                         allowed=("prompt", "response", "id"))]


def load_prompts(path: Path) -> list[tuple[str, str]]:
    """(where, prompt) of the prepared task's prompts (fields prompt, id)."""
    return [(where, r["prompt"]) for where, r in read_records(path, required=("prompt",), nonempty=("prompt",),
                                                               allowed=("prompt", "id"))]


@dataclass(frozen=True)
class Example:
    """One tokenized demonstration: prompt ids then response ids (ending in eos)."""
    input_ids: list[int]
    n_prompt: int


def tokenize_demonstrations(rows: list[dict], tok: PreTrainedTokenizerBase, max_length: int,
                            source: Path | str, overlong: str = "truncate",
                            section: str = "sft") -> tuple[list[Example], int, int]:
    """Tokenize. A demonstration longer than `max_length` keeps its response and the prompt's
    template (bos, system block, headers) and loses the left end of the user text (`overlong:
    truncate`: the instruction's tail and the response matter most; tokenizer.cut_prompt),
    or is left out (`drop`), or is an error naming it (`error`). Returns examples and how many were
    truncated and dropped. A response alone longer than the limit is an error under `truncate`
    (nothing sensible is left). `section`: the params section whose `max_length` and `overlong`
    these are (the errors name its keys)."""
    examples, truncated, dropped = [], 0, 0
    for i, row in enumerate(rows):
        p, r = encode_prompt(tok, row["prompt"]), encode_response(tok, row["response"])
        if len(p) + len(r) > max_length:
            where = row.get("where", f"{source}: record {i + 1}")
            if overlong == "error":
                raise DataError(f"{where}: prompt + response of "
                                f"{len(p) + len(r)} tokens exceed {section}.max_length={max_length} ({section}.overlong: "
                                f"truncate or drop accepts such records)")
            if overlong == "drop":
                dropped += 1
                continue
            if len(r) >= max_length:
                raise DataError(f"{where}: response of {len(r)} tokens exceeds "
                                f"{section}.max_length={max_length} ({section}.overlong: drop skips such records)")
            p, truncated = cut_prompt(tok, row["prompt"], max_length - len(r), p), truncated + 1
        examples.append(Example(p + r, len(p)))
    if not examples:
        raise DataError(f"{source}: every record is longer than {section}.max_length={max_length}")
    return examples, truncated, dropped


def collate_packed(batch: list[Example]) -> dict[str, torch.Tensor]:
    """The examples end to end in one (1, N) row, N their total tokens, with (1, N) position ids
    restarting at 0 for each and no attention mask: transformers (masking_utils) reads the
    restarts as packed sequences and keeps attention within each (flash-attention's
    variable-length kernel; a block-diagonal mask under SDPA or eager). Labels as collate_sft's,
    each example's first token ignored too, so none is trained to follow the one before it."""
    ids, pos = pack([e.input_ids for e in batch])                                            # (1, N) each
    labels = ids.clone()                                                                             # (1, N)
    start = 0
    for e in batch:
        labels[0, start:start + max(e.n_prompt, 1)] = IGNORE
        start += len(e.input_ids)
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def collate_sft(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) input_ids/attention_mask and labels with prompt and pads ignored."""
    ids, mask = right_pad([e.input_ids for e in batch], pad_id)
    labels = ids.masked_fill(~mask, IGNORE)
    for i, e in enumerate(batch):
        labels[i, :e.n_prompt] = IGNORE
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": labels}
