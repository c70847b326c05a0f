"""The `ppo` stage: build the four models, run (or resume) the PPO loop, measure the result.

Outputs under `outputs/ppo/`: `model/` (the actor, a plain HF checkpoint), `train.tsv` (every
metric of every iteration), `metrics.json` (final training metrics, the over-optimisation
detector's record and the held-out comparison of the PPO policy with the SFT policy it started
from), `config.json`, and `checkpoint/` (resumable state; a `persist: true` DVC output, which DVC
does not clear before re-running, so a killed run resumes).

The detector (detector.py) reads each iteration's stats. With `ppo.detector.action: stop`, its
first alarm ends the loop and the saved actor is the one of the last checkpoint before the alarm:
the latest weights whose rollouts had not yet tripped it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..config import Params, PPOConfig, SamplingConfig
from ..errors import ConfigError
from ..progress import Progress
from ..tracking.sinks import StepLog
from ..training import stopping
from ..tracking.metric_names import METRICS_JSON, Metric
from ..tracking.model_card import ModelFacts
from .spec import StageSpec

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    from ..models.rollout_engine import RolloutEngine
    from ..ppo.detector import Detector
    from ..ppo.placement import PPOModels
    from ..ppo.quantile_reward import ReferenceScores
    from ..ppo.trainer import PPOTrainer
    from ..training import memory_plan
    from .skeleton import StageRun

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per iteration; statistics are averaged over processes unless said otherwise",
    "metrics.json": "the last row of `train.tsv` under `train/`, the detector's record, and the "
                    "held-out comparison of the PPO policy (`ppo/*`) with the SFT policy (`sft/*`), "
                    "sampled as in PPO",
}
METRIC_NOTES = """\
With `ppo.detector.action: warn` the first alarm logs one line naming the signals over their
thresholds. `python -m pipeline detect outputs/ppo/train.tsv` replays the detector on a logged run
(each signal's maximum, the first alarm) to calibrate the thresholds.

Health warnings in the log: mean ratio more than 0.2 from 1, KL above 20 nats per response, more
than 30% of tokens clipped, and (when the old log-probs are the sampler's) a sampler/trainer
difference `val/logprob_diff_max` above 1e-4 nats. The log's first PPO line says whose log-probs
are the old policy's (`ppo.recompute_logprobs`), why, and the difference measured.
A NaN or infinite loss, gradient, reward or advantage stops the stage
with the iteration and the quantity named; the last checkpoint is kept.
"""


def declared_metrics(stage: str = "ppo") -> list[Metric]:
    """The PPO stage's names; `stage="grpo"`: the same trainer without a critic (compare/dvc.yaml).
    The step log's columns are those of the section's default estimator (`<stage>.advantage`)."""
    from ..ppo.advantages import ESTIMATORS
    from ..ppo.trainer import CRITIC_COLUMNS, TRAIN_COLUMNS
    facts = ESTIMATORS.facts(getattr(Params(), stage).advantage)

    def m(file: str, name: str, meaning: str, condition: Optional[str] = None, copy_of: Optional[str] = None):
        if stage != "ppo":
            meaning = meaning.replace("`ppo.", f"`{stage}.").replace("PPO policy", f"{stage.upper()} policy")
            condition = "compare" if condition is None else condition
        return Metric(stage, file, name, meaning, condition, copy_of)

    train = [row for row in TRAIN_COLUMNS if facts["critic"] or row[0] not in CRITIC_COLUMNS]
    train += [(name, meaning, None) for name, meaning in facts["columns"]]
    out = [m("train.tsv", name, meaning, condition) for name, meaning, condition in train]
    out += [m(METRICS_JSON, f"train/{name.replace('/', '_')}", f"the last iteration's `{name}`", condition, name)
            for name, _, condition in train if name != "step"]
    out += [
        m(METRICS_JSON, "data/prompts_truncated", "training prompts longer than `ppo.max_prompt_length` kept with "
                                                  "their left end cut (`ppo.overlong: truncate`)"),
        m(METRICS_JSON, "data/prompts_dropped", "training prompts longer than `ppo.max_prompt_length` left out "
                                                "(`ppo.overlong: drop`)"),
        m(METRICS_JSON, "detector/first_fire", "the first iteration the detector fired (0 if it never fired)",
          "!no_detector"),
        m(METRICS_JSON, "detector/fired", "1 if the detector fired at any iteration", "!no_detector"),
        m(METRICS_JSON, "detector/stopped_at", "with `action: stop`, the iteration whose alarm ended training; 0 "
                                               "otherwise", "!no_detector"),
        m(METRICS_JSON, "detector/kept_iteration", "the iteration whose actor weights are in `model/`: the last "
                                                   "checkpoint before the alarm after a stop, else the last "
                                                   "iteration", "!no_detector"),
    ]
    for policy, who in (("sft", "the SFT (reference) policy"), (stage, "the PPO policy")):
        out += [
            m(METRICS_JSON, f"{policy}/rm", f"mean score by PPO's reward source (`ppo.reward_source`) of "
                                            f"responses sampled from {who} to the first `ppo.n_eval_prompts` "
                                            "held-out prompts"),
            m(METRICS_JSON, f"{policy}/rm_ci95", "half-width of its 95% interval"),
            m(METRICS_JSON, f"{policy}/kl", f"mean sequence-level sampled KL of {who} to the reference on "
                                            "those prompts" + (" (0 by construction)" if policy == "sft" else "")),
            m(METRICS_JSON, f"{policy}/kl_ci95", "half-width of its 95% interval"),
            m(METRICS_JSON, f"{policy}/gold", f"mean gold score of {who}'s responses", "!no_judge"),
            m(METRICS_JSON, f"{policy}/gold_ci95", "half-width of its 95% interval", "!no_judge"),
            m(METRICS_JSON, f"{policy}/eos_rate", f"rate of {who}'s responses that ended with eos or the stop "
                                                  "token"),
            m(METRICS_JSON, f"{policy}/length", f"mean length of {who}'s responses, words"),
            m(METRICS_JSON, f"{policy}/distinct_2", f"distinct bigrams / bigrams over {who}'s responses (words)"),
        ]
    out += [
        m(METRICS_JSON, f"{stage}/gold_gain", f"mean paired gold-score difference {stage.upper()} - SFT on the same "
                                              "prompts", "!no_judge"),
        m(METRICS_JSON, f"{stage}/gold_gain_ci95", "half-width of its 95% interval", "!no_judge"),
    ]
    return out


SPEC = StageSpec(
    "ppo", help="PPO against the reward model", inputs=("data", "sft", "reward"), training=True, shape="load",
    policy=True, headline=("ppo/gold", "ppo/rm", "ppo/kl", "detector/fired"),
    parent_params=("ppo.seed", "ppo.lr", "ppo.kl_coef", "ppo.adaptive_kl", "ppo.iterations", "ppo.rollout_batch_size"),
    model=ModelFacts("the PPO policy", "the SFT policy, against the reward model", "rlhf-policy",
                     "The PPO policy of the RLHF pipeline (transformers text-generation, with its tokenizer)."),
    check_inputs=lambda params, data_dir: check_inputs(params, data_dir),
    metrics=declared_metrics, files=METRIC_FILES, notes=METRIC_NOTES,
    plan=lambda params, shapes: memory_plan_of(params, shapes), reads=(
    "data.task", "model.trust_remote_code",
    "reward.max_length",         # the reward model scores as it was trained
    "ppo", "distributed",
    "prompts",                   # training prompts (train split), held-out ones and how they are measured
))

log = logging.getLogger(__name__)


def memory_plan_of(params: Params, shapes: memory_plan.Shapes, section: str = "ppo") -> Optional[memory_plan.Planner]:
    """The four PPO models (or the critic-free three) of `section` (ppo, or grpo's copy of its keys)."""
    from ..training import memory_plan
    return memory_plan.rl_planner(params, section, shapes)


def check_inputs(params: Params, data_dir: Path) -> None:
    """What the RL stages read before their first step: the prompts, train and held-out (the
    held-out split checked for leaks from the train split)."""
    from ..data import inputs
    inputs.prompts(params, data_dir, "eval")


def compare_policies(models: PPOModels, cfg: PPOConfig, sampling: SamplingConfig, max_prompt_length: int,
                     prompts: list[str], judge: Optional[Callable], policy_name: str = "ppo") -> dict[str, Any]:
    """Collective. The trained policy vs the SFT (reference) policy on the same held-out prompts,
    sampled as `sampling` says (`prompts.sampling`), where the models are (every rank its share of
    the prompts): `<policy>/<rm|kl|gold>` with their 95% half-widths and `<policy>/eos_rate` for
    `sft` and the trained policy (the names the evaluate and compare stages give a policy), and the
    trained policy's per-prompt gold gain over SFT, `<policy>/gold_gain`. `policy_name`: the stage (ppo, grpo), `cfg` its section."""
    from ..measurement.policy import measure_trained
    return measure_trained(policy_name, models.actor, models.tok, prompts, sampling, cfg.seed + 7, sft=models.reference(),
                           reward=models.reward, judge=judge, max_prompt_length=max_prompt_length, ctx=models.ctx,
                           beside_sft=True, packed=cfg.packing)[0]


def reference_scores(models: PPOModels, cfg: PPOConfig, prompts: list, progress: bool) -> ReferenceScores:
    """Collective (each process samples the whole table, the same one). The SFT policy's shaped scores on
    `cfg.quantile_reward_samples` responses to each training prompt, sampled as rollouts are (a
    process's rollout batch per call, our sampler) from a stream of their own: the rollouts' stream
    is untouched, so the first iteration samples what it would without them."""
    from .. import devices
    from ..measurement.policy import whole
    from ..ppo.quantile_reward import sample_reference_scores
    from ..ppo.scoring import shaped_scores
    ctx = models.ctx
    generator = devices.generator(ctx.device, cfg.seed + 104729)
    with whole(models.reference()) as ref, models.actor.autocast():
        return sample_reference_scores(
            ref, models.tok, models.reward, prompts, cfg.quantile_reward_samples, cfg.sampling, generator,
            lambda raw, ended: shaped_scores(raw, ended, cfg.missing_eos_score, cfg.score_clip),
            cfg.rollout_batch_size // ctx.world_size, cfg.max_prompt_length, progress,
            micro_batch=cfg.rollout_micro_batch_size, drop_finished=cfg.rollout_drop_finished,
            max_tokens=cfg.rollout_max_tokens)


def auditor_dirs(cfg: PPOConfig) -> list[Path]:
    det = cfg.detector
    return [Path(det.auditor)] if det.enabled and det.auditor is not None else []


def progress_fields(stats: dict[str, float], detector: Optional[Detector]) -> dict[str, str]:
    """The progress bar's postfix: RM score, KL, gold score (with a judge), detector state."""
    fields = {"score": f"{stats['objective/scores']:.2f}", "kl": f"{stats['objective/kl']:.2f}"}
    if "objective/gold_scores" in stats:
        fields["gold"] = f"{stats['objective/gold_scores']:.2f}"
    if detector is not None:
        fields["detector"] = detector.state()
    return fields


def train(trainer: PPOTrainer, detector: Optional[Detector], step_log: StepLog, ckpt: Path, fp: str,
          progress: bool, name: str = "ppo") -> int:
    """The numbered loop (trainer.py) from the trainer's iteration on, fed to the detector, logged,
    checkpointed every save_every and when a stop signal came (training/stopping.py: then it raises
    Stopped). Returns the iteration the detector stopped it at (0: it didn't)."""
    from ..ppo import checkpoint
    cfg, ctx = trainer.cfg, trainer.ctx
    bar = Progress(cfg.iterations, name, unit="iterations", initial=trainer.iteration, enabled=progress)
    stopped_at = 0
    while trainer.iteration < cfg.iterations:
        stats = trainer.step()
        if detector is not None:   # every rank holds the same reduced stats: all agree on an alarm
            fired_before = detector.first_fire
            stats.update(detector.update(stats))
            if detector.first_fire and not fired_before and ctx.is_main:
                log.warning(detector.message())
        step_log.log(trainer.iteration, stats)
        bar.update(1, progress_fields(stats, detector))
        if detector is not None and detector.first_fire == trainer.iteration and cfg.detector.action == "stop":
            stopped_at = trainer.iteration   # no checkpoint of this iteration: the last one predates the alarm
            break
        saved = trainer.iteration % cfg.save_every == 0 or trainer.iteration == cfg.iterations
        signum = stopping.requested(ctx)   # collective: every rank stops after the same iteration
        if saved or signum:
            step_log.flush()
            checkpoint.save(trainer, step_log, ckpt, fp)
        if signum:
            bar.close()
            raise stopping.stop(name, signum, f"after iteration {trainer.iteration} of {cfg.iterations}")
    bar.close()
    step_log.flush()
    return stopped_at


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, out: Path,
        progress: bool = True, spec: StageSpec = SPEC) -> dict[str, Any]:
    """The stage: place the models, run (or resume) the loop, compare with SFT, write the outputs.
    The auditor's weights are an input of the run like the SFT model and the RM. `spec`: the stage
    that runs this code with its own params section (grpo.SPEC), in place of `ppo`."""
    from .skeleton import stage_run
    inputs_ = [data_dir, sft_dir, reward_dir, *auditor_dirs(getattr(params, spec.name)), params.prompts.dataset.path]
    with stage_run(spec, params, out, inputs_) as run:
        model, tok, metrics = _run(run, data_dir, sft_dir, reward_dir, progress)
        run.finish(metrics, model, tok)
    return metrics


def rollout_engine(run: StageRun, inputs_: list[Path]) -> RolloutEngine:
    """The engine of the rollouts (`rollout_engine`): our sampler, or vLLM in this process, its
    memory what the stage's memory plan leaves of the device and its weights the actor's (loaded
    at each rollout; the SFT model's folder gives the architecture)."""
    import torch
    from ..models.rollout_engine import TORCH
    from ..training import memory_plan
    cfg: PPOConfig = getattr(run.params, run.spec.name)
    if cfg.rollout_engine == "torch":
        return TORCH
    key = f"{run.spec.name}.rollout_engine"
    # CUDA itself, not any accelerator (devices.is_accelerator): vLLM's kernels, its memory
    # fraction and its weight loading are CUDA's, so no other device can host it.
    if torch.device(run.ctx.device).type != "cuda":
        raise ConfigError(f"{key}: vllm needs a CUDA device; this process has {run.ctx.device}")
    from ..models import vllm_engine   # imports vllm itself only when the engine is made
    plan = memory_plan.stage_plan(run.spec.name, run.spec.plan, run.params, dict(zip(run.spec.inputs, inputs_)))
    device_gib = torch.cuda.get_device_properties(run.ctx.device).total_memory / 2 ** 30
    try:
        return vllm_engine.VllmEngine(
            inputs_[1], dtype="bfloat16" if cfg.distributed.precision == "bf16" else "float32",
            seed=cfg.seed, memory_fraction=vllm_engine.memory_fraction(plan.beside_engine / 2 ** 30 if plan else 0.0,
                                                                       device_gib),
            max_model_len=vllm_engine.max_model_len(cfg.max_prompt_length, cfg.sampling.max_new_tokens))
    except ImportError as err:   # vllm itself is imported when the engine is made
        raise ConfigError(f"{key}: vllm is not installed here ({err}); see docs/guide/rollout-engines.md") from None


def _run(run: StageRun, data_dir: Path, sft_dir: Path, reward_dir: Path, progress: bool):
    from ..data import inputs
    from ..models import lora
    from ..models.reward_source import FunctionSource
    from ..ppo import checkpoint
    from ..ppo.detector import Detector
    from ..ppo.placement import place_models
    from ..ppo.trainer import PPOTrainer
    from ..training.engines import write_deepspeed_config
    params, ctx, out, fp, section = run.params, run.ctx, run.out, run.fingerprint, run.spec.name
    cfg: PPOConfig = getattr(params, section)
    held = params.prompts
    prompts = inputs.prompt_records(params, data_dir, "train")
    eval_prompts = inputs.prompt_records(params, data_dir, "eval")[:cfg.n_eval_prompts]
    judge = inputs.judge(params)
    if cfg.reward_source != "reward_model":   # its contract, on one probe pair, before any model is built
        FunctionSource(cfg.reward_source, probe=(prompts[0][1], "a probe response ."), key=f"{section}.reward_source",
                       timeout=cfg.reward_timeout)
    engine = rollout_engine(run, [data_dir, sft_dir, reward_dir])   # before the trainer takes the device
    models = place_models(params, sft_dir, reward_dir, ctx, section)
    run.check_stop_tokens(models.tok)
    prompts, n_trunc, n_drop = inputs.fit_prompts(prompts, models.tok, cfg.max_prompt_length, cfg.overlong,
                                                  f"{section}.max_prompt_length")
    eval_prompts, _, _ = inputs.fit_prompts(eval_prompts, models.tok, held.max_length, held.overlong,
                                            "prompts.max_length")
    if ctx.is_main:
        critic = {"critic": models.critic} if models.critic is not None else {}
        write_deepspeed_config(out / "deepspeed_config.json", actor=models.actor, **critic, frozen=models.frozen)
    trainer = PPOTrainer(cfg, models, prompts, judge, engine)
    if cfg.quantile_reward_samples:   # before the first iteration, and again on resume (the same bits)
        trainer.quantiles = reference_scores(models, cfg, prompts, progress and ctx.is_main)
        if ctx.is_main:
            log.warning("%s: reward = log CDF of the score among %d SFT responses per training prompt; %s",
                        section, cfg.quantile_reward_samples,
                        ", ".join(f"{k} {v:.3f}" for k, v in trainer.quantiles.stats().items()))
    step_log = StepLog(out / "train.tsv", tracker=run.tracker, series="train", write=ctx.is_main)
    detector = Detector(cfg.detector) if cfg.detector.enabled else None
    saved_log = checkpoint.load(trainer, run.checkpoint, fp)
    if saved_log is not None:
        step_log.restore(saved_log["rows"], saved_log["columns"])
        if detector is not None:   # its state is the history it was fed: replaying it is exact
            for row in saved_log["rows"]:
                detector.update(row)
        log.warning("%s: resuming from %s at iteration %d", run.spec.name, run.checkpoint, trainer.iteration)
        run.tracker.mark_resumed(trainer.iteration)
    stopped_at = train(trainer, detector, step_log, run.checkpoint, fp, progress and ctx.is_main, run.spec.name)
    kept = checkpoint.restore_actor(trainer, run.checkpoint, fp) if stopped_at else trainer.iteration

    held_out = compare_policies(models, cfg, held.sampling, held.max_length, eval_prompts, judge, section)   # collective
    full = models.actor.full_model()   # collective under ZeRO-3; None on ranks > 0
    if full is None:
        return None, models.tok, {}
    actor = lora.export(full, out / "adapter" if cfg.lora.enabled else None).cpu().eval()
    last = step_log.rows[-1]
    metrics: dict[str, Any] = {f"train/{k.replace('/', '_')}": v for k, v in last.items() if k != "step"}
    metrics.update({"data/prompts_truncated": n_trunc, "data/prompts_dropped": n_drop})
    if detector is not None:
        metrics.update({"detector/first_fire": detector.first_fire, "detector/fired": int(bool(detector.first_fire)),
                        "detector/stopped_at": stopped_at, "detector/kept_iteration": kept})
    metrics.update(held_out)
    return actor, models.tok, metrics
