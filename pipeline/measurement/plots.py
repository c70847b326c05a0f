"""PNG plots people look at instead of reading tables (rendered offline with matplotlib's Agg):
the writer every plot uses and the reward model's calibration diagram. The comparison of policies
(evaluate stage, frontier across experiments) is in comparison_plots.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..files import umask_mode


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display, no network: DVC's own renderer loads its
    JS from the web), imported when a stage first plots: the command line reads every stage's
    module, and a stage that plots nothing should not pay a second for matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path, close: bool = True):
    """Write atomically: a reader never sees half a PNG. `close=False` keeps the figure open and
    returns it, for a stage to hand to its tracker (MLflow's log_figure) before `close_figure`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.fchmod(fd, umask_mode(0o666))   # savefig rewrites the file in place, keeping this mode
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        if close:
            pyplot().close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return None if close else fig


def close_figure(fig) -> None:
    pyplot().close(fig)


def calibration_plot(bins: list[dict], path: Path):
    """Reliability diagram: observed preference rate against the reward model's prediction; the
    figure is returned open (see save_figure)."""
    fig, ax = pyplot().subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", label="perfect calibration")
    ax.plot([b["predicted"] for b in bins], [b["observed"] for b in bins], marker="o", label="reward model")
    ax.set_xlabel("predicted P(preferred) = sigmoid(r_a - r_b)")
    ax.set_ylabel("observed rate preferred")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    ax.set_title("Reward model calibration (held-out pairs)")
    return save_figure(fig, path, close=False)
