"""Where each stage's demonstrations and prompts come from: the prepared default task, or the
user's own dataset named in params.

- SFT demonstrations (`sft.dataset`): layouts `prompt_completion` (a prompt and a completion
  column), `text` (one text column; trained on every token), or `messages` (a list of chat
  messages whose last one is the assistant's answer), `auto` to detect from the columns.
- RL training and held-out prompts (`prompts.dataset`): layouts `prompt` (a text column) or `messages` (the
  conversation so far; a trailing assistant message is dropped).

Column names are mappable in params. Sources go through `datasets` like the preference pairs (see
preferences.py): a hub id with split and revision, a folder saved with `save_to_disk`, or local
JSONL/JSON/Parquet/CSV files; a bad record is reported as `file:line:` (JSONL) or `source: row N:`.

A prompt is a string, or a list of `{role, content}` messages (rendered with the tokenizer's chat
template where it has one: see tokenizer.encode_prompt).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Hashable, TypeVar, Union

from ..config import Params, PreferenceDataConfig, PromptDatasetConfig, SFTDatasetConfig
from .records import load_demonstrations, load_prompts
from ..errors import ConfigError, DataError
from ..files import nonempty_text
from .preferences import ASSISTANT_TURN, Pair, _rows, load_pairs

Prompt = Union[str, list[dict[str, str]]]
T = TypeVar("T")
log = logging.getLogger(__name__)


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
    return nonempty_text(row[key], where, key)


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
    """The task's gold annotator when `prompts.gold_judge` asks for it (config refuses it with a
    dataset of the user's own); None: measurements report RM scores only."""
    from ..tasks import get_judge
    return get_judge(params.data.task) if params.prompts.gold_judge else None


def fit_lengths(items: list[T], length: Callable[[T], int], max_length: int, overlong: str,
                limit_key: str, where: Callable[[T], str] | None = None) -> tuple[list[T], int, int]:
    """Items within `max_length` tokens: longer ones are kept for truncation where they are
    encoded (`overlong: truncate`), left out (`drop`), or an error naming the record (`error`).
    Returns the items and how many were truncated and dropped; none left is an error naming the
    limit's key."""
    kept, truncated, dropped = [], 0, 0
    for i, item in enumerate(items):
        n = length(item)
        if n > max_length:
            if overlong == "error":
                name = where(item) if where is not None else f"record {i + 1}"
                raise DataError(f"{name}: {n} tokens exceed {limit_key}={max_length} (overlong: truncate or drop "
                                f"accepts such records)")
            if overlong == "drop":
                dropped += 1
                continue
            truncated += 1
        kept.append(item)
    if not kept:
        raise DataError(f"every record is longer than {limit_key}={max_length}")
    return kept, truncated, dropped


def fit_prompts(records: list[tuple[str, Prompt]], tok, max_length: int, overlong: str,
                limit_key: str) -> tuple[list[Prompt], int, int]:
    """Prompts of `(where, prompt)` records within `max_length` tokens after the chat template.
    A longer one is cut where it is encoded (`overlong: truncate`; tokenizer.encode_prompt keeps
    the template's head and tail and the right end of the user text), left out (`drop`) or an
    error (`error`); `limit_key` names the limit's params key in errors. A prompt whose template around the user text is alone longer than the limit
    cannot be cut that way: an error naming it under `truncate` too, since leaving it out would
    quietly do what `drop` says (a long system message usually makes every prompt so)."""
    from .tokenizer import encode_prompt, prompt_parts
    sized = [(where, p, len(encode_prompt(tok, p))) for where, p in records]
    kept, truncated, dropped = fit_lengths(sized, lambda r: r[2], max_length, overlong, limit_key,
                                           where=lambda r: r[0])
    for where, p, n in kept:
        if n > max_length:
            head, _, tail = prompt_parts(tok, p)
            if len(head) + len(tail) > max_length:
                raise DataError(f"{where}: the prompt template around the user text is {len(head)} + {len(tail)} "
                                f"tokens, over {limit_key}={max_length}, so truncation cannot fit it "
                                f"(raise the limit, or overlong: drop leaves such prompts out)")
    return [p for _, p, _ in kept], truncated, dropped


def _user_rows(cfg: SFTDatasetConfig | PromptDatasetConfig, split: str,
               section: str) -> list[tuple[str, dict]]:
    """(where, record) of the "train" or "eval" split of a user's dataset section (`path`,
    `train_split`, `eval_split`, `revision`), `section` its key (`sft.dataset`)."""
    split_name = cfg.train_split if split == "train" else cfg.eval_split
    rows = _rows(cfg.path, split_name, cfg.revision, f"{section}.path")
    if not rows:
        raise DataError(f"{cfg.path}: no records")
    return rows


def demonstrations(params: Params, data_dir: Path, split: str) -> list[dict[str, Any]]:
    """SFT demonstrations of `split` ("train" or "eval"): {prompt, response, where}. The eval split
    is checked against the train split for leaked records (`sft.dataset.leakage`)."""
    cfg = params.sft.dataset
    if split == "eval":
        train = demonstrations(params, data_dir, "train")
    if cfg.path is None:
        rows = load_demonstrations(data_dir / ("sft_train.jsonl" if split == "train" else "sft_eval.jsonl"))
    else:
        raw = _user_rows(cfg, split, "sft.dataset")
        layout = detect_sft_layout(raw[0][1], cfg) if cfg.layout == "auto" else cfg.layout
        rows = [{**to_demonstration(row, layout, cfg, where), "where": where} for where, row in raw]
    if split == "eval":
        key = lambda r: (prompt_key(r["prompt"]), r["response"])   # noqa: E731
        rows = held_out([(r["where"], key(r)) for r in train], rows, [(r["where"], key(r)) for r in rows],
                        cfg.leakage, "sft.dataset.leakage", "demonstration")
    return rows


def prompt_records(params: Params, data_dir: Path, split: str) -> list[tuple[str, Prompt]]:
    """(where, prompt) of `split` of `prompts.dataset`: "train" (the RL stages') or "eval" (held-out,
    for every measurement; checked against the train split for leaked prompts, `prompts.dataset.leakage`)."""
    cfg = params.prompts.dataset
    if cfg.path is None:
        records = load_prompts(data_dir / ("ppo_prompts.jsonl" if split == "train" else "eval_prompts.jsonl"))
    else:
        rows = _user_rows(cfg, split, "prompts.dataset")
        layout = cfg.layout
        if layout == "auto":
            layout = "messages" if cfg.messages_column in rows[0][1] else "prompt"
        records = [(where, to_prompt(row, layout, cfg, where)) for where, row in rows]
    if split == "eval":
        train = [(where, prompt_key(p)) for where, p in prompt_records(params, data_dir, "train")]
        records = held_out(train, records, [(where, prompt_key(p)) for where, p in records], cfg.leakage,
                           "prompts.dataset.leakage", "prompt")
    return records


def prompts(params: Params, data_dir: Path, split: str) -> list[Prompt]:
    """The prompts of `prompt_records`."""
    return [p for _, p in prompt_records(params, data_dir, split)]


def prompt_key(prompt: Prompt) -> str:
    """A prompt (text or messages) as a hashable key, for leakage checks."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def held_out(train: list[tuple[str, Hashable]], records: list[T], keys: list[tuple[str, Hashable]], policy: str,
             param: str, what: str) -> list[T]:
    """Held-out `records` (with their `(where, key)`) that are not also training records
    (`train`: `(where, key)` of each). A shared one is
    train/eval leakage: an error naming both places (`policy: error`), or left out of the held-out
    set (`drop`, logged with the count); none left is an error."""
    first: dict[Hashable, str] = {}
    for where, key in train:
        first.setdefault(key, where)
    kept = []
    for record, (where, key) in zip(records, keys):
        if key in first:
            if policy == "error":
                raise DataError(f"{where}: the same {what} is in the training split at {first[key]} (train/eval "
                                f"leakage; {param}: drop leaves such records out of evaluation)")
            continue
        kept.append(record)
    if len(kept) < len(records):
        log.warning("%s: left %d of %d held-out %ss out, they are also training records", param,
                    len(records) - len(kept), len(records), what)
    if not kept:
        raise DataError(f"{param}: every held-out {what} is also a training record")
    return kept


PREPARED_PAIR_FIELDS = ("prompt", "chosen", "rejected", "id")


def preference_pairs(ds: PreferenceDataConfig, data_dir: Path, section: str) -> tuple[list[Pair], list[Pair]]:
    """Training and held-out pairs of a `<section>.dataset` (reward, dpo): the prepared pairs when
    its path is null; a held-out pair that is also a training pair is leakage
    (`<section>.dataset.leakage`)."""
    if ds.path is None:
        fields = PREPARED_PAIR_FIELDS + ((ds.margin_column,) if ds.margin_column else ())
        train, held = (load_pairs(data_dir / name, layout=ds.layout, margin_column=ds.margin_column, allowed=fields)
                       for name in ("pairs_train.jsonl", "pairs_eval.jsonl"))
    else:
        train, held = (load_pairs(ds.path, split, ds.revision, ds.layout, ds.margin_column,
                                  key=f"{section}.dataset.path") for split in (ds.train_split, ds.eval_split))
    key = lambda p: (prompt_key(p.prompt), p.chosen, p.rejected)   # noqa: E731
    held = held_out([(p.where, key(p)) for p in train], held, [(p.where, key(p)) for p in held],
                    ds.leakage, f"{section}.dataset.leakage", "pair")
    return train, held


def validation_pairs(ds: PreferenceDataConfig, data_dir: Path, train: list[Pair], holdout: float,
                     key: str) -> tuple[list[Pair], list[Pair]]:
    """Training and validation pairs for a check on training titles (reward.restart): prepare's
    pairs_val.jsonl (fresh pairs of the training titles, the training pairs untouched) when the
    pairs are the prepared ones; else the training pairs whose prompt falls in the `holdout` share
    (by a stable hash of the prompt, so a prompt's pairs are all on one side), taken out of
    training. `key`: the setting to name when neither is there."""
    import hashlib
    if ds.path is None:
        path = data_dir / "pairs_val.jsonl"
        if not path.exists():
            raise DataError(f"{path}: missing; the restart check reads it (prepare writes it with data.n_val_pairs > 0), "
                            f"or set {key}.min_accuracy: null")
        fields = PREPARED_PAIR_FIELDS + ((ds.margin_column,) if ds.margin_column else ())
        return train, load_pairs(path, layout=ds.layout, margin_column=ds.margin_column, allowed=fields)
    if holdout <= 0:
        raise ConfigError(f"{key}.holdout: 0 with {key.split('.')[0]}.dataset.path set: the check needs validation pairs "
                        f"of your training prompts; set {key}.holdout (e.g. 0.02) and a {key}.min_accuracy for your "
                        f"pairs, or {key}.min_accuracy: null")
    bucket = lambda p: int(hashlib.sha256(prompt_key(p.prompt).encode()).hexdigest()[:8], 16) / 16**8  # noqa: E731
    kept, val = [p for p in train if bucket(p) >= holdout], [p for p in train if bucket(p) < holdout]
    if not val or not kept:
        raise DataError(f"{key}.holdout: {holdout} leaves {len(val)} validation and {len(kept)} training pairs "
                        f"of {len(train)}; both must be non-empty")
    return kept, val
