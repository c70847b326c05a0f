"""The PPO loop. It only orchestrates; the math lives in advantages.py and losses.py.

One iteration (numbered as in the code):
  1. rollout     sample responses to a batch of prompts from the actor (KV cache, stop at eos);
                 each prompt k = samples_per_prompt times, its k rows consecutive
  2. score       old/ref log-probs, critic values (with a critic), reward-source scores (one forward
                 per model), or their log CDF among the SFT policy's (quantile_reward.py); the
                 sampler's vs a training forward's log-probs measured (mismatch.py)
  3. rewards     per-token -kl_coef * KL_t plus the score on the last real token
  4. advantages  the estimator ppo.advantage names (advantages.ESTIMATORS); with a critic (gae): GAE
                 over response tokens, returns = advantages + values, whitened advantages; critic-free
                 (grpo, rloo, reinforce_baseline): each response's summed reward against its group's
                 baseline (group_advantages.py), the same advantage on every token
  5. update      ppo_epochs of shuffled minibatches, micro-batch gradient accumulation,
                 clipped policy loss (aggregated as ppo.loss_aggregation), value loss (with a
                 critic), early stop above target_kl; the first critic_warmup iterations
                 update the critic only
  6. log         metrics of the iteration, health warnings, checkpoint every save_every
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from .. import devices
from ..config import PPOConfig
from ..errors import check_finite
from ..measurement.stats import distinct_n
from ..training.batches import BatchSampler
from ..training import token_batches
from ..training import nonfinite
from ..models.rollout_engine import TORCH, RolloutEngine
from ..training.nonfinite import NonfiniteGuard
from . import advantages as adv
from . import group_advantages as group
from .losses import aggregate, policy_loss, truncated_is_weights, value_loss
from .mismatch import TOLERANCE, ratio_deviation, resolve_recompute
from .placement import PPOModels
from .quantile_reward import ReferenceScores
from .rollout import Rollout, rollout
from .scoring import Scored, critic_values, policy_logprobs, score_rollout, update_chunks

log = logging.getLogger(__name__)


def _check_finite(name: str, value: torch.Tensor | float, iteration: int) -> None:
    check_finite(f"ppo iteration {iteration}", name, value)


def estimator_options(cfg: PPOConfig) -> dict[str, object]:
    """The keyword arguments of the section's advantage estimator, from the keys it declares."""
    return {arg: getattr(cfg, key) for arg, key in adv.ESTIMATORS.facts(cfg.advantage)["options"].items()}


@dataclass
class Batch:
    """A rollout with everything the update needs."""
    ro: Rollout
    sc: Scored
    advantages: torch.Tensor   # (B, R) whitened GAE advantages, or group advantages broadcast; zero on pads
    returns: torch.Tensor | None   # (B, R) value targets, zero on pads; None without a critic
    tis_weights: torch.Tensor | None = None   # (B, R) truncated IS weights (ppo.tis_cap), None when off


# Per-iteration stats that add up over ranks (counts, throughput); the rest are averaged.
SUM_STATS = ("val/num_eos_tokens", "rollouts", "tokens_per_second/rollout", "tokens_per_second/update")
MAX_STATS = ("val/ratio_max", "memory/peak_gib", "val/logprob_diff_max", "val/first_ratio_max_dev")
# Stats of the first minibatch only (the ratio before any update), kept out of the epoch averages.
FIRST_STATS = ("val/first_ratio_mean_dev", "val/first_ratio_max_dev")


class PPOTrainer:
    """One process's share of PPO. With N processes each rank samples its slice of the global
    prompt batch; whitening, token counts and statistics are reduced over ranks, so one step does
    the maths of one process holding the whole batch."""

    def __init__(self, cfg: PPOConfig, models: PPOModels, prompts: list[str],
                 judge: Optional[Callable[[str, str], float]] = None, engine: RolloutEngine = TORCH):
        self.cfg, self.m, self.prompts, self.judge, self.engine = cfg, models, prompts, judge, engine
        self.ctx = models.ctx
        self.kl_ctl = (adv.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon_iterations) if cfg.adaptive_kl
                       else adv.FixedKLController(cfg.kl_coef))
        # rollout_batch_size counts responses: rollout_batch_size / k prompts per iteration, each k times.
        self.prompt_sampler = BatchSampler(len(prompts), cfg.rollout_batch_size // cfg.samples_per_prompt, cfg.seed)
        # Each rank its own sampling stream (rank 0's is the single-process one), on its device: a GPU
        # run draws on the GPU, a CPU run on the CPU as the committed runs did (devices.generator).
        self.sample_gen = devices.generator(self.ctx.device, cfg.seed + 1 + 7919 * self.ctx.rank)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.iteration = 0  # iterations completed
        self.actor_lr = models.actor.lr   # learning rate of the actor's last update
        # Whose log-probs are pi_old: decided once, from what the actor really is (mismatch.py).
        param = next(p for p in models.actor.model.parameters() if p.is_floating_point())
        # An accelerator counts where either the weights or the process's device is one (ZeRO-3 may
        # offload the weights to the CPU while the forwards still run on the GPU).
        device = next((d for d in (param.device, self.ctx.device) if devices.is_accelerator(d)), param.device)
        self.recompute, self.recompute_reason = resolve_recompute(
            cfg.recompute_logprobs, cfg.distributed.precision, param.dtype, device.type, tis=cfg.tis_cap is not None,
            engine=engine.name)
        self._announced = False   # the log line on whose log-probs are used, once per process
        # ppo.quantile_reward_samples: the SFT policy's scores per training prompt, which the stage
        # samples before the first iteration (quantile_reward.py); None: the scores are the reward.
        self.quantiles: ReferenceScores | None = None
        self.guard = NonfiniteGuard(cfg._section, cfg.on_nonfinite, cfg.max_skipped_updates)   # restored on resume

    # ---- steps 3-4 -------------------------------------------------------------------------
    def make_batch(self, ro: Rollout, sc: Scored) -> tuple[Batch, dict[str, float]]:
        cfg, mask = self.cfg, ro.response_mask
        kl = adv.kl_penalty(sc.old_logprobs, sc.ref_logprobs, cfg.kl_estimator)            # (B, R)
        kl_coef = self.kl_ctl.kl_coef if cfg.kl_loss_coef == 0 else 0.0
        rewards, stats = adv.assemble_rewards(sc.scores, kl, mask, kl_coef)                 # (B, R)
        if cfg.kl_loss_coef > 0:  # the penalty lives in the loss; still report the KL itself
            stats["objective/kl"] = adv.masked_mean(kl, mask, dim=1).mul(mask.sum(1)).mean().item()
        if cfg.uses_critic:
            advantages, returns = self.gae_advantages(rewards, sc.values, mask, stats)
        else:
            # The KL penalty (kl_coef > 0) is in `rewards`: summed over each response and subtracted
            # from its score before the group baseline (group_advantages.sequence_rewards). A rank holds
            # whole groups (config.py) and computes their baselines alone; reinforce_baseline's batch
            # std is then the rank's share of the batch, not the global batch's.
            seq_adv, group_stats = adv.ESTIMATORS[cfg.advantage](group.sequence_rewards(rewards, mask),
                                                                 cfg.samples_per_prompt, **estimator_options(cfg))
            advantages, returns = group.broadcast_to_tokens(seq_adv, mask), None
            stats.update(group_stats)
        weights = None
        if cfg.tis_cap is not None:   # the tokens came from the sampler, the loss is under pi_old
            weights, tis_stats = truncated_is_weights(sc.old_logprobs, ro.logprobs.float(), mask, cfg.tis_cap)
            stats.update(tis_stats)
        return Batch(ro, sc, advantages, returns, weights), stats

    def gae_advantages(self, rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       stats: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 4 with a critic: its estimator (GAE), advantages whitened over the global batch;
        (advantages, returns)."""
        cfg = self.cfg
        reduce = self.ctx.sum if self.ctx.world_size > 1 else adv.local
        if cfg.whiten_rewards:
            rewards = adv.masked_whiten(rewards, mask, shift_mean=False, reduce=reduce)
        advantages, returns = adv.ESTIMATORS[cfg.advantage](rewards, values, mask, **estimator_options(cfg))
        advantages = adv.masked_whiten(advantages, mask, reduce=reduce)   # over the global batch
        largest = (lambda v: self.ctx.reduce_stats({"v": v}, max_keys={"v"})["v"]) if self.ctx.world_size > 1 else float
        stats["val/explained_variance"] = adv.explained_variance(values, returns, mask, reduce, largest)
        return advantages, returns

    # ---- step 5 ------------------------------------------------------------------------------
    def micro_step(self, b: Batch, idx: torch.Tensor, n_tokens: float, first: bool = False,
                   n_rows: float | None = None, boundary: bool | None = None, filler: bool = False) -> dict[str, float]:
        """Forward/backward of one micro-batch; its losses add up over the minibatch's micro-batches
        to the minibatch's loss (n_tokens, n_rows: real tokens and responses of the whole minibatch).
        `first`: a micro-batch of the first minibatch, whose ratio (before any update) is logged.
        `boundary`: whether it ends the minibatch, where their number varies (a token budget);
        `filler`: a repeat run only so that every rank runs as many micro-batches, adding nothing.
        With `packing` the actor's and the critic's forwards take the micro-batch as one packed row."""
        cfg, ro = self.cfg, b.ro.select(idx, trim=True)   # only this micro-batch's own padding
        mask, r = ro.response_mask, ro.response_mask.size(1)
        mode = cfg.loss_aggregation
        counts = {"tokens": n_tokens, "responses": n_rows}   # what the mode averages over (AGGREGATIONS)
        agg = dict(mode=mode, loss_denominator=counts[group.AGGREGATIONS.facts(mode)["counts"]],
                   max_len=cfg.sampling.max_new_tokens)
        frozen = self.actor_frozen
        with self.forwards(), (torch.no_grad() if frozen else contextlib.nullcontext()):   # its stats still logged
            logprobs, entropy = policy_logprobs(self.m.actor.forward, ro, cfg.sampling.temperature, with_entropy=True,
                                                entropy_grad=cfg.entropy_coef > 0, packed=cfg.packing)
        weights = b.tis_weights[idx, :r] if b.tis_weights is not None else None
        pg_loss, stats = policy_loss(logprobs, b.sc.old_logprobs[idx, :r], b.advantages[idx, :r], mask,
                                     cfg.clip_eps, cfg.dual_clip, loss_denominator=agg["loss_denominator"],
                                     tis_weights=weights, aggregation=mode, max_len=agg["max_len"])
        if first:
            stats.update(ratio_deviation(logprobs, b.sc.old_logprobs[idx, :r], mask))
        ent_loss = aggregate(entropy, mask, **agg)
        ent_sum = aggregate(entropy.detach(), mask, "token_mean", n_tokens)   # logged as the token mean whatever the mode
        loss = pg_loss - cfg.entropy_coef * ent_loss
        if cfg.kl_loss_coef > 0:
            kl = adv.kl_penalty(logprobs, b.sc.ref_logprobs[idx, :r], cfg.kl_estimator)
            loss = loss + cfg.kl_loss_coef * aggregate(kl, mask, **agg)
        if self.guard.stops:
            _check_finite("loss/policy", pg_loss.detach(), self.iteration + 1)
        vstats: dict[str, float] = {}
        if self.m.critic is not None:
            with self.forwards():
                values = critic_values(self.m.critic.model, ro, packed=cfg.packing)
            v_loss, vstats = value_loss(values, b.sc.values[idx, :r], b.returns[idx, :r], mask, cfg.clip_eps_value,
                                        loss_denominator=n_tokens)
            if self.guard.stops:
                _check_finite("loss/value", v_loss.detach(), self.iteration + 1)
            vstats["loss/value"] = v_loss.item()
        # Two graphs (a shared trunk is run twice), so two backward passes, one per engine.
        keep = 0.0 if filler else 1.0
        if not frozen:
            self.m.actor.backward(self.guard.poisoned(loss * keep), boundary=boundary)
        if self.m.critic is not None:
            self.m.critic.backward(self.guard.poisoned(cfg.vf_coef * v_loss * keep), boundary=boundary)
        if filler:
            return {}
        weight = float(mask.sum()) / n_tokens
        out = {k: v * weight for k, v in {**stats, **vstats}.items() if k not in MAX_STATS and k != "loss/value"}
        out.update({"loss/policy": pg_loss.item(), **({"loss/value": vstats["loss/value"]} if vstats else {}),
                    "objective/entropy": ent_sum.item(), **{k: stats[k] for k in MAX_STATS if k in stats}})
        return out

    @property
    def actor_frozen(self) -> bool:
        """Whether this iteration trains the critic only (the first `critic_warmup`)."""
        return self.iteration < self.cfg.critic_warmup

    @contextlib.contextmanager
    def forwards(self) -> Iterator[None]:
        """The update's forwards: in the trained engines' precision (bf16 autocast without DeepSpeed),
        their checkpointed layers recomputing (distributed.gradient_checkpointing); backward outside."""
        critic = self.m.critic
        with self.m.actor.autocast(), self.m.actor.recomputing(), \
                (critic.recomputing() if critic is not None else contextlib.nullcontext()):
            yield

    def optimizer_step(self) -> dict[str, float]:
        """Every trained engine's update (the actor's, and the critic's when there is one); returns
        their gradient norms as stats. The actor's learning rate is kept for the iteration's log (the
        rate its last update used, as SFT and the RM log it)."""
        norms = {}
        for name, engine in (("policy/grad_norm", self.m.actor), ("val/grad_norm", self.m.critic)):
            if engine is None:
                continue
            if engine is self.m.actor and self.actor_frozen:   # no gradient to apply: logged as 0
                norms[name], self.actor_lr = 0.0, 0.0
                continue
            result = engine.step()   # skipped (and reported below) when the norm is not finite
            if self.guard.stops:
                _check_finite("gradient norm", result.grad_norm, self.iteration + 1)
            self.guard.count(f"{self.cfg._section} iteration {self.iteration + 1}", result)
            norms[name] = result.grad_norm
            if engine is self.m.actor:
                self.actor_lr = result.lr
        return norms

    def update(self, b: Batch) -> dict[str, float]:
        cfg, B = self.cfg, len(b.ro.prompts)
        totals: dict[str, float] = {}
        first: dict[str, float] = {}
        n_minibatches, epochs_done = 0, 0
        budget = cfg.distributed.max_tokens_per_micro_batch
        prompt_lengths = b.ro.attention_mask[:, :b.ro.n_prompt].sum(1)    # (B,) real prompt tokens
        for _ in range(cfg.ppo_epochs):
            # The shuffle stream is the CPU's on every device (a resumed run restores it), the rows the rollout's.
            perm = torch.randperm(B, generator=self.shuffle_gen, device="cpu").to(b.ro.response_mask.device)
            epoch_kl = []
            for mb in perm.split(cfg.minibatch_size // self.ctx.world_size):
                # Losses are token sums over the global minibatch divided by its token count.
                n_tokens = float(self.ctx.sum(b.ro.response_mask[mb].sum().double()).clamp(min=1))
                n_rows = float(len(mb) * self.ctx.world_size)   # equal slices on every rank
                mb_stats: dict[str, float] = {}
                chunks = update_chunks(b.ro.response_mask, mb, cfg.micro_batch_size, prompt_lengths, budget)
                # A budget gives each rank its own count: all run the largest (ZeRO's collectives pair up).
                for run in token_batches.agreed_runs(len(chunks), budget, self.ctx):
                    micro = chunks[run.part] if not run.filler else chunks[0][:1]
                    stats = self.micro_step(b, micro, n_tokens, first=n_minibatches == 0, n_rows=n_rows,
                                            boundary=run.boundary, filler=run.filler)
                    for k, v in stats.items():
                        mb_stats[k] = max(mb_stats.get(k, v), v) if k in MAX_STATS else mb_stats.get(k, 0.0) + v
                # Each rank holds token-weighted parts of the global minibatch: they add up.
                mb_stats = self.ctx.reduce_stats(mb_stats, sum_keys=set(mb_stats) - set(MAX_STATS), max_keys=MAX_STATS)
                first.update({k: mb_stats.pop(k) for k in FIRST_STATS if k in mb_stats})
                mb_stats.update(self.optimizer_step())
                for k, v in mb_stats.items():
                    totals[k] = max(totals.get(k, v), v) if k == "val/ratio_max" else totals.get(k, 0.0) + v
                epoch_kl.append(mb_stats["policy/approxkl"])
                n_minibatches += 1
            epochs_done += 1
            # Early stop (seed 000, 16.2.5): the policy has moved far enough from the rollout policy.
            if cfg.target_kl is not None and sum(epoch_kl) / len(epoch_kl) > cfg.target_kl:
                break
        out = {k: (v if k == "val/ratio_max" else v / n_minibatches) for k, v in totals.items()}
        out["policy/epochs"] = float(epochs_done)
        out.update(first)
        return out

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        cfg, it = self.cfg, self.iteration + 1
        self.m.actor.eval()   # dropout off everywhere; gradients still flow in the update
        t0 = time.perf_counter()
        # The same global batch on every rank (same seed); each keeps its slice.
        # Each prompt k times, consecutive; a rank's slice holds whole groups (checked in config.py).
        k = cfg.samples_per_prompt
        prompts = self.ctx.shard([self.prompts[i] for i in next(self.prompt_sampler) for _ in range(k)])
        with self.m.actor.gathered() as policy, self.m.actor.autocast():   # ZeRO-3: gathered once per rollout
            ro = rollout(policy, self.m.tok, prompts, cfg.sampling, self.sample_gen, cfg.max_prompt_length,   # 1
                         self.engine, cfg.rollout_micro_batch_size, cfg.rollout_drop_finished,
                         cfg.rollout_max_tokens)
        t1 = time.perf_counter()
        critic = self.m.critic.model if self.m.critic is not None else None
        with self.m.actor.autocast():
            sc = score_rollout(self.m.actor.forward, self.m.ref, critic, self.m.reward, ro,            # 2
                               cfg.sampling.temperature, cfg.score_micro_batch_size or cfg.micro_batch_size,
                               cfg.missing_eos_score, cfg.score_clip, self.recompute, cfg.logprob_check_rows,
                               cfg.packing, self.quantiles)
        _check_finite("rewards (scores)", sc.raw_scores, it)
        batch, stats = self.make_batch(ro, sc)                                                     # 3, 4
        stats.update(sc.mismatch)
        if self.quantiles is not None:   # objective/scores are log CDFs then: the source's own beside them
            stats["objective/source_scores"] = sc.raw_scores.mean().item()
        _check_finite("advantages", batch.advantages, it)
        t2 = time.perf_counter()
        stats.update(self.update(batch))                                                           # 5
        t3 = time.perf_counter()
        n_tokens = float(ro.response_mask.sum())
        stats.update({                                                                             # 6
            "kl_coef": self.kl_ctl.kl_coef, "lr": self.actor_lr,
            "val/num_eos_tokens": float(ro.ended.sum()), "rollouts": float(len(prompts)),
            "objective/response_length": n_tokens / len(prompts),
            "time/rollout": t1 - t0, "time/scoring": t2 - t1, "time/update": t3 - t2,
            "tokens_per_second/rollout": n_tokens / max(t1 - t0, 1e-9),
            "tokens_per_second/update": n_tokens * stats["policy/epochs"] / max(t3 - t2, 1e-9),
        })
        peak = devices.peak_memory_gib(self.ctx.device)   # this process's peak since the last iteration
        if peak is not None:
            stats["memory/peak_gib"] = peak
            devices.reset_peak(self.ctx.device)
        # Diversity of this rank's rollouts (averaged over ranks below): a mode-collapse sign for the
        # over-optimisation detector; the auditor RM scores the same rollouts without being optimised.
        stats["objective/distinct_2"] = distinct_n(ro.responses, 2)
        if self.m.auditor is not None:
            stats["objective/auditor_scores"] = self.m.auditor.score(prompts, ro.responses).float().mean().item()
        if self.judge is not None:
            stats["objective/gold_scores"] = sum(self.judge(p, r) for p, r in zip(prompts, ro.responses)) / len(prompts)
        # Every rank continues with the same, global statistics.
        stats = self.ctx.reduce_stats(stats, sum_keys=SUM_STATS, max_keys=MAX_STATS)
        stats[nonfinite.COLUMN] = self.guard.skipped   # the same on every rank (training/nonfinite.py)
        self.kl_ctl.update(stats["objective/kl"], 1)   # the horizon is in iterations (config.py)
        self.iteration = it
        if self.ctx.is_main:
            if not self._announced:   # warning level: the stages configure no logging, and this must show
                log.warning(self.logprob_source(stats))
            warn_health(stats, it, sampler_logprobs=not self.recompute)
        self._announced = True
        return stats

    def logprob_source(self, stats: dict[str, float]) -> str:
        """The one log line on whose log-probs are pi_old, why, and the difference measured."""
        cfg = self.cfg
        measured = (f"measured max |diff| {stats['val/logprob_diff_max']:.2g} nats, mean "
                    f"{stats['val/logprob_diff_mean']:.2g}, at iteration {self.iteration}")
        if self.recompute:
            tis = f"; truncated IS weights capped at {cfg.tis_cap}" if cfg.tis_cap is not None else ""
            return (f"ppo: old log-probs: recomputed by a training forward ({self.recompute_reason}; sampler vs "
                    f"trainer {measured} over every rollout; first-minibatch max |ratio - 1| "
                    f"{stats['val/first_ratio_max_dev']:.2g}{tis})")
        rows = min(cfg.logprob_check_rows, cfg.rollout_batch_size // self.ctx.world_size)
        return (f"ppo: old log-probs: sampler's ({self.recompute_reason}; {measured} over {rows} rollouts "
                f"per process; first-minibatch max |ratio - 1| {stats['val/first_ratio_max_dev']:.2g})")


def warn_health(stats: dict[str, float], iteration: int, sampler_logprobs: bool = False) -> None:
    """Log the warning signs the seeds describe (000, 16.2.8): ratio far from 1, KL exploding,
    many clipped updates; and, when pi_old is the sampler's log-probs, a sampler that disagrees
    with the training forward. Warnings only: these are judgement calls, not errors."""
    if sampler_logprobs and stats["val/logprob_diff_max"] > TOLERANCE:
        log.warning("iteration %d: the sampler's log-probs differ from the training forward's by up to %.2g "
                    "nats, so the ratio is not 1 at the first minibatch: set ppo.recompute_logprobs: true",
                    iteration, stats["val/logprob_diff_max"])
    if abs(stats["val/ratio"] - 1.0) > 0.2:
        log.warning("iteration %d: mean ratio %.3f is far from 1: updates are too large (lower lr or epochs)",
                    iteration, stats["val/ratio"])
    if stats["objective/kl"] > 20.0 or not math.isfinite(stats["objective/kl"]):
        log.warning("iteration %d: KL to the reference is %.2f nats per response and growing: raise kl_coef",
                    iteration, stats["objective/kl"])
    if stats["policy/clipfrac"] > 0.3:
        log.warning("iteration %d: %.0f%% of tokens clipped: the policy moves too fast per update",
                    iteration, 100 * stats["policy/clipfrac"])


# ---- The step log's columns, declared for docs/metrics.md (stages/ppo.py declared_metrics) --------

# PPO's train.tsv columns: (name, meaning, condition); metrics.json copies each one's last value.
TRAIN_COLUMNS = (
    ("step", "PPO iteration", None),
    ("objective/scores", "mean sequence score given to the rollouts (after the missing-eos rule and "
                         "`ppo.score_clip`; then the log CDF with `ppo.quantile_reward_samples`)", None),
    ("objective/source_scores", "mean score of the rollouts by the reward source itself (`objective/scores` are "
                                "then their log CDF among the SFT policy's, `ppo.quantile_reward_samples`)",
     "quantile_reward"),
    ("objective/kl", "mean over rollouts of the summed per-token KL estimate to the reference "
                     "(`ppo.kl_estimator`)", None),
    ("objective/non_score_reward", "mean summed KL penalty, `-kl_coef * KL` (0 with `ppo.kl_loss_coef`, where "
                                   "the KL is in the loss)", None),
    ("objective/rlhf_reward", "`scores + non_score_reward`: what PPO maximises", None),
    ("objective/entropy", "mean per-token entropy of the policy during the update", None),
    ("objective/response_length", "mean response tokens (eos included)", None),
    ("objective/distinct_2", "distinct bigrams / bigrams over the iteration's rollout responses (words; averaged "
                             "over processes); falls when the policy collapses onto few phrasings", None),
    ("objective/gold_scores", "mean gold score of the rollouts", "!no_judge"),
    ("objective/auditor_scores", "mean score of the rollouts by the auditor reward model (a second RM that PPO "
                                 "does not optimise)", "auditor"),
    ("policy/approxkl", "0.5 * mean (log ratio)^2 between the updated and the rollout policy, averaged over "
                        "minibatches", None),
    ("policy/approxkl_k1", "mean -log ratio (k1 estimate of the same)", None),
    ("policy/clipfrac", "fraction of tokens where the clipped surrogate was taken (zero gradient)", None),
    ("policy/dual_clipfrac", "fraction of tokens held at the dual-clip floor (negative advantages)", "dual_clip"),
    ("policy/epochs", "PPO epochs actually run (fewer when `ppo.target_kl` stops early)", None),
    ("policy/grad_norm", "actor gradient norm before clipping, averaged over minibatches", None),
    ("val/grad_norm", "critic gradient norm before clipping, averaged over minibatches", None),
    ("loss/policy", "clipped policy loss", None),
    ("loss/value", "clipped value loss (0.5 * max of the squared errors)", None),
    ("val/ratio", "mean probability ratio new/old over real tokens; healthy near 1", None),
    ("val/ratio_max", "largest probability ratio new/old of the iteration", None),
    ("val/logprob_diff_mean", "mean \\|sampler log-prob - training-forward log-prob\\| of the rollout's response "
                              "tokens, nats: over every rollout when the old log-probs are recomputed, else over the "
                              "first `ppo.logprob_check_rows` rollouts per process (one extra actor forward); "
                              "averaged over processes", None),
    ("val/logprob_diff_max", "the largest such difference, over processes; ~1e-6 in fp32 on CPU, far more in "
                             "bf16/fp16 or on a GPU", None),
    ("val/first_ratio_mean_dev", "mean \\|ratio - 1\\| over the first minibatch's tokens, before any update: 0 in "
                                 "exact arithmetic when the old log-probs are the trainer's", None),
    ("val/first_ratio_max_dev", "largest \\|ratio - 1\\| over the first minibatch's tokens, over processes", None),
    ("policy/tis_weight", "mean truncated importance-sampling weight min(pi_old / pi_sampler, `ppo.tis_cap`) of the "
                          "rollout's tokens", "tis"),
    ("policy/tis_capfrac", "fraction of the rollout's tokens whose weight was cut to `ppo.tis_cap`", "tis"),
    ("val/clipfrac", "fraction of tokens where the clipped value prediction was used", None),
    ("val/vpred", "mean critic prediction", None),
    ("val/error", "mean squared error of the critic's prediction to the returns", None),
    ("val/explained_variance", "1 - Var(returns - values) / Var(returns) of the rollout values (NaN when the "
                               "returns are constant)", None),
    ("val/num_eos_tokens", "rollouts that ended with eos or the stop token, summed over processes (of "
                           "`ppo.rollout_batch_size`)", None),
    ("rollouts", "rollouts the update used, summed over processes (= `ppo.rollout_batch_size`: every rank "
                 "contributed)", None),
    ("memory/peak_gib", "the largest peak GPU memory allocated by any process during the iteration, GiB", "cuda"),
    ("kl_coef", "KL coefficient of the iteration's rewards (adapted after it with `ppo.adaptive_kl`)", None),
    ("lr", "actor learning rate of the iteration's last update", None),
    ("time/rollout", "seconds of sampling", None),
    ("time/scoring", "seconds of scoring, rewards and advantages", None),
    ("time/update", "seconds of the update", None),
    ("tokens_per_second/rollout", "response tokens per second of sampling, summed over processes", None),
    ("tokens_per_second/update", "response tokens x epochs per second of the update, summed over processes", None),
    ("skipped_updates", f"actor and critic {nonfinite.SKIPPED}", None),
    ("detector/kl_rise", "over-optimisation detector: mean `objective/kl` of the last `window` iterations minus "
                         "that of the `window` before (nats); 0 until iteration `warmup + 2 * window`",
     "!no_detector"),
    ("detector/length_change", "\\|relative change\\| of mean `objective/response_length` between the same two "
                               "windows", "!no_detector"),
    ("detector/entropy_drop", "relative drop (old - new) / old of `objective/entropy` between the two windows",
     "!no_detector"),
    ("detector/distinct_drop", "relative drop of `objective/distinct_2` between the two windows", "!no_detector"),
    ("detector/auditor_drop", "the auditor's best `window` mean so far minus its current one (0 without an "
                              "auditor); counts only while the RM's window mean is within 0.1 of its own best",
     "!no_detector"),
    ("detector/fired", "1 when any signal is over its `ppo.detector` threshold at this iteration", "!no_detector"),
    ("detector/first_fire", "the first iteration the detector fired (0: not yet)", "!no_detector"),
)


# The critic's columns, which the critic-free estimators (the grpo stage by default) do not write.
CRITIC_COLUMNS = ("val/grad_norm", "loss/value", "val/clipfrac", "val/vpred", "val/error", "val/explained_variance")
