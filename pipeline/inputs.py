"""Where each stage's demonstrations and prompts come from: the prepared default task, or the
user's own dataset named in params.

- SFT demonstrations (`sft.dataset`): layouts `prompt_completion` (a prompt and a completion
  column), `text` (one text column; trained on every token), or `messages` (a list of chat
  messages whose last one is the assistant's answer), `auto` to detect from the columns.
- PPO and evaluation prompts (`ppo.dataset`): layouts `prompt` (a text column) or `messages` (the
  conversation so far; a trailing assistant message is dropped).

Column names are mappable in params. Sources go through `datasets` like the preference pairs (see
preferences.py): a hub id with split and revision, a folder saved with `save_to_disk`, or local
JSONL/JSON/Parquet/CSV files; a bad record is reported as `file:line:` (JSONL) or `source: row N:`.

A prompt is a string, or a list of `{role, content}` messages (rendered with the tokenizer's chat
template where it has one: see tokenizer.encode_prompt).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, TypeVar, Union

from .config import Params, PromptDatasetConfig, SFTDatasetConfig
from .data import load_demonstrations, load_prompts
from .errors import DataError
from .preferences import ASSISTANT_TURN, _rows

Prompt = Union[str, list[dict[str, str]]]
T = TypeVar("T")


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        raise DataError(f"{where}: field '{key}' must be a non-empty list of {{role, content}} messages")
    if not all(m["content"].strip() for m in value):
        raise DataError(f"{where}: field '{key}' has an empty message")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _text(row: dict[str, Any], key: str, where: str) -> str:
    if key not in row:
        raise DataError(f"{where}: missing field '{key}' (columns: {', '.join(sorted(row))})")
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return value


def detect_sft_layout(row: dict[str, Any], cfg: SFTDatasetConfig) -> str:
    if cfg.messages_column in row:
        return "messages"
    if cfg.prompt_column in row:
        return "prompt_completion"
    if cfg.text_column in row:
        return "text"
    raise DataError(f"{cfg.path}: cannot tell the layout from columns {sorted(row)}; set sft.dataset.layout "
                    f"and the column names")


def to_demonstration(row: dict[str, Any], layout: str, cfg: SFTDatasetConfig, where: str) -> dict[str, Any]:
    """{prompt, response}; a `text` row has the empty prompt (every token is a target)."""
    if layout == "prompt_completion":
        return {"prompt": _text(row, cfg.prompt_column, where), "response": _text(row, cfg.response_column, where)}
    if layout == "text":
        return {"prompt": "", "response": _text(row, cfg.text_column, where)}
    if cfg.messages_column not in row:
        raise DataError(f"{where}: missing field '{cfg.messages_column}'")
    msgs = _messages(row[cfg.messages_column], where, cfg.messages_column)
    if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
        raise DataError(f"{where}: field '{cfg.messages_column}' must end with the assistant's answer after "
                        f"at least one other message")
    return {"prompt": msgs[:-1], "response": msgs[-1]["content"]}


def to_prompt(row: dict[str, Any], layout: str, cfg: PromptDatasetConfig, where: str) -> Prompt:
    if layout == "prompt":
        return _text(row, cfg.prompt_column, where)
    if layout == "conversation":   # "\n\nHuman: ... \n\nAssistant: ..." : everything up to the last answer
        text = _text(row, cfg.conversation_column, where)
        cut = text.rfind(ASSISTANT_TURN)
        if cut < 0:
            raise DataError(f"{where}: field '{cfg.conversation_column}' has no '\\n\\nAssistant:' turn")
        return text[:cut + len(ASSISTANT_TURN)].strip()
    if cfg.messages_column not in row:
        raise DataError(f"{where}: missing field '{cfg.messages_column}'")
    msgs = _messages(row[cfg.messages_column], where, cfg.messages_column)
    if msgs[-1]["role"] == "assistant":   # a full conversation: prompt with everything before the answer
        msgs = msgs[:-1]
    if not msgs:
        raise DataError(f"{where}: field '{cfg.messages_column}' has no message before the assistant's")
    return msgs


def judge(params: Params):
    """The task's gold annotator, only while every input is the default task's own data."""
    from .tasks import get_judge
    own = params.sft.dataset.path is None and params.ppo.dataset.path is None and params.reward.dataset.path is None
    return get_judge(params.data.task) if own else None


def fit_lengths(items: list[T], length: Callable[[T], int], max_length: int, overlong: str,
                limit_key: str) -> tuple[list[T], int, int]:
    """Items within `max_length` tokens: longer ones are kept for truncation where they are
    encoded (`overlong: truncate`) or left out (`drop`). Returns the items and how many were
    truncated and dropped; none left is an error naming the limit's key."""
    kept, truncated, dropped = [], 0, 0
    for item in items:
        if length(item) > max_length:
            if overlong == "drop":
                dropped += 1
                continue
            truncated += 1
        kept.append(item)
    if not kept:
        raise DataError(f"every record is longer than {limit_key}={max_length}")
    return kept, truncated, dropped


def fit_prompts(prompts: list[Prompt], tok, max_length: int, overlong: str) -> tuple[list[Prompt], int, int]:
    """Prompts within `max_length` tokens after the chat template (the right end kept on truncation)."""
    from .tokenizer import encode_prompt
    return fit_lengths(prompts, lambda p: len(encode_prompt(tok, p)), max_length, overlong, "ppo.max_prompt_length")


def _user_rows(source: str, split: str, revision: str | None) -> list[tuple[str, dict]]:
    rows = _rows(source, split, revision)
    if not rows:
        raise DataError(f"{source}: no records")
    return rows


def demonstrations(params: Params, data_dir: Path, split: str) -> list[dict[str, Any]]:
    """SFT demonstrations of `split` ("train" or "eval")."""
    cfg = params.sft.dataset
    if cfg.path is None:
        return load_demonstrations(data_dir / ("sft_train.jsonl" if split == "train" else "sft_eval.jsonl"))
    rows = _user_rows(cfg.path, cfg.train_split if split == "train" else cfg.eval_split, cfg.revision)
    layout = detect_sft_layout(rows[0][1], cfg) if cfg.layout == "auto" else cfg.layout
    return [to_demonstration(row, layout, cfg, where) for where, row in rows]


def prompts(params: Params, data_dir: Path, split: str) -> list[Prompt]:
    """Prompts of `split`: "train" (PPO's) or "eval" (held-out, for SFT/RM/PPO/evaluate measurements)."""
    cfg = params.ppo.dataset
    if cfg.path is None:
        return load_prompts(data_dir / ("ppo_prompts.jsonl" if split == "train" else "eval_prompts.jsonl"))
    rows = _user_rows(cfg.path, cfg.train_split if split == "train" else cfg.eval_split, cfg.revision)
    layout = cfg.layout
    if layout == "auto":
        layout = "messages" if cfg.messages_column in rows[0][1] else "prompt"
    return [to_prompt(row, layout, cfg, where) for where, row in rows]
