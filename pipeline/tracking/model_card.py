"""The model card (README.md) written into every stage's `model/` folder: what trained the model,
on what, with which settings and results, and how to load and use it without this project.

Built with huggingface_hub's `ModelCard` and `ModelCardData`, so the YAML header is the one the
Hugging Face Hub and its tools read: licence, library, task, tags, datasets, base model, and a
`model-index` of the results the stage measured (the Hub's evaluation results). A person reads the
rest. The numbers are the stage's own final metrics (what metrics.json holds) at the time it writes
the card: a policy's win rate over SFT appears only where its stage measured one (the evaluate stage
writes no model folder, so its numbers are in outputs/evaluate/, not here). The card travels with the
checkpoint to DVC's cache, MLflow's registry or a hub upload.

The usage snippets spell out what a plain transformers user needs to get the pipeline's numbers:
the prompt format (`{prompt}\\nResponse:`, or the chat template), the eos that ends every scored
response and the reward model's normalisation offset. tests/unit/test_model_card.py runs them.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping


@dataclass(frozen=True)
class ModelFacts:
    """What a stage's `model/` folder is, declared by the stage (its SPEC's `model`): the words of
    its card, the kind of model, and where MLflow's model registry keeps its versions."""
    what: str            # "the PPO policy": the card's title, and an input folder's --help
    trained_from: str    # "the SFT policy, against the reward model": what it was trained from, on what
    registered: str      # its registered model in MLflow, the name of its DVC artifact in dvc.yaml too
    description: str     # the registered model's description
    kind: Literal["policy", "reward"] = "policy"   # a causal LM, or a scalar-head reward model


# The reward model's config key of its offset (pipeline/models/reward_model.py OFFSET_KEY; a stage that
# writes a card need not import the reward model for it; tests/system/test_e2e.py checks the two agree).
OFFSET_KEY = "reward_offset"
# The project's licence, pyproject.toml's `license` (tests/unit/test_model_card.py checks the two agree);
# the Hub spells its ids in lower case.
LICENSE_NAME = "Apache-2.0"
LICENSE = LICENSE_NAME.lower()
# A prompt of the default task, for the snippets.
EXAMPLE_PROMPT = "Review the film Silent River . Focus on the music ."
EXAMPLE_RESPONSE = "the music was really superb . overall , a fine film ."
# A hub repository id (`org/name` or `name`). A local folder given as `model.name_or_path` (an absolute
# path, `./x`, `a/b/c`) is no base model the Hub can link to, so the card names it in its text only.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")

# The results a card's model-index lists, when the stage measured them: (metrics.json name, with
# {stage} for the stage's own policy; the Hub's metric type; what it is; the data it was measured
# on: the stage's own dataset's held-out split, or the held-out prompts).
INDEXED = (
    ("eval/accuracy", "accuracy", "held-out preference accuracy", "own"),
    ("eval/loss", "loss", "held-out loss", "own"),
    ("{stage}/gold", "gold_score", "gold annotator's mean score of its responses", "prompts"),
    ("{stage}/rm", "reward_model_score", "reward model's mean score of its responses", "prompts"),
    ("{stage}/kl", "kl", "KL to the SFT policy (nats per response)", "prompts"),
    ("win_rate/{stage}_vs_sft_gold", "win_rate", "win rate over SFT by the gold annotator", "prompts"),
    ("win_rate/{stage}_vs_sft_rm", "win_rate", "win rate over SFT by the reward model", "prompts"),
)

POLICY_USE = f'''Responses follow the prompt in the format the policy was trained with: a chat model's
template with its generation prompt, else `{{prompt}}\\nResponse:`. Greedy decoding with plain
transformers gives the pipeline's own greedy response:

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_path = "path/to/model"   # this folder, or the model's hub id
tok = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path).eval()


def respond(prompt: str, max_new_tokens: int = 48) -> str:
    """The policy's greedy response to `prompt`."""
    if tok.chat_template:   # a chat model: the prompt as a user turn, then the assistant header
        text = tok.apply_chat_template([{{"role": "user", "content": prompt}}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:                   # bos, the prompt, and the line the response continues
        ids = tok(f"{{prompt}}\\nResponse:", return_tensors="pt").input_ids
    listed = model.generation_config.eos_token_id   # a chat model ends on any of several ids
    ends = [tok.eos_token_id, *(listed if isinstance(listed, list) else [] if listed is None else [listed])]
    with torch.no_grad():   # a hub generation config may set a repetition penalty; the pipeline uses none
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, repetition_penalty=1.0, eos_token_id=ends,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


print(respond("{EXAMPLE_PROMPT}"))
```'''

REWARD_USE = f'''The score of a (prompt, response) is the classifier's output at the last token of the
prompt, then the response, then eos, minus the normalisation offset stored in the config
(`{OFFSET_KEY}`: the mean raw score of held-out demonstrations, so a typical good response scores
about 0). The prompt is formatted as in training (a chat model's template with its generation prompt,
else `{{prompt}}\\nResponse:`) and the response tokenized on its own; the tokenizer adds no eos, so it is
appended. With plain transformers:

```python
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

model_path = "path/to/model"   # this folder, or the model's hub id
tok = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()


def score(prompt: str, response: str) -> float:
    """The reward model's normalised score of `response` to `prompt`."""
    if tok.chat_template:   # a chat model: the prompt as a user turn, then the assistant header
        text = tok.apply_chat_template([{{"role": "user", "content": prompt}}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
    else:                   # bos, the prompt, and the line the response continues
        ids = tok(f"{{prompt}}\\nResponse:").input_ids
    ids = ids + tok(response, add_special_tokens=False).input_ids + [tok.eos_token_id]
    with torch.no_grad():
        raw = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    return raw - model.config.{OFFSET_KEY}


print(score("{EXAMPLE_PROMPT}", "{EXAMPLE_RESPONSE}"))
```

`pipeline("text-classification")` gives another number: it formats no prompt, adds no eos and
subtracts no offset. The pipeline scores through `pipeline.models.reward_model.score_texts`, which
also cuts a pair longer than `reward.max_length` tokens (the prompt's left end goes first).'''


def _scalars(section: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in section.items():
        if isinstance(value, Mapping):
            out += _scalars(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _dataset_path(config: Mapping[str, Any], section: str) -> str | None:
    """`<section>.dataset.path` of the config (`prompts`, or a stage's own section), when set."""
    value = config.get(section, {})
    dataset = value.get("dataset") if isinstance(value, Mapping) else None
    path = dataset.get("path") if isinstance(dataset, Mapping) else None
    return path if isinstance(path, str) and path else None


def datasets(stage: str, config: Mapping[str, Any]) -> dict[str, str]:
    """What the model was trained on (`own`) and measured on (`prompts`): a user dataset's path or
    hub id, else the default task generated locally. A stage with no dataset of its own (ppo, grpo,
    rs) trains on the prompts."""
    task = config.get("data", {}).get("task", "reviews")
    local = f"{task} task, generated locally by rlhf-pipeline (python -m pipeline prepare)"
    prompts = _dataset_path(config, "prompts") or local
    section = config.get(stage, {})
    has_own = isinstance(section, Mapping) and "dataset" in section
    own = (_dataset_path(config, stage) or local) if has_own else prompts
    return {"own": own, "prompts": prompts}


def _rounded(value: float) -> float | int:
    """As the Results table shows it (4 significant digits): a re-run whose metrics agree to that
    precision writes the same card."""
    return value if isinstance(value, int) else float(f"{value:.4g}")


def eval_results(stage: str, facts: ModelFacts, config: Mapping[str, Any],
                 metrics: Mapping[str, Any]) -> list[Any]:
    """The model-index entries (`INDEXED`) of the metrics the stage measured; none invented."""
    from huggingface_hub import EvalResult
    data = datasets(stage, config)
    task = "text-classification" if facts.kind == "reward" else "text-generation"
    out = []
    for name, kind, meaning, where in INDEXED:
        key = name.format(stage=stage)
        value = metrics.get(key)
        # NaN: a metric not defined on this run's data
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or value != value:
            continue
        out.append(EvalResult(task_type=task, dataset_type=data[where], dataset_name=data[where],
                              dataset_split="held-out", metric_type=kind, metric_name=f"{key}: {meaning}",
                              metric_value=_rounded(value)))
    return out


def base_checkpoint(stage: str, config: Mapping[str, Any]) -> str | None:
    """The pretrained checkpoint the model started from, when its config says: the stage's own
    `name_or_path` (a reward model's backbone), else `model.name_or_path` (SFT's starting point).
    The stages trained from the SFT policy don't read the latter, so their cards can't name it."""
    for section in (config.get(stage, {}), config.get("model", {})):
        value = section.get("name_or_path") if isinstance(section, Mapping) else None
        if isinstance(value, str) and value:
            return value
    return None


def card_data(stage: str, facts: ModelFacts, config: Mapping[str, Any], metrics: Mapping[str, Any]) -> Any:
    """The card's YAML header, as huggingface_hub's `ModelCardData`."""
    from huggingface_hub import ModelCardData
    data = datasets(stage, config)
    base = base_checkpoint(stage, config)
    results = eval_results(stage, facts, config, metrics)
    return ModelCardData(
        license=LICENSE, library_name="transformers",
        pipeline_tag="text-classification" if facts.kind == "reward" else "text-generation",
        tags=["rlhf", stage, "reward-model" if facts.kind == "reward" else "causal-lm"],
        datasets=[data["own"]],
        base_model=base if base is not None and HUB_ID.fullmatch(base) else None,
        model_name=facts.registered if results else None, eval_results=results or None)


def card(stage: str, facts: ModelFacts, config: Mapping[str, Any], metrics: Mapping[str, Any],
         version: str) -> str:
    """README.md for the `model/` folder of `stage`, the model `facts` say; `config` is the stage's
    config.json (its declared params), `metrics` its final metrics (flat names)."""
    from huggingface_hub import ModelCard
    header = card_data(stage, facts, config, metrics)
    return str(ModelCard(f"---\n{header.to_yaml()}\n---\n\n{body(stage, facts, config, metrics, version)}"))


def body(stage: str, facts: ModelFacts, config: Mapping[str, Any], metrics: Mapping[str, Any],
         version: str) -> str:
    """The card's text under its YAML header."""
    data = datasets(stage, config)
    base = base_checkpoint(stage, config)
    lines = [
        f"# {stage}: {facts.what}", "",
        f"Trained by the `{stage}` stage of rlhf-pipeline {version} (`python -m pipeline {stage}`) from "
        f"{facts.trained_from}. The stage's `config.json` beside this folder holds every "
        "setting; `metrics.json` every result.", "",
        "## Data", "",
    ]
    if data["own"] == data["prompts"]:
        lines.append(f"- trained and measured (held-out split) on: {data['own']}")
    else:
        lines += [f"- trained on: {data['own']}", f"- measured on (held-out split): {data['prompts']}"]
    if base is not None:
        lines.append(f"- base model: `{base}`")
    section = config.get(stage, {})
    lines += ["", "## Settings", "", "| key | value |", "|---|---|"]
    for key, value in _scalars(section if isinstance(section, Mapping) else {}, f"{stage}."):
        if key.startswith(f"{stage}.distributed.") or key.startswith(f"{stage}.detector."):
            continue
        lines.append(f"| `{key}` | {'null' if value is None else value} |")
    precision = (config.get("distributed", {}).get("precision")
                 or section.get("distributed", {}).get("precision"))
    if precision:
        lines.append(f"| `distributed.precision` | {precision} |")
    lines += ["", "## Results", "", "| metric | value |", "|---|---|"]
    lines += [f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |"
              for k, v in shown(stage, metrics)]
    lines += ["", "Metric names are explained in the project's docs/metrics.md.", "", "## Use", "",
              REWARD_USE if facts.kind == "reward" else POLICY_USE, "", "## Licence", "",
              f"rlhf-pipeline, which trained it, is licensed under {LICENSE_NAME}. A model fine-tuned from a "
              "pretrained checkpoint (`model.name_or_path`) is bound by that checkpoint's licence too.", ""]
    return "\n".join(lines)


def shown(stage: str, metrics: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The Results table's rows: the held-out evaluation (`eval/*`, and the policies measured under
    their own names: the stage's, SFT's beside it, the demonstrations') and the data counts in full;
    of training, its loss and steps (PPO's step log statistics stay in metrics.json and train.tsv).
    No times: the card is part of the model folder DVC hashes, and a re-run that trains the same
    weights must write the same folder."""
    groups = ("eval", "data", stage, "sft", "demonstrations", "win_rate")
    return [(k, v) for k, v in metrics.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)
            and (k.split("/")[0] in groups or k in ("train/loss", "train/steps"))]
