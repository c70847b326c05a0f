"""The default tokenizer and the prompt/response format every stage shares.

The default task's language is closed (a few hundred words), so a word-level tokenizer covers it
exactly and keeps sequences short: a review is ~25 tokens instead of ~40 with BPE, which is what
lets the whole pipeline run in minutes on two cores. It is saved as a `PreTrainedTokenizerFast`, so
every stage (and any user) loads it with `AutoTokenizer.from_pretrained`.

Format: `<bos> {prompt}\nResponse: {response} <eos>`. The prompt part is tokenized with special
tokens (adds bos) and the response part without, then eos is appended; tokenizing the two parts
separately means a response token never merges with the prompt's last token.

When the tokenizer has a chat template (a chat model's), the prompt is rendered with it instead,
as one user message or as the given list of messages, with the generation prompt added, so the
response follows the assistant header exactly as at inference. Every stage encodes prompts
through `encode_prompt`, so the format is the same in SFT, RM, PPO and evaluation.

A prompt cut to a token limit keeps the template's head (bos, system block, headers) and tail (end
of turn and generation prompt, or `\nResponse:`) and loses the left end of the user text: the model
always sees the format it was tuned on, and the words next to the response.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING


from ..errors import CheckpointError, DataError, loading
from ..files import check_folder

if TYPE_CHECKING:   # imported where used (pipeline/models/checkpoints.py says why)
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
RESPONSE_MARKER = "Response:"


def format_prompt(prompt: str) -> str:
    """The plain prompt format shared by SFT, RM, PPO and evaluation."""
    return f"{prompt}\n{RESPONSE_MARKER}"


def build_word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words` plus the format's marker and the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in [PAD, BOS, EOS, UNK, *words, "Response", ":"]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Split on whitespace and punctuation: "Response:" -> "Response", ":".
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="right", model_max_length=1024, clean_up_tokenization_spaces=False)


def prepared_tokenizer(data_dir: str | Path) -> Path:
    """The tokenizer the prepare stage writes into its folder `data_dir`. Not there yet (a fresh
    clone, or another --data) is said as such: the loader would take the missing path for a hub
    id and fail on its form."""
    path = Path(data_dir) / "tokenizer"
    if not path.exists():
        raise DataError(f"{path} does not exist yet: the prepare stage writes it; run `dvc repro prepare` "
                        f"(or `python -m pipeline prepare --out {data_dir}`) first")
    return path


def reusable_pad_token(tok: PreTrainedTokenizerBase) -> str | None:
    """A token `tok` already has that can serve as pad, so the vocabulary and the model's embeddings
    stay as they are: the first special token whose text contains "pad" (Llama-3.1's
    `<|finetune_right_pad_id|>`, Qwen2.5's `<|vision_pad|>`), else the first reserved special token
    (Llama-3's `<|reserved_special_token_N|>`), else unk; None when there is none. Never eos or bos:
    both are real inputs (chat templates end every turn with eos), and a model config's
    `pad_token_id` becomes its embedding's `padding_idx`, whose row then gets no gradient."""
    taken = {tok.eos_token_id, tok.bos_token_id}
    special = [t.content for i, t in sorted(tok.added_tokens_decoder.items()) if t.special and i not in taken]
    for word in ("pad", "reserved"):
        found = next((text for text in special if word in text.lower()), None)
        if found is not None:
            return found
    if tok.unk_token is not None and tok.unk_token_id not in taken:
        return tok.unk_token
    return None


def load_tokenizer(path: str | Path, trust_remote_code: bool = False,
                   add_pad: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer and check the special tokens the pipeline relies on. With `add_pad` (a
    model entering the pipeline), a missing pad token is one the tokenizer already has
    (`reusable_pad_token`), or else a new token; only then does the caller resize the model's
    embeddings (models.init_policy). Either way one warning names the token."""
    from transformers import AutoTokenizer

    check_folder(path)
    with loading(path, "the tokenizer"):
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise CheckpointError(f"{path}: tokenizer has no eos token; the pipeline needs one to end responses")
    if tok.pad_token_id is None:
        if not add_pad:
            raise CheckpointError(f"{path}: tokenizer has no pad token; set one (e.g. pad = eos) and save it again")
        reused = reusable_pad_token(tok)
        if reused is not None:
            tok.pad_token = reused
            log.warning("%s: the tokenizer had no pad token; reusing its token %r (id %d) as pad, the vocabulary "
                        "is unchanged", path, reused, tok.pad_token_id)
        else:
            tok.add_special_tokens({"pad_token": PAD})
            log.warning("%s: the tokenizer had no pad token; added %r as a new token (id %d) and the model's "
                        "embeddings are resized to match", path, PAD, tok.pad_token_id)
    return tok


def as_messages(prompt: "str | list[dict[str, str]]") -> list[dict[str, str]]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def prompt_text(prompt: "str | list[dict[str, str]]") -> str:
    """A prompt as plain text (chat messages as `role: content` lines)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def encode_prompt(tok: PreTrainedTokenizerBase, prompt: "str | list[dict[str, str]]",
                  max_length: int | None = None) -> list[int]:
    """Token ids of a prompt up to where the response starts: the chat template with its
    generation prompt when the tokenizer has one, else the plain format (`{prompt}\nResponse:`).
    The empty prompt (a `text`-layout demonstration) is just bos, when the tokenizer has one.
    With `max_length`, a longer prompt keeps the template's head and tail whole and the right end
    of the user text (`prompt_parts`); a DataError when head and tail alone are longer. A prompt
    within the limit is never re-tokenized in parts."""
    ids = _encode_prompt(tok, prompt)
    if max_length is None or len(ids) <= max_length:
        return ids
    head, text, tail = prompt_parts(tok, prompt)
    room = max_length - len(head) - len(tail)
    if room < 0:
        raise DataError(f"a prompt of {len(ids)} tokens cannot be cut to {max_length}: its template around the user "
                        f"text alone is {len(head)} + {len(tail)} tokens")
    return head + text[len(text) - room:] + tail


def cut_prompt(tok: PreTrainedTokenizerBase, prompt: "str | list[dict[str, str]]", room: int,
               ids: list[int] | None = None) -> list[int]:
    """A prompt's ids within `room` tokens, for an example whose response takes the rest: whole when
    it fits; else the template's head and tail with the right end of the user text (as
    `encode_prompt` cuts); else, when even head and tail exceed `room`, the right end of the ids
    (the tokens next to the response), where refusing is no option (scoring a rollout).
    `ids`: the prompt's ids when the caller has them already."""
    ids = _encode_prompt(tok, prompt) if ids is None else ids
    if len(ids) <= room:
        return list(ids)
    head, text, tail = prompt_parts(tok, prompt)
    if len(head) + len(tail) <= room:
        return head + text[len(text) - (room - len(head) - len(tail)):] + tail
    return list(ids[len(ids) - room:]) if room > 0 else []


def _encode_prompt(tok: PreTrainedTokenizerBase, prompt: "str | list[dict[str, str]]") -> list[int]:
    if isinstance(prompt, str) and not prompt:
        return [tok.bos_token_id] if tok.bos_token_id is not None else []
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(format_prompt(prompt_text(prompt)), add_special_tokens=True)["input_ids"]


# Stands in for the user text when the template is rendered to find its head and tail; it must
# survive Jinja filters such as `trim` and never occur in a real prompt.
_USER_TEXT = "USERTEXTGOESHERE7f3a9c"


def _render(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_parts(tok: PreTrainedTokenizerBase,
                 prompt: "str | list[dict[str, str]]") -> tuple[list[int], list[int], list[int]]:
    """(head, text, tail) ids of a prompt, the pieces `encode_prompt` truncates: the text is the
    last user message's content (the last message's when none is the user's) as the template
    renders it, or the whole plain prompt; the head is everything before it (bos, system block,
    earlier turns, the user header) and the tail everything after (end of turn and the generation
    prompt, or `\nResponse:`). Each piece is tokenized alone, so at the two seams the ids may differ
    from `encode_prompt`'s; they are only for a prompt that must be cut anyway."""
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]   # noqa: E731
    if getattr(tok, "chat_template", None):
        messages = as_messages(prompt)
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        k = users[-1] if users else len(messages) - 1
        marked = [*messages[:k], {**messages[k], "content": _USER_TEXT}, *messages[k + 1:]]
        pieces = _render(tok, marked).split(_USER_TEXT)
        whole = _render(tok, messages)
        if (len(pieces) != 2 or len(whole) < len(pieces[0]) + len(pieces[1])
                or not (whole.startswith(pieces[0]) and whole.endswith(pieces[1]))):
            raise DataError(f"{tok.name_or_path}: the chat template does not render the user message once and "
                            f"as given, so a prompt over the limit cannot be cut inside it")
        head, tail = pieces
        return encode(head), encode(whole[len(head):len(whole) - len(tail)]), encode(tail)
    text = prompt_text(prompt)
    body = encode(format_prompt(text))
    whole = tok(format_prompt(text), add_special_tokens=True)["input_ids"]
    # The tokenizer's own special tokens (bos) sit around the body: find where it starts.
    start = next((i for i in range(len(whole) - len(body) + 1) if whole[i:i + len(body)] == body), None)
    if start is None:
        raise DataError(f"{tok.name_or_path}: the tokenizer's special tokens change the prompt's ids, so a prompt "
                        f"over the limit cannot be cut")
    return whole[:start], encode(text), encode(f"\n{RESPONSE_MARKER}") + whole[start + len(body):]


def encode_response(tok: PreTrainedTokenizerBase, response: str) -> list[int]:
    """Response ids followed by eos: the end of response the policy must learn to emit."""
    return tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def end_ids(tok: PreTrainedTokenizerBase, model=None) -> list[int]:
    """Ids that end a response: the tokenizer's eos, then each id of the model's
    `generation_config.eos_token_id` (an int or a list), each once, in that order. Chat models
    stop on more than one token, as `generate` does with that list: Llama-3.1-Instruct lists
    <|end_of_text|>, <|eom_id|> and <|eot_id|>, Qwen2.5-Instruct <|im_end|> and <|endoftext|>."""
    ids = [tok.eos_token_id]
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if listed is not None:
        ids += [listed] if isinstance(listed, int) else list(listed)
    return list(dict.fromkeys(int(i) for i in ids))


def decode_response(tok: PreTrainedTokenizerBase, ids: list[int], end_ids: list[int] | None = None) -> str:
    """Text of generated ids, cut at the first of `end_ids` (default: the tokenizer's eos); pads
    and the end token are not part of the text."""
    ends = {tok.eos_token_id} if end_ids is None else set(end_ids)
    cut = next((i for i, t in enumerate(ids) if t in ends), len(ids))
    return tok.decode(ids[:cut], skip_special_tokens=True).strip()
