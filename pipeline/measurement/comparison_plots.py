"""Plots that compare policies: the evaluate stage's scores and KL frontier, the compare stage's
gold against KL, and the frontier across DVC experiments. No training stage uses them, so editing
them re-runs none.

The reward model's score and the gold annotator's are on scales of their own (an RM score of 4 is
no gold score of 4): scores.png and the frontier give each its own axis, and only kl_frontier.png
draws both on one, where what is read is each curve's shape against KL. Labels of points go through
`label_layout.label_points` and legends sit beside the axes, so no text covers another.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from .label_layout import fit_tick_labels, label_points
from .plots import pyplot, save_figure

JUDGES = {"rm": "reward model", "gold": "gold annotator"}
COLOURS = {"rm": "C0", "gold": "C1"}
# A legend beside the axes, top-aligned: it can cover neither points nor labels.
OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0}


def _policy_tick(name: str) -> str:
    return name.replace("best_of_", "bo")


def scores_figure(m: dict, policies: tuple[str, ...], has_gold: bool):
    """A panel per judge, each with its own score axis: mean score per policy, 95% intervals."""
    keys = ["rm", "gold"] if has_gold else ["rm"]
    width = max(6.0 / len(keys), 1.4 + 0.45 * len(policies))   # inches per panel
    fig, axes = pyplot().subplots(1, len(keys), figsize=(width * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        ax.bar(range(len(policies)), [m[f"{p}/{key}"] for p in policies], 0.7, color=COLOURS[key],
               yerr=[m[f"{p}/{key}_ci95"] for p in policies], capsize=4)
        ax.set_xticks(range(len(policies)), [_policy_tick(p) for p in policies])
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_ylabel(f"mean {JUDGES[key]} score")
        fit_tick_labels(ax)
    fig.suptitle("Score by policy on held-out prompts (95% intervals)")
    fig.tight_layout()
    return fig


def kl_frontier_figure(m: dict, policies: tuple[str, ...], has_gold: bool):
    """Score against KL to the SFT policy: best-of-n joined in order of n (the frontier a cheap
    baseline traces, which PPO's single point is read against), SFT (KL 0) and PPO alone. Colour is
    the judge, marker the policy; each n is written once, by the RM's point (both judges' points of
    one policy share its KL)."""
    from matplotlib.lines import Line2D
    keys = ["rm", "gold"] if has_gold else ["rm"]
    markers = {"best_of_n": "o", "sft": "^", "ppo": "*"}
    fig, ax = pyplot().subplots(figsize=(6.6, 3.8))
    bon = [p for p in policies if p.startswith("best_of_")]
    for key in keys:
        ax.plot([m[f"{p}/kl"] for p in bon], [m[f"{p}/{key}"] for p in bon], marker=markers["best_of_n"],
                color=COLOURS[key])
        for p in ("sft", "ppo"):
            ax.plot([m[f"{p}/kl"]], [m[f"{p}/{key}"]], marker=markers[p], markersize=10, linestyle="",
                    color=COLOURS[key])
    ax.set_xlabel("KL to SFT policy (nats per response)")
    ax.set_ylabel("mean score (held-out prompts)")
    ax.set_title("Score against KL")
    handles = [Line2D([], [], color=COLOURS[k], label=JUDGES[k]) for k in keys]
    handles += [Line2D([], [], color="grey", marker=markers[p], linestyle="", markersize=8,
                       label={"best_of_n": "best-of-n (n marked)"}.get(p, p))
                for p in markers if p != "best_of_n" or bon]
    ax.legend(handles=handles, fontsize=8, **OUTSIDE)
    ax.margins(x=0.08, y=0.1)
    fig.tight_layout()
    others = [(m[f"{p}/kl"], m[f"{p}/{k}"]) for p in policies for k in keys]
    label_points(ax, [(m[f"{p}/kl"], m[f"{p}/rm"], p.replace("best_of_", "n=")) for p in bon], avoid=others)
    return fig


def evaluation_plots(m: dict, policies: tuple[str, ...], has_gold: bool, out: Path) -> dict:
    """scores.png and kl_frontier.png (above). Returns {file name: figure}, the figures still open
    (see save_figure)."""
    return {"scores.png": save_figure(scores_figure(m, policies, has_gold), out / "scores.png", close=False),
            "kl_frontier.png": save_figure(kl_frontier_figure(m, policies, has_gold), out / "kl_frontier.png",
                                           close=False)}


def gold_vs_kl_plot(m: dict[str, Any], names: tuple[str, ...], has_gold: bool, path: Path):
    """Score (gold where there is an annotator, else RM) against KL to SFT: a point per method with
    its 95% interval, best-of-n joined in order of n. Returns the open figure (see save_figure)."""
    key = "gold" if has_gold else "rm"
    fig, ax = pyplot().subplots(figsize=(7.4, 4.2))
    bon = [n for n in names if n.startswith("best_of_")]
    if bon:
        ax.plot([0.0] + [m[f"{n}/kl"] for n in bon], [m[f"sft/{key}"]] + [m[f"{n}/{key}"] for n in bon],
                "--o", color="grey", label="best-of-n from SFT")
    # The default colour cycle without its grey (C7), which is best-of-n's.
    colours = itertools.cycle(f"C{i}" for i in range(10) if i != 7)
    for name in names:
        if name.startswith("best_of_"):
            continue
        ax.errorbar(m[f"{name}/kl"], m[f"{name}/{key}"], yerr=m[f"{name}/{key}_ci95"], fmt="s", capsize=4,
                    color=next(colours), label=name)
    ax.set_xlabel("KL to the SFT policy (nats per response)")
    ax.set_ylabel(f"mean {JUDGES[key]} score (held-out prompts)")
    ax.set_title("Quality for distance moved, per method")
    ax.legend(fontsize=8, **OUTSIDE)
    ax.margins(x=0.06, y=0.08)
    fig.tight_layout()
    label_points(ax, [(m[f"{n}/kl"], m[f"{n}/{key}"], n.replace("best_of_", "n=")) for n in bon],
                 avoid=[(m[f"{n}/kl"], m[f"{n}/{key}"]) for n in names], color="grey")
    return save_figure(fig, path, close=False)


def frontier_plot(points: list[dict], path: Path):
    """RM score (top) and gold score (bottom, where every point has one) of the PPO policy against its
    KL to SFT, one point per experiment, labelled with its `label` (its `ppo.kl_coef`, or "target
    <kl_target>" under the adaptive controller), else its `kl_coef`. KL is drawn on a log scale
    where it spans a decade or more: a run without a penalty can drift tens of nats and would squeeze
    the others into a corner. Returns the open figure (see save_figure)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    keys = ["rm", "gold"] if all(p["gold"] is not None for p in points) else ["rm"]
    fig, axes = pyplot().subplots(len(keys), 1, figsize=(6, 2.2 + 2.0 * len(keys)), sharex=True,
                                  squeeze=False)
    kls = [p["kl"] for p in points]
    log = min(kls) > 0 and max(kls) >= 10 * min(kls)
    for ax, key in zip(axes[:, 0], keys):
        ax.plot(kls, [p[key] for p in points], marker="o" if key == "rm" else "s", color=COLOURS[key])
        ax.set_ylabel(f"mean {JUDGES[key]} score", fontsize=9)
        ax.margins(x=0.12, y=0.18)
    bottom = axes[-1, 0]
    if log:
        bottom.set_xscale("log")
        bottom.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        bottom.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        bottom.xaxis.set_minor_formatter(NullFormatter())
    bottom.set_xlabel("KL(PPO || SFT), nats per response" + (" (log scale)" if log else ""))
    fig.suptitle("Reward vs gold across the KL sweep (points: ppo.kl_coef or kl_target)")
    fig.tight_layout()
    for ax, key in zip(axes[:, 0], keys):
        label_points(ax, [(p["kl"], p[key], p.get("label") or f"{p['kl_coef']:g}") for p in points], fontsize=8)
    return save_figure(fig, path, close=False)
