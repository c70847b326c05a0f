"""Your own model and data through params alone: dataset layouts and column mapping, chat templates,
pad tokens, dtype and attention settings, two model families (GPT-2 with a byte-level BPE
tokenizer and no pad; Llama with a chat template) through SFT -> RM -> PPO, and a policy paired with
a reward model whose tokenizer differs. Every model and file here is written by the tests."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast)

from conftest import REPO, TINY, merge, run_env, write_params
from pipeline.data import inputs
from pipeline.config import ModelConfig, Params, from_dict
from pipeline.data.records import tokenize_demonstrations
from pipeline.errors import DataError
from pipeline.models.checkpoints import init_policy
from pipeline.models.reward_model import encode_pair_text
from pipeline.tasks import reviews
from pipeline.data.tokenizer import build_word_tokenizer, encode_prompt, load_tokenizer

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}< | {{ m['role'] }} | > {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}< | assistant | >{% endif %}")


def _examples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    import random
    rng = random.Random(seed)
    out = []
    for i in range(n):
        aspect = reviews.ASPECTS[i % len(reviews.ASPECTS)]
        prompt = reviews.make_prompt(reviews.TITLES[i % len(reviews.TITLES)], aspect, i % 3)
        adj = rng.choice(reviews.POSITIVE + reviews.NEGATIVE)
        out.append((prompt, f"the {aspect} was {adj} . overall , a fine film ."))
    return out


def _params(**sections) -> Params:
    """Params with data of the user's own: the default task's gold judge is off, as it must be."""
    from pipeline.config import merge_distributed
    sections = {**sections, "prompts": {"gold_judge": False, **sections.get("prompts", {})}}
    return from_dict(Params, merge_distributed(sections, "params.yaml: "), "params.yaml: ")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Local datasets in the public layouts, and two tiny model families saved with save_pretrained."""
    root = tmp_path_factory.mktemp("real")
    rows = _examples(48)
    # SFT, chat messages under a custom column name, as a saved DatasetDict with two splits.
    chat = [{"dialog": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]} for p, r in rows]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(chat[:40]),
                          "test": datasets.Dataset.from_list(chat[40:])}).save_to_disk(str(root / "sft_chat"))
    # SFT, prompt/completion under other names, Parquet; SFT, one text column, CSV.
    datasets.Dataset.from_list([{"question": p, "answer": r} for p, r in rows]).to_parquet(str(root / "qa.parquet"))
    (root / "text.csv").write_text("text\n" + "".join(f"\"{p} {r}\"\n" for p, r in rows[:8]))
    # Preference pairs in the messages layout; PPO prompts as messages, per split by file name.
    pairs = [{"chosen": [{"role": "user", "content": p}, {"role": "assistant", "content": r}],
              "rejected": [{"role": "user", "content": p}, {"role": "assistant", "content": "bad . bad ."}]}
             for p, r in rows]
    for split, part in (("train", pairs[:40]), ("test", pairs[40:])):
        (root / f"pairs_{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in part))
        prompts = [{"messages": [{"role": "user", "content": p}]} for p, _ in (rows[:40] if split == "train" else rows[40:])]
        (root / f"prompts_{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in prompts))
    (root / "hh.jsonl").write_text(json.dumps({"chosen": "\n\nHuman: hi there\n\nAssistant: hello"}) + "\n")

    # Llama family: word-level tokenizer with a chat template (and a pad token).
    words = reviews.vocabulary() + ["<", "|", ">", "user", "assistant", "system", "bad"]
    tok = build_word_tokenizer(words)
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True))
    llama.save_pretrained(str(root / "llama"))
    tok.save_pretrained(str(root / "llama"))
    # GPT-2 family: byte-level BPE trained here, eos only (no pad, no chat template).
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([f"{p} {r}" for p, r in rows] + ["bad . bad ."], vocab_size=400, min_frequency=1,
                            special_tokens=["<|endoftext|>"])
    gtok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(gtok), n_embd=32, n_layer=1, n_head=2, n_positions=256,
                                      bos_token_id=gtok.eos_token_id, eos_token_id=gtok.eos_token_id,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    gpt2.save_pretrained(str(root / "gpt2"))
    gtok.save_pretrained(str(root / "gpt2"))
    return root


# ---- Data layouts --------------------------------------------------------------------------------


def test_sft_layouts_and_column_mapping(files):
    chat = inputs.demonstrations(_params(sft={"dataset": {"path": str(files / "sft_chat"), "messages_column": "dialog"}}),
                                 files, "train")
    assert len(chat) == 40 and chat[0]["prompt"] == [{"role": "user", "content": _examples(1)[0][0]}]
    assert chat[0]["response"] == _examples(1)[0][1]
    held_out = inputs.demonstrations(_params(sft={"dataset": {"path": str(files / "sft_chat"),
                                                              "messages_column": "dialog"}}), files, "eval")
    assert len(held_out) == 8                                   # the saved dataset's test split
    qa = inputs.demonstrations(_params(sft={"dataset": {"path": str(files / "qa.parquet"), "layout": "prompt_completion",
                                                        "prompt_column": "question", "response_column": "answer"}}),
                               files, "train")
    assert (qa[3]["prompt"], qa[3]["response"]) == _examples(4)[3]
    text = inputs.demonstrations(_params(sft={"dataset": {"path": str(files / "text.csv")}}), files, "train")
    assert text[0] == {"prompt": "", "response": " ".join(_examples(1)[0]), "where": f"{files / 'text.csv'}: row 1"}
    # Wrong column names are reported with the row and the columns there are.
    with pytest.raises(DataError, match=r"qa.parquet: row 1: missing field 'prompt' \(columns: answer, question\)"):
        inputs.demonstrations(_params(sft={"dataset": {"path": str(files / "qa.parquet"),
                                                       "layout": "prompt_completion"}}), files, "train")


def test_prompt_layouts_and_split_placeholder(files):
    p = _params(prompts={"dataset": {"path": str(files / "prompts_{split}.jsonl")}})
    train, held_out = inputs.prompts(p, files, "train"), inputs.prompts(p, files, "eval")
    assert (len(train), len(held_out)) == (40, 8)
    assert train[0] == [{"role": "user", "content": _examples(1)[0][0]}]
    hh = inputs.prompts(_params(prompts={"dataset": {"path": str(files / "hh.jsonl"), "layout": "conversation"}}), files, "train")
    assert hh == ["Human: hi there\n\nAssistant:"]
    bad = files / "bad_prompts.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": "not a list"}\n')
    with pytest.raises(DataError, match=r"bad_prompts.jsonl:2: field 'messages' must be a non-empty list"):
        inputs.prompts(_params(prompts={"dataset": {"path": str(bad)}}), files, "train")


def test_a_missing_local_source_is_no_such_file_naming_its_key(tmp_path, monkeypatch):
    """A path that names a local file (a file type, ./ or /, a {split}) and is not there is said so
    with the key that names it; the hub is never asked for a dataset of that name."""
    from pipeline.data.preferences import load_pairs, looks_local
    monkeypatch.chdir(tmp_path)
    absolute = str(tmp_path / ("a-long-folder-name-" * 6) / "pairs.parquet")   # whole at any checkout path
    for section, path, read in (
            ("prompts", "userdata/prompts_{split}.jsonl", lambda p: inputs.prompts(p, tmp_path, "train")),
            ("sft", "./mine", lambda p: inputs.demonstrations(p, tmp_path, "train")),
            ("reward", absolute, lambda p: inputs.preference_pairs(p.reward.dataset, tmp_path, "reward"))):
        with pytest.raises(DataError) as err:
            read(_params(**{section: {"dataset": {"path": path}}}))
        named = path.replace("{split}", "train")
        assert str(err.value) == f"{named}: no such file ({section}.dataset.path: {path})"
    with pytest.raises(DataError) as err:   # the prepared task's files: no key names them
        load_pairs(tmp_path / "pairs_train.jsonl")
    assert str(err.value) == f"{tmp_path / 'pairs_train.jsonl'}: no such file"
    hub_ids = ("Anthropic/hh-rlhf", "HuggingFaceH4/ultrafeedback_binarized", "org/data.v2")
    assert not any(map(looks_local, hub_ids))


def test_chat_template_is_the_prompt_format_in_every_stage(files):
    tok = load_tokenizer(files / "llama")
    messages = [{"role": "user", "content": _examples(1)[0][0]}]
    expected = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, messages) == expected
    assert tok.convert_ids_to_tokens(expected[-5:]) == ["<", "|", "assistant", "|", ">"]
    assert encode_prompt(tok, messages[0]["content"]) == expected          # a plain string is one user turn
    # SFT examples and reward-model inputs start with exactly those ids.
    (example,), _, _ = tokenize_demonstrations([{"prompt": messages, "response": "the plot was good ."}], tok, 200, "x")
    assert example.input_ids[:example.n_prompt] == expected
    assert encode_pair_text(tok, messages, "the plot was good .", 200)[:len(expected)] == expected
    # Without a template (the default task's tokenizer): the plain format, unchanged.
    plain = build_word_tokenizer(reviews.vocabulary())
    ids = encode_prompt(plain, "Review the film Lost River .")
    assert plain.convert_ids_to_tokens(ids) == ["<bos>", "Review", "the", "film", "Lost", "River", ".", "Response", ":"]


def test_missing_pad_token_is_added_attention_from_params_dtype_from_the_loading_rule(files, caplog):
    """The attention implementation comes from params; the dtype from the loading rule, passed in."""
    with caplog.at_level(logging.WARNING):
        model, tok = init_policy(ModelConfig(name_or_path=str(files / "gpt2"), attn_implementation="eager"),
                                 files, seed=0, dtype=torch.bfloat16)
    base = load_tokenizer(files / "gpt2", add_pad=True)
    assert tok.pad_token == "<pad>" and tok.pad_token_id == len(tok) - 1 != tok.eos_token_id
    assert model.get_input_embeddings().weight.size(0) == len(tok) == len(base)
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert "had no pad token; added '<pad>'" in caplog.text


# ---- Whole stages on two model families ------------------------------------------------------------


def _stage(name: str, params: Path, root: Path, out: str, **paths: str) -> dict:
    cmd = [sys.executable, "-m", "pipeline", name, "--params", str(params), "--data", str(root / "no-prepared-data"),
           "--out", out, "--no-progress"] + [a for k, v in paths.items() for a in (f"--{k}", v)]
    proc = subprocess.run(cmd, cwd=root, env={**run_env(), "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads((root / out / "metrics.json").read_text())


def _own_data_params(files: Path, model: str, path: Path, **extra) -> Path:
    override = merge(TINY, {
        "model": {"name_or_path": str(files / model)},
        "sft": {"dataset": {"path": str(files / "sft_chat"), "messages_column": "dialog"}, "max_length": 200},
        "reward": {"dataset": {"path": str(files / "pairs_{split}.jsonl"), "layout": "messages"}, "max_length": 200,
                   "batch_size": 8},
        "ppo": {"max_prompt_length": 128},
        "prompts": {"dataset": {"path": str(files / "prompts_{split}.jsonl")}, "max_length": 128, "gold_judge": False},
        **extra})
    write_params(path, override)
    return path


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_own_model_and_data_through_sft_rm_ppo(files, family):
    params = _own_data_params(files, family, files / f"{family}.yaml")
    sft = _stage("sft", params, files, f"{family}_sft")
    assert sft["train"]["steps"] == 3 and sft["eval"]["loss"] > 0 and "gold" not in sft.get("sft", {})  # no judge
    rm = _stage("reward", params, files, f"{family}_rm", sft=f"{family}_sft/model")
    assert 0.0 <= rm["eval"]["accuracy"] <= 1.0 and "noise_ceiling" not in rm["eval"]
    ppo = _stage("ppo", params, files, f"{family}_ppo", sft=f"{family}_sft/model", reward=f"{family}_rm/model")
    assert ppo["data"]["prompts_dropped"] == 0 and abs(ppo["ppo"]["kl"]) < 1e3   # a sampled estimate: may be < 0
    policy = AutoModelForCausalLM.from_pretrained(str(files / f"{family}_ppo/model"))
    assert type(policy).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[family]
    scorer = AutoModelForSequenceClassification.from_pretrained(str(files / f"{family}_rm/model"))
    assert scorer.config.num_labels == 1
    if family == "gpt2":   # the added pad token travelled with the checkpoints
        assert load_tokenizer(files / "gpt2_sft/model").pad_token == "<pad>"


def test_policy_and_reward_model_with_different_tokenizers(files):
    """A Llama policy (word-level tokenizer, chat template) scored by a GPT-2 reward model (byte-level
    BPE): responses are decoded to text and re-tokenized for the RM."""
    if not (files / "gpt2_rm/model").exists() or not (files / "llama_sft/model").exists():
        pytest.fail("run after test_own_model_and_data_through_sft_rm_ppo (same module)")
    params = _own_data_params(files, "llama", files / "mixed.yaml", ppo={
        "critic_init": "sft", "iterations": 2})
    ppo = _stage("ppo", params, files, "mixed_ppo", sft="llama_sft/model", reward="gpt2_rm/model")
    assert ppo["train"]["rollouts"] == 8 and abs(ppo["ppo"]["rm"]) < 1e6
    # The reward model's own tokenizer is the one used: scoring a text equals scoring its BPE ids.
    from pipeline.models.reward_source import RewardModelSource
    from pipeline.models import reward_model as rm
    source = RewardModelSource(files / "gpt2_rm/model", max_length=200)
    prompt, response = _examples(1)[0]
    ids = encode_pair_text(source.tok, prompt, response, 200)
    direct = rm.raw_scores(source.model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)) - rm.offset(source.model)
    assert torch.allclose(source.score([prompt], [response]), direct)
    assert source.tok.convert_ids_to_tokens(ids[-1:]) == ["<|endoftext|>"]
