"""Plots that compare policies: the evaluate stage's scores and KL frontier, and the frontier across
DVC experiments. Only the evaluate stage and `python -m pipeline frontier` use them, so editing
them re-runs no training stage."""

from __future__ import annotations

from pathlib import Path

from .plots import pyplot, save_figure


def evaluation_plots(m: dict, policies: tuple[str, ...], has_gold: bool, out: Path) -> dict:
    """scores.png: RM (and gold) score per policy with 95% intervals; kl_frontier.png: score
    against KL to the SFT policy, the trade-off PPO's KL penalty controls. Returns {file name:
    figure}, the figures still open (see save_figure)."""
    keys = ["rm", "gold"] if has_gold else ["rm"]
    fig, ax = pyplot().subplots(figsize=(6, 3.8))
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(policies))]
        ax.bar(xs, [m[f"{p}/{key}"] for p in policies], width, yerr=[m[f"{p}/{key}_ci95"] for p in policies],
               capsize=4, label={"rm": "reward model", "gold": "gold annotator"}[key])
    ax.set_xticks(range(len(policies)), [p.replace("best_of_", "bo") for p in policies])
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_ylabel("mean score (held-out prompts)")
    ax.legend()
    ax.set_title("Scores by policy (95% intervals)")
    figures = {"scores.png": save_figure(fig, out / "scores.png", close=False)}

    # Best-of-n points joined in order of n: the frontier a cheap baseline traces, which PPO's single
    # point is read against; SFT (KL 0) and PPO stand alone.
    fig, ax = pyplot().subplots(figsize=(5, 3.8))
    bon = [p for p in policies if p.startswith("best_of_")]
    for key, marker in zip(keys, ("o", "s")):
        label = {"rm": "reward model", "gold": "gold annotator"}[key]
        line, = ax.plot([m[f"{p}/kl"] for p in bon], [m[f"{p}/{key}"] for p in bon], marker=marker,
                        label=f"{label}: best-of-n")
        for p in ("sft", "ppo"):
            ax.plot([m[f"{p}/kl"]], [m[f"{p}/{key}"]], marker={"sft": "^", "ppo": "*"}[p], markersize=10,
                    linestyle="", color=line.get_color(), label=f"{label}: {p}")
        for p in policies:
            ax.annotate(p.replace("best_of_", "n="), (m[f"{p}/kl"], m[f"{p}/{key}"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    ax.set_xlabel("KL to SFT policy (nats per response)")
    ax.set_ylabel("mean score")
    ax.legend(fontsize=7)
    ax.set_title("Score against KL")
    figures["kl_frontier.png"] = save_figure(fig, out / "kl_frontier.png", close=False)
    return figures


def frontier_plot(points: list[dict], path: Path) -> None:
    """Gold and RM score of the PPO policy against its KL to SFT, one point per experiment."""
    fig, ax = pyplot().subplots(figsize=(5.5, 4))
    kls = [p["kl"] for p in points]
    ax.plot(kls, [p["rm"] for p in points], marker="o", label="reward model")
    if all(p["gold"] is not None for p in points):
        ax.plot(kls, [p["gold"] for p in points], marker="s", label="gold annotator")
    for p in points:
        ax.annotate(f"kl_coef={p['kl_coef']:g}", (p["kl"], p["rm"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    ax.set_xlabel("KL(PPO || SFT), nats per response")
    ax.set_ylabel("mean score on held-out prompts")
    ax.set_title("Reward vs gold across the kl_coef sweep")
    ax.legend()
    save_figure(fig, path)
