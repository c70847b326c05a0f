"""The `compare` stage: every alignment method built from the same SFT policy and reward model,
measured on the same held-out prompts by the same judges.

Policies arrive as `--policy name=folder` (ppo, dpo, grpo, rs, ...: whichever stages of
compare/dvc.yaml ran), next to the SFT policy and best-of-n from it (`compare.best_of_n`, the
KL-efficient baseline of Gao et al. 2023). Each is sampled on the first `compare.n_prompts`
held-out prompts with `prompts.sampling` (as PPO's rollouts and the evaluate stage sample) and
measured once by `measurement.policy.measure`: reward-model score, KL to the SFT policy, gold score
where the task has an annotator, length, end-of-response rate, distinct-2. Win rates over SFT come
per prompt (ties count half) with bootstrap intervals, by gold and by the RM. With a gold judge,
each method's gap to the best-of-n frontier at its own KL (measurement/frontier_gap.py, as the
evaluate stage measures PPO's), with a paired bootstrap interval over the prompts.

Each method stage's own cost comes from its metrics.json: `resources/wall_seconds` (that stage's
process, start to finish) and `resources/peak_rss_gib` (its peak resident memory; on a GPU the peak
allocated device memory, `resources/peak_device_gib`, too).

Writes metrics.json (`<policy>/<measure>`, `win_rate/<policy>_vs_sft_<judge>[_low|_high]`,
`frontier/<method>_gap_gold[_low|_high]`, `frontier/<method>_beyond_best_of_n`),
methods.tsv (one row per policy, for `dvc plots`), report.md (one table and the plot) and
gold_vs_kl.png (score against KL to SFT: a point per method, best-of-n as a curve).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..config import Params
from ..files import atomic_write_text, read_json_object
from ..errors import ConfigError, DataError, shown
from ..measurement.comparison_plots import gold_vs_kl_plot
from ..measurement.plots import close_figure
from ..measurement.frontier_gap import finite
from ..tracking.sinks import StepLog
from ..tracking.metric_names import METRICS_JSON, Metric
from .spec import StageSpec, reads_held_out_prompts

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    from ..training import memory_plan

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "methods.tsv": "one row per policy, in report order",
    "metrics.json": "per policy (`sft`, `best_of_<n>` for each n of `compare.best_of_n`, each method "
                    "given by `--policy`) on the held-out prompts, then each one's win rates over SFT and "
                    "each method's gap to the best-of-n frontier",
}

def declared_metrics() -> list[Metric]:
    from ..measurement.held_out import frontier_declarations
    from ..measurement.policy import sampled_declarations
    def m(file: str, name: str, meaning: str) -> Metric:
        return Metric("compare", file, name, meaning, "compare")

    out = [m("methods.tsv", "step", "position of the policy in the report's order"),
           m("methods.tsv", "policy", "the policy's name: `sft`, `best_of_<n>`, or a method (`ppo`, `dpo`, ...)"),
           m("methods.tsv", "rm", "its mean RM score"), m("methods.tsv", "gold", "its mean gold score"),
           m("methods.tsv", "kl", "its KL to SFT"),
           m("methods.tsv", "gold_gap", "a method's `frontier/<method>_gap_gold`: its gold minus the "
                                        "best-of-n curve at its KL; blank for SFT and best-of-n (the curve's "
                                        "own points) and where undefined (past best-of-n's largest KL)"),
           m(METRICS_JSON, "n_prompts", "held-out prompts every policy answered (`compare.n_prompts`)")]
    out += sampled_declarations("compare", {
        "rm": "mean reward-model score of the policy's responses", "gold": "mean gold score of the policy's responses",
        "kl": "mean KL to SFT (best-of-n: the analytic `log n - (n-1)/n`) of the policy's responses"},
        policy="{policy}")
    out += [m(METRICS_JSON, "{policy}/stage_wall_seconds", "the method stage's `resources/wall_seconds`"),
            m(METRICS_JSON, "{policy}/stage_peak_rss_gib", "the method stage's `resources/peak_rss_gib`")]
    for judge in ("rm", "gold"):
        who = "reward model" if judge == "rm" else "gold annotator"
        out += [m(METRICS_JSON, f"win_rate/{{policy}}_vs_sft_{judge}", f"rate at which the {who} scores the policy's "
                                                                       "response above SFT's (ties count 1/2)"),
                m(METRICS_JSON, f"win_rate/{{policy}}_vs_sft_{judge}_low", "lower end of its bootstrap 95% interval"),
                m(METRICS_JSON, f"win_rate/{{policy}}_vs_sft_{judge}_high", "upper end of that interval")]
    return out + frontier_declarations("compare", "{policy}", "compare")


SPEC = StageSpec(
    "compare", help="every alignment method (--policy NAME=FOLDER each), SFT and best-of-n on the held-out prompts",
    inputs=("data", "sft", "reward"), measuring=True, pipeline="compare",
    headline=("*/gold", "*/rm", "*/kl", "win_rate/*_vs_sft_gold", "win_rate/*_vs_sft_rm",
              "frontier/*_gap_gold"),
    parent_params=("compare.n_prompts", "compare.best_of_n"),
    check_inputs=reads_held_out_prompts,
    metrics=declared_metrics, files=METRIC_FILES,
    plan=lambda params, shapes: memory_plan_of(params, shapes),
    summary=lambda metrics, folders: [f"compare: wrote {folders['out']}; report: {folders['out'] / 'report.md'}",
                                      *console_lines(metrics)],
    add_options=lambda parser: parser.add_argument(
        "--policy", action="append", default=[], metavar="NAME=FOLDER",
        help="a method's policy checkpoint, e.g. dpo=outputs/dpo/model (repeat for each; default: none, only SFT "
             "and best-of-n)"),
    reads=(
    "data.task", "model.trust_remote_code",
    "reward.max_length",         # the reward model scores as it was trained
    "prompts",                   # held-out prompts, how they are sampled, the gold judge switch
    "compare", "distributed",
))

# Per-policy measures, in table order; `resources` come from the method stage's metrics.json.
MEASURES = ("rm", "gold", "kl", "length", "eos_rate", "distinct_2")
RESOURCES = ("wall_seconds", "peak_rss_gib")


def parse_policies(specs: list[str]) -> dict[str, Path]:
    """`name=folder` pairs, in order; a name is a method (not sft or best_of_<n>) and appears once."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ConfigError(f"--policy {spec!r}: expected NAME=FOLDER, e.g. dpo=outputs/dpo/model")
        if name == "sft" or name.startswith("best_of_"):
            raise ConfigError(f"--policy {shown(repr(spec))}: '{name}' is reserved for the baselines")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", name):   # it becomes a TSV cell, a metric and a file name
            raise ConfigError(f"--policy {shown(repr(spec))}: a policy name is a letter, then letters, digits, _ or - "
                              "(at most 64)")
        if name in out:
            raise ConfigError(f"--policy {spec!r}: '{name}' given twice")
        out[name] = Path(folder)
    return out


def stage_resources(policy_dir: Path) -> dict[str, float]:
    """The method stage's `resources/*` (its metrics.json sits next to its model folder); {} when
    the stage did not record them."""
    path = Path(policy_dir).parent / "metrics.json"
    if not path.exists():
        return {}
    res = read_json_object(path, "method's metrics file").get("resources") or {}
    if not isinstance(res, dict):
        raise DataError(f"{path}: resources: expected a mapping, got {type(res).__name__}")
    return {k: float(res[k]) for k in RESOURCES if isinstance(res.get(k), (int, float))}


def _fmt(m: dict[str, Any], key: str, digits: int = 3) -> str:
    if key not in m:
        return "n/a"
    ci = m.get(f"{key}_ci95")
    return f"{m[key]:.{digits}f}" + (f" ± {ci:.{digits}f}" if ci is not None else "")


def _rate(m: dict[str, Any], base: str) -> str:
    if base not in m:
        return "-"
    return f"{m[base]:.1%} ({m[f'{base}_low']:.1%}-{m[f'{base}_high']:.1%})"


BEYOND = "beyond best-of-n"


def gap_cell(m: dict[str, Any], name: str) -> str:
    """A method's gap to the best-of-n frontier with its interval, `beyond best-of-n` past its
    largest KL, `-` for SFT and best-of-n (the curve's own points) and without a gold judge."""
    base = f"frontier/{name}_gap_gold"
    if base not in m:
        return "-"
    if m.get(f"frontier/{name}_beyond_best_of_n"):
        return BEYOND
    gap, low, high = m[base], m.get(f"{base}_low"), m.get(f"{base}_high")
    if not finite(gap):
        return "n/a"
    return f"{gap:+.3f}" + (f" ({low:+.3f} to {high:+.3f})" if finite(low) and finite(high) else "")


def report_markdown(m: dict[str, Any], names: tuple[str, ...], resources: dict[str, dict[str, float]],
                    has_gold: bool) -> str:
    rows = ["| policy | gold (95% CI) | gold win rate vs SFT (95% CI) | gold gap to best-of-n (95% CI) | "
            "RM score | RM win rate vs SFT | KL to SFT (nats) | length | distinct-2 | eos rate | "
            "stage wall time (s) | peak memory (GiB) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        res = resources.get(name, {})
        wall = f"{res['wall_seconds']:.0f}" if "wall_seconds" in res else "-"
        mem = f"{res['peak_rss_gib']:.2f}" if "peak_rss_gib" in res else "-"
        rows.append(" | ".join([
            f"| {name}", _fmt(m, f"{name}/gold") if has_gold else "n/a",
            _rate(m, f"win_rate/{name}_vs_sft_gold") if has_gold else "n/a", gap_cell(m, name),
            _fmt(m, f"{name}/rm"), _rate(m, f"win_rate/{name}_vs_sft_rm"), f"{m[f'{name}/kl']:.2f}",
            f"{m[f'{name}/length']:.1f}", f"{m[f'{name}/distinct_2']:.3f}", f"{m[f'{name}/eos_rate']:.2f}",
            wall, mem]) + " |")
    judge = "gold annotator" if has_gold else "reward model (no gold annotator for this task)"
    best = max((n for n in names if n != "sft"), key=lambda n: m[f"{n}/{'gold' if has_gold else 'rm'}"], default=None)
    lines = ["# Alignment methods compared", "",
             f"Every policy answers the same {m['n_prompts']} held-out prompts (films never seen in training), "
             f"sampled as PPO samples; judged by the {judge}. ± is a 95% interval of the mean; win rates count "
             "ties as half, with bootstrap 95% intervals. Best-of-n's KL is the analytic log n - (n-1)/n. "
             "A method's gold gap to best-of-n is its mean gold minus the best-of-n curve at its KL (Gao "
             "et al. 2023's form, gold - gold(SFT) = d (a - b d) with d = sqrt KL, fitted through SFT and "
             "the best-of-n points; negative: below the frontier), with a paired bootstrap 95% interval over "
             "the prompts; past best-of-n's largest KL the curve is not extrapolated. "
             "Stage wall time and peak memory are the method stage's own process (resources/* in its metrics.json).",
             "", *rows, ""]
    if best is not None:
        lines += [f"Highest mean {'gold' if has_gold else 'RM'} score: **{best}**. One run per method; the spread "
                  "over seeds is in docs/guide/methods.md.", ""]
    lines += ["![gold against KL](gold_vs_kl.png)", ""]
    return "\n".join(lines)


def methods_table(m: dict[str, Any], names: Sequence[str],
                  has_gold: bool) -> tuple[list[str], list[dict[str, Any]]]:
    """methods.tsv's columns (but `step`) and a row per policy of `names`: its scores and, with a
    gold judge, a method's gap to the best-of-n frontier (left out, so blank, for the baselines and
    where undefined)."""
    scores = ["rm", "gold", "kl"] if has_gold else ["rm", "kl"]
    rows = []
    for name in names:
        gap = m.get(f"frontier/{name}_gap_gold")
        rows.append({"policy": name, **{k: m[f"{name}/{k}"] for k in scores},
                     **({"gold_gap": gap} if finite(gap) else {})})
    return ["policy", *scores, *(["gold_gap"] if has_gold else [])], rows


def memory_plan_of(params: Params, shapes: memory_plan.Shapes) -> Optional[memory_plan.Planner]:
    """SFT, one method's policy at a time and the reward model whole on every rank. Before any
    checkpoint (shapes.predicted): every method the registry lists, each saved by its own stage;
    from the folders: the policies given, the largest resident."""
    from ..training import memory_plan
    if not shapes.ready("sft", "reward"):
        return None
    sft, rm = shapes.model("sft"), shapes.model("reward", True)
    if shapes.predicted:
        from . import registry   # every method's stage (a module of this package)
        methods = tuple(shapes.model(name) for name in registry.methods())
        return memory_plan.measuring_planner("compare", params, (sft, sft, rm), (sft, *methods, rm))
    policies = tuple(shapes.model(k) for k in shapes.folders if k not in ("data", "sft", "reward"))
    resident = (sft, *(policies and (max(policies, key=lambda m: m.params),)), rm)
    return memory_plan.measuring_planner("compare", params, resident, (*resident, *policies))


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, out: Path, progress: bool = True,
        policy: Sequence[str] = ()) -> dict[str, Any]:
    """The stage: measure every policy (`policy`: NAME=FOLDER each, as --policy gives them), write
    the table, the plot and the metrics."""
    from ..data import inputs
    from ..measurement import held_out
    from ..training import loading
    from .skeleton import stage_run
    methods = parse_policies(list(policy))
    for name, folder in methods.items():
        if not folder.is_dir():
            raise ConfigError(f"--policy {name}={folder}: no such folder (has that method's stage run?)")
    resources = {name: stage_resources(folder) for name, folder in methods.items()}   # read before sampling
    with stage_run(SPEC, params, out, [data_dir, sft_dir, reward_dir, *methods.values(), params.prompts.dataset.path]) as run:
        p = run.params
        judge = inputs.judge(p)
        prompts = inputs.prompts(p, data_dir, "eval")[:p.compare.n_prompts]
        cfg = p.compare
        per = held_out.measure_against_sft(
            sft_dir, methods, reward_dir, prompts, judge, sampling=p.prompts.sampling, seed=cfg.seed,
            best_of=cfg.best_of_n, reward_max_length=p.reward.max_length,
            trust_remote_code=p.model.trust_remote_code, dtype=loading.load_dtype(cfg.distributed, trained=False),
            ctx=run.ctx, packed=cfg.packing)
        names = tuple(per)
        if not run.ctx.is_main:   # rank 0 writes the table, the plot and the metrics
            return {}
        m = held_out.summarise(per, cfg.bootstrap, cfg.seed, versus=[n for n in names if n != "sft"],
                               against_frontier=list(methods))
        m["n_prompts"] = len(prompts)
        for name, res in resources.items():
            m.update({f"{name}/stage_{k}": v for k, v in res.items()})
        columns, rows = methods_table(m, names, judge is not None)
        table = StepLog(run.out / "methods.tsv", columns)
        for i, row in enumerate(rows):
            table.log(i, row)
        table.flush()
        figure = gold_vs_kl_plot(m, names, judge is not None, run.out / "gold_vs_kl.png")
        run.tracker.log_figure(figure, "gold_vs_kl.png")
        close_figure(figure)
        atomic_write_text(run.out / "report.md", report_markdown(m, names, resources, judge is not None))
        run.finish(m)
    return m


def methods_in(m: dict[str, Any]) -> list[str]:
    """The policy names a compare metrics dict holds (for the console summary)."""
    return list(dict.fromkeys(k.split("/")[0] for k in m
                              if "/" in k and not k.startswith(("win_rate/", "frontier/"))))


def console_lines(m: dict[str, Any], names: Optional[list[str]] = None) -> list[str]:
    has_gold = any(k.endswith("/gold") for k in m)
    key = "gold" if has_gold else "rm"
    lines = []
    for name in names or methods_in(m):
        if f"{name}/{key}" not in m:
            continue
        rate = m.get(f"win_rate/{name}_vs_sft_{key}")
        gap = gap_cell(m, name)
        lines.append(f"  {name:12s} {key} {m[f'{name}/{key}']:.3f}  KL {m[f'{name}/kl']:.2f}"
                     + (f"  wins over SFT {rate:.1%}" if rate is not None else "")
                     + ("" if gap == "-" else "  past best-of-n's KL" if gap == BEYOND
                        else f"  gap to best-of-n {gap}"))
    return lines
