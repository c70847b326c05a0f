"""The compare stage's summary of every method: its gap to the best-of-n frontier in metrics.json,
methods.tsv's column, the report's table and the console lines (no models: measurements given)."""

from __future__ import annotations

import math
import random

from pipeline.measurement import held_out
from pipeline.measurement.frontier_gap import Series, gaps
from pipeline.measurement.policy import Measured
from pipeline.measurement.stats import best_of_n_kl
from pipeline.stages import compare

N = 80
METHODS = {"ppo": (2.5, 2.2), "dpo": (0.3, 1.3), "grpo": (7.7, 2.5), "rs": (1.2, 1.9), "kto": (0.5, 1.2),
           "onpolicy_dpo": (0.34, 1.1)}   # name: (KL, gold), about the committed run's


def measured() -> dict[str, Measured]:
    rng = random.Random(0)
    hard = [rng.gauss(0, 0.5) for _ in range(N)]

    def policy(kl: float, gold: float, spread: float) -> Measured:
        return Measured(["a b c"] * N, [True] * N,
                        {"rm": [gold + rng.gauss(0, 1) for _ in range(N)],
                         "kl": [max(kl + rng.gauss(0, spread), 0.0) for _ in range(N)],
                         "gold": [gold + h + rng.gauss(0, 0.3) for h in hard]})
    per = {"sft": policy(0.0, 0.59, 0.0)}
    for k, gold in ((4, 1.75), (16, 2.48), (64, 2.83)):
        per[f"best_of_{k}"] = policy(best_of_n_kl(k), gold, 0.0)
    per.update({name: policy(kl, gold, 0.3) for name, (kl, gold) in METHODS.items()})
    return per


def summarised(per: dict[str, Measured]) -> dict:
    m = held_out.summarise(per, 200, 3, versus=[n for n in per if n != "sft"], against_frontier=list(METHODS))
    m["n_prompts"] = N
    return m


def test_every_method_has_its_gap_to_the_frontier_with_the_same_resamples():
    per = measured()
    m = summarised(per)
    series = {name: Series(p.values["kl"], p.values["gold"]) for name, p in per.items()}
    want = gaps(per["sft"].values["gold"], [series[f"best_of_{k}"] for k in (4, 16, 64)],
                {name: series[name] for name in METHODS}, 200, 3)
    def same(a, b) -> bool:   # NaN where there is no gap
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    for name, g in want.items():
        base = f"frontier/{name}_gap_gold"
        got = (m[base], m[f"{base}_low"], m[f"{base}_high"], m[f"frontier/{name}_beyond_best_of_n"])
        assert all(same(a, b) for a, b in zip(got, (g.gap, g.low, g.high, g.beyond))), name
    assert m["frontier/grpo_beyond_best_of_n"] is True and math.isnan(m["frontier/grpo_gap_gold"])
    assert m["frontier/rs_beyond_best_of_n"] is False and m["frontier/rs_gap_gold_high"] < 0
    assert not any(k.startswith(("frontier/sft", "frontier/best_of")) for k in m)   # the curve's own points
    # One method measured alone gets the gap it gets beside the others: the resamples are the prompts'.
    alone = held_out.summarise(per, 200, 3, versus=["rs"], against_frontier=["rs"])
    assert alone["frontier/rs_gap_gold_low"] == m["frontier/rs_gap_gold_low"]


def test_the_report_and_the_console_give_each_methods_gap():
    m = summarised(measured())
    names = ("sft", "best_of_4", "best_of_16", "best_of_64", *METHODS)
    report = compare.report_markdown(m, names, {}, True)
    rows = {r[0][2:]: r for r in (line.split(" | ") for line in report.splitlines() if line.startswith("| "))}
    head = rows["policy"]
    col = head.index("gold gap to best-of-n (95% CI)")
    rs = m["frontier/rs_gap_gold"], m["frontier/rs_gap_gold_low"], m["frontier/rs_gap_gold_high"]
    assert rows["rs"][col] == f"{rs[0]:+.3f} ({rs[1]:+.3f} to {rs[2]:+.3f})"
    assert rows["grpo"][col] == "beyond best-of-n"
    assert rows["sft"][col] == "-" and rows["best_of_64"][col] == "-"
    assert len(rows["rs"]) == len(head)
    lines = compare.console_lines(m)
    assert [line.split()[0] for line in lines] == list(names)   # `frontier/...` names no policy
    assert next(x for x in lines if x.split()[0] == "grpo").endswith("past best-of-n's KL")
    assert next(x for x in lines if x.split()[0] == "rs").endswith(f"gap to best-of-n {rows['rs'][col]}")
    # Without a judge: no gap, no column values.
    assert compare.gap_cell({}, "rs") == "-"


def test_methods_tsv_has_a_methods_gap_and_blanks_for_the_baselines(tmp_path):
    from pipeline.tracking.sinks import StepLog
    m = summarised(measured())
    names = ("sft", "best_of_4", "best_of_16", "best_of_64", *METHODS)
    columns, rows = compare.methods_table(m, names, True)
    log = StepLog(tmp_path / "methods.tsv", columns)
    for i, row in enumerate(rows):
        log.log(i, row)
    log.flush()
    lines = [line.split("\t") for line in (tmp_path / "methods.tsv").read_text().splitlines()]
    assert lines[0] == ["step", "policy", "rm", "gold", "kl", "gold_gap"]
    gap = {row[1]: row[5] for row in lines[1:]}
    assert gap["sft"] == gap["best_of_64"] == gap["grpo"] == ""
    assert float(gap["rs"]) == float(f"{m['frontier/rs_gap_gold']:.6g}")
    assert compare.methods_table(m, names, False)[0] == ["policy", "rm", "kl"]


def test_methods_tsv_declares_the_gap_column():
    declared = {(m.file, m.name) for m in compare.declared_metrics()}
    assert ("methods.tsv", "gold_gap") in declared
    names = ("gap_gold", "gap_gold_low", "gap_gold_high", "beyond_best_of_n")
    assert {("metrics.json", f"frontier/{{policy}}_{s}") for s in names} <= declared
