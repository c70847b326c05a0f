"""Preference pairs from the common layouts, loaded through `datasets`.

Layouts (`reward.dataset.layout`, or `auto` to detect from the columns):
- `text`: `prompt`, `chosen`, `rejected` text columns (the default task; many public sets).
- `conversation`: `chosen` and `rejected` hold whole dialogues that share everything up to the last
  assistant turn, as in Anthropic's HH-RLHF (`\\n\\nHuman: ... \\n\\nAssistant: ...`).
- `messages`: `chosen` and `rejected` are lists of `{role, content}` chat messages whose last one
  is the assistant's answer, as in UltraFeedback binarized (a `prompt` column may sit beside them).
An optional margin column gives per-pair margins for the loss.

A local `.jsonl` file is first read line by line so a malformed line is reported as `file:line:`;
other sources (hub ids, `save_to_disk` folders, Parquet/CSV) report `source: row N:`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from ..errors import DataError, shown
from ..files import MAX_RECORD_BYTES, check_fields, check_ids, check_unicode, nonempty_text, numbered_jsonl, regular_file

Layout = Literal["auto", "text", "conversation", "messages"]
ASSISTANT_TURN = "\n\nAssistant:"


@dataclass(frozen=True)
class Pair:
    prompt: Any          # text, or a list of {role, content} messages (the `messages` layout)
    chosen: str
    rejected: str
    margin: float = 0.0
    where: str = field(default="", compare=False)   # `file:line` or `source: row N`, for messages


# The file types a local source may have; a name with one of them is a file, never a hub id.
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def looks_local(source: str) -> bool:
    """Whether `source` names a local file or folder rather than a hub dataset: a file type of
    LOCAL_SUFFIXES, a path from `./`, `../` or `/`, or a `{split}` to fill in. A missing one is
    then "no such file", not the hub's failure to find a dataset of that name."""
    return (Path(source).suffix in LOCAL_SUFFIXES or source.startswith(("./", "../", "/"))
            or "{split}" in source)


def _rows(source: str, split: str, revision: Optional[str], key: str = "") -> list[tuple[str, dict]]:
    """Raw rows, each with how errors name it (`file:line` for JSONL, `source: row N` otherwise).
    A `{split}` in a local path is replaced by the split's name (`data/sft_{split}.jsonl`). `key`:
    the params key that names `source` (`prompts.dataset.path`), for the error when it is missing."""
    given, source = source, source.replace("{split}", split)
    path = Path(source)
    if looks_local(given) and not path.exists() and not path.is_symlink():   # a dangling link: regular_file
        # A path is shown whole up to a long one (the user's own folders), cut in its middle beyond.
        raise DataError(f"{source}: no such file" + (f" ({key}: {shown(given, 300, keep_end=True)})" if key else ""))
    if (path.exists() or path.is_symlink()) and not path.is_dir():
        regular_file(path)   # a FIFO, device or dangling link is refused before any reader opens it
    if path.suffix == ".jsonl" and path.is_file():
        rows = [(f"{source}:{line}", row) for line, row in numbered_jsonl(path)]
        check_ids(rows)
        return rows
    import datasets  # imported here: it is slow to import and only some sources need it

    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        elif path.is_file():
            kind = {".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
            if kind is None:
                raise DataError(f"{source}: unsupported file type {path.suffix!r} (use .jsonl, .json, .parquet, .csv)")
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(source, split=split, revision=revision)
    except DataError:
        raise
    except Exception as err:  # datasets raises many types; the user needs the source named
        # pandas' own words name the row ("Expected 2 fields in line 4, saw 3"): keep its first line
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        cause = err.__cause__ or err.__context__
        detail = next((line for line in str(cause).splitlines() if line.strip()), "") if cause else ""
        raise DataError(f"{source}: cannot load dataset: {shown(first, 200)}"
                        + (f" ({shown(detail, 200)})" if detail and detail not in first else "")) from None
    rows = []
    for i, r in enumerate(ds):
        where, row = f"{source}: row {i + 1}", dict(r)
        size = sum(len(v.encode("utf-8", "surrogatepass")) for v in row.values() if isinstance(v, str))
        if size > MAX_RECORD_BYTES:
            raise DataError(f"{where}: a record of {size} bytes of text; at most {MAX_RECORD_BYTES} are read")
        check_unicode(row, where)
        rows.append((where, row))
    check_ids(rows)
    return rows


def detect_layout(row: dict[str, Any]) -> str:
    if isinstance(row.get("chosen"), list):
        return "messages"
    if "prompt" in row:
        return "text"
    return "conversation"


def _split_conversation(chosen: str, rejected: str, where: str) -> tuple[str, str, str]:
    """Shared dialogue up to the last assistant turn, then the two final answers."""
    cut_c, cut_r = chosen.rfind(ASSISTANT_TURN), rejected.rfind(ASSISTANT_TURN)
    if cut_c < 0 or cut_r < 0:
        raise DataError(f"{where}: conversation has no '\\n\\nAssistant:' turn")
    prompt = chosen[:cut_c + len(ASSISTANT_TURN)]
    if rejected[:cut_r + len(ASSISTANT_TURN)] != prompt:
        raise DataError(f"{where}: chosen and rejected conversations differ before the last assistant turn")
    return prompt.strip(), chosen[len(prompt):].strip(), rejected[len(prompt):].strip()


def _split_messages(row: dict[str, Any], where: str) -> tuple[str, str, str]:
    answers = []
    for key in ("chosen", "rejected"):
        msgs = row[key]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m
                                                             and "content" in m for m in msgs):
            raise DataError(f"{where}: field '{key}' must be a non-empty list of {{role, content}} messages")
        if msgs[-1]["role"] != "assistant":
            raise DataError(f"{where}: the last message of '{key}' must be the assistant's")
        answers.append(msgs)
    # The conversation before the answers stays a message list: tokenizers with a chat template
    # render it as the policy saw it (tokenizer.encode_prompt); others get `role: content` lines.
    prompt = row.get("prompt") or [{"role": m["role"], "content": m["content"]} for m in answers[0][:-1]]
    if isinstance(prompt, list) and not prompt:
        raise DataError(f"{where}: 'chosen' has no message before the assistant's answer")
    return prompt, answers[0][-1]["content"], answers[1][-1]["content"]


def to_pair(row: dict[str, Any], layout: str, where: str, margin_column: Optional[str]) -> Pair:
    """Normalise one raw row to a Pair, checking every field."""
    for key in ("chosen", "rejected") + (("prompt",) if layout == "text" else ()):
        if key not in row:
            raise DataError(f"{where}: missing field '{key}'")
    if layout == "text":
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    elif layout == "conversation":
        prompt, chosen, rejected = _split_conversation(nonempty_text(row["chosen"], where, "chosen"),
                                                       nonempty_text(row["rejected"], where, "rejected"), where)
    else:
        prompt, chosen, rejected = _split_messages(row, where)
    prompt = prompt if isinstance(prompt, list) else nonempty_text(prompt, where, "prompt")
    chosen, rejected = nonempty_text(chosen, where, "chosen"), nonempty_text(rejected, where, "rejected")
    if chosen.strip() == rejected.strip():
        raise DataError(f"{where}: chosen and rejected are identical")
    margin = 0.0
    if margin_column is not None:
        if margin_column not in row:
            raise DataError(f"{where}: missing margin field '{margin_column}'")
        value = row[margin_column]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(f"{where}: margin field '{margin_column}' must be a number, got {shown(value)}")
        try:
            margin = float(value)
        except OverflowError:   # an integer beyond float range
            margin = math.inf
        if not math.isfinite(margin):
            raise DataError(f"{where}: margin field '{margin_column}' must be finite, got {shown(value)}")
    return Pair(prompt, chosen, rejected, margin, where)


def check_distinct(where: str, chosen: list[int], rejected: list[int]) -> None:
    """A pair whose responses are one token sequence teaches nothing (its loss is constant, its
    gradient zero) and counts as a tie in accuracy: refused as the textually identical pair is. It
    happens when the tokenizer maps the texts' differences (case, spacing, unknown words) to the
    same tokens."""
    if chosen == rejected:
        raise DataError(f"{where}: chosen and rejected are identical once tokenized ({len(chosen)} tokens; the "
                        "tokenizer maps their differences to the same tokens); fix or remove the pair")


def load_pairs(source: str | Path, split: str = "train", revision: Optional[str] = None,
               layout: Layout = "auto", margin_column: Optional[str] = None,
               allowed: Optional[Sequence[str]] = None, key: str = "") -> list[Pair]:
    """All pairs of `source` (a local file or folder, or a hub id), validated. With `allowed` (a
    fixed schema, as in the prepared task's files) a field outside it is an error. `key`: the
    params key naming `source`, for errors."""
    rows = _rows(str(source), split, revision, key)
    if not rows:
        raise DataError(f"{source}: no records")
    if allowed is not None:
        for where, row in rows:
            check_fields(where, row, allowed)
    chosen_layout = detect_layout(rows[0][1]) if layout == "auto" else layout
    return [to_pair(row, chosen_layout, where, margin_column) for where, row in rows]
