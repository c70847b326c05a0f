"""The model card of a stage's `model/` folder: its Hub metadata (licence, datasets, base model,
the results the stage measured) and its usage snippets, run as a user would with plain transformers,
against the pipeline's own numbers: the reward model's scores and a policy's greedy responses."""

import random
import tomllib
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from conftest import REPO, tiny_params, tiny_policy_and_reward_model
from model_cards import card_code
from real_checkpoints import llama3_like
from pipeline.config import SamplingConfig
from pipeline.data.tokenizer import build_word_tokenizer, load_tokenizer
from pipeline.measurement.policy import measure
from pipeline.models import reward_model as rm
from pipeline.models.checkpoints import load_policy
from pipeline.stages import registry
from pipeline.stages.spec import resolve
from pipeline.tasks import reviews
from pipeline.tracking import model_card


def _written(stage: str, folder: Path, config: dict | None = None, metrics: dict | None = None) -> str:
    """The card of `stage` for the model in `folder`, written there as README.md, as read back."""
    config = resolve(tiny_params(), registry.spec(stage)) if config is None else config
    text = model_card.card(stage, registry.spec(stage).model, config, metrics or {}, "0.1")
    (folder / "README.md").write_text(text)
    return (folder / "README.md").read_text()


def _pairs(n: int) -> tuple[list[str], list[str]]:
    """Held-out-style prompts of the default task with a review each, the card's example first."""
    rng = random.Random(0)
    prompts = [model_card.EXAMPLE_PROMPT, *(reviews.make_prompt(t, a, i % 3) for i, (t, a) in
                                            enumerate(zip(reviews.TITLES[::7], reviews.ASPECTS)))][:n]
    return prompts, [reviews.sample_review(rng, p) for p in prompts]


def _chat_models(root: Path) -> tuple[Path, Path]:
    """A Llama-3.1-Instruct-shaped policy (chat template, several end ids) with the pad token the
    pipeline gives it (one of its reserved tokens), and a reward model built from it, with an offset."""
    policy = llama3_like(root / "chat_policy")
    load_tokenizer(policy, add_pad=True).save_pretrained(policy)
    model, tok = rm.init_reward_model(policy, seed=0, head_std=1.0)
    model.config.reward_offset = -0.375
    model.save_pretrained(root / "chat_rm")
    tok.save_pretrained(root / "chat_rm")
    return policy, root / "chat_rm"


@pytest.mark.parametrize("shape", ["word tokenizer", "chat template"])
def test_the_reward_cards_snippet_scores_as_the_pipeline_does(shape, tiny_data, tmp_path):
    """The snippet formats the prompt, appends eos and subtracts the offset: plain transformers gives
    `score_texts` (the tokenizer alone would add no eos, and the classifier's logit has no offset)."""
    if shape == "word tokenizer":
        _, folder = tiny_policy_and_reward_model(tmp_path, tiny_data, offset=0.8125)
    else:
        _, folder = _chat_models(tmp_path)
    snippet = card_code(_written("reward", folder), folder)
    model, tok = rm.load_reward_model(folder)
    prompts, responses = _pairs(6)
    ours = rm.score_texts(model, tok, prompts, responses, max_length=512).tolist()
    assert [snippet["score"](p, r) for p, r in zip(prompts, responses)] == pytest.approx(ours, abs=1e-5)
    assert len(set(ours)) == len(ours)    # the pairs are told apart: a constant would not pass
    # What the card warns against is another number: the text as one string, no eos, no offset.
    text = tok(f"{prompts[0]}\nResponse: {responses[0]}", return_tensors="pt")
    with torch.no_grad():
        naive = snippet["model"](**text).logits[0, 0].item()
    assert abs(naive - ours[0]) > 1e-3


def _word_policy(folder: Path) -> Path:
    """An untrained policy on the default task's tokenizer whose greedy answers depend on the prompt
    (weights drawn wider than transformers' default, which answers every prompt alike)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    tok = build_word_tokenizer(reviews.vocabulary())
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, initializer_range=0.2, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("shape", ["word tokenizer", "chat template"])
def test_the_policy_cards_snippet_answers_as_the_pipelines_greedy_sample(shape, tmp_path):
    """The snippet prompts in the trained format (`\nResponse:`, or the chat template) and stops at
    the model's end ids: its greedy answers are the pipeline's greedy samples."""
    folder = _word_policy(tmp_path / "policy") if shape == "word tokenizer" else _chat_models(tmp_path)[0]
    snippet = card_code(_written("ppo", folder), folder)
    model, tok = load_policy(folder)
    prompts, _ = _pairs(4)
    sampling = SamplingConfig(max_new_tokens=12)
    ours = measure(model, tok, prompts, sampling, seed=0, greedy=True).texts
    assert [snippet["respond"](p, max_new_tokens=12) for p in prompts] == ours
    # The format decides the answers: the prompt tokenized alone (no `Response:` line, no template)
    # gets others.
    bare = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = snippet["model"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                        do_sample=False, pad_token_id=tok.pad_token_id)
        bare.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    assert len(set(ours)) > 1 and bare != ours


def _header(stage: str, folder: Path, override: dict, metrics: dict) -> tuple[object, str]:
    """The card's parsed YAML header and its text, for `stage` under tiny params with `override`."""
    text = _written(stage, folder, resolve(tiny_params(override), registry.spec(stage)), metrics)
    return ModelCard.load(folder / "README.md").data, text


def test_the_card_header_is_the_hubs_with_the_results_the_stage_measured(tmp_path):
    measured = {"eval/accuracy": 0.71875, "eval/loss": 0.5, "train/seconds": 3.0}
    data, _ = _header("reward", tmp_path, {}, measured)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]
    assert data.license == project.lower() == "apache-2.0"
    assert (data.library_name, data.pipeline_tag) == ("transformers", "text-classification")
    assert data.tags == ["rlhf", "reward", "reward-model"] and data.base_model is None
    assert data.datasets == ["reviews task, generated locally by rlhf-pipeline (python -m pipeline prepare)"]
    assert data.model_name == "rlhf-reward-model"
    got = {(r.metric_type, r.metric_value, r.dataset_type, r.task_type) for r in data.eval_results}
    assert got == {("accuracy", 0.7188, data.datasets[0], "text-classification"),
                   ("loss", 0.5, data.datasets[0], "text-classification")}

    # A user's dataset by its id; only what the stage measured (ppo measures no win rate).
    theirs = {"prompts": {"dataset": {"path": "org/prompts"}, "gold_judge": False}}
    data, _ = _header("ppo", tmp_path, theirs, {"ppo/rm": 1.25, "ppo/kl": 2.0, "sft/rm": 0.5})
    assert data.datasets == ["org/prompts"] and data.pipeline_tag == "text-generation"
    assert {(r.metric_type, r.metric_value, r.dataset_type) for r in data.eval_results} == {
        ("reward_model_score", 1.25, "org/prompts"), ("kl", 2.0, "org/prompts")}
    data, _ = _header("ppo", tmp_path, {}, {"ppo/gold": 1.25, "win_rate/ppo_vs_sft_gold": 0.65625})
    win = [r for r in data.eval_results if r.metric_type == "win_rate"]
    assert [(w.metric_value, w.metric_name) for w in win] == [
        (0.6562, "win_rate/ppo_vs_sft_gold: win rate over SFT by the gold annotator")]

    # A hub base model by its id; a local one only in the text.
    own = {"sft": {"dataset": {"path": "data/demos.jsonl"}}, "prompts": {"gold_judge": False}}
    hub = {"model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}}
    data, text = _header("sft", tmp_path, {**own, **hub}, {})
    assert (data.base_model, data.datasets) == ("Qwen/Qwen2.5-0.5B-Instruct", ["data/demos.jsonl"])
    assert data.eval_results is None and "- trained on: data/demos.jsonl\n" in text
    data, text = _header("sft", tmp_path, {"model": {"name_or_path": "/models/llama"}}, {})
    assert data.base_model is None and "- base model: `/models/llama`" in text
