"""The `ppo` stage: build the four models, run (or resume) the PPO loop, measure the result.

Outputs under `outputs/ppo/`: `model/` (the actor, a plain HF checkpoint), `train.tsv` (every
metric of every iteration), `metrics.json` (final training metrics and the held-out comparison of
the PPO policy with the SFT policy it started from), `config.json`, and `checkpoint/` (resumable
state; a `persist: true` DVC output, which DVC does not clear before re-running, so a killed run
resumes).
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


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, out: Path,
        progress: bool = True) -> dict[str, Any]:
    resolved = {"data": {"task": params.data.task}, "model": {"trust_remote_code": params.model.trust_remote_code},
                "reward": {"max_length": params.reward.max_length}, "ppo": to_dict(params.ppo)}
    with distributed.session(params.ppo.distributed) as ctx:
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            stale_extras(out, params.ppo.lora.enabled, ctx.world_size > 1 or params.ppo.distributed.backend != "none")
        ctx.barrier()
        with stage_tracking("ppo", resolved, [data_dir, sft_dir, reward_dir], enabled=ctx.is_main) as tracker:
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
    fp = checkpoint.fingerprint(resolved, [sft_dir, reward_dir])
    step_log = StepLog(out / "train.tsv", tracker=tracker, series="train", write=ctx.is_main)
    saved_log = checkpoint.load(trainer, out / "checkpoint", fp)
    if saved_log is not None:
        step_log.restore(saved_log["rows"], saved_log["columns"])
        log.warning("ppo: resuming from %s at iteration %d", out / "checkpoint", trainer.iteration)
    bar = tqdm(total=cfg.iterations, initial=trainer.iteration, desc="ppo", disable=not (progress and ctx.is_main),
               mininterval=1.0)
    while trainer.iteration < cfg.iterations:
        stats = trainer.step()
        step_log.log(trainer.iteration, stats)
        bar.update(1)
        bar.set_postfix(score=f"{stats['objective/scores']:.2f}", kl=f"{stats['objective/kl']:.2f}")
        if trainer.iteration % cfg.save_every == 0 or trainer.iteration == cfg.iterations:
            step_log.flush()
            checkpoint.save(trainer, step_log, out / "checkpoint", fp)
    bar.close()
    step_log.flush()

    adapter_dir = out / "adapter" if cfg.lora.enabled else None
    plain = evaluation_models(models, params, sft_dir, reward_dir, adapter_dir)   # collective; None on ranks > 0
    if plain is None:
        return {}
    actor, ref, reward = plain
    last = step_log.rows[-1]
    metrics: dict[str, Any] = {f"train/{k.replace('/', '_')}": v for k, v in last.items() if k != "step"}
    metrics.update({"data/prompts_truncated": n_trunc, "data/prompts_dropped": n_drop})
    metrics.update(compare_policies(actor, ref, models.tok, params, eval_prompts, judge, reward))
    with atomic_dir(out / "model") as tmp:
        save_checkpoint(actor, models.tok, tmp)

    atomic_write_text(out / "config.json", json.dumps(resolved, indent=2) + "\n")
    write_metrics(out / "metrics.json", metrics, tracker)
    tracker.log_outputs(out)
    return metrics
