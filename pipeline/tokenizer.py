"""The default tokenizer and the prompt/response format every stage shares.

The default task's language is closed (a few hundred words), so a word-level tokenizer covers it
exactly and keeps sequences short: a review is ~25 tokens instead of ~40 with BPE, which is what
lets the whole pipeline run in minutes on two cores. It is saved as a `PreTrainedTokenizerFast`, so
every stage (and any user) loads it with `AutoTokenizer.from_pretrained`.

Format: `<bos> {prompt}\nResponse: {response} <eos>`. The prompt part is tokenized with special
tokens (adds bos) and the response part without, then eos is appended; tokenizing the two parts
separately means a response token never merges with the prompt's last token.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .errors import CheckpointError

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


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer and check the special tokens the pipeline relies on."""
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise CheckpointError(f"{path}: tokenizer has no eos token; the pipeline needs one to end responses")
    if tok.pad_token_id is None:
        raise CheckpointError(f"{path}: tokenizer has no pad token; set one (e.g. pad = eos) and save it again")
    return tok


def encode_prompt(tok: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    return tok(format_prompt(prompt), add_special_tokens=True)["input_ids"]


def encode_response(tok: PreTrainedTokenizerBase, response: str) -> list[int]:
    """Response ids followed by eos: the end of response the policy must learn to emit."""
    return tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def decode_response(tok: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text of generated ids, cut at the first eos (pads and eos are not part of the text)."""
    if tok.eos_token_id in ids:
        ids = ids[:ids.index(tok.eos_token_id)]
    return tok.decode(ids, skip_special_tokens=True).strip()
