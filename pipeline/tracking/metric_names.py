"""What a metric name is, and the names each kind of stage writes; docs/metrics.md is generated
from them.

A `Metric` is one name (or pattern) a stage writes: the stage, the file it is written to
(`metrics.json`, nested by the `/` in names, or a per-step TSV whose header holds the names), its
meaning and the condition under which it is written. The builders here (`sft()`, `rl(stage)`,
`resources(stage)`, ...) give a stage's declarations; each stage's SPEC names its own, and
pipeline/stages/registry.py gathers them into the registry (`registry.metrics()`), renders
docs/metrics.md (`render_markdown`) and compares a finished run's files with it (`check_run`):

    python -m pipeline.stages.registry metrics > docs/metrics.md     # regenerate the docs after an edit

Conditions: `None` means always written on the default task with the default params; `"key"` only
when the run has `key`; `"!key"` always unless the run has `key` (the keys are `CONDITIONS`).
Placeholders such as `{n}` in a name match one piece of a path segment (`best_of_{n}/rm` matches
`best_of_4/rm`).

Self-contained (standard library only), so it can move to another package.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Iterable, Optional

METRICS_JSON = "metrics.json"


@dataclass(frozen=True)
class StageMetrics:
    """One stage's part of the registry: its names and its sections of docs/metrics.md."""
    stage: str
    title: str                     # its heading
    metrics: tuple["Metric", ...]
    files: dict                    # file -> the note under its heading
    notes: str = ""                # what follows its tables
    compare: bool = False          # compare/dvc.yaml's: a run's check expects it only with `compare`


@dataclass(frozen=True)
class Metric:
    stage: str                       # sft | reward | ppo | evaluate: written under outputs/<stage>/
    file: str                        # metrics.json, or the TSV file whose column this is
    name: str                        # the name, or a pattern with {placeholders}
    meaning: str                     # markdown
    condition: Optional[str] = None  # None: always; "key": only with key; "!key": unless key (CONDITIONS)
    copy_of: Optional[str] = None    # a metrics.json copy of this TSV column's last value (ppo's train/*)

    def satisfied(self, conditions: AbstractSet[str]) -> bool:
        """Whether a run with `conditions` writes this name."""
        if self.condition is None:
            return True
        if self.condition.startswith("!"):
            return self.condition[1:] not in conditions
        return self.condition in conditions

    @property
    def placeholders(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)\}", self.name))

    def regex(self) -> re.Pattern:
        """The name with each placeholder matching one piece of a path segment."""
        parts = re.split(r"\{(\w+)\}", self.name)
        out = []
        for i, part in enumerate(parts):
            out.append(f"(?:{PLACEHOLDERS.get(part, PLACEHOLDER_DEFAULT)})" if i % 2 else re.escape(part))
        return re.compile("".join(out))


# A placeholder matches this within one path segment; specific ones are narrower.
PLACEHOLDER_DEFAULT = r"[^/]+"
PLACEHOLDERS = {"n": r"[1-9][0-9]*"}

# The keys of `Metric.condition`: facts of a run that add names to it or take names away.
CONDITIONS = {
    "no_judge": "no gold annotator: `sft.dataset.path`, `reward.dataset.path` or `ppo.dataset.path` is set (a "
                "task's judge scores only the task's own data), or `data.task` has no judge",
    "custom_pairs": "`reward.dataset.path` is set (your own pairs: no noise ceiling from the prepare stage); "
                    "implies `no_judge`",
    "no_normalize": "`reward.normalize: false`",
    "sft_lora": "`sft.lora.r > 0`",
    "reward_lora": "`reward.lora.r > 0`",
    "no_detector": "`ppo.detector.enabled: false`",
    "auditor": "`ppo.detector.auditor` is set and the detector is enabled",
    "dual_clip": "`ppo.dual_clip` is set",
    "cuda": "the stage's process sees a CUDA device (`torch.cuda.is_available()`)",
    "method_lora": "`lora.r > 0` in the section of a compare/dvc.yaml method (`dpo`, `rs`)",
    "compare": "the alignment methods of compare/dvc.yaml ran (`dvc repro compare/dvc.yaml`, `make compare`)",
    "tis": "`ppo.tis_cap` is set (truncated importance sampling)",
}
IMPLIES = {"custom_pairs": ("no_judge",)}


# ---- The registry ---------------------------------------------------------------------------------


# The step logs' count of skipped updates (training/nonfinite.py), supervised and RL alike.
SKIPPED = ("updates skipped so far for a NaN or infinite loss or gradient (`on_nonfinite: skip`; always 0 "
           "with `stop`, which ends the stage instead)")


def supervised(stage: str, items: str, loss: str, eval_loss: str, trained: str) -> list[Metric]:
    """What the one supervised loop (training/supervised.py) writes for SFT and the RM alike."""
    def m(file: str, name: str, meaning: str, condition: Optional[str] = None) -> Metric:
        return Metric(stage, file, name, meaning, condition)

    return [
        m("train.tsv", "step", "optimizer step"),
        m("train.tsv", "loss", loss),
        m("train.tsv", "lr", "learning rate the step used (linear warmup, then cosine decay)"),
        m("train.tsv", "grad_norm", "global gradient norm before clipping"),
        m("train.tsv", "skipped_updates", SKIPPED),
        m("eval.tsv", "step", f"optimizer step (every `{stage}.eval_every` steps and the last)"),
        m("eval.tsv", "loss", eval_loss),
        m(METRICS_JSON, "train/loss", "`train.tsv`'s last `loss`"),
        m(METRICS_JSON, "train/steps", "optimizer steps of the whole training"),
        m(METRICS_JSON, "train/seconds", "seconds of the training loop, interrupted runs' (resumed) included"),
        m(METRICS_JSON, "train/skipped_updates", "`train.tsv`'s last `skipped_updates`"),
        m(METRICS_JSON, "eval/loss", "`eval.tsv`'s last `loss`"),
        m(METRICS_JSON, "data/truncated", f"training {items} longer than `{stage}.max_length` kept with their "
                                          f"prompt's left end cut (`{stage}.overlong: truncate`)"),
        m(METRICS_JSON, "data/dropped", f"training {items} longer than `{stage}.max_length` left out "
                                        f"(`{stage}.overlong: drop`)"),
        m(METRICS_JSON, "train/trainable_params", f"parameters LoRA trained ({trained})", f"{stage}_lora"),
        m(METRICS_JSON, "train/total_params", "parameters of the model with its adapters", f"{stage}_lora"),
    ]


def sft() -> list[Metric]:
    def m(file: str, name: str, meaning: str, condition: Optional[str] = None) -> Metric:
        return Metric("sft", file, name, meaning, condition)

    out = supervised("sft", "demonstrations", "cross-entropy per response token of the step's global batch "
                      "(prompt tokens are not targets)", "cross-entropy per response token on the held-out "
                      "demonstrations", "adapters")
    for tag, how in (("greedy", "greedy"), ("sampled", "sampled (`sft.sampling`)")):
        out += [
            m(METRICS_JSON, f"eval/eos_rate_{tag}", f"rate of {how} responses to the first `sft.n_eval_generations` "
                                                    "evaluation prompts that end with the end-of-response token "
                                                    "(or `sft.sampling.stop_token`) rather than at `max_new_tokens`"),
            m(METRICS_JSON, f"eval/gold_{tag}", f"mean gold score of those {tag} responses", "!no_judge"),
            m(METRICS_JSON, f"eval/well_formed_{tag}", f"rate of those {tag} responses that are grammatical reviews "
                                                       "ending with (exactly one) closing sentence", "!no_judge"),
        ]
    out.append(m(METRICS_JSON, "eval/gold_demonstrations", "mean gold score of the held-out demonstrations (what "
                                                           "SFT imitates)", "!no_judge"))
    return out


def reward() -> list[Metric]:
    def m(file: str, name: str, meaning: str, condition: Optional[str] = None) -> Metric:
        return Metric("reward", file, name, meaning, condition)

    return supervised("reward", "pairs", "Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) of "
                       "the step's global batch", "Bradley-Terry loss on the held-out pairs",
                       "adapters and the score head") + [
        m("train.tsv", "accuracy", "fraction of the batch's pairs with r(chosen) > r(rejected)"),
        m("eval.tsv", "accuracy", "pairwise accuracy on the held-out pairs"),
        m("calibration.tsv", "step", "bin of predicted probability, 0 .. `reward.calibration_bins` - 1 (empty "
                                     "bins have no row)"),
        m("calibration.tsv", "predicted", "mean predicted preference probability sigmoid(r_a - r_b) in the bin; "
                                          "every held-out pair counts in both orders"),
        m("calibration.tsv", "observed", "rate at which the first response of the bin's ordered pairs is the "
                                         "labelled winner"),
        m("calibration.tsv", "count", "ordered pairs in the bin"),
        m(METRICS_JSON, "eval/offset", "the normalisation offset stored in the model: mean raw score of the "
                                       "held-out demonstrations", "!no_normalize"),
        m(METRICS_JSON, "eval/accuracy", "held-out pairwise accuracy: r(chosen) > r(rejected)"),
        m(METRICS_JSON, "eval/chosen_mean", "mean normalised RM score of the held-out chosen responses"),
        m(METRICS_JSON, "eval/chosen_std", "their standard deviation"),
        m(METRICS_JSON, "eval/rejected_mean", "mean normalised RM score of the held-out rejected responses"),
        m(METRICS_JSON, "eval/rejected_std", "their standard deviation"),
        m(METRICS_JSON, "eval/calibration_error", "expected calibration error of sigmoid(r_a - r_b) (count-weighted "
                                                  "\\|predicted - observed\\| over the bins of `calibration.tsv`; "
                                                  "`calibration.png` shows them)"),
        m(METRICS_JSON, "eval/noise_ceiling", "accuracy of the noiseless gold ordering on the same (noisy) labels: "
                                              "the best any model can do (from the prepare stage's `stats.json`)",
          "!custom_pairs"),
        m(METRICS_JSON, "eval/accuracy_of_ceiling", "`accuracy / noise_ceiling`", "!custom_pairs"),
        m(METRICS_JSON, "eval/spearman_gold_heldout", "Spearman correlation of RM score and gold score over all "
                                                      "held-out responses (chosen and rejected)", "!no_judge"),
        m(METRICS_JSON, "eval/gold_order_agreement", "fraction of held-out pairs the RM orders as the gold annotator "
                                                     "does (a tie on either side counts 1/2); free of the label "
                                                     "draw's noise, ceiling 1", "!no_judge"),
        m(METRICS_JSON, "eval/spearman_gold_sft_samples", "Spearman correlation of RM score and gold score over "
                                                          "`reward.n_sft_samples` responses sampled from the SFT "
                                                          "policy (where PPO starts)", "!no_judge"),
        m(METRICS_JSON, "eval/sft_samples_score_mean", "mean normalised RM score of those SFT samples", "!no_judge"),
    ]


# PPO's train.tsv columns: (name, meaning, condition); metrics.json copies each one's last value.
_PPO_TRAIN = (
    ("step", "PPO iteration", None),
    ("objective/scores", "mean sequence score given to the rollouts (after the missing-eos rule and "
                         "`ppo.score_clip`)", None),
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
    ("skipped_updates", f"actor and critic {SKIPPED}", None),
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
_CRITIC_COLUMNS = ("val/grad_norm", "loss/value", "val/clipfrac", "val/vpred", "val/error", "val/explained_variance")
# What the group estimators add: (name, meaning, the `grpo.advantage` that writes it).
_GROUP_TRAIN = (
    ("objective/group_std", "mean within-group standard deviation of the sequence rewards (k responses to one "
                            "prompt)", "grpo"),
    ("objective/zero_std_frac", "fraction of groups whose k rewards are all equal (zero advantage, no gradient)",
     "grpo"),
    ("objective/baseline", "mean leave-one-out baseline (the other k - 1 responses' mean reward)", "rloo"),
    ("objective/batch_std", "standard deviation of the baselined rewards over the batch", "reinforce_baseline"),
)


def rl(stage: str = "ppo") -> list[Metric]:
    """The PPO stage's names; `stage="grpo"`: the same trainer without a critic (compare/dvc.yaml)."""
    def m(file: str, name: str, meaning: str, condition: Optional[str] = None, copy_of: Optional[str] = None):
        if stage != "ppo":
            meaning = meaning.replace("`ppo.", f"`{stage}.").replace("PPO policy", f"{stage.upper()} policy")
            condition = {None: "compare", "grpo": None}.get(condition, condition)
        return Metric(stage, file, name, meaning, condition, copy_of)

    train = [row for row in _PPO_TRAIN if stage == "ppo" or row[0] not in _CRITIC_COLUMNS]
    if stage != "ppo":   # the default estimator's columns (grpo.advantage: grpo)
        train += [row for row in _GROUP_TRAIN if row[2] == "grpo"]
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
            m(METRICS_JSON, f"eval/rm_{policy}", f"mean score by PPO's reward source (`ppo.reward_source`) of "
                                                 f"responses sampled from {who} to the first `ppo.n_eval_prompts` "
                                                 "held-out prompts"),
            m(METRICS_JSON, f"eval/rm_{policy}_ci95", "half-width of its 95% interval"),
            m(METRICS_JSON, f"eval/kl_{policy}", f"mean sequence-level sampled KL of {who} to the reference on "
                                                 "those prompts" + (" (0 by construction)" if policy == "sft" else "")),
            m(METRICS_JSON, f"eval/kl_{policy}_ci95", "half-width of its 95% interval"),
            m(METRICS_JSON, f"eval/gold_{policy}", f"mean gold score of {who}'s responses", "!no_judge"),
            m(METRICS_JSON, f"eval/gold_{policy}_ci95", "half-width of its 95% interval", "!no_judge"),
            m(METRICS_JSON, f"eval/eos_rate_{policy}", f"rate of {who}'s responses that ended with eos or the stop "
                                                       "token"),
        ]
    out += [
        m(METRICS_JSON, "eval/gold_gain", f"mean paired gold-score difference {stage.upper()} - SFT on the same "
                                          "prompts", "!no_judge"),
        m(METRICS_JSON, "eval/gold_gain_ci95", "half-width of its 95% interval", "!no_judge"),
    ]
    return out


def evaluate() -> list[Metric]:
    def m(file: str, name: str, meaning: str, condition: Optional[str] = None) -> Metric:
        return Metric("evaluate", file, name, meaning, condition)

    out = [
        m("policies.tsv", "step", "position of the policy in the order `sft`, `best_of_<n>` for each n, `ppo`"),
        m("policies.tsv", "policy", "the policy's name: `sft`, `best_of_<n>`, `ppo` (the bars of `dvc plots show`)"),
        m("policies.tsv", "rm", "the policy's mean RM score (its `<policy>/rm`)"),
        m("policies.tsv", "gold", "its mean gold score", "!no_judge"),
        m("policies.tsv", "kl", "its KL to SFT"),
    ]
    for policy, who in (("sft", "the SFT policy"), ("best_of_{n}", "best-of-n"), ("ppo", "the PPO policy")):
        kl = {"sft": "KL to SFT (0 by construction)",
              "best_of_{n}": "KL to SFT, the analytic `log n - (n-1)/n`",
              "ppo": "mean sequence-level sampled KL to SFT"}[policy]
        out += [
            m(METRICS_JSON, f"{policy}/rm", f"mean reward-model score of {who}'s responses to the first "
                                            "`evaluate.n_prompts` held-out prompts"),
            m(METRICS_JSON, f"{policy}/rm_ci95", "half-width of its 95% interval"),
            m(METRICS_JSON, f"{policy}/gold", f"mean gold score of {who}'s responses", "!no_judge"),
            m(METRICS_JSON, f"{policy}/gold_ci95", "half-width of its 95% interval", "!no_judge"),
            m(METRICS_JSON, f"{policy}/kl", kl),
            m(METRICS_JSON, f"{policy}/kl_ci95", "half-width of its 95% interval"
                                                 + (" (0 up to rounding)" if policy != "ppo" else "")),
            m(METRICS_JSON, f"{policy}/length", "mean response length, words"),
            m(METRICS_JSON, f"{policy}/eos_rate", "rate of responses that ended with eos or the stop token"),
            m(METRICS_JSON, f"{policy}/distinct_2", "distinct bigrams / bigrams over its responses (words)"),
        ]
    for judge, condition in (("rm", None), ("gold", "!no_judge")):
        who = "reward model" if judge == "rm" else "gold annotator"
        out += [
            m(METRICS_JSON, f"win_rate/ppo_vs_sft_{judge}", f"rate at which the {who} scores PPO's response above "
                                                            "SFT's to the same prompt (ties count 1/2)", condition),
            m(METRICS_JSON, f"win_rate/ppo_vs_sft_{judge}_low", "lower end of its bootstrap 95% interval "
                                                                "(`evaluate.bootstrap` resamples of the prompts)",
              condition),
            m(METRICS_JSON, f"win_rate/ppo_vs_sft_{judge}_high", "upper end of that interval", condition),
        ]
    out.append(m(METRICS_JSON, "overoptimisation/win_rate_gap", "RM win rate - gold win rate: how much more the "
                                                                "reward model prefers PPO than the gold annotator "
                                                                "does", "!no_judge"))
    return out


def resources(stage: str, condition: Optional[str] = None) -> list[Metric]:
    """What the stage skeleton adds to every stage's metrics.json: what its process cost."""
    def m(name: str, meaning: str, cond: Optional[str] = condition) -> Metric:
        return Metric(stage, METRICS_JSON, name, meaning, cond)

    gpu = "cuda" if condition is None else None
    out = [m("resources/wall_seconds", "seconds of the stage's process from its start to its outputs (a resumed "
                                       "stage: its last process only)"),
           m("resources/peak_rss_gib", "peak resident memory of the stage's process (rank 0), GiB"),
           m("resources/gpus", "GPUs the stage ran on (one per process; 0: the CPU); config.json's `runtime` "
                               "names the device")]
    if gpu is not None:
        out.append(m("resources/peak_device_gib", "peak GPU memory torch allocated in the stage's process (rank 0), "
                                                  "GiB", gpu))
    return out


def dpo() -> list[Metric]:
    def m(file: str, name: str, meaning: str) -> Metric:
        return Metric("dpo", file, name, meaning, "compare")

    out = supervised("dpo", "pairs", "the method's loss (`dpo.method`) over the step's pairs",
                      "the method's loss on the held-out pairs", "adapters")
    out = [Metric("dpo", x.file, x.name, x.meaning, "compare" if x.condition is None else "method_lora") for x in out]
    columns = {"accuracy": "rate of pairs whose implicit reward (beta x log-ratio to the reference; SimPO: beta x "
                           "mean log-prob) is higher for the chosen response",
               "margin": "mean implicit reward of chosen minus rejected",
               "chosen_logp": "mean summed log-prob of the chosen responses under the policy",
               "rejected_logp": "mean summed log-prob of the rejected responses under the policy",
               "chosen_reward": "mean implicit reward of the chosen responses",
               "rejected_reward": "mean implicit reward of the rejected responses"}
    for file in ("train.tsv", "eval.tsv"):
        out += [m(file, k, v) for k, v in columns.items()]
    out += [m("eval.tsv", "chosen_logp_drift", "held-out chosen log-prob, policy minus reference: both drifts "
                                               "falling while the margin grows is DPO's known failure"),
            m("eval.tsv", "rejected_logp_drift", "held-out rejected log-prob, policy minus reference")]
    out += [m(METRICS_JSON, f"eval/{k}", f"`eval.tsv`'s last `{k}`") for k in (*columns, "chosen_logp_drift",
                                                                              "rejected_logp_drift")]
    out += [m(METRICS_JSON, "train/accuracy", "`train.tsv`'s last `accuracy`"),
            m(METRICS_JSON, "train/margin", "`train.tsv`'s last `margin`"),
            m(METRICS_JSON, "data/eval_truncated", "held-out pairs kept with their prompt's left end cut"),
            m(METRICS_JSON, "data/eval_dropped", "held-out pairs left out (`dpo.overlong: drop`)")]
    return out + sampled("dpo", ("gold", "kl"))


def sampled(stage: str, keys: tuple[str, ...]) -> list[Metric]:
    """A trained policy sampled on the held-out prompts (measurement.policy.sampled_metrics): the
    `keys` it is scored by, then its responses' end rate, length and distinct-2 (compare/dvc.yaml's)."""
    meanings = {"rm": "mean RM score", "gold": "mean gold score", "kl": "mean sequence-level sampled KL to SFT"}

    def m(name: str, meaning: str) -> Metric:
        return Metric(stage, METRICS_JSON, name, meaning, "compare")
    out = []
    for key in keys:
        out += [m(f"eval/{key}_sampled", f"{meanings[key]} of the trained policy's responses to the first "
                                         f"`{stage}.n_eval_prompts` held-out prompts (`ppo.sampling`)"),
                m(f"eval/{key}_sampled_ci95", "half-width of its 95% interval")]
    return out + [m("eval/eos_rate_sampled", "rate of those responses that ended with eos or the stop token"),
                  m("eval/length_sampled", "their mean length, words"),
                  m("eval/distinct_2_sampled", "distinct bigrams / bigrams over them")]


def rs() -> list[Metric]:
    def m(file: str, name: str, meaning: str, condition: str = "compare") -> Metric:
        return Metric("rs", file, name, meaning, condition)

    out = [Metric("rs", x.file, x.name, x.meaning, "compare" if x.condition is None else "method_lora")
           for x in supervised("rs", "winners", "cross-entropy per response token of the step's winners",
                                "cross-entropy per response token on SFT's held-out demonstrations", "adapters")]
    out += [m(METRICS_JSON, "data/prompts_truncated", "PPO training prompts longer than `ppo.max_prompt_length` "
                                                      "kept with their left end cut"),
            m(METRICS_JSON, "data/prompts_dropped", "such prompts left out (`ppo.overlong: drop`)"),
            m(METRICS_JSON, "rs/prompts", "prompts sampled (`rs.n_prompts` of the PPO training prompts)"),
            m(METRICS_JSON, "rs/winners_kept", "winners trained on (those at or above `rs.min_score`)"),
            m(METRICS_JSON, "rs/rm_candidates", "mean RM score of all `rs.n` candidates of every prompt"),
            m(METRICS_JSON, "rs/rm_winners", "mean RM score of the winners (each prompt's best candidate)"),
            m(METRICS_JSON, "rs/rm_winners_ci95", "half-width of its 95% interval"),
            m(METRICS_JSON, "rs/eos_rate_candidates", "rate of candidates that ended with eos or the stop token"),
            m(METRICS_JSON, "rs/eos_rate_winners", "the same rate among the winners"),
            m(METRICS_JSON, "rs/gold_candidates", "mean gold score of all candidates"),
            m(METRICS_JSON, "rs/gold_winners", "mean gold score of the winners"),
            m(METRICS_JSON, "rs/gold_winners_ci95", "half-width of its 95% interval")]
    return out + sampled("rs", ("rm", "gold", "kl"))


def compare() -> list[Metric]:
    def m(file: str, name: str, meaning: str) -> Metric:
        return Metric("compare", file, name, meaning, "compare")

    out = [m("methods.tsv", "step", "position of the policy in the report's order"),
           m("methods.tsv", "policy", "the policy's name: `sft`, `best_of_<n>`, or a method (`ppo`, `dpo`, ...)"),
           m("methods.tsv", "rm", "its mean RM score"), m("methods.tsv", "gold", "its mean gold score"),
           m("methods.tsv", "kl", "its KL to SFT"),
           m(METRICS_JSON, "n_prompts", "held-out prompts every policy answered (`compare.n_prompts`)")]
    for key, meaning in (("rm", "mean reward-model score"), ("gold", "mean gold score"),
                         ("kl", "mean KL to SFT (best-of-n: the analytic `log n - (n-1)/n`)")):
        out += [m(METRICS_JSON, f"{{policy}}/{key}", f"{meaning} of the policy's responses"),
                m(METRICS_JSON, f"{{policy}}/{key}_ci95", "half-width of its 95% interval")]
    out += [m(METRICS_JSON, "{policy}/length", "mean response length, words"),
            m(METRICS_JSON, "{policy}/eos_rate", "rate of responses that ended with eos or the stop token"),
            m(METRICS_JSON, "{policy}/distinct_2", "distinct bigrams / bigrams over its responses"),
            m(METRICS_JSON, "{policy}/stage_wall_seconds", "the method stage's `resources/wall_seconds`"),
            m(METRICS_JSON, "{policy}/stage_peak_rss_gib", "the method stage's `resources/peak_rss_gib`")]
    for judge in ("rm", "gold"):
        who = "reward model" if judge == "rm" else "gold annotator"
        out += [m(METRICS_JSON, f"win_rate/{{policy}}_vs_sft_{judge}", f"rate at which the {who} scores the policy's "
                                                                       "response above SFT's (ties count 1/2)"),
                m(METRICS_JSON, f"win_rate/{{policy}}_vs_sft_{judge}_low", "lower end of its bootstrap 95% interval"),
                m(METRICS_JSON, f"win_rate/{{policy}}_vs_sft_{judge}_high", "upper end of that interval")]
    return out


# ---- docs/metrics.md ------------------------------------------------------------------------------

INTRO = """\
# Metrics

Every metric a stage writes, what it means and where it is. Per-step series go to the stage's
`*.tsv` files (registered as DVC plots; `step` is the optimizer step, or the PPO iteration); final
values go to `metrics.json` (read by `dvc metrics show` and `dvc exp show`), nested by the `/` in
their names (`eval/accuracy` is `{"eval": {"accuracy": ...}}`). MLflow gets the same values, a TSV
column as `<series>/<column>` (`train/loss`) unless it has a `/` of its own (`objective/kl`). Names
follow TRL's PPO trainer where the quantity is the same.

This file is generated from each stage's metric declarations (its SPEC's `metrics`, built with
pipeline/tracking/metric_names.py); edit them and run
`REGENERATE`. `tests/unit/test_metric_names.py` fails when the
two differ, or when the committed run in `outputs/` writes a name the registry does not define or
lacks one it defines. The last column says when a name is written: always (default task, default
params), `only with` or `unless` one of the conditions below.
"""

CONDITIONS_HEADING = """\
## Conditions

| condition | the run has it when |
| --- | --- |
"""

def _when(condition: Optional[str]) -> str:
    if condition is None:
        return "always"
    return f"unless `{condition[1:]}`" if condition.startswith("!") else f"only with `{condition}`"


def _files(metrics: Iterable[Metric]) -> list[str]:
    """A stage's files in registry order, metrics.json last."""
    files = list(dict.fromkeys(m.file for m in metrics))
    return [f for f in files if f != METRICS_JSON] + [METRICS_JSON]


def render_markdown(stages: Iterable[StageMetrics], regenerate: str) -> str:
    """The whole of docs/metrics.md (`regenerate`: the command that writes it)."""
    stages = list(stages)
    declared = [m for st in stages for m in st.metrics]
    parts = [INTRO.replace("REGENERATE", regenerate)]
    for st in stages:
        stage = st.stage
        parts.append(f"## {st.title}\n")
        for file in _files(st.metrics):
            parts.append(f"### `{file}`: {st.files[file]}\n")
            rows = ["| name | meaning | written |", "| --- | --- | --- |"]
            copies = []
            for m in declared:
                if m.stage != stage or m.file != file:
                    continue
                if m.copy_of is not None:
                    copies.append(m)
                    continue
                rows.append(f"| `{m.name}` | {m.meaning} | {_when(m.condition)} |")
            if copies:
                source = {m.copy_of for m in copies}
                tsv = next(m.file for m in declared if m.stage == stage and m.name in source and m.copy_of is None)
                rows.insert(2, f"| `train/<column>` | the last row's value of each column of `{tsv}` but `step`, "
                               f"its `/` written `_` (`train/objective_kl`); {len(copies)} names | as the column |")
            parts.append("\n".join(rows) + "\n")
        if st.notes:
            parts.append(st.notes)
    parts.append(CONDITIONS_HEADING + "\n".join(f"| `{k}` | {v} |" for k, v in CONDITIONS.items()) + "\n")
    return "\n".join(parts)


# ---- Checking a finished run ----------------------------------------------------------------------


def _flatten(node: object, prefix: str = "") -> Iterable[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _flatten(value, f"{prefix}{key}/")
    else:
        yield prefix[:-1]


def emitted(outputs_dir: Path, stages: Iterable[str]) -> dict[tuple[str, str], list[str]]:
    """(stage, file) -> the names a finished run wrote: the flattened keys of each stage's
    metrics.json and the header of each of its TSV files."""
    out: dict[tuple[str, str], list[str]] = {}
    for stage in stages:
        folder = Path(outputs_dir) / stage
        path = folder / METRICS_JSON
        if path.is_file():
            out[(stage, METRICS_JSON)] = list(_flatten(json.loads(path.read_text(encoding="utf-8"))))
        for tsv in sorted(folder.glob("*.tsv")):
            with tsv.open(encoding="utf-8") as f:
                header = f.readline().rstrip("\n")
            out[(stage, tsv.name)] = header.split("\t") if header else []
    return out


def _placeholder_values(outputs_dir: Path) -> dict[str, list[str]]:
    """Values a placeholder takes in this run, where the run's resolved config says: `{n}` is each
    n of `evaluate.best_of_n` (outputs/evaluate/config.json)."""
    path = Path(outputs_dir) / "evaluate" / "config.json"
    try:
        ns = json.loads(path.read_text(encoding="utf-8"))["evaluate"]["best_of_n"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {"n": [str(n) for n in ns]}


def check_run(outputs_dir: Path, stages: Iterable[StageMetrics],
              conditions: AbstractSet[str] = frozenset()) -> tuple[list[str], list[str]]:
    """Compare a finished run under `outputs_dir` (stage folders sft, reward, ppo, evaluate) with
    the registry. Returns (names written that the registry does not define, names the registry
    defines for a run with `conditions` that were not written), each as `<stage>/<file>: <name>`.
    A pattern's placeholders take the run's values where known (`{n}`: evaluate.best_of_n from
    outputs/evaluate/config.json); otherwise one matching name satisfies it."""
    unknown_keys = set(conditions) - set(CONDITIONS)
    if unknown_keys:
        raise ValueError(f"unknown conditions {sorted(unknown_keys)}; known: {', '.join(CONDITIONS)}")
    conditions = set(conditions)
    for key in list(conditions):
        conditions.update(IMPLIES.get(key, ()))
    stages = list(stages)
    declared = [m for st in stages for m in st.metrics]
    compare_stages = {st.stage for st in stages if st.compare}
    written = emitted(outputs_dir, [st.stage for st in stages])
    values = _placeholder_values(outputs_dir)
    undefined, missing = [], []
    for (stage, file), names in written.items():
        entries = [m for m in declared if m.stage == stage and m.file == file]
        for name in names:
            if not any(m.regex().fullmatch(name) for m in entries):
                undefined.append(f"{stage}/{file}: {name}")
    for m in declared:
        if not m.satisfied(conditions) or (m.stage in compare_stages and "compare" not in conditions):
            continue
        names = written.get((m.stage, m.file), [])
        holes = m.placeholders
        if not holes:
            expected = [m.name]
        elif all(h in values for h in holes) and len(set(holes)) == 1:
            expected = [m.name.replace(f"{{{holes[0]}}}", v) for v in values[holes[0]]]
        else:
            if not any(m.regex().fullmatch(n) for n in names):
                missing.append(f"{m.stage}/{m.file}: {m.name}")
            continue
        missing += [f"{m.stage}/{m.file}: {e}" for e in expected if e not in names]
    return undefined, missing
