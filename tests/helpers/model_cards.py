"""What a model card tells a user to run: its python block, run as they would, against a folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def card_code(card: str, model_dir: Path) -> dict[str, Any]:
    """Run the card's one python block with its `path/to/model` pointing at `model_dir`: the names it
    defines (the block's own print runs too)."""
    (code,) = CODE.findall(card)
    assert code.count('"path/to/model"') == 1, "the snippet names its model folder once"
    namespace: dict[str, Any] = {"__name__": "card_snippet"}
    exec(compile(code.replace('"path/to/model"', repr(str(model_dir))), "README.md", "exec"), namespace)
    return namespace
