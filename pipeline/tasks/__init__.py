"""Tasks: where prompts, demonstrations and preference pairs come from, and the optional judge.

A task with a gold judge (`gold_score(prompt, response) -> float`) lets evaluation and PPO logging
report gold metrics; a task without one (public datasets) simply skips them.
"""

from __future__ import annotations

from typing import Callable, Optional

from . import reviews

Judge = Callable[[str, str], float]

_JUDGES: dict[str, Judge] = {"reviews": reviews.gold_score}


def get_judge(task: str) -> Optional[Judge]:
    """The gold judge of `task`, or None when the task has none."""
    return _JUDGES.get(task)
