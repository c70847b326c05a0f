"""The model card (README.md) written into every stage's `model/` folder: what trained the model,
on what, with which settings and results, and how to load and use it without this project.

The Hugging Face Hub and its tools read the YAML header (library, task, tags, base model); a
person reads the rest. The numbers are the stage's own final metrics (what metrics.json holds),
so the card travels with the checkpoint to DVC's cache, MLflow's registry or a hub upload.
"""

from __future__ import annotations

import numbers
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

POLICY_USE = """```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("path/to/model")
model = AutoModelForCausalLM.from_pretrained("path/to/model")
ids = tok("Review the film Silent River . Focus on the music .", return_tensors="pt")
print(tok.decode(model.generate(**ids, max_new_tokens=48, do_sample=True)[0]))
```"""

REWARD_USE = f"""The score of a (prompt, response) is the classifier's logit minus the normalisation
offset stored in the config (`{OFFSET_KEY}`: the mean raw score of held-out demonstrations, so
a typical good response scores about 0):

```python
from transformers import AutoModelForSequenceClassification, AutoTokenizer
tok = AutoTokenizer.from_pretrained("path/to/model")
model = AutoModelForSequenceClassification.from_pretrained("path/to/model")
inputs = tok(prompt_and_response_text, return_tensors="pt")   # the prompt, then the response, then eos
score = model(**inputs).logits[:, 0] - model.config.{OFFSET_KEY}
```

The pipeline builds the ids with `pipeline.models.reward_model.encode_pair_text` (the chat template for
chat models) and scores with `pipeline.models.reward_model.score_texts`, which subtracts the offset."""

def _scalars(section: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in section.items():
        if isinstance(value, Mapping):
            out += _scalars(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def card(stage: str, facts: ModelFacts, config: Mapping[str, Any], metrics: Mapping[str, Any], version: str) -> str:
    """README.md for the `model/` folder of `stage`, the model `facts` say; `config` is the stage's
    config.json (its declared params), `metrics` its final metrics (flat names)."""
    reward = facts.kind == "reward"
    model = config.get("model", {})
    header = ["---", "library_name: transformers", f"pipeline_tag: {'text-classification' if reward else 'text-generation'}",
              "tags:", "- rlhf", f"- {stage}"]
    base = model.get("name_or_path")
    if isinstance(base, str) and base:
        header.append(f"base_model: {base}")
    header.append("---")
    data = config.get("data", {})
    task = data.get("task", "reviews")
    lines = header + [
        "", f"# {stage}: {facts.what}", "",
        f"Trained by the `{stage}` stage of rlhf-pipeline {version} (`python -m pipeline {stage}`) from "
        f"{facts.trained_from}. The stage's `config.json` beside this folder holds every "
        "setting; `metrics.json` every result.", "",
        "## Data", "",
        f"- task: `{task}`" + (" (the built-in film-review task with its simulated gold annotator)"
                                 if task == "reviews" else ""),
    ]
    section = config.get(stage, {})
    dataset = section.get("dataset") if isinstance(section, Mapping) else None
    if isinstance(dataset, Mapping) and dataset.get("path"):
        lines.append(f"- dataset: `{dataset['path']}`")
    lines += ["", "## Settings", "", "| key | value |", "|---|---|"]
    for key, value in _scalars(section, f"{stage}."):
        if key.startswith(f"{stage}.distributed.") or key.startswith(f"{stage}.detector."):
            continue
        lines.append(f"| `{key}` | {'null' if value is None else value} |")
    precision = config.get("distributed", {}).get("precision") or section.get("distributed", {}).get("precision")
    if precision:
        lines.append(f"| `distributed.precision` | {precision} |")
    # The held-out evaluation (`eval/*`, and the policies measured under their own names: the stage's,
    # SFT's beside it, the demonstrations') and the data counts in full; of training, its loss and
    # steps (PPO's step log statistics stay in metrics.json and train.tsv). No times: the card is part
    # of the model folder DVC hashes, and a re-run that trains the same weights must write the same folder.
    groups = ("eval", "data", stage, "sft", "demonstrations")
    shown = [(k, v) for k, v in metrics.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)
             and (k.split("/")[0] in groups or k in ("train/loss", "train/steps"))]
    lines += ["", "## Results", "", "| metric | value |", "|---|---|"]
    lines += [f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |" for k, v in shown]
    lines += ["", "Metric names are explained in the project's docs/metrics.md.", "", "## Use", "",
              REWARD_USE if reward else POLICY_USE, ""]
    return "\n".join(lines)
