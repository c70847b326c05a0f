"""The one sequence of the pair methods (the dpo and kto stages, and a method that makes its own
pairs): the SFT policy trained on preference pairs, or on examples made from them, against its own
reference log-probs, then sampled on the held-out prompts. Not a stage (no SPEC): a stage module declares
itself over it as a `PairMethod` (its SPEC, its examples, its task, its final metrics, the training
pairs it makes itself, if any) and its `run` calls `run` here.

1. Read and validate every input before the first step: the training and held-out pairs
   (`<stage>.dataset`, the RM's by default), the stage's examples made from them, and the held-out
   prompts the trained policy is measured on at the end.
2. The policy is the SFT checkpoint (each rank loads its partition only under ZeRO-3), with fresh
   LoRA adapters when `<stage>.lora.r > 0`; every example is tokenised by the pairs' one length
   rule (preference.logprobs.fit_pairs), an overlong one following `<stage>.overlong`. A method
   that makes its own training pairs from the SFT policy (`PairMethod.pairs`: on-policy pairs
   sampled and ranked) makes them here, before the policy trains; the held-out pairs stay the
   dataset's, so every method's eval.tsv measures the same pairs.
3. The reference model's log-probs of every example's two responses are computed once, by the
   policy's own engine before its first step (and before a resumed state is loaded) with any
   adapter switched off (`reference_logprobs_of`): the same weights, device and precision the
   policy computes with, so log pi - log pi_ref is exactly 0 at step 0 and no second model is
   resident while the policy trains. A resumed run recomputes them (they are deterministic, and the
   SFT weights are part of the resume fingerprint).
4. Training runs in the shared supervised loop (training/supervised.py) with the stage's loss.
5. After training: the stage's final metrics, and the policy sampled on the held-out prompts as PPO
   and the evaluate stage sample (`prompts.sampling`): KL to the SFT policy, end-of-response rate,
   length, distinct-2 and, with the task's gold judge, the gold score, as `<stage>/*` (the names
   compare gives a policy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from ..config import Params
from ..data.preferences import Pair
from ..context import Context
from ..tracking.metric_names import METRICS_JSON, Metric
from .spec import StageSpec

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    import torch
    from ..preference.logprobs import TokenPair
    from ..training import memory_plan
    from ..training.engines import TrainEngine
    from ..training.supervised import SupervisedResult, SupervisedTask
    from .skeleton import StageRun


@dataclass(frozen=True)
class Prepared:
    """What a stage's task is built on: its training and held-out examples as token ids, each with
    the Pair it was made from, and how every pass over them is batched."""
    train: list[tuple[Pair, TokenPair]]
    held: list[tuple[Pair, TokenPair]]
    pad: int          # the tokenizer's pad id
    width: int        # examples per reference or held-out forward: twice the global batch
    ctx: Context
    name: str         # the stage: its progress bar, messages and checkpoint

    @property
    def train_tokens(self) -> list[TokenPair]:
        return [tokens for _, tokens in self.train]

    @property
    def held_tokens(self) -> list[TokenPair]:
        return [tokens for _, tokens in self.held]


@dataclass(frozen=True)
class PairMethod:
    """An offline-pair stage, as the sequence runs it."""
    spec: StageSpec      # its name is the stage's params section too
    # (section, engine, micro, prepared) -> steps 3-4: the reference pass, the loss of a micro-batch
    # and the held-out evaluation (micro: the micro-batch size per process)
    task: Callable[[Any, TrainEngine, int, Prepared], SupervisedTask]
    report: Callable[[SupervisedResult], dict[str, Any]]   # step 5: the final metrics from the step logs
    # step 1: the stage's examples made from the pairs (section, pairs); the pairs themselves by default
    examples: Callable[[Any, list[Pair]], list[Pair]] = lambda cfg, pairs: pairs
    distinct: bool = True   # an example's two responses must differ once tokenised (fit_pairs)
    # data/* counts of the kept training examples, before the truncated and dropped ones
    counts: Callable[[list[Pair]], dict[str, int]] = lambda kept: {}
    # step 2: the training pairs the stage makes itself instead of the dataset's train split, from
    # (run, SFT policy, tokenizer, input folders by name) before any step: (pairs, the metrics that
    # say how they were made, added to metrics.json); None: the dataset's
    pairs: Optional[Callable[[StageRun, Any, Any, Mapping[str, Any]], tuple[list[Pair], dict[str, Any]]]] = None


def metric(stage: str, file: str, name: str, meaning: str) -> Metric:
    """A name an offline-pair stage writes: compare/dvc.yaml's, so only with `compare`."""
    return Metric(stage, file, name, meaning, "compare")


def declared_metrics(stage: str, items: str, loss: str, eval_loss: str, own: list[Metric]) -> list[Metric]:
    """What an offline-pair stage writes (docs/metrics.md): the supervised loop's names (`loss`,
    `eval_loss`: its losses' meanings; the LoRA counts only with `method_lora`), the stage's `own`,
    the held-out `items` truncated and dropped, and the sampled measurement's names."""
    from ..measurement.policy import sampled_declarations
    from ..training import supervised
    out = [metric(stage, x.file, x.name, x.meaning) if x.condition is None else
           Metric(stage, x.file, x.name, x.meaning, "method_lora")
           for x in supervised.declared_metrics(stage, items, loss, eval_loss, "adapters")]
    return out + own + [
        metric(stage, METRICS_JSON, "data/eval_truncated", f"held-out {items} kept with their prompt's left end cut"),
        metric(stage, METRICS_JSON, "data/eval_dropped", f"held-out {items} left out (`{stage}.overlong: drop`)"),
        *sampled_declarations(stage, ("gold", "kl"))]


def reference_logprobs_of(engine: TrainEngine, pairs: list[TokenPair], batch_size: int,
                          pad_id: int, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: the SFT policy's summed log-probs of every pair's two responses, (N,) and (N,) on the
    CPU, from the engine's model before its first step with any adapter off (`packed`: in packed rows)."""
    from ..models import lora
    from ..preference.logprobs import reference_logprobs
    model = engine.model
    with (model.disable_adapter() if lora.is_peft(model) else contextlib.nullcontext()):
        return reference_logprobs(model, pairs, batch_size, pad_id, packed)


def read_inputs(method: PairMethod, params: Params, data_dir: Path) -> tuple[list[Pair], list[Pair], list]:
    """Step 1: the stage's training and held-out examples made from its pairs, and the held-out
    prompts of the final measurement, every one read and validated."""
    from ..data import inputs
    cfg = getattr(params, method.spec.name)
    train_pairs, held_pairs = inputs.preference_pairs(cfg.dataset, data_dir, method.spec.name)
    prompts = inputs.prompts(params, data_dir, "eval")[:cfg.n_eval_prompts]
    return method.examples(cfg, train_pairs), method.examples(cfg, held_pairs), prompts


def measure_policy(name: str, engine: TrainEngine, tok, params: Params, sft_dir: Path, prompts: list,
                   ctx: Context) -> dict[str, float]:
    """Collective. Step 5's sampling: the trained policy sampled on the held-out `prompts` as in
    `prompts.sampling`, with its KL to the SFT policy (loaded now, after training, onto this rank's
    device) and, while the pairs are the default task's, the gold score: `<name>/<gold|kl>` with
    `_ci95` half-widths, `<name>/<eos_rate|length|distinct_2>`."""
    from ..data import inputs
    from ..measurement.policy import measure_trained
    from ..models.checkpoints import load_policy
    cfg = getattr(params, name)
    sft, _ = load_policy(sft_dir, params.model.trust_remote_code, next(engine.model.parameters()).dtype)
    return measure_trained(name, engine, tok, prompts, params.prompts.sampling, cfg.seed, sft=sft.to(ctx.device),
                           judge=inputs.judge(params) if cfg.dataset.path is None else None,
                           max_prompt_length=params.prompts.max_length, ctx=ctx, packed=cfg.packing)[0]


def train(method: PairMethod, run: StageRun, data_dir: Path, sft_dir: Path, progress: bool = True,
          more: Optional[Mapping[str, Any]] = None) -> tuple[Any, Any, dict]:
    """Steps 1-5 of the module doc; in a multi-process run rank 0 returns the whole model, the
    other ranks (None, tokenizer, {}). `more`: the stage's other inputs by name (`run`'s)."""
    import torch
    from ..models import lora
    from ..models.checkpoints import load_policy
    from ..preference.logprobs import fit_pairs
    from ..training import loading, supervised
    params, ctx, name = run.params, run.ctx, method.spec.name
    cfg = getattr(params, name)
    # 1. Every input, validated before the first step; the stage's examples.
    train_pairs, held_pairs, prompts = read_inputs(method, params, data_dir)
    # 2. The policy and its examples as token ids.
    with loading.partitioned(cfg.distributed, ctx):   # ZeRO-3: each rank loads its partition only
        model, tok = load_policy(sft_dir, params.model.trust_remote_code, loading.load_dtype(cfg.distributed, True))
    run.check_stop_tokens(tok)   # the held-out measurement's (and onpolicy_dpo's own sampling)
    made: dict[str, Any] = {}
    if method.pairs is not None:   # the stage's own training pairs, made by the SFT policy before it trains
        own, made = method.pairs(run, model, tok, {"data": data_dir, "sft": sft_dir, **(more or {})})
        train_pairs = method.examples(cfg, own)
    train_fit, n_trunc, n_drop = fit_pairs(train_pairs, tok, cfg.max_length, cfg.overlong, name, method.distinct)
    held_fit, e_trunc, e_drop = fit_pairs(held_pairs, tok, cfg.max_length, cfg.overlong, name, method.distinct)
    torch.manual_seed(cfg.seed)
    model = lora.wrap(model, cfg.lora, "CAUSAL_LM", f"{name}.lora")
    prepared = Prepared(train_fit, held_fit, tok.pad_token_id, 2 * cfg.batch_size, ctx, name)
    recipe = supervised.Recipe(
        model, len(train_fit), lambda engine, micro: method.task(cfg, engine, micro, prepared),   # 3-4.
        measure=lambda engine: measure_policy(name, engine, tok, params, sft_dir, prompts, ctx),   # every rank
        # 5. The final metrics and the sampled measurement.
        report=lambda model, result, measured: {**made, **method.report(result), **measured},
        counts={**method.counts([pair for pair, _ in train_fit]), "data/truncated": n_trunc, "data/dropped": n_drop,
                "data/eval_truncated": e_trunc, "data/eval_dropped": e_drop})
    model, metrics = supervised.run(name, cfg, recipe, run.out, run.checkpoint, run.tracker, ctx, run.fingerprint,
                                    progress)
    return model, tok, metrics


def run(method: PairMethod, params: Params, data_dir: Path, sft_dir: Path, out: Path,
        progress: bool = True, **more: Any) -> dict[str, Any]:
    """The stage: train, measure, then write model/, metrics.json, config.json and the step logs
    atomically (rank 0 writes; other ranks of a multi-process run return empty metrics). `more`:
    the stage's other inputs by name (its SPEC's other input folders, the user's dataset paths; None
    for none), part of its fingerprint and handed to `method.pairs`."""
    from .skeleton import stage_run
    spec, folders = method.spec, {"data": data_dir, "sft": sft_dir, **more}
    dataset = getattr(params, spec.name).dataset
    # The SPEC's input folders first, in its order: the skeleton reads them by position.
    local = [folders[k] for k in spec.inputs] + [dataset.path] + [v for k, v in more.items() if k not in spec.inputs]
    with stage_run(spec, params, out, local) as run:
        model, tok, metrics = train(method, run, data_dir, sft_dir, progress, more)
        run.finish(metrics, model, tok)
    return metrics


def memory_plan_of(name: str, params: Params, shapes: memory_plan.Shapes) -> Optional[memory_plan.Planner]:
    """The SFT policy trained on two sequences per example (dpo: a pair's two responses in one
    forward; kto: its own response with grad, and the per-step KL forward without gradient, two
    micro-batches of rows at a time); its reference log-probs come from the same engine, so no
    second model."""
    from ..training import memory_plan
    if not shapes.ready("sft"):
        return None
    sft = shapes.model("sft")
    return memory_plan.supervised_planner(name, params, sft, (sft,), rows=2,
                                          sampled=lambda cfg: params.prompts.sampling.max_new_tokens,
                                          beside=(sft,))   # the SFT policy, loaded for the KL
