"""Chat checkpoints shaped like Llama-3.1-Instruct and Qwen2.5-Instruct (tests/real_checkpoints.py):
no pad token, several end-of-response ids, chat templates with a system block. The pad token is one
of their own, long prompts keep the template's head and tail, and responses end at any end id."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from pipeline.data.tokenizer import decode_response, end_ids, load_tokenizer
from real_checkpoints import llama3_like, qwen25_like


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {"llama3": llama3_like(root / "llama3"), "qwen25": qwen25_like(root / "qwen25")}


# ---- End of response -----------------------------------------------------------------------------


def test_end_ids_are_the_tokenizer_eos_then_the_generation_config_ones(ckpts):
    for shape, names in (("llama3", ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]),
                         ("qwen25", ["<|im_end|>", "<|endoftext|>"])):
        tok = load_tokenizer(ckpts[shape], add_pad=True)
        model = AutoModelForCausalLM.from_pretrained(str(ckpts[shape]))
        assert end_ids(tok, model) == tok.convert_tokens_to_ids(names)
        assert end_ids(tok) == [tok.eos_token_id]
        model.generation_config.eos_token_id = tok.eos_token_id     # one int, the tokenizer's own
        assert end_ids(tok, model) == [tok.eos_token_id]


def test_decode_response_cuts_at_any_end_id(ckpts):
    tok = load_tokenizer(ckpts["llama3"], add_pad=True)
    ends = end_ids(tok, AutoModelForCausalLM.from_pretrained(str(ckpts["llama3"])))
    first = tok("the plot was good .", add_special_tokens=False)["input_ids"]
    rest = tok(" the music was bad .", add_special_tokens=False)["input_ids"]
    for end in ends:
        assert decode_response(tok, first + [end] + rest + [tok.pad_token_id] * 3, ends) == "the plot was good ."
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    # Without end ids only the tokenizer's eos ends a response, as always; other specials are skipped.
    assert decode_response(tok, first + [eom] + rest) == "the plot was good . the music was bad ."
    assert decode_response(tok, first + [tok.eos_token_id] + rest) == "the plot was good ."
    assert decode_response(tok, first + rest, ends) == "the plot was good . the music was bad ."
