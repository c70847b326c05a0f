"""The `sft` stage: supervised fine-tuning on demonstrations (InstructGPT step 1).

Causal-LM cross-entropy on response tokens only (prompt tokens are context, not targets), AdamW,
linear warmup then cosine decay, gradient clipping, held-out loss every `eval_every` steps. After
training, greedy and sampled responses to the evaluation prompts are judged by the task's gold
annotator next to the held-out demonstrations, so the metrics say how good imitation got.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..config import Params
from ..tasks import reviews
from ..context import SINGLE, Context
from ..tracking.metric_names import METRICS_JSON, Metric
from ..tracking.model_card import ModelFacts
from .spec import StageSpec

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    from ..training import memory_plan
    from .skeleton import StageRun

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per optimizer step",
    "eval.tsv": "held-out loss during training",
    "metrics.json": "after training; the `sft/*` names judge the policy's responses to the evaluation "
                    "prompts (sampled, and greedy where they end in `_greedy`)",
}

def declared_metrics() -> list[Metric]:
    from ..training import supervised
    def m(file: str, name: str, meaning: str, condition: Optional[str] = None) -> Metric:
        return Metric("sft", file, name, meaning, condition)

    out = supervised.declared_metrics("sft", "demonstrations", "cross-entropy per response token of the step's global batch "
                      "(prompt tokens are not targets)", "cross-entropy per response token on the held-out "
                      "demonstrations", "adapters")
    for end, tag, how in (("_greedy", "greedy", "greedy"), ("", "sampled", "sampled (`sft.sampling`)")):
        out += [
            m(METRICS_JSON, f"sft/eos_rate{end}", f"rate of {how} responses to the first `sft.n_eval_generations` "
                                                  "evaluation prompts that end with the end-of-response token "
                                                  "(or `sft.sampling.stop_token`) rather than at `max_new_tokens`"),
            m(METRICS_JSON, f"sft/gold{end}", f"mean gold score of those {tag} responses", "!no_judge"),
            m(METRICS_JSON, f"sft/gold_ci95{end}", "half-width of its 95% interval", "!no_judge"),
            m(METRICS_JSON, f"sft/length{end}", f"mean length of those {tag} responses, words"),
            m(METRICS_JSON, f"sft/distinct_2{end}", f"distinct bigrams / bigrams over those {tag} responses (words)"),
            m(METRICS_JSON, f"sft/well_formed{end}", f"rate of those {tag} responses that are grammatical reviews "
                                                     "ending with (exactly one) closing sentence", "!no_judge"),
        ]
    out.append(m(METRICS_JSON, "demonstrations/gold", "mean gold score of the held-out demonstrations (what "
                                                           "SFT imitates)", "!no_judge"))
    return out


SPEC = StageSpec(
    "sft", help="supervised fine-tuning on demonstrations", inputs=("data",), training=True, shape="load",
    headline=("eval/loss", "sft/gold", "sft/well_formed"),
    parent_params=("model.name_or_path", "model.num_layers", "model.hidden_size", "sft.seed", "sft.lr", "sft.epochs"),
    model=ModelFacts("the supervised fine-tuned (SFT) policy", "the base model, on demonstrations", "rlhf-sft-policy",
                     "The SFT policy of the RLHF pipeline (transformers text-generation, with its tokenizer)."),
    check_inputs=lambda params, data_dir: check_inputs(params, data_dir),
    metrics=declared_metrics, files=METRIC_FILES,
    plan=lambda params, shapes: memory_plan_of(params, shapes), reads=(
    "data.task", "model", "sft", "distributed",
    "prompts.dataset",           # held-out prompts for the SFT policy's evaluation
    "prompts.max_length",
    "prompts.gold_judge",
))


def check_inputs(params: Params, data_dir: Path) -> None:
    """What the stage reads before its first step: the demonstrations (the held-out split checked
    for leaks from the train split) and the held-out prompts."""
    from ..data import inputs
    inputs.demonstrations(params, data_dir, "eval")
    inputs.prompts(params, data_dir, "eval")


def train(run: StageRun, data_dir: Path, progress: bool = True) -> tuple[Any, Any, dict]:
    """Train and return (model, tokenizer, metrics); per-step TSVs are written into the stage's
    folder. In a multi-process run every rank trains and the returned model is whole on rank 0 only
    (None elsewhere); evaluation after training is rank 0's."""
    from ..data import inputs
    from ..models.checkpoints import init_policy
    from ..training import demonstrations, loading, supervised
    params, ctx = run.params, run.ctx
    cfg = params.sft
    train_rows = inputs.demonstrations(params, data_dir, "train")
    eval_rows = inputs.demonstrations(params, data_dir, "eval")
    # Read (and so validate) now what is measured after training: a broken line must fail fast.
    eval_prompts = inputs.prompts(params, data_dir, "eval")[:cfg.n_eval_generations]
    source = cfg.dataset.path or data_dir / "sft_train.jsonl"
    # ZeRO-3 partitions a checkpoint as it loads; a model built from a config is built whole (its
    # seeded initialisation then does not depend on the placement) and partitioned by its engine.
    pretrained = params.model.name_or_path is not None
    with loading.partitioned(cfg.distributed, ctx) if pretrained else contextlib.nullcontext():
        model, tok = init_policy(params.model, data_dir / "tokenizer", cfg.seed,
                                 loading.load_dtype(cfg.distributed, trained=True))
    run.check_stop_tokens(tok)   # sampled after training: checked before it
    recipe = demonstrations.recipe(
        "sft", model, tok, (train_rows, source), (eval_rows, source), cfg, ctx,
        measure=lambda engine: evaluate_policy(engine, tok, params, eval_prompts, eval_rows, ctx))  # every rank
    model, metrics = supervised.run("sft", cfg, recipe, run.out, run.checkpoint, run.tracker, ctx, run.fingerprint, progress)
    return model, tok, metrics


def evaluate_policy(model, tok, params: Params, prompts: list, demos: list[dict],
                    ctx: Context = SINGLE) -> dict[str, Any]:
    """Collective. Greedy and sampled responses of `model` (a module or an engine) to the evaluation
    `prompts`, judged next to the held-out `demos`: `sft/<eos_rate|gold|well_formed>` of the sampled
    ones (the names the evaluate stage gives the SFT policy), `sft/<...>_greedy` of the greedy ones
    and `demonstrations/gold` (gold ones only with a judge)."""
    from ..data import inputs
    from ..measurement.policy import measure_trained
    cfg, judge = params.sft, inputs.judge(params)
    out, per = measure_trained("sft", model, tok, prompts, cfg.sampling, cfg.seed, judge=judge, ctx=ctx, greedy=True)
    if judge is not None:
        for tag, end in (("greedy", "_greedy"), ("sft", "")):
            out[f"sft/well_formed{end}"] = sum(map(reviews.is_well_formed, per[tag].texts)) / len(per[tag].texts)
        out["demonstrations/gold"] = sum(judge(r["prompt"], r["response"]) for r in demos) / len(demos)
    return out


def memory_plan_of(params: Params, shapes: memory_plan.Shapes) -> Optional[memory_plan.Planner]:
    """One trained policy: the tiny model built on the prepared tokenizer, or model.name_or_path's
    checkpoint (then read too)."""
    from ..training import memory_plan
    if not shapes.ready("data"):
        return None
    base = shapes.policy()
    return memory_plan.supervised_planner("sft", params, base, (base,) if params.model.name_or_path is not None else (),
                                          sampled=lambda cfg: cfg.sampling.max_new_tokens)


def run(params: Params, data_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage: train, then write model/, metrics.json, config.json and the step logs atomically
    (rank 0 writes; other ranks of a multi-process run return empty metrics)."""
    from .skeleton import stage_run
    with stage_run(SPEC, params, out, [data_dir, params.sft.dataset.path]) as run:
        model, tok, metrics = train(run, data_dir, progress)
        run.finish(metrics, model, tok)
    return metrics
