"""Chat checkpoints shaped like Llama-3.1-Instruct and Qwen2.5-Instruct (tests/helpers/real_checkpoints.py):
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
from pipeline.data import inputs
from pipeline.data.tokenizer import (as_messages, build_word_tokenizer, decode_response, encode_prompt, end_ids,
                                     load_tokenizer, reusable_pad_token)
from pipeline.errors import DataError
from pipeline.models.checkpoints import init_policy, load_policy, save_checkpoint
from pipeline.tasks import reviews
from real_checkpoints import QWEN25_DEFAULT_SYSTEM, llama3_like, qwen25_like

# A user text of ~150 tokens under both tokenizers: a dozen of the default task's prompts.
LONG = " ".join(reviews.make_prompt(title, "plot", 1) for title in reviews.TITLES[:12])
SHORT = "Review the film Lost River . Focus on the plot ."
SYSTEM = "Answer in one sentence."

LLAMA3_HEAD = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday is 1 March 2025.\n\n" + SYSTEM
               + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n")
LLAMA3_TAIL = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
QWEN25_SYSTEM_BLOCK = f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n"
QWEN25_TAIL = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {"llama3": llama3_like(root / "llama3"), "qwen25": qwen25_like(root / "qwen25")}


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _templated(tok, prompt) -> list[int]:
    """The prompt's ids as they were always made: the whole rendered template, tokenized once."""
    return tok(tok.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


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


# ---- Prompt truncation ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape, messages, head, tail", [
    ("llama3", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG}], LLAMA3_HEAD, LLAMA3_TAIL),
    ("qwen25", [{"role": "user", "content": LONG}], QWEN25_SYSTEM_BLOCK + "<|im_start|>user\n", QWEN25_TAIL),
    ("qwen25", [{"role": "user", "content": SHORT}, {"role": "assistant", "content": "the plot was good ."},
                {"role": "user", "content": LONG}],
     QWEN25_SYSTEM_BLOCK + f"<|im_start|>user\n{SHORT}<|im_end|>\n<|im_start|>assistant\nthe plot was good ."
                           "<|im_end|>\n<|im_start|>user\n", QWEN25_TAIL),
], ids=["llama3-system", "qwen25-default-system", "qwen25-multi-turn"])
def test_truncation_keeps_the_template_head_and_tail_and_cuts_the_last_user_text_from_the_left(
        ckpts, shape, messages, head, tail):
    tok = load_tokenizer(ckpts[shape], add_pad=True)
    full = encode_prompt(tok, messages)
    limit = len(full) - 40
    ids = encode_prompt(tok, messages, limit)
    assert len(ids) == limit
    text = _text(tok, ids)
    assert text.startswith(head) and text.endswith(tail)
    kept = text[len(head):len(text) - len(tail)]
    assert LONG.endswith(kept) and 0 < len(kept) < len(LONG) - 100
    if tok.bos_token_id is not None:
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    # Keeping the right end of the ids, as before, lost bos and the system block.
    assert not _text(tok, full[-limit:]).startswith(head[:20])


def test_plain_format_truncation_keeps_bos_and_the_response_marker():
    tok = build_word_tokenizer(reviews.vocabulary())
    ids = encode_prompt(tok, LONG, 20)
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", *LONG.split()[-17:], "Response", ":"]
    assert encode_prompt(tok, SHORT, 20) == encode_prompt(tok, SHORT)


def test_plain_format_truncation_with_a_byte_level_bpe(ckpts):
    tok = load_tokenizer(ckpts["llama3"], add_pad=True)
    tok.chat_template = None                      # the base model's plain format; bos from the post-processor
    full = encode_prompt(tok, LONG)
    ids = encode_prompt(tok, LONG, 30)
    assert len(full) > 30 == len(ids) and ids[0] == tok.bos_token_id
    text = _text(tok, ids)
    assert text.startswith("<|begin_of_text|>") and text.endswith("\nResponse:")
    kept = text[len("<|begin_of_text|>"):-len("\nResponse:")]
    assert LONG.endswith(kept) and len(kept) > 20


@pytest.mark.parametrize("shape", ["llama3", "qwen25"])
def test_prompts_within_the_limit_encode_as_the_whole_template_tokenized(ckpts, shape):
    tok = load_tokenizer(ckpts[shape], add_pad=True)
    for prompt in (SHORT, LONG, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SHORT}],
                   [{"role": "user", "content": SHORT}, {"role": "assistant", "content": "the plot was good ."},
                    {"role": "user", "content": "  And the music ?  "}]):
        expected = _templated(tok, prompt)
        assert encode_prompt(tok, prompt) == expected
        assert encode_prompt(tok, prompt, len(expected)) == expected
        assert encode_prompt(tok, prompt, 100_000) == expected


def test_a_prompt_whose_template_alone_is_over_the_limit_cannot_be_truncated(ckpts):
    tok = load_tokenizer(ckpts["llama3"], add_pad=True)
    big_system = [{"role": "system", "content": LONG}, {"role": "user", "content": SHORT}]
    long_user = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG}]
    short = [{"role": "user", "content": SHORT}]
    limit = len(encode_prompt(tok, short)) + 5
    assert len(encode_prompt(tok, long_user)) > limit
    records = [("p.jsonl:1", short), ("p.jsonl:2", long_user), ("p.jsonl:3", big_system)]
    with pytest.raises(DataError, match=r"^p.jsonl:3: the prompt template around the user text is \d+ \+ 8 tokens, "
                                        rf"over ppo.max_prompt_length={limit}, so truncation cannot fit it"):
        inputs.fit_prompts(records, tok, limit, "truncate", "ppo.max_prompt_length")
    assert inputs.fit_prompts(records[:2], tok, limit, "truncate", "ppo.max_prompt_length") == ([short, long_user], 1, 0)
    assert inputs.fit_prompts(records, tok, limit, "drop", "ppo.max_prompt_length") == ([short], 0, 2)
    with pytest.raises(DataError, match=rf"^p.jsonl:2: \d+ tokens exceed ppo.max_prompt_length={limit}"):
        inputs.fit_prompts(records, tok, limit, "error", "ppo.max_prompt_length")
    with pytest.raises(DataError, match=rf"cannot be cut to {limit}: its template around the user text alone"):
        encode_prompt(tok, big_system, limit)


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


# ---- Sampling ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["llama3", "qwen25"])
def test_a_response_ends_at_a_generation_config_eos_that_is_not_the_tokenizers(ckpts, shape):
    """The sampler stops at every end id: with the model pushed towards the generation_config's
    last eos (Llama-3.1's <|eom_id|>-style, Qwen2.5's <|endoftext|>), not the tokenizer's, rollouts
    end there, the id is the response's last token, and the text stops before it."""
    import torch

    from pipeline.config import SamplingConfig
    from pipeline.measurement.policy import measure
    from pipeline.ppo.rollout import rollout
    model, tok = init_policy(ModelConfig(name_or_path=str(ckpts[shape])), Path("unused"), seed=0)
    others = end_ids(tok, model)[1:]   # the generation_config's, beyond the tokenizer's eos
    assert others and tok.eos_token_id not in others
    bias = torch.zeros(model.config.vocab_size)
    bias[others], bias[tok.eos_token_id] = 8.0, -30.0   # the other end ids likely, the tokenizer's never
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    ro = rollout(model.eval(), tok, [SHORT] * 4, SamplingConfig(max_new_tokens=24), torch.Generator().manual_seed(0))
    assert ro.ended.all()
    last = ro.response_mask.sum(1) - 1
    assert set(ro.input_ids[:, ro.n_prompt:].gather(1, last[:, None]).flatten().tolist()) <= set(others)
    assert all(not any(t in r for t in tok.convert_ids_to_tokens(others)) for r in ro.responses)
    assert measure(model, tok, [SHORT] * 4, SamplingConfig(max_new_tokens=24), seed=1).ended == [True] * 4
