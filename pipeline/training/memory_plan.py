"""A memory plan before launch: bytes per rank of every stage, predicted from the configs alone.

What each model, phase and offload costs is pipeline/training/memory_terms.py's (its doc lists
every term and what is not counted). This module finds each stage's models and batch shapes: from
the params alone (`planned`, before any checkpoint exists; `python -m pipeline plan` prints each
stage's table) or from the stage's input folders (`stage_plan`). A plan is a function of the
stage's own params section (a `Planner`), so a changed setting is re-planned exactly.

`check_stage` runs in the stage skeleton before a training stage builds a model: a plan larger
than the device is a ConfigError naming settings that shrink it (`advice`). A suggestion is only
made when the config accepts it (the changed section is rebuilt, so its checks run, and the batch
split is checked as the stage checks it), when the models support it (gradient checkpointing), and
when the re-planned need is smaller; the largest saving comes first.

Where a stage runs is where its `distributed` section resolves (pipeline/training/distributed.py's
resolve_device). On the CPU every row is RAM: a rank needs its device rows and its share of the
node's cpu rows, against its share of the available RAM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import Params, PPOConfig, check_batch_split, from_dict, to_dict
from ..errors import MAX_MESSAGE, ConfigError
from .memory_terms import (
    GIB, PHASES, STATES, ModelShape, Plan, as_saved_by, checkpoint_shape, inference_plan, policy_config, rl_plan,
    shape_of, supervised_plan, with_attention,
)

log = logging.getLogger(__name__)

WARN_FRACTION = 0.9   # a plan above 90% of the device warns: allocator and CUDA context are not counted
Planner = Callable[[Any], Plan]   # the stage's params section -> its plan


# ---- Device --------------------------------------------------------------------------------------


def runs_on_cpu(dist: Any) -> bool:
    """Whether the stage's models live on the CPU (as distributed.resolve_device decides)."""
    if dist.device == "cpu":
        return True
    import torch
    return dist.device == "auto" and not torch.cuda.is_available()


def device_memory(dist: Any) -> tuple[float, str]:
    """Bytes one rank may use, and where the number comes from: `distributed.device_memory_gb`
    when set; else the free memory of this process's GPU (pipeline/devices.py); else this
    machine's available RAM shared by the node's processes."""
    if dist.device_memory_gb is not None:
        return dist.device_memory_gb * GIB, "distributed.device_memory_gb"
    import torch

    from .. import devices
    # The device the config resolves to, as resolve_device would (a plan is made before any process
    # has one: `python -m pipeline plan`); CUDA is the one besides the CPU that `distributed.device` offers.
    free = devices.free_memory(torch.device("cuda" if dist.device != "cpu" and torch.cuda.is_available() else "cpu"))
    if free is not None:   # None on the CPU: its memory is the machine's RAM
        return float(free[0]), f"free on {free[1]}"
    import psutil
    n = dist.num_processes
    return float(psutil.virtual_memory().available) / n, "available RAM" + (f" / {n} processes" if n > 1 else "")


def need(plan: Plan, on_cpu: bool) -> float:
    """Bytes one rank needs: its device rows; on the CPU also its share of the node's cpu rows."""
    return plan.total + (plan.cpu_total / plan.processes if on_cpu else 0.0)


def _cost(plan: Plan, on_cpu: bool) -> float:
    """What a suggestion must shrink: one GPU's bytes, or the node's RAM on the CPU (where more
    processes on the node are more copies, not more memory)."""
    return need(plan, on_cpu) * (plan.processes if on_cpu else 1)


# ---- Suggestions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Suggestion:
    """A change to params.yaml: set `key` (dotted) to `value`, together with `also` (keys the
    config accepts only with it, e.g. zero_stage 3 for offload_frozen); `saves`: bytes it saves."""
    key: str
    value: Any
    reason: str
    also: tuple[tuple[str, Any], ...] = ()
    saves: float = 0.0

    @property
    def settings(self) -> dict[str, Any]:
        return {self.key: self.value, **dict(self.also)}

    def __str__(self) -> str:
        sets = " and ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings.items())
        return f"set {sets} ({self.reason}, saves {self.saves / GIB:.3g} GiB)"


def candidates(stage: str, cfg: Any, plan: Plan, on_cpu: bool = False) -> list[Suggestion]:
    """Settings that may shrink `plan`, each with the keys the config needs alongside it; which
    ones do is for `advice` to find out. On the CPU nothing is offloaded (it is the same RAM) and
    no processes are added (each is one more copy in that RAM)."""
    dist, d = cfg.distributed, f"{stage}.distributed"
    out: list[Suggestion] = []

    def suggest(key: str, value: Any, reason: str, **with_: Any) -> None:
        also = tuple((f"{d}.{k}", v) for k, v in with_.items() if getattr(dist, k) != v)
        out.append(Suggestion(key, value, reason, also))

    if dist.precision == "fp32":   # bf16, never fp16: fp16 needs DeepSpeed's loss scaling
        suggest(f"{d}.precision", "bf16", "16-bit activations, caches, frozen weights")
    if not plan.trains:   # evaluate, compare: every model whole on every rank
        return out
    ppo = isinstance(cfg, PPOConfig)
    # A shared value head is no transformers model: engines.enable_checkpointing refuses it.
    if not dist.gradient_checkpointing and plan.checkpointing and not (ppo and cfg.shared_backbone and cfg.uses_critic):
        suggest(f"{d}.gradient_checkpointing", True, "layers recomputed in the backward")
    for zero in range(dist.zero_stage + 1, 4):
        suggest(f"{d}.zero_stage", zero, f"partitioned over {dist.world_size} ranks", backend="deepspeed")
    if not on_cpu:
        if not dist.offload_optimizer:
            suggest(f"{d}.offload_optimizer", True, "AdamW states and gradients in CPU RAM",
                    backend="deepspeed", zero_stage=max(2, dist.zero_stage))
        if not dist.offload_param:
            suggest(f"{d}.offload_param", True, "weights in CPU RAM too", backend="deepspeed",
                    zero_stage=3, offload_optimizer=True)
        if plan.device["frozen"] and not dist.offload_frozen:
            suggest(f"{d}.offload_frozen", True, "frozen models in CPU RAM", backend="deepspeed", zero_stage=3)
        suggest(f"{d}.num_processes", 2 * dist.num_processes, "a GPU each, smaller shares", backend="deepspeed")
    if not ppo:
        suggest(f"{d}.gradient_accumulation_steps", 2 * dist.gradient_accumulation_steps,
                "half the micro-batch, the same step")
        return out
    if cfg.micro_batch_size > 1:
        suggest(f"{stage}.micro_batch_size", cfg.micro_batch_size // 2, "a smaller training forward")
    score = cfg.score_micro_batch_size or cfg.micro_batch_size
    if score > 1:
        suggest(f"{stage}.score_micro_batch_size", score // 2, "a smaller scoring forward")
    rows = cfg.rollout_micro_batch_size or cfg.rollout_batch_size // dist.world_size
    if cfg.rollout_max_tokens is not None:   # rollout_micro_batch_size beside it is refused
        if cfg.rollout_max_tokens > 1:
            suggest(f"{stage}.rollout_max_tokens", cfg.rollout_max_tokens // 2,
                    "sampling in smaller calls, the same training")
    elif rows > 1:
        suggest(f"{stage}.rollout_micro_batch_size", rows // 2, "sampling in smaller calls, the same training")
    suggest(f"{stage}.rollout_batch_size", cfg.rollout_batch_size // 2, "fewer responses; changes training")
    return out


def apply(stage: str, cfg: Any, settings: dict[str, Any]) -> Any:
    """The section `cfg` of `stage` with the dotted `settings` set, validated as loading params
    validates it (config.from_dict: types, bounds, every check of the combination; ConfigError
    when refused), and its batch split checked as the stage checks it before building a model."""
    data = to_dict(cfg)
    for key, value in settings.items():
        *path, leaf = key.split(".")[1:]   # below the section
        node = data
        for part in path:
            node = node[part]
        node[leaf] = value
    new = from_dict(type(cfg), data, stage)
    if isinstance(new, PPOConfig):
        new.check_shape()
    elif hasattr(new, "batch_size"):
        check_batch_split(stage, new.batch_size, new.distributed)
    return new


def advice(stage: str, cfg: Any, planner: Planner, on_cpu: bool = False) -> list[Suggestion]:
    """The candidates the config accepts that shrink the re-planned need, the best value of each
    key only, largest saving first."""
    plan = planner(cfg)
    before = _cost(plan, on_cpu)
    best: dict[str, Suggestion] = {}
    for s in candidates(stage, cfg, plan, on_cpu):
        try:
            after = _cost(planner(apply(stage, cfg, s.settings)), on_cpu)
        except ConfigError:
            continue   # a combination the config (or the stage's batch split) refuses is never suggested
        if after < before and before - after > best.get(s.key, s).saves:
            best[s.key] = replace(s, saves=before - after)
    return sorted(best.values(), key=lambda s: -s.saves)


# ---- Verdict and table ---------------------------------------------------------------------------


def verdict(plan: Plan, available: float, source: str, suggestions: tuple[Suggestion, ...] | list[Suggestion] = (),
            on_cpu: bool = False) -> Optional[str]:
    """None when the plan fits with 10% to spare; a warning text when it fits narrowly.
    Raises ConfigError (one line with the settings that shrink it most) when it does not fit."""
    total = need(plan, on_cpu)
    if total > available:
        head = f"{plan.stage}: plan {total / GIB:.3g} GiB > {available / GIB:.3g} GiB device ({source}): "
        raise ConfigError(head + _tips(plan.stage, suggestions, MAX_MESSAGE - len(head)))
    if total > WARN_FRACTION * available:
        head = (f"{plan.stage}: plan {total / GIB:.3g} GiB is within 10% of the {available / GIB:.3g} GiB device "
                f"({source}), which leaves little for the allocator and CUDA context; to gain room: ")
        return head + _tips(plan.stage, suggestions, MAX_MESSAGE - len(head))
    return None


def _tips(stage: str, suggestions: tuple[Suggestion, ...] | list[Suggestion], room: int) -> str:
    """As many suggestions as the one-line message has room for, best first, and how many more."""
    if not suggestions:
        return f"no setting of {stage} shrinks it; a larger device, or smaller models"
    texts = [str(s) for s in suggestions]

    def more(k: int) -> str:
        return f"; {len(texts) - k} more: python -m pipeline plan --stage {stage}" if k < len(texts) else ""
    k = 1
    while k < len(texts) and len("; ".join(texts[:k + 1]) + more(k + 1)) <= room:
        k += 1
    return "; ".join(texts[:k]) + more(k)


def assess(stage: str, cfg: Any, planner: Planner, plan: Plan) -> tuple[float, str, bool, list[Suggestion]]:
    """The bytes one rank may use, their source, whether the stage runs on the CPU, and the
    suggestions (worked out only when the plan is within 10% of the device or over it)."""
    dist = cfg.distributed
    available, source = device_memory(dist)
    on_cpu = runs_on_cpu(dist)
    tips = advice(stage, cfg, planner, on_cpu) if need(plan, on_cpu) > WARN_FRACTION * available else []
    return available, source, on_cpu, tips


LABELS = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer states", "frozen": "frozen models",
          "update": "update: activations", "rollout": "rollout: KV, logits, engine", "scoring": "scoring forwards",
          "measurement": "final measurement", "loading": "checkpoint read"}


def table(plan: Plan, available: float, source: str, on_cpu: bool = False,
          suggestions: tuple[Suggestion, ...] | list[Suggestion] = ()) -> str:
    """The plan as a text table (GiB per rank on the device, GiB per node on the CPU), then every
    suggestion, largest saving first."""
    def gib(x: float) -> str:
        return f"{x / GIB:11.4f}"
    lines = [f"{plan.stage + ' (GiB)':<26}{'device/rank':>11} {'cpu/node':>11}"]
    for row in STATES:
        lines.append(f"  {LABELS[row]:<24}{gib(plan.device[row])} {gib(plan.cpu[row])}")
    lines.append(f"  {LABELS['loading']:<24}{'-':>11} {gib(plan.cpu['loading'])}")
    lines.append("  phases (never at once; the largest counts):")
    for row in PHASES:
        mark = "  <- largest" if row == plan.peak_phase else ""
        lines.append(f"    {LABELS[row]:<22}{gib(plan.device[row])}{mark}")
    lines.append(f"  {'total':<24}{gib(plan.total)} {gib(plan.cpu_total)}")
    if on_cpu:
        lines.append(f"  on the CPU every row is RAM: a rank needs {need(plan, on_cpu) / GIB:.4f} GiB "
                     f"(its device rows and 1/{plan.processes} of the cpu ones)")
    lines.append(f"  {'device memory':<24}{gib(available)}  ({source})")
    lines.append(f"  {'headroom':<24}{gib(available - need(plan, on_cpu))}")
    lines += [f"  to shrink it: {s}" for s in suggestions]
    return "\n".join(lines)


# ---- Plans of the pipeline's stages ----------------------------------------------------------------


def _micro(cfg: Any) -> int:
    """A supervised section's examples per forward on one rank."""
    return cfg.batch_size // (cfg.distributed.world_size * cfg.distributed.gradient_accumulation_steps)


def _sequences(cfg: Any, rows: int) -> int:
    """Sequences of `cfg.max_length` one supervised forward holds at most, `rows` per example: a
    fixed micro-batch's, or under a token budget as many as it fits (rows x longest <= budget, an
    example longer than the budget alone: training/token_batches.py)."""
    budget = cfg.distributed.max_tokens_per_micro_batch
    if budget is None:
        return rows * _micro(cfg)
    return max(rows, budget // cfg.max_length)


def supervised_planner(stage: str, params: Params, model: ModelShape, read: tuple[ModelShape, ...], rows: int = 1,
                       sampled: Optional[Callable[[Any], int]] = None,
                       beside: tuple[ModelShape, ...] = ()) -> Planner:
    """One trained model (sft, reward, dpo, rs, ...): `rows` sequences per example in one forward (a
    preference pair is two); `sampled(cfg)`: the most new tokens the trained policy samples on the
    held-out prompts (up to prompts.max_length long) with its own weights, or None when it
    samples none (the reward model is measured on the SFT policy's samples); `beside`: the models
    the measurement loads whole beside the trained one (memory_terms.supervised_plan)."""
    def shape(cfg: Any) -> tuple[int, int]:
        """(sequences, tokens each) of the largest forward: packed (`<stage>.packing`), one row of
        them all, a pair's two sequences included."""
        n = _sequences(cfg, rows)
        return (1, n * cfg.max_length) if getattr(cfg, "packing", False) else (n, cfg.max_length)

    if sampled is None:
        return lambda cfg: supervised_plan(stage, model, cfg.distributed, *shape(cfg), cfg.lora, read, beside=beside)
    prompt = params.prompts.max_length
    return lambda cfg: supervised_plan(stage, model, cfg.distributed, *shape(cfg), cfg.lora,
                                       read, (prompt, sampled(cfg)), beside, getattr(cfg, "packing", False))


def ppo_planner(params: Params, actor: ModelShape, critic: Optional[ModelShape], reward: Optional[ModelShape],
                auditors: tuple[ModelShape, ...] = ()) -> Planner:
    """The PPO trainer as its section (ppo, or grpo) configures it: no critic with a critic-free
    estimator or a shared backbone; rollout_batch_size counts responses, k per prompt; the reward
    model reads reward.max_length tokens of each rollout."""
    reward_length = params.reward.max_length

    def plan(cfg: PPOConfig) -> Plan:
        k, det = cfg.samples_per_prompt, cfg.detector
        return rl_plan(cfg._section, actor, cfg.distributed, micro_batch=cfg.micro_batch_size,
                       rollout_batch=cfg.rollout_batch_size // k, samples_per_prompt=k,
                       prompt_length=cfg.max_prompt_length, response_length=cfg.sampling.max_new_tokens,
                       critic=None if cfg.shared_backbone or not cfg.uses_critic else critic,
                       reward=reward if cfg.reward_source == "reward_model" else None,
                       extra_frozen=auditors if det.enabled and det.auditor is not None else (),
                       lora=cfg.lora, critic_lora=cfg.critic_lora, score_micro_batch=cfg.score_micro_batch_size,
                       reward_length=reward_length, rollout_micro_batch=cfg.rollout_micro_batch_size,
                       rollout_max_tokens=cfg.rollout_max_tokens, engine=cfg.rollout_engine,
                       packing=cfg.packing)
    return plan


def measuring_planner(stage: str, params: Params, resident: tuple[ModelShape, ...],
                      read: tuple[ModelShape, ...]) -> Planner:
    """evaluate (SFT, PPO and the reward model) and compare (SFT, one method's policy at a time
    and the reward model): `resident` whole on every rank, the first sampling the held-out prompts
    as prompts.sampling."""
    prompt, new = params.prompts.max_length, params.prompts.sampling.max_new_tokens
    return lambda cfg: inference_plan(stage, cfg.distributed, resident, resident[0], prompt, new, read, cfg.packing)


class PredictedShapes:
    """The models of every stage from the params alone, before any checkpoint exists (`python -m
    pipeline plan`): a checkpoint a stage writes holds the dtype it trained in; the reward model is
    `reward.name_or_path` or the policy with a scalar head; an auditor and every method's policy
    have their model's size."""
    predicted = True

    def __init__(self, params: Params, data_dir: Optional[Path]):
        self.params, self.data_dir = params, data_dir
        mc = params.model
        self.base, self.scalar = (with_attention(shape_of(policy_config(params, data_dir), head), mc.attn_implementation)
                                  for head in (False, True))
        name = params.reward.name_or_path
        self.reward_start = (with_attention(checkpoint_shape(name, True, mc.trust_remote_code), mc.attn_implementation)
                             if name is not None else None)

    def ready(self, *folders: str) -> bool:
        return True

    def policy(self) -> ModelShape:
        """The untrained policy SFT builds (or starts from)."""
        return self.base

    def model(self, folder: str, scalar_head: bool = False) -> ModelShape:
        """What the stage `folder` writes: a policy saved in its trained dtype; with a scalar head,
        the reward model (`reward`) or a critic initialised from that policy."""
        if folder == "reward":
            return as_saved_by(self.reward_start or self.scalar, self.params.reward.distributed)
        saved = as_saved_by(self.base, getattr(self.params, folder).distributed)
        return replace(self.scalar, saved_bytes=saved.saved_bytes) if scalar_head else saved

    def auditors(self, detector: Any) -> tuple[ModelShape, ...]:
        return (self.model("reward", True),)   # an auditor is a reward model


class FolderShapes:
    """The models of one stage from its input folders (`folders`: by name, as its SPEC lists them;
    for compare, each further entry a method's policy folder)."""
    predicted = False

    def __init__(self, params: Params, folders: dict[str, Any]):
        self.params, self.folders = params, folders

    def ready(self, *folders: str) -> bool:
        """Whether the folders are there (else the stage's own loading reports it)."""
        return all(Path(self.folders[k], "tokenizer" if k == "data" else "config.json").exists() for k in folders)

    def policy(self) -> ModelShape:
        mc = self.params.model
        return with_attention(shape_of(policy_config(self.params, self.folders["data"])), mc.attn_implementation)

    def model(self, folder: str, scalar_head: bool = False) -> ModelShape:
        return checkpoint_shape(self.folders[folder], scalar_head, self.params.model.trust_remote_code)

    def auditors(self, detector: Any) -> tuple[ModelShape, ...]:
        trust = self.params.model.trust_remote_code
        return (checkpoint_shape(detector.auditor, True, trust),) \
            if detector.enabled and detector.auditor is not None and Path(detector.auditor, "config.json").exists() else ()


Shapes = PredictedShapes | FolderShapes
PlanFn = Callable[[Params, Shapes], Optional[Planner]]   # a stage's SPEC.plan


def rl_planner(params: Params, section: str, shapes: Shapes) -> Optional[Planner]:
    """ppo and grpo (the same trainer, each with its own section)."""
    if not shapes.ready("sft", "reward"):
        return None
    cfg = getattr(params, section)
    rm = shapes.model("reward", True)
    critic = shapes.model("reward" if cfg.critic_init == "reward" else "sft", True)
    return ppo_planner(params, shapes.model("sft"), critic, rm, shapes.auditors(cfg.detector))


def planners(params: Params, data_dir: Optional[Path], plans: dict[str, PlanFn]) -> dict[str, Planner]:
    """Each stage's planner from the params alone (`plans`: stage -> its SPEC.plan)."""
    shapes = PredictedShapes(params, data_dir)
    return {s: fn(params, shapes) for s, fn in plans.items()}


def planned(params: Params, data_dir: Optional[Path], plans: dict[str, PlanFn]) -> list[Plan]:
    """Every stage's plan from the params alone."""
    return [planner(getattr(params, s)) for s, planner in planners(params, data_dir, plans).items()]


def stage_planner(stage: str, plan: PlanFn, params: Params, folders: dict[str, Any]) -> Optional[Planner]:
    """A stage's planner from its input folders; None while an input is missing (the stage's own
    loading reports it). A training stage's planner reads only the params its SPEC declares;
    evaluate's and compare's read prompts.max_length, their prompts' bound."""
    return plan(params, FolderShapes(params, folders))


def stage_plan(stage: str, plan: PlanFn, params: Params, folders: dict[str, Any]) -> Optional[Plan]:
    """A stage's plan from its inputs (None while an input is missing)."""
    planner = stage_planner(stage, plan, params, folders)
    return planner(getattr(params, stage)) if planner is not None else None


def check_stage(stage: str, plan_fn: PlanFn, params: Params, folders: dict[str, Any],
                is_main: bool = True) -> Optional[Plan]:
    """Before a stage builds a model: refuse (ConfigError) a plan that does not fit the device,
    warn (rank 0) about one within 10% of it."""
    planner = stage_planner(stage, plan_fn, params, folders)
    if planner is None:
        return None
    cfg = getattr(params, stage)
    plan = planner(cfg)
    available, source, on_cpu, tips = assess(stage, cfg, planner, plan)
    warning = verdict(plan, available, source, tips, on_cpu)
    if warning and is_main:
        log.warning(warning)
    return plan


def main(params: Params, data_dir: Optional[Path], plans: dict[str, PlanFn]) -> int:
    """`python -m pipeline plan`: the table of every stage in `plans` (stage -> its SPEC.plan); a
    stage that does not fit raises ConfigError after all tables are printed (exit 2)."""
    refusals = []
    for name, planner in planners(params, data_dir, plans).items():
        cfg = getattr(params, name)
        plan = planner(cfg)
        available, source, on_cpu, tips = assess(name, cfg, planner, plan)
        print(table(plan, available, source, on_cpu, tips))
        try:
            warning = verdict(plan, available, source, tips, on_cpu)
        except ConfigError as err:
            refusals.append(str(err))
            continue
        if warning:
            print(f"warning: {warning}")
    if refusals:
        raise ConfigError(" | ".join(refusals))
    return 0
