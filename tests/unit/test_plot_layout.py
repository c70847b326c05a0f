"""Every plot the project draws, measured as the renderer lays it out: no two texts overlap, no text
leaves the figure, no point's label leaves its axes and no legend covers a text. On the committed
run's numbers and on awkward ones: long method names, points that coincide, a run that drifted far."""

from __future__ import annotations

import importlib.util
import itertools
from unittest import mock

import pytest

from conftest import REPO
from pipeline.measurement import comparison_plots, plots
from pipeline.measurement.label_layout import label_points

TOLERANCE_PX = 0.5   # boxes that merely touch (tick labels edge to edge) are not a collision


def drawn_texts(fig) -> list:
    """The non-empty texts one draw of `fig` puts on the canvas (ticks out of view and annotations of
    points outside their axes are not drawn, and so not measured)."""
    from matplotlib.text import Text
    drawn, draw = [], Text.draw

    def record(self, renderer):
        drawn.append(self)
        return draw(self, renderer)

    with mock.patch.object(Text, "draw", record):
        fig.canvas.draw()
    return [t for t in dict.fromkeys(drawn) if t.get_visible() and t.get_text().strip()]


def _overlap(a, b) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > TOLERANCE_PX
            and min(a.y1, b.y1) - max(a.y0, b.y0) > TOLERANCE_PX)


def _inside(box, frame) -> bool:
    return (box.x0 >= frame.x0 - TOLERANCE_PX and box.x1 <= frame.x1 + TOLERANCE_PX
            and box.y0 >= frame.y0 - TOLERANCE_PX and box.y1 <= frame.y1 + TOLERANCE_PX)


def layout_problems(fig) -> list[str]:
    """What a reader of `fig` would find broken, one line each; [] when its text is all legible."""
    from matplotlib.text import Annotation, Text
    texts = drawn_texts(fig)
    renderer = fig.canvas.get_renderer()
    boxes = [(t, Text.get_window_extent(t, renderer)) for t in texts]   # an annotation's text, no leader line
    problems = [f"{t.get_text()!r} leaves the figure" for t, box in boxes if not _inside(box, fig.bbox)]
    problems += [f"label {t.get_text()!r} leaves its axes" for t, box in boxes
                 if isinstance(t, Annotation) and t.axes is not None and not _inside(box, t.axes.bbox)]
    problems += [f"{s.get_text()!r} overlaps {t.get_text()!r}"
                 for (s, a), (t, b) in itertools.combinations(boxes, 2) if _overlap(a, b)]
    for legend in [ax.get_legend() for ax in fig.axes] + list(fig.legends):
        if legend is None:
            continue
        own, frame = set(legend.findobj()), legend.get_window_extent(renderer)
        problems += [f"the legend covers {t.get_text()!r}" for t, box in boxes
                     if t not in own and _overlap(box, frame)]
    return problems


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plots.pyplot().close("all")


# The committed run's evaluate and compare numbers (rounded): (kl, rm, rm_ci95, gold, gold_ci95).
RUN = {"sft": (0.0, -0.033, 0.292, 0.585, 0.222), "best_of_4": (0.636, 1.912, 0.189, 1.75, 0.173),
       "best_of_16": (1.835, 3.256, 0.122, 2.479, 0.125), "best_of_64": (3.175, 4.132, 0.088, 2.834, 0.106),
       "ppo": (4.241, 3.87, 0.191, 2.712, 0.122), "dpo": (0.298, 0.949, 0.273, 1.321, 0.205),
       "grpo": (7.667, 3.924, 0.224, 2.51, 0.136), "kto": (0.525, 1.04, 0.269, 1.216, 0.212),
       "onpolicy_dpo": (0.342, 1.173, 0.257, 1.142, 0.211), "rs": (1.187, 2.058, 0.232, 1.929, 0.181)}


def metrics(rows: dict[str, tuple]) -> dict[str, float]:
    m = {}
    for name, (kl, rm, rm_ci, gold, gold_ci) in rows.items():
        m.update({f"{name}/kl": kl, f"{name}/rm": rm, f"{name}/rm_ci95": rm_ci, f"{name}/gold": gold,
                  f"{name}/gold_ci95": gold_ci})
    return m


EVALUATE = {k: RUN[k] for k in ("sft", "best_of_4", "best_of_16", "best_of_64", "ppo")}
EVALUATE_CASES = {
    "committed run": EVALUATE,
    # PPO on best-of-64's point exactly, and best-of-4's RM and gold scores equal.
    "equal points": {**EVALUATE, "ppo": EVALUATE["best_of_64"], "best_of_4": (0.636, 1.8, 0.1, 1.8, 0.1)},
    # No penalty: PPO drifted 84 nats, its gold score collapsed.
    "far outlier": {**EVALUATE, "ppo": (83.93, 5.035, 0.2, -5.848, 0.3)},
    "no best-of-n": {k: RUN[k] for k in ("sft", "ppo")},
    # Many n: eleven bars, ticks close together.
    "many n": {"sft": RUN["sft"],
               **{f"best_of_{2 ** i}": (i * 0.6, 0.4 * i, 0.1, 0.3 * i, 0.1) for i in range(1, 11)},
               "ppo": RUN["ppo"]},
}


@pytest.mark.parametrize("has_gold", [True, False])
@pytest.mark.parametrize("case", sorted(EVALUATE_CASES))
def test_evaluate_plots_lay_out_every_text_legibly(tmp_path, case, has_gold):
    rows = EVALUATE_CASES[case]
    figures = comparison_plots.evaluation_plots(metrics(rows), tuple(rows), has_gold, tmp_path)
    assert sorted(figures) == ["kl_frontier.png", "scores.png"]
    for name, fig in figures.items():
        assert layout_problems(fig) == [], name
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_scores_give_each_judge_its_own_axis_and_draw_the_scores_as_given(tmp_path):
    m = metrics(EVALUATE)
    fig = comparison_plots.evaluation_plots(m, tuple(EVALUATE), True, tmp_path)["scores.png"]
    assert [ax.get_ylabel() for ax in fig.axes] == ["mean reward model score", "mean gold annotator score"]
    for ax, key in zip(fig.axes, ("rm", "gold")):
        assert [bar.get_height() for bar in ax.patches] == [m[f"{p}/{key}"] for p in EVALUATE]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["sft", "bo4", "bo16", "bo64", "ppo"]


def test_kl_frontier_writes_each_n_once_and_the_legend_sits_beside_the_axes(tmp_path):
    figures = comparison_plots.evaluation_plots(metrics(EVALUATE), tuple(EVALUATE), True, tmp_path)
    fig = figures["kl_frontier.png"]
    ax, = fig.axes
    assert sorted(t.get_text() for t in ax.texts) == ["n=16", "n=4", "n=64"]
    renderer = fig.canvas.get_renderer()
    assert ax.get_legend().get_window_extent(renderer).x0 > ax.get_window_extent(renderer).x1


COMPARE_CASES = {
    "committed run": RUN,
    "long method names": {**RUN, "onpolicy_dpo_with_a_reference_refreshed_every_epoch": RUN["onpolicy_dpo"],
                          "grpo_dr_without_std_scaling_and_token_mean": RUN["grpo"]},
    # DPO and KTO on one point; best-of-64 on PPO's.
    "equal points": {**RUN, "kto": RUN["dpo"], "best_of_64": RUN["ppo"]},
    "far outlier": {**RUN, "grpo": (83.93, 5.035, 0.2, -5.848, 0.3)},
    "no best-of-n": {k: v for k, v in RUN.items() if not k.startswith("best_of_")},
}


@pytest.mark.parametrize("has_gold", [True, False])
@pytest.mark.parametrize("case", sorted(COMPARE_CASES))
def test_gold_vs_kl_lays_out_every_text_legibly(tmp_path, case, has_gold):
    rows = COMPARE_CASES[case]
    fig = comparison_plots.gold_vs_kl_plot(metrics(rows), tuple(rows), has_gold, tmp_path / "gold_vs_kl.png")
    assert layout_problems(fig) == []
    methods = {n for n in rows if not n.startswith("best_of_")}
    curve = {"best-of-n from SFT"} if len(methods) < len(rows) else set()
    assert {t.get_text() for t in fig.axes[0].get_legend().get_texts()} == curve | methods


# docs/frontier.md's snapshot: (kl_coef, KL, RM, gold); kl_coef 0 drifted 84 nats.
SWEEP = [(0.0, 83.93, 5.035, -5.848), (0.05, 11.35, 3.939, 2.702), (0.1, 6.46, 3.548, 2.715),
         (0.2, 3.39, 3.176, 2.788)]
FRONTIER_CASES = {
    "committed sweep": SWEEP,
    "no gold": [(c, kl, rm, None) for c, kl, rm, _ in SWEEP],
    "one decade or less": SWEEP[1:],
    # Two coefficients that gave one policy's numbers, and a point at KL 0 (a linear axis).
    "equal points": [*SWEEP[1:], (0.3, 3.39, 3.176, 2.788), (5.0, 0.0, 0.0, 0.6)],
    "dense sweep": [(c / 100, 3.0 / (c / 100 + 0.02), 3 + 0.1 / (c / 100 + 0.1), 2.7 - c / 400)
                    for c in range(0, 31, 3)],
}


def frontier_points(rows) -> list[dict]:
    return [{"name": f"exp-{i}", "kl_coef": c, "kl": kl, "rm": rm, "gold": gold}
            for i, (c, kl, rm, gold) in enumerate(rows)]


@pytest.mark.parametrize("case", sorted(FRONTIER_CASES))
def test_frontier_lays_out_every_text_legibly(tmp_path, case):
    points = frontier_points(FRONTIER_CASES[case])
    fig = comparison_plots.frontier_plot(points, tmp_path / "frontier.png")
    assert layout_problems(fig) == []
    assert len(fig.axes) == (1 if case == "no gold" else 2)
    for ax in fig.axes:   # every point labelled with its kl_coef (coinciding points share one label)
        labels = [v for t in ax.texts for v in t.get_text().split(", ")]
        assert sorted(labels) == sorted(f"{p['kl_coef']:g}" for p in points)


def test_frontier_spreads_the_sweep_when_one_run_drifted_far(tmp_path):
    """With kl_coef 0 at 84 nats the other three runs (3-11 nats) take a quarter of the width or more,
    on a log axis; without the outlier the axis stays linear."""
    fig = comparison_plots.frontier_plot(frontier_points(SWEEP), tmp_path / "frontier.png")
    ax = fig.axes[-1]
    assert ax.get_xscale() == "log"
    xs = sorted(ax.transData.transform((kl, 0))[0] for _, kl, _, _ in SWEEP[1:])
    assert (xs[-1] - xs[0]) / ax.bbox.width > 1 / 4
    assert [float(v) for v in ax.lines[0].get_xdata()] == [kl for _, kl, _, _ in SWEEP]   # as measured
    fig = comparison_plots.frontier_plot(frontier_points(SWEEP[1:]), tmp_path / "frontier.png")
    assert fig.axes[-1].get_xscale() == "linear"


CALIBRATION_CASES = {
    "committed run": [(0.032, 0.085), (0.147, 0.209), (0.247, 0.387), (0.347, 0.408), (0.453, 0.51),
                      (0.551, 0.492), (0.655, 0.593), (0.752, 0.614), (0.855, 0.792), (0.966, 0.915)],
    # A reward model that is always wrong: every point in the legend's corner or opposite it.
    "inverted": [(p / 10 + 0.05, 1 - p / 10 - 0.05) for p in range(10)],
    "one bin": [(0.5, 0.5)],
}


@pytest.mark.parametrize("case", sorted(CALIBRATION_CASES))
def test_calibration_plot_lays_out_every_text_legibly(tmp_path, case):
    bins = [{"predicted": p, "observed": o} for p, o in CALIBRATION_CASES[case]]
    assert layout_problems(plots.calibration_plot(bins, tmp_path / "calibration.png")) == []


def methods_benchmark():
    path = REPO / "benchmarks" / "compare_methods.py"
    spec = importlib.util.spec_from_file_location("compare_methods_plot", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_methods_benchmark_plot_lays_out_every_text_legibly():
    """benchmarks/compare_methods.py's figure over seeds and sweeps (docs/compare_methods.png), on rows
    like the committed table's: seeds close together, sweep values labelled, one far DPO point."""
    m = {name: {"kl": kl, "gold": gold, "gold_ci95": ci} for name, (kl, _, _, gold, ci) in RUN.items()}
    rows = [{"method": method, "seed": seed, "sweep": "", "kl": kl + 0.1 * seed, "gold": gold - 0.03 * seed,
             "gold_ci95": ci} for method in ("ppo", "dpo", "kto", "grpo", "rs")
            for seed, (kl, _, _, gold, ci) in itertools.product(range(3), [RUN[method]])]
    rows += [{"method": "ppo", "seed": 0, "sweep": f"ppo.kl_coef={c}", "kl": kl, "gold": gold,
              "gold_ci95": 0.1}
             for c, kl, gold in ((0.05, 10.2, 2.73), (0.1, 7.7, 2.71), (0.2, 4.2, 2.72))]
    rows += [{"method": "dpo", "seed": 0, "sweep": f"dpo.beta={b}", "kl": kl, "gold": gold, "gold_ci95": 0.25}
             for b, kl, gold in ((0.05, 18.4, 0.11), (0.1, 9.8, 1.26), (0.3, 4.0, 1.84), (2.0, 0.4, 1.38))]
    rows += [{"method": "kto", "seed": 0, "sweep": f"kto.beta={b}", "kl": kl, "gold": gold, "gold_ci95": 0.2}
             for b, kl, gold in ((0.1, 4.0, 1.13), (0.5, 1.33, 1.67), (2.0, 0.53, 1.22))]
    fig = methods_benchmark().figure(rows, m)
    assert layout_problems(fig) == []
    assert sorted(t.get_text() for t in fig.axes[0].texts) == sorted(   # two methods sweep a beta: each named
        ["kl_coef 0.05", "kl_coef 0.1", "kl_coef 0.2", "dpo β 0.05", "dpo β 0.1", "dpo β 0.3", "dpo β 2.0",
         "kto β 0.1", "kto β 0.5", "kto β 2.0"])


def test_the_check_finds_overlapping_clipped_and_covered_labels():
    """The measure the tests above rely on fails where a reader would: two labels on one point, a label
    past the axes' right edge and past the figure's, and a legend over a label."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="a series")
    ax.annotate("first", (0.5, 0.5), xytext=(4, 4), textcoords="offset points")
    ax.annotate("second", (0.5, 0.5), xytext=(4, 4), textcoords="offset points")
    ax.annotate("past the edge", (1.0, 0.3), xytext=(4, 4), textcoords="offset points")
    ax.annotate("under the legend", (0.0, 0.97), xytext=(4, -4), textcoords="offset points", va="top")
    ax.legend(loc="upper left")
    problems = layout_problems(fig)
    assert "'second' overlaps 'first'" in problems or "'first' overlaps 'second'" in problems
    assert "label 'past the edge' leaves its axes" in problems
    assert "the legend covers 'under the legend'" in problems
    ax.annotate("off the figure", (1.0, 0.5), xytext=(60, 0), textcoords="offset points")
    assert "'off the figure' leaves the figure" in layout_problems(fig)


def test_label_points_places_a_crowd_without_a_collision():
    """Twelve labels on points a few pixels apart, four of them on one place (one label for those),
    one at the axes' corner: each inside the axes, none over another."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [1.0 + 0.02 * i for i in range(8)] + [1.1] * 3 + [2.0]
    ys = [1.0 + 0.01 * i for i in range(8)] + [1.05] * 3 + [2.0]
    ax.plot(xs, ys, "o")
    names = [f"point {i}" for i in range(8)] + ["p", "q", "r", "the corner"]
    notes = label_points(ax, list(zip(xs, ys, names)))
    assert layout_problems(fig) == []
    assert len(notes) == 9 and "point 5, p, q, r" in [n.get_text() for n in notes]
