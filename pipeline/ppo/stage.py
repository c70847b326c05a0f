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

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm import tqdm

from .. import distributed
from ..config import Params, to_dict
from ..distributed import Context
from ..engines import write_deepspeed_config
from .. import inputs
from ..evaluate import mean_ci, sequence_kl
from ..generation import generate_texts
from ..io import atomic_dir, atomic_write_text, stale_extras
from ..mlflow_tracking import stage_tracking
from ..models import save_checkpoint
from ..reward_source import RewardSource
from ..tracking import StepLog, Tracker, write_metrics
from . import checkpoint
from .detector import Detector
from .placement import evaluation_models, place_models
from .trainer import PPOTrainer

log = logging.getLogger(__name__)


def compare_policies(actor, ref, tok, params: Params, prompts: list[str], judge: Optional[Callable],
                     reward: RewardSource) -> dict[str, Any]:
    """PPO policy vs the SFT (reference) policy on the same held-out prompts, sampled as in PPO."""
    cfg = params.ppo
    m: dict[str, Any] = {}
    per: dict[str, dict[str, list[float]]] = {}
    for name, policy in (("sft", ref), ("ppo", actor)):
        texts, ended = generate_texts(policy, tok, prompts, cfg.sampling, cfg.seed + 7, greedy=False,
                                      max_prompt_length=cfg.max_prompt_length)
        per[name] = {"rm": reward.score(prompts, texts).tolist(),
                     "kl": sequence_kl(policy, ref, tok, prompts, texts, cfg.sampling.temperature)}
        if judge is not None:
            per[name]["gold"] = [judge(p, r) for p, r in zip(prompts, texts)]
        m[f"eval/eos_rate_{name}"] = sum(ended) / len(ended)
        for key, values in per[name].items():
            m[f"eval/{key}_{name}"], m[f"eval/{key}_{name}_ci95"] = mean_ci(values)
    if judge is not None:
        diff = [a - b for a, b in zip(per["ppo"]["gold"], per["sft"]["gold"])]
        m["eval/gold_gain"], m["eval/gold_gain_ci95"] = mean_ci(diff)
    return m


def auditor_dirs(params: Params) -> list[Path]:
    det = params.ppo.detector
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
          progress: bool) -> int:
    """The numbered loop (trainer.py) from the trainer's iteration on, fed to the detector, logged,
    checkpointed every save_every. Returns the iteration the detector stopped it at (0: it didn't)."""
    cfg, ctx = trainer.cfg, trainer.ctx
    bar = tqdm(total=cfg.iterations, initial=trainer.iteration, desc="ppo", disable=not progress, mininterval=1.0)
    stopped_at = 0
    while trainer.iteration < cfg.iterations:
        stats = trainer.step()
        if detector is not None:   # every rank holds the same reduced stats: all agree on an alarm
            fired_before = detector.first_fire
            stats.update(detector.update(stats))
            if detector.first_fire and not fired_before and ctx.is_main:
                log.warning(detector.message())
        step_log.log(trainer.iteration, stats)
        bar.update(1)
        bar.set_postfix(progress_fields(stats, detector))
        if detector is not None and detector.first_fire == trainer.iteration and cfg.detector.action == "stop":
            stopped_at = trainer.iteration   # no checkpoint of this iteration: the last one predates the alarm
            break
        if trainer.iteration % cfg.save_every == 0 or trainer.iteration == cfg.iterations:
            step_log.flush()
            checkpoint.save(trainer, step_log, ckpt, fp)
    bar.close()
    step_log.flush()
    return stopped_at


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, out: Path,
        progress: bool = True) -> dict[str, Any]:
    resolved = {"data": {"task": params.data.task}, "model": {"trust_remote_code": params.model.trust_remote_code},
                "reward": {"max_length": params.reward.max_length}, "ppo": to_dict(params.ppo)}
    with distributed.session(params.ppo.distributed) as ctx:
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            stale_extras(out, params.ppo.lora.enabled, ctx.world_size > 1 or params.ppo.distributed.backend != "none")
        ctx.barrier()
        with stage_tracking("ppo", resolved, [data_dir, sft_dir, reward_dir, *auditor_dirs(params)],
                            enabled=ctx.is_main) as tracker:
            return _run(params, data_dir, sft_dir, reward_dir, out, resolved, tracker, progress, ctx)


def _run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, out: Path, resolved: dict,
         tracker: Tracker, progress: bool, ctx: Context) -> dict[str, Any]:
    cfg = params.ppo
    prompts = inputs.prompt_records(params, data_dir, "train")
    eval_prompts = inputs.prompt_records(params, data_dir, "eval")[:cfg.n_eval_prompts]
    judge = inputs.judge(params)
    models = place_models(params, sft_dir, reward_dir, ctx)
    prompts, n_trunc, n_drop = inputs.fit_prompts(prompts, models.tok, cfg.max_prompt_length, cfg.overlong)
    eval_prompts, _, _ = inputs.fit_prompts(eval_prompts, models.tok, cfg.max_prompt_length, cfg.overlong)
    if ctx.is_main:
        write_deepspeed_config(out / "deepspeed_config.json", actor=models.actor, critic=models.critic,
                               frozen=models.frozen)
    trainer = PPOTrainer(cfg, models, prompts, judge)
    # The auditor's weights are an input of the run like the SFT model and the RM.
    fp = checkpoint.fingerprint(resolved, [sft_dir, reward_dir, *auditor_dirs(params)])
    step_log = StepLog(out / "train.tsv", tracker=tracker, series="train", write=ctx.is_main)
    detector = Detector(cfg.detector) if cfg.detector.enabled else None
    saved_log = checkpoint.load(trainer, out / "checkpoint", fp)
    if saved_log is not None:
        step_log.restore(saved_log["rows"], saved_log["columns"])
        if detector is not None:   # its state is the history it was fed: replaying it is exact
            for row in saved_log["rows"]:
                detector.update(row)
        log.warning("ppo: resuming from %s at iteration %d", out / "checkpoint", trainer.iteration)
    stopped_at = train(trainer, detector, step_log, out / "checkpoint", fp, progress and ctx.is_main)
    kept = checkpoint.restore_actor(trainer, out / "checkpoint", fp) if stopped_at else trainer.iteration

    adapter_dir = out / "adapter" if cfg.lora.enabled else None
    plain = evaluation_models(models, params, sft_dir, reward_dir, adapter_dir)   # collective; None on ranks > 0
    if plain is None:
        return {}
    actor, ref, reward = plain
    last = step_log.rows[-1]
    metrics: dict[str, Any] = {f"train/{k.replace('/', '_')}": v for k, v in last.items() if k != "step"}
    metrics.update({"data/prompts_truncated": n_trunc, "data/prompts_dropped": n_drop})
    if detector is not None:
        metrics.update({"detector/first_fire": detector.first_fire, "detector/fired": int(bool(detector.first_fire)),
                        "detector/stopped_at": stopped_at, "detector/kept_iteration": kept})
    metrics.update(compare_policies(actor, ref, models.tok, params, eval_prompts, judge, reward))
    with atomic_dir(out / "model") as tmp:
        save_checkpoint(actor, models.tok, tmp)

    atomic_write_text(out / "config.json", json.dumps(resolved, indent=2) + "\n")
    write_metrics(out / "metrics.json", metrics, tracker)
    tracker.log_outputs(out)
    return metrics
