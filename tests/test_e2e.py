"""The real pipeline end to end: `dvc repro` on tiny params in a temporary git repository."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import BIN, run
from pipeline.tokenizer import decode_response, encode_prompt


def test_dvc_repro_tiny_pipeline(tiny_repo):
    proc = run([str(BIN / "dvc"), "repro"], tiny_repo)
    assert "Running stage 'sft'" in proc.stdout

    stats = json.loads((tiny_repo / "data/prepared/stats.json").read_text())
    assert stats["sizes"]["sft_train"] == 64 and stats["sizes"]["eval_prompts"] == 8
    assert 0.5 < stats["noise_ceiling"]["pairs_eval"] <= 1.0

    metrics = json.loads((tiny_repo / "outputs/sft/metrics.json").read_text())
    assert metrics["train"]["steps"] == 4                       # 64 demos / batch 16, one epoch
    assert 0 < metrics["eval"]["loss"] < 10
    for tag in ("greedy", "sampled"):
        assert 0.0 <= metrics["eval"][f"eos_rate_{tag}"] <= 1.0
        assert -10 < metrics["eval"][f"gold_{tag}"] < 5
    train_rows = (tiny_repo / "outputs/sft/train.tsv").read_text().splitlines()
    assert train_rows[0].split("\t") == ["step", "loss", "lr", "grad_norm"] and len(train_rows) == 5

    # The checkpoint is a plain HF one: Auto classes load it (safetensors) and it generates.
    path = tiny_repo / "outputs/sft/model"
    assert (path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = torch.tensor([encode_prompt(tok, "Review the film Silent River . Focus on the music .")])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(decode_response(tok, out[0, ids.shape[1]:].tolist()), str)

    # Nothing changed: a second repro runs no stage; a params change reruns only what reads it.
    assert "didn't change" in run([str(BIN / "dvc"), "repro"], tiny_repo).stdout
    params = (tiny_repo / "params.yaml").read_text()
    (tiny_repo / "params.yaml").write_text(params.replace("lr: 0.002", "lr: 3e-05"))
    status = json.loads(run([str(BIN / "dvc"), "status", "--json"], tiny_repo).stdout)
    assert set(status) == {"sft"}
