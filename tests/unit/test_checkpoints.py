"""Saving a checkpoint: what it writes, and what it costs to start."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("deepspeed", "accelerate")),
                    reason="deepspeed or accelerate is not installed: nothing would import it")
def test_a_save_imports_no_deepspeed_and_writes_what_save_pretrained_writes(tmp_path):
    """save_checkpoint leaves deepspeed unimported (accelerate's unwrapping would import it, and
    mlflow with it, only to ask whether the model is a DeepSpeedEngine), restores accelerate's probe,
    and writes the files a plain save_pretrained (deepspeed imported by then) writes, byte for byte.
    In a fresh interpreter: the test process may have imported deepspeed already."""
    script = textwrap.dedent(f"""
        import sys
        import torch
        from accelerate.utils import other
        from pipeline.config import ModelConfig
        from pipeline.data.tokenizer import build_word_tokenizer
        from pipeline.models.checkpoints import save_checkpoint, tiny_config
        from transformers import AutoModelForCausalLM
        tok = build_word_tokenizer(["a", "review", "of", "the", "film"])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(ModelConfig(hidden_size=16, num_layers=1,
                                                                         num_heads=2, intermediate_size=32), tok))
        probe = other.is_deepspeed_available
        save_checkpoint(model, tok, {str(tmp_path / "ours")!r})
        print("deepspeed imported:", "deepspeed" in sys.modules, "probe restored:", other.is_deepspeed_available is probe)
        model.save_pretrained({str(tmp_path / "plain")!r}, safe_serialization=True)
        print("deepspeed imported by a plain save:", "deepspeed" in sys.modules)
        """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepspeed imported: False probe restored: True" in proc.stdout, proc.stdout
    # The plain save did import it: the patch is what kept it out, not a path that never imports it.
    assert "deepspeed imported by a plain save: True" in proc.stdout, proc.stdout
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
