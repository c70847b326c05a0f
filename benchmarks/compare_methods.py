"""The alignment methods side by side over seeds, and the DPO beta / KTO beta / PPO kl_target /
GRPO kl_loss_coef sweeps.

    .venv/bin/python benchmarks/compare_methods.py                  # 3 seeds x every method, then the sweeps
    .venv/bin/python benchmarks/compare_methods.py --seeds 0 --methods dpo --sweep none
    .venv/bin/python benchmarks/compare_methods.py --reuse --methods grpo --sweep grpo --merge docs/compare_methods.tsv
    .venv/bin/python benchmarks/compare_methods.py --reuse --seeds --methods dpo kto --sweep dpo kto \
        --merge docs/compare_methods.tsv --out docs/compare_methods.tsv --plot docs/compare_methods.png

Every method starts from the workspace's SFT policy and reward model (outputs/sft/model,
outputs/reward/model: run `make pipeline` first), as compare/dvc.yaml's stages do; each method's
own seed (`ppo.seed`, `dpo.seed`, `grpo.seed`, `rs.seed`) is set to the run's seed. Each seed's
policies are then measured together by the compare stage, and so are each sweep's values (seed 0);
best-of-n is sampled in seed 0's compare and in every sweep's, so each of those policies has its
gap to the best-of-n frontier at its own KL (`gap`, with its paired 95% interval). The stage
commands run in a copy of the tracked files with MLflow off, one at a time.

Prints and writes (`--out`, default /tmp/compare_methods.tsv) one row per (method, seed, sweep
value): gold with its 95% half-width, gold and RM win rates over SFT, RM score, KL to SFT, the
method stage's wall time and peak memory, the gap to best-of-n (blank past its KL or without it); then per method the median and range over seeds; and
`--plot` (default /tmp/compare_methods.png): gold against KL, a point per run, best-of-n as a curve.
`--merge FILE`: the rows of FILE but those of the methods run now (their seeds, or their sweep),
then this run's rows, written to `--out` and plotted together.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from seed_grid import copy_tree, stage, write_params   # noqa: E402

from pipeline.stages import registry   # noqa: E402

# method -> the model folders its stage reads (after --data): every stage whose policy compare measures
METHODS = registry.methods()
SWEEPS = {"dpo": ("dpo.beta", (0.05, 0.1, 0.3, 0.5, 1.0, 2.0)), "kto": ("kto.beta", (0.1, 0.3, 0.5, 1.0, 2.0)),
          # PPO's KL is set by its adaptive controller's target (kl_coef is only its start)
          "ppo": ("ppo.kl_target", (1.0, 2.0, 2.8)), "grpo": ("grpo.kl_loss_coef", (0.05, 0.2, 0.5, 1.0))}
BEST_OF_N = [4, 16, 64]   # the frontier seed 0's methods and every sweep value are measured against
LABELS = {"beta": "β"}   # a sweep's label in the plot: its key's last part, or this
COLUMNS = ["method", "seed", "sweep", "gold", "gold_ci95", "gold_win", "gold_win_low", "gold_win_high", "rm",
           "rm_win", "kl", "length", "wall_seconds", "peak_rss_gib", "gap", "gap_low", "gap_high"]
NAN = float("nan")


def default_value(params: Path, key: str):
    from ruamel.yaml import YAML
    node = YAML(typ="safe").load(params.read_text())
    for part in key.split("."):
        node = node[part]
    return node


def run_method(work: Path, method: str, params: Path, out: Path, log: Path) -> None:
    models = {"sft": ROOT / "outputs/sft/model", "reward": ROOT / "outputs/reward/model"}
    args = [method, "--params", str(params), "--data", "data/prepared"]
    for name in METHODS[method]:
        args += [f"--{name}", str(models[name])]
    stage([*args, "--out", str(out)], work, 2, log)


def rows_of(compare_dir: Path, runs: dict[str, tuple[str, int, str]]) -> list[dict]:
    m = json.loads((compare_dir / "metrics.json").read_text())
    rows = []
    frontier = m.get("frontier", {})   # no best-of-n in that compare (seeds but 0): no gap

    def gap(name: str, end: str = "") -> float:
        value = frontier.get(f"{name}_gap_gold{end}")
        return NAN if value is None else value
    for name, (method, seed, sweep) in runs.items():
        p, w = m[name], m["win_rate"]
        rows.append({"method": method, "seed": seed, "sweep": sweep, "gold": p["gold"], "gold_ci95": p["gold_ci95"],
                     "gold_win": w[f"{name}_vs_sft_gold"], "gold_win_low": w[f"{name}_vs_sft_gold_low"],
                     "gold_win_high": w[f"{name}_vs_sft_gold_high"], "rm": p["rm"], "rm_win": w[f"{name}_vs_sft_rm"],
                     "kl": p["kl"], "length": p["length"], "wall_seconds": p.get("stage_wall_seconds", float("nan")),
                     "peak_rss_gib": p.get("stage_peak_rss_gib", NAN),
                     "gap": gap(name), "gap_low": gap(name, "_low"), "gap_high": gap(name, "_high")})
    return rows


def merged(path: Path, new: list[dict]) -> list[dict]:
    """The rows of the table at `path`, but those that `new` replaces (a method's seed rows when
    `new` has any, its rows of a sweep key when `new` has that key), then `new`; numbers as floats."""
    with path.open() as f:
        old = list(csv.DictReader(f, delimiter="\t"))
    for r in old:
        for c in COLUMNS:
            if c not in ("method", "seed", "sweep"):
                r[c] = float(r.get(c) or NAN)   # a column the table predates: not measured
        r["seed"] = int(r["seed"])
    replaced = {(r["method"], r["sweep"].split("=")[0]) for r in new}
    return [r for r in old if (r["method"], r["sweep"].split("=")[0]) not in replaced] + new


def figure(rows: list[dict], m: dict):
    """Gold against KL: best-of-n from SFT as a curve, a point per (method, seed, sweep value) of `rows`,
    each sweep value labelled; `m` is the seed-0 compare stage's metrics.json. Returns the open figure."""
    from pipeline.measurement.comparison_plots import OUTSIDE
    from pipeline.measurement.label_layout import label_points
    from pipeline.measurement.plots import pyplot
    fig, ax = pyplot().subplots(figsize=(8.2, 4.5))
    bon = sorted((int(k.split("_")[-1]), v) for k, v in m.items() if k.startswith("best_of_"))
    if bon:
        ax.plot([0] + [v["kl"] for _, v in bon], [m["sft"]["gold"]] + [v["gold"] for _, v in bon], "--o", color="grey",
                label=f"best-of-n ({', '.join(str(n) for n, _ in bon)}) from SFT")
    ax.errorbar([0], [m["sft"]["gold"]], yerr=[m["sft"]["gold_ci95"]], fmt="ks", capsize=3, label="SFT")
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        ax.errorbar([r["kl"] for r in mine], [r["gold"] for r in mine], yerr=[r["gold_ci95"] for r in mine],
                    fmt="o", capsize=3, label=method)
    ax.set_xlabel("KL to the SFT policy (nats per response)")
    ax.set_ylabel("mean gold score, 200 held-out prompts")
    ax.set_title("Gold against KL: every method, seed and sweep value")
    ax.legend(fontsize=8, **OUTSIDE)
    ax.margins(x=0.06, y=0.08)
    fig.tight_layout()
    labels = []
    swept_by: dict[str, set] = {}   # a swept key's last part -> the methods sweeping one of that name
    for r in rows:
        if r["sweep"]:
            swept_by.setdefault(r["sweep"].split("=")[0].rsplit(".", 1)[-1], set()).add(r["method"])
    for r in rows:
        if r["sweep"]:
            key, value = r["sweep"].split("=")
            name = key.rsplit(".", 1)[-1]
            who = f"{r['method']} " if len(swept_by[name]) > 1 else ""   # dpo's beta and kto's: say whose
            labels.append((r["kl"], r["gold"], f"{who}{LABELS.get(name, name)} {value}"))
    points = [(r["kl"], r["gold"]) for r in rows] + [(v["kl"], v["gold"]) for _, v in bon]
    label_points(ax, labels, avoid=points, fontsize=7)
    return fig


def plot(rows: list[dict], compare0: Path, path: Path) -> None:
    from pipeline.measurement.plots import save_figure
    save_figure(figure(rows, json.loads((compare0 / "metrics.json").read_text())), path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="seeds of every method (none: sweeps only)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--sweep", nargs="+", default=list(SWEEPS), help="methods to sweep on seed 0 (or 'none')")
    ap.add_argument("--out", type=Path, default=Path("/tmp/compare_methods.tsv"))
    ap.add_argument("--plot", type=Path, default=Path("/tmp/compare_methods.png"))
    ap.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temporary one)")
    ap.add_argument("--merge", type=Path, default=None,
                    help="a table of earlier rows to keep but those this run replaces (module doc)")
    ap.add_argument("--reuse", action="store_true",
                    help="seed 0 with the default params: use the workspace's outputs/<method> (make pipeline; make "
                         "compare) instead of training again")
    args = ap.parse_args()
    for what in ("sft", "reward"):
        if not (ROOT / "outputs" / what / "model").is_dir():
            sys.exit(f"outputs/{what}/model is missing: run `make pipeline` first")
    work = args.keep or Path(tempfile.mkdtemp(prefix="compare_methods."))
    copy_tree(work)
    log = work / "runs.log"
    stage(["prepare", "--params", "params.yaml", "--out", "data/prepared"], work, 2, log)
    rows: list[dict] = []
    compare0 = None
    runs_s0: dict[str, Path] = {}
    plan = [(seed, None) for seed in args.seeds]
    plan += [(0, method) for method in args.sweep if method in SWEEPS and method in args.methods]
    for seed, swept in plan:
        overrides = {f"{m}.seed": seed for m in args.methods}
        overrides["compare.best_of_n"] = BEST_OF_N if seed == 0 else []
        tag = f"s{seed}" + (f"_{swept}" if swept else "")
        params = work / f"params_{tag}.yaml"
        write_params(work / "params.yaml", params, overrides)
        runs, policies = {}, []
        if swept is None:
            for method in args.methods:
                out = work / tag / method
                if args.reuse and seed == 0 and (ROOT / "outputs" / method / "model").is_dir():
                    out = ROOT / "outputs" / method      # the workspace's default run is seed 0's
                if not (out / "model").is_dir():
                    run_method(work, method, params, out, log)
                runs[method] = (method, seed, "")
                policies += ["--policy", f"{method}={out / 'model'}"]
            if seed == 0:
                runs_s0 = {method: Path(p.split("=", 1)[1]).parent for p in policies[1::2] for method in [p.split("=")[0]]}
        else:
            # Every value of one sweep in one compare, beside best-of-n: each gap is paired with the same
            # SFT and best-of-n samples, and best-of-n is sampled once per sweep.
            key, default = SWEEPS[swept][0], default_value(work / "params.yaml", SWEEPS[swept][0])
            for value in SWEEPS[swept][1]:
                vtag = f"{tag}{value}"
                out = work / vtag / swept
                if value == default:                    # the sweep's default point is seed 0's run
                    reused = ROOT / "outputs" / swept
                    out = runs_s0.get(swept, reused if args.reuse and (reused / "model").is_dir() else out)
                if not (out / "model").is_dir():
                    vparams = work / f"params_{vtag}.yaml"
                    write_params(work / "params.yaml", vparams, {**overrides, key: value})
                    run_method(work, swept, vparams, out, log)
                name = f"{swept}_{str(value).replace('.', 'p')}"   # a policy name has no dot
                runs[name] = (swept, seed, f"{key}={value}")
                policies += ["--policy", f"{name}={out / 'model'}"]
        cmp_dir = work / tag / "compare"
        stage(["compare", "--params", str(params), "--data", "data/prepared", "--sft", str(ROOT / "outputs/sft/model"),
               "--reward", str(ROOT / "outputs/reward/model"), *policies, "--out", str(cmp_dir)], work, 2, log)
        compare0 = compare0 or (cmp_dir if seed == 0 else None)   # best-of-n: the plot's curve
        new = rows_of(cmp_dir, runs)
        rows += new
        for r in new:
            print("\t".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS), flush=True)
    if args.merge is not None:
        rows = merged(args.merge, rows)
    with args.out.open("w") as f:
        w = csv.DictWriter(f, COLUMNS, delimiter="\t")
        w.writeheader()
        w.writerows(rows)
    print("\nper method over seeds (default params): median (min .. max)")
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method and not r["sweep"]]
        if not mine:
            continue
        cells = []
        for col in ("gold", "gold_win", "rm", "kl", "wall_seconds", "peak_rss_gib"):
            xs = [r[col] for r in mine]
            cells.append(f"{col} {statistics.median(xs):.3f} ({min(xs):.3f} .. {max(xs):.3f})")
        print(f"  {method:5s} n={len(mine)}  " + "  ".join(cells))
    if compare0 is not None:
        plot(rows, compare0, args.plot)
    print(f"work folder: {work}; table: {args.out}; plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
