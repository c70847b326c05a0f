"""Chat checkpoints shaped like Llama-3.1-Instruct and Qwen2.5-Instruct (tests/real_checkpoints.py):
no pad token, several end-of-response ids, chat templates with a system block. The pad token is one
of their own, long prompts keep the template's head and tail, and responses end at any end id."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from pipeline.config import ModelConfig
from pipeline.data.tokenizer import decode_response, end_ids, load_tokenizer, reusable_pad_token
from pipeline.models.checkpoints import init_policy, load_policy, save_checkpoint
from real_checkpoints import llama3_like, qwen25_like


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {"llama3": llama3_like(root / "llama3"), "qwen25": qwen25_like(root / "qwen25")}


# ---- Pad token ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, pad", [("llama3", "<|finetune_right_pad_id|>"), ("qwen25", "<|vision_pad|>")])
def test_missing_pad_reuses_a_special_token_and_keeps_the_vocabulary(ckpts, shape, pad, tmp_path, caplog):
    folder = ckpts[shape]
    saved = AutoTokenizer.from_pretrained(str(folder))
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert saved.pad_token is None and rows == len(saved)
    with caplog.at_level(logging.WARNING):
        model, tok = init_policy(ModelConfig(name_or_path=str(folder)), tmp_path, seed=0)
    assert tok.pad_token == pad and tok.pad_token_id == saved.convert_tokens_to_ids(pad)
    assert len(tok) == len(saved)
    assert model.get_input_embeddings().weight.size(0) == model.get_output_embeddings().weight.size(0) == rows
    assert model.config.pad_token_id == tok.pad_token_id
    assert tok.pad_token_id not in end_ids(tok, model) + [tok.bos_token_id]
    assert [r.getMessage() for r in caplog.records if "pad token" in r.getMessage()] == [
        f"{folder}: the tokenizer had no pad token; reusing its token {pad!r} (id {tok.pad_token_id}) as pad, "
        f"the vocabulary is unchanged"]
    # The choice travels with the checkpoint a stage writes, so later stages pad alike.
    save_checkpoint(model, tok, tmp_path / "sft")
    _, again = load_policy(tmp_path / "sft")
    assert (again.pad_token, len(again)) == (pad, len(saved))


def _specials_tokenizer(specials: list[str], eos: str, bos: str | None = None,
                        unk: str | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary holds a plain word containing "pad" and the given special tokens."""
    tok = Tokenizer(models.WordLevel({"hello": 0, "padding": 1}, unk_token="hello"))
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, unk_token=unk)


def test_pad_choice_prefers_a_pad_token_then_a_reserved_one_then_unk_and_never_eos_or_bos():
    pick = lambda specials, **named: reusable_pad_token(_specials_tokenizer(specials, **named))   # noqa: E731
    assert pick(["<s>", "</s>", "<|reserved_special_token_0|>", "<|fim_pad|>", "<unk>"],
                eos="</s>", bos="<s>", unk="<unk>") == "<|fim_pad|>"
    assert pick(["<s>", "</s>", "<unk>", "<|reserved_special_token_5|>", "<|reserved_special_token_2|>"],
                eos="</s>", bos="<s>", unk="<unk>") == "<|reserved_special_token_5|>"   # the first by id
    assert pick(["<s>", "</s>", "<unk>"], eos="</s>", bos="<s>", unk="<unk>") == "<unk>"
    # GPT-2: its unk is its eos; a plain word "padding" is not a special token.
    assert pick(["<|endoftext|>"], eos="<|endoftext|>", bos="<|endoftext|>", unk="<|endoftext|>") is None
    assert pick(["<pad_eos>"], eos="<pad_eos>") is None


def test_without_a_spare_token_a_new_pad_token_is_added(tmp_path, caplog):
    _specials_tokenizer(["<|endoftext|>"], eos="<|endoftext|>", unk="<|endoftext|>").save_pretrained(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(tmp_path, add_pad=True)
    assert (tok.pad_token, tok.pad_token_id, len(tok)) == ("<pad>", 3, 4)
    assert "had no pad token; added '<pad>' as a new token (id 3)" in caplog.text


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
