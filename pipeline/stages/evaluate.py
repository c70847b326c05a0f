"""The `evaluate` stage: SFT, best-of-n and PPO policies on the held-out prompts.

For each policy: reward-model score, gold score (when the task has a judge), KL to the reference
(SFT) policy, response length, end-of-response rate, distinct-n diversity. Then win rates of PPO
over SFT (gold and RM verdicts, ties count half) with bootstrap intervals, and the over-optimisation
signal: how much more the reward model prefers PPO than the gold annotator does.

Best-of-n samples n responses from SFT and keeps the one the reward model scores highest; its KL
to SFT is known analytically, log n - (n - 1) / n (Stiennon et al. 2020, appendix G.3), an upper
bound that is tight when responses rarely repeat. Each n of `evaluate.best_of_n` is measured from
one draw of max(n) samples per prompt: best-of-n keeps the favourite among the first n, so the
baselines are nested and cost as much as the largest alone; the KL-vs-score curve they trace is
what PPO has to beat at its own KL (Gao et al. 2023). With a gold judge that distance is measured:
Gao et al.'s best-of-n form fitted through the points, PPO's gold minus the curve at PPO's KL, with
a paired bootstrap interval over the prompts (measurement/frontier_gap.py).

The verdict (first line of report.md, end of the console output, the MLflow parent run's
description) says in one paragraph whether PPO beat SFT, whether the RM was gamed and whether PPO
fell clearly below the best-of-n frontier (measurement/verdict.py). When it is OK,
the PPO policy becomes the registered model's champion (`models:/rlhf-policy@champion`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..config import EvaluateConfig, Params
from ..files import atomic_write_text
from ..measurement.comparison_plots import evaluation_plots
from ..measurement.plots import close_figure
from ..measurement.frontier_gap import MIN_DEFINED, finite
from ..measurement.verdict import BELOW_FRONTIER, detector_record, passed, verdict
from ..tracking.sinks import StepLog, Tracker
from ..context import SINGLE, Context
from . import registry
from ..tracking.metric_names import METRICS_JSON, Metric
from .spec import StageSpec, reads_held_out_prompts

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    from ..measurement.policy import Measured
    from ..training import memory_plan

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "policies.tsv": "one row per policy, in report order",
    "metrics.json": "per policy (`sft`, `best_of_<n>` for each n of `evaluate.best_of_n`, `ppo`) on "
                    "the held-out prompts, then the win rates and PPO's gap to the best-of-n frontier",
}
# How the gap in the reward model's score reads beside the gold gap: the metrics page and the report.
RM_GAP_READING = ("Below in both, PPO gets less of the score it optimises per nat of KL than best-of-n; below in "
                  "gold only, its score gains are worth less gold than best-of-n's")
METRIC_NOTES = f"""\
`best_of_<n>` keeps the reward model's favourite among the first n of max(n) SFT samples per prompt
(nested: one draw serves every n). `report.md` opens with the verdict (did PPO beat SFT by the gold
annotator, is the RM-vs-gold gap above 20 points, is PPO below the best-of-n frontier, what the PPO
detector recorded; also printed last by the stage and set as the MLflow parent run's description),
compares PPO with each best-of-n at their KLs, and shows `scores.png` and `kl_frontier.png`
(best-of-n points joined as a curve).

`frontier/ppo_gap_gold` fits Gao et al. 2023's best-of-n form, gold - gold(SFT) = d (a - b d) with
d = sqrt(KL), by least squares through the best-of-n points (anchored at SFT, KL 0), and takes PPO's
mean gold minus the curve at PPO's mean KL; its interval resamples the prompts, the same ones for
every policy, and refits. Past best-of-n's largest KL the curve is not extrapolated: the gap and its
bounds are null and `frontier/ppo_beyond_best_of_n` is true. `frontier/ppo_margin_gold`, defined at
every KL, is PPO's mean gold minus the best mean gold SFT or a best-of-n reaches at no more KL. A gap,
or a margin, below -{BELOW_FRONTIER:.2f} whose whole interval is below 0 makes the verdict not OK.
`frontier/ppo_gap_rm` is the same gap in the reward model's score.
{RM_GAP_READING} (over-optimisation of the reward model).
"""

def declared_metrics() -> list[Metric]:
    from ..measurement.held_out import frontier_declarations
    from ..measurement.policy import sampled_declarations
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
        kl = {"sft": "KL to SFT (0 by construction; its interval's half-width 0 up to rounding)",
              "best_of_{n}": "KL to SFT, the analytic `log n - (n-1)/n` (its interval's half-width 0 up to rounding)",
              "ppo": "mean sequence-level sampled KL to SFT"}[policy]
        out += sampled_declarations("evaluate", {
            "rm": f"mean reward-model score of {who}'s responses to the first `evaluate.n_prompts` held-out prompts",
            "gold": f"mean gold score of {who}'s responses", "kl": kl},
            policy=policy, condition=None, conditions={"gold": "!no_judge"})
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
    return out + frontier_declarations("evaluate", "ppo", "!no_judge")


SPEC = StageSpec(
    "evaluate", help="SFT, best-of-n and PPO on the held-out prompts", inputs=("data", "sft", "reward", "ppo"),
    measuring=True, headline=("*/gold", "*/rm", "*/kl", "win_rate/ppo_vs_sft_gold", "win_rate/ppo_vs_sft_rm",
                              "frontier/ppo_gap_gold"),
    headline_prefixed=False,     # its names already say the policy (`ppo/gold`): the pipeline's own numbers
    parent_params=("evaluate.n_prompts", "evaluate.best_of_n"),
    check_inputs=reads_held_out_prompts,
    metrics=declared_metrics, files=METRIC_FILES, notes=METRIC_NOTES,
    plan=lambda params, shapes: memory_plan_of(params, shapes),
    summary=lambda metrics, folders: console_lines(metrics, folders), reads=(
    "data.task", "model.trust_remote_code",
    "reward.max_length",         # the reward model scores as it was trained
    "prompts",                   # held-out prompts, how they are sampled, the gold judge switch
    "evaluate", "distributed",
))


def policies(cfg: EvaluateConfig) -> tuple[str, ...]:
    """Policy names in report order: sft, best_of_<n> for each n, ppo."""
    return ("sft", *(f"best_of_{n}" for n in cfg.best_of_n), "ppo")


def summarise(per: dict[str, Measured], n_boot: int, seed: int) -> dict[str, Any]:
    """The held-out summary (measurement/held_out.py) with PPO's win rates over SFT and, with a
    judge, its gap to the best-of-n frontier and the over-optimisation gap: the RM's verdict minus
    the gold verdict on the same comparisons."""
    from ..measurement import held_out
    m = held_out.summarise(per, n_boot, seed, versus=("ppo",), against_frontier=("ppo",))
    if "gold" in per["sft"].values:
        m["overoptimisation/win_rate_gap"] = m["win_rate/ppo_vs_sft_rm"] - m["win_rate/ppo_vs_sft_gold"]
    return m


def samples_markdown(per: dict[str, Measured], prompts: list[str], k: int) -> str:
    sft, ppo = per["sft"], per["ppo"]
    has_gold = "gold" in sft.values
    lines = ["| prompt | SFT | PPO | RM (SFT / PPO) |" + (" gold (SFT / PPO) |" if has_gold else ""),
             "| --- | --- | --- | --- |" + (" --- |" if has_gold else "")]
    for i in range(min(k, len(prompts))):
        row = f"| {prompts[i]} | {sft.texts[i]} | {ppo.texts[i]} | " \
              f"{sft.values['rm'][i]:.2f} / {ppo.values['rm'][i]:.2f} |"
        if has_gold:
            row += f" {sft.values['gold'][i]:.2f} / {ppo.values['gold'][i]:.2f} |"
        lines.append(row.replace("\n", " "))
    return "\n".join(lines) + "\n"


def samples_table(per: dict[str, Measured], prompts: list[str]) -> dict[str, list]:
    """Columns of the SFT and PPO answer to every held-out prompt with their scores (MLflow's table)."""
    table: dict[str, list] = {"prompt": list(prompts)}
    for policy in ("sft", "ppo"):
        table[f"{policy}_response"] = list(per[policy].texts[:len(prompts)])
        for key in ("rm", "gold"):
            if key in per[policy].values:
                table[f"{policy}_{key}"] = [float(v) for v in per[policy].values[key][:len(prompts)]]
    return table


def ppo_vs_best_of_n(m: dict[str, Any], ns: tuple[int, ...], key: str) -> list[str]:
    """Report lines: for each best-of-n, its KL and mean `key` score (gold, or RM without a judge)
    against PPO's; last, PPO against the best-of-n nearest to it in KL."""
    judge = "gold" if key == "gold" else "RM score"
    ppo_kl, ppo = m["ppo/kl"], m[f"ppo/{key}"]
    lines = []
    for n in ns:
        kl, b = m[f"best_of_{n}/kl"], m[f"best_of_{n}/{key}"]
        lines.append(f"- best_of_{n} sits at KL {kl:.2f} with {judge} {b:.3f}; PPO, at KL {ppo_kl:.2f} with "
                     f"{ppo:.3f}, {'beats' if ppo > b else 'does not beat'} it.")
    near = min(ns, key=lambda n: abs(m[f"best_of_{n}/kl"] - ppo_kl))
    lines.append(f"- PPO (KL {ppo_kl:.2f}) vs best-of-n at the nearest KL (best_of_{near}, KL "
                 f"{m[f'best_of_{near}/kl']:.2f}): {judge} {ppo:.3f} vs {m[f'best_of_{near}/{key}']:.3f}.")
    if "frontier/ppo_gap_gold" in m:
        lines.append(f"- {frontier_sentence(m, ns)}")
    return lines


def frontier_sentence(m: dict[str, Any], ns: tuple[int, ...]) -> str:
    """PPO's gap to the best-of-n curve fitted through the points above, with its interval, or why
    there is none."""
    gap, low, high = (m.get(f"frontier/ppo_gap_gold{s}") for s in ("", "_low", "_high"))
    if m.get("frontier/ppo_beyond_best_of_n"):
        top = ns[-1]
        margin, m_low, m_high = (m.get(f"frontier/ppo_margin_gold{s}") for s in ("", "_low", "_high"))
        against = (f" Against the best gold of SFT and best-of-n, all at less KL, PPO's differs by {margin:+.3f} "
                   f"(95% CI {m_low:+.3f} to {m_high:+.3f}): `frontier/ppo_margin_gold`."
                   if finite(margin) and finite(m_low) and finite(m_high) else "")
        return (f"PPO's KL ({m['ppo/kl']:.2f}) is past best-of-n's largest (best_of_{top}, KL "
                f"{m[f'best_of_{top}/kl']:.2f}): the fitted best-of-n curve is not extrapolated, so no gap "
                f"to the frontier is measured (a larger n in `evaluate.best_of_n` reaches further).{against}")
    if not finite(gap):
        return "Fewer than two best-of-n points: no best-of-n curve to measure PPO's gap to."
    side = "below" if gap < 0 else "above"
    interval = (f"95% CI {low:+.3f} to {high:+.3f}" if finite(low) and finite(high) else
                f"no interval: over {1 - MIN_DEFINED:.0%} of the prompt resamples put PPO's KL past "
                "best-of-n's largest")
    sentence = (f"Against the best-of-n curve fitted through SFT and these points (Gao et al. 2023: "
                f"gold - gold(SFT) = d (a - b d), d = sqrt KL), PPO's gold is {abs(gap):.3f} {side} what "
                f"best-of-n reaches at PPO's KL: gap {gap:+.3f} ({interval}).")
    rm_gap, rm_low, rm_high = (m.get(f"frontier/ppo_gap_rm{s}") for s in ("", "_low", "_high"))
    if not finite(rm_gap):
        return sentence
    rm_interval = f" (95% CI {rm_low:+.3f} to {rm_high:+.3f})" if finite(rm_low) and finite(rm_high) else ""
    return (f"{sentence} In the reward model's own score, its curve fitted the same way, PPO's gap is "
            f"{rm_gap:+.3f}{rm_interval}: `frontier/ppo_gap_rm`. {RM_GAP_READING}.")


def report_markdown(m: dict[str, Any], samples: str, has_gold: bool, names: tuple[str, ...],
                    ns: tuple[int, ...], verdict_text: str) -> str:
    rows = ["| policy | RM score | gold score | KL to SFT (nats) | length | eos rate | distinct-2 |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        gold = f"{m[f'{name}/gold']:.3f} ± {m[f'{name}/gold_ci95']:.3f}" if has_gold else "n/a"
        rows.append(f"| {name} | {m[f'{name}/rm']:.3f} ± {m[f'{name}/rm_ci95']:.3f} | {gold} | "
                    f"{m[f'{name}/kl']:.2f} | {m[f'{name}/length']:.1f} | {m[f'{name}/eos_rate']:.2f} | "
                    f"{m[f'{name}/distinct_2']:.3f} |")
    wins = [f"- PPO beats SFT by the reward model's verdict in {m['win_rate/ppo_vs_sft_rm']:.1%} of prompts "
            f"(95% CI {m['win_rate/ppo_vs_sft_rm_low']:.1%}-{m['win_rate/ppo_vs_sft_rm_high']:.1%})."]
    if has_gold:
        wins.append(f"- By the gold annotator: {m['win_rate/ppo_vs_sft_gold']:.1%} "
                    f"(95% CI {m['win_rate/ppo_vs_sft_gold_low']:.1%}-{m['win_rate/ppo_vs_sft_gold_high']:.1%}); "
                    f"the gap between the two verdicts, {m['overoptimisation/win_rate_gap']:+.1%}, is the "
                    "over-optimisation signal (positive: the RM likes PPO more than the annotator does).")
    return "\n".join([
        "# Evaluation report", "", f"**{verdict_text}**", "",
        "Held-out prompts (films never seen in training); ± is a 95% interval of the mean. "
        "Best-of-n's KL is the analytic log n - (n-1)/n.", "", *rows, "", *wins, "",
        "PPO against best-of-n (means):", "", *ppo_vs_best_of_n(m, ns, "gold" if has_gold else "rm"), "",
        "![scores](scores.png)", "", "![KL vs score](kl_frontier.png)", "", "## Sample responses", "", samples])


def memory_plan_of(params: Params, shapes: memory_plan.Shapes) -> Optional[memory_plan.Planner]:
    """SFT, PPO and the reward model whole on every rank."""
    from ..training import memory_plan
    if not shapes.ready("sft", "reward", "ppo"):
        return None
    sft, ppo, rm = shapes.model("sft"), shapes.model("ppo"), shapes.model("reward", True)
    return memory_plan.measuring_planner("evaluate", params, (sft, ppo, rm),
                                         (sft, ppo, rm) if shapes.predicted else (sft, ppo, rm, ppo))


def console_lines(m: dict[str, Any], folders: dict[str, Path]) -> list[str]:
    """The report's place, each policy's gold score and KL, PPO's gold win rate, the verdict."""
    out = folders["out"]
    lines = [f"evaluate: wrote {out}; report: {out / 'report.md'}"]
    names = sorted((k[:-len("/gold")] for k in m if k.endswith("/gold")),
                   key=lambda n: (n != "sft", n == "ppo", int(n[len("best_of_"):]) if n.startswith("best_of_") else 0))
    lines += [f"  {n}/gold = {m[f'{n}/gold']:.3f} (KL {m[f'{n}/kl']:.2f})" for n in names]
    if "win_rate/ppo_vs_sft_gold" in m:
        lines.append(f"  win_rate/ppo_vs_sft_gold = {m['win_rate/ppo_vs_sft_gold']:.3f}")
    if "frontier/ppo_gap_gold" in m:
        gap, low, high = (m[f"frontier/ppo_gap_gold{s}"] for s in ("", "_low", "_high"))
        ci = f" (95% CI {low:+.3f} to {high:+.3f})" if finite(low) and finite(high) else ""
        beyond = m["frontier/ppo_beyond_best_of_n"]
        lines.append("  frontier/ppo_gap_gold = "
                     + ("none: PPO's KL is past best-of-n's largest" if beyond else f"{gap:+.3f}{ci}"))
        rm_gap = m.get("frontier/ppo_gap_rm")
        if not beyond and finite(rm_gap):
            lines.append(f"  frontier/ppo_gap_rm = {rm_gap:+.3f}")
    return [*lines, verdict(m, detector_record(folders["ppo"]))]


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, ppo_dir: Path, out: Path,
        progress: bool = True) -> dict[str, Any]:
    """The stage: measure every policy, write the report, its plots and metrics; the verdict
    becomes the description of the pipeline's MLflow parent run."""
    from .skeleton import stage_run
    with stage_run(SPEC, params, out, [data_dir, sft_dir, reward_dir, ppo_dir, params.prompts.dataset.path]) as run:
        m, text, table, figures = _run(run.params, data_dir, sft_dir, reward_dir, ppo_dir, run.out, run.ctx)
        if not run.ctx.is_main:   # rank 0 writes the report
            return {}
        for name, figure in figures.items():   # before finish, which uploads the files not logged so
            run.tracker.log_figure(figure, name)
            close_figure(figure)
        run.finish(m)
        run.tracker.log_table(table, "samples.json")   # every held-out prompt, browsable in MLflow
        run.tracker.set_description(text)   # the pipeline's parent run, described by its verdict
        name_champion(run.tracker, m)
    return m


def name_champion(tracker: Tracker, m: dict[str, Any]) -> bool:
    """Point the alias `champion` of PPO's registered model (`models:/rlhf-policy@champion`) at the
    policy this pipeline execution judged, when the verdict on it (`m`, evaluate's metrics) is OK;
    whether it did. A policy that lost to SFT, or gamed the reward model, or has no gold verdict
    leaves the alias where it was: on the last policy that passed."""
    if not passed(m):
        return False
    tracker.alias_evaluated("ppo", registry.spec("ppo").model.registered, "champion")
    return True


def _run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, ppo_dir: Path,
         out: Path, ctx: Context = SINGLE) -> tuple[dict[str, Any], str, dict[str, list], dict[str, Any]]:
    from ..data import inputs
    from ..measurement import held_out
    from ..training import loading
    cfg, judge = params.evaluate, inputs.judge(params)
    names = policies(cfg)
    prompts = inputs.prompts(params, data_dir, "eval")[:cfg.n_prompts]
    per = held_out.measure_against_sft(
        sft_dir, {"ppo": ppo_dir}, reward_dir, prompts, judge, sampling=params.prompts.sampling, seed=cfg.seed,
        best_of=cfg.best_of_n, reward_max_length=params.reward.max_length,
        trust_remote_code=params.model.trust_remote_code, dtype=loading.load_dtype(cfg.distributed, trained=False),
        ctx=ctx, packed=cfg.packing)
    if not ctx.is_main:
        return {}, "", {}, {}
    m = summarise(per, cfg.bootstrap, cfg.seed)
    # The policy's name is a column so `dvc plots show` can draw bars by policy (dvc.yaml's plots).
    scores = ["rm", "gold", "kl"] if judge else ["rm", "kl"]
    table = StepLog(out / "policies.tsv", ["policy", *scores])
    for i, name in enumerate(names):
        table.log(i, {"policy": name, **{k: m[f"{name}/{k}"] for k in scores}})
    table.flush()
    figures = evaluation_plots(m, names, judge is not None, out)
    samples = samples_markdown(per, prompts, cfg.n_samples_shown)
    text = verdict(m, detector_record(ppo_dir))
    atomic_write_text(out / "samples.md", samples)
    atomic_write_text(out / "report.md", report_markdown(m, samples, judge is not None, names, cfg.best_of_n, text))
    return m, text, samples_table(per, prompts), figures
