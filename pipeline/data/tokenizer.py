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
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..errors import CheckpointError, loading
from .io import check_folder

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
RESPONSE_MARKER = "Response:"


def format_prompt(prompt: str) -> str:
    """The plain prompt format shared by SFT, RM, PPO and evaluation."""
    return f"{prompt}\n{RESPONSE_MARKER}"


def build_word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words` plus the format's marker and the special tokens."""
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
    With `max_length`, a longer prompt keeps its right end (the part next to the response)."""
    ids = _encode_prompt(tok, prompt)
    return ids[-max_length:] if max_length is not None else ids


def _encode_prompt(tok: PreTrainedTokenizerBase, prompt: "str | list[dict[str, str]]") -> list[int]:
    if isinstance(prompt, str) and not prompt:
        return [tok.bos_token_id] if tok.bos_token_id is not None else []
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(format_prompt(prompt_text(prompt)), add_special_tokens=True)["input_ids"]


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
