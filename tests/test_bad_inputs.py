"""Bad input never costs finished work: every file of the corpus in tests/bad_inputs/ (and the
broken checkpoints built below) makes the stage that reads it exit with status 2 and one line
`error: <file>:<line or key>: what is wrong`, with no traceback, and leaves every output of earlier
runs byte for byte as it was.

Corpus file names say where a case goes: `<prepared file>.<case>.jsonl` replaces that file of
data/prepared; `params.<case>.yaml` is merged into the tiny params (or, for `not_yaml`, is the
params file itself)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from conftest import REPO, TINY, merge, run_env, write_params
from pipeline.__main__ import main
from pipeline.config import Params, from_dict
from pipeline.stages.prepare import run as prepare_run
from pipeline.config import DataConfig

CORPUS = Path(__file__).parent / "bad_inputs"
STAGE_ARGS = {"sft": ["--data", "{data}", "--out", "{out}/sft"],
              "reward": ["--data", "{data}", "--sft", "{out}/sft/model", "--out", "{out}/reward"],
              "ppo": ["--data", "{data}", "--sft", "{out}/sft/model", "--reward", "{out}/reward/model",
                      "--out", "{out}/ppo"]}

# corpus file -> (stage that reads it, params override, what the one line must say after `file`)
DATA_CASES = {
    "sft_train.malformed_json.jsonl": ("sft", {}, r"sft_train\.jsonl:3: malformed JSON"),
    "sft_train.wrong_type.jsonl": ("sft", {}, r"sft_train\.jsonl:2: field 'prompt' must be a string, got int"),
    "sft_train.missing_field.jsonl": ("sft", {}, r"sft_train\.jsonl:2: missing field 'response'"),
    "sft_train.extra_field.jsonl": ("sft", {}, r"sft_train\.jsonl:2: unexpected field 'score'"),
    "sft_train.empty_text.jsonl": ("sft", {}, r"sft_train\.jsonl:2: field 'response' is empty"),
    "sft_train.whitespace_text.jsonl": ("sft", {}, r"sft_train\.jsonl:2: field 'prompt' is empty"),
    "sft_train.invalid_utf8.jsonl": ("sft", {}, r"sft_train\.jsonl:2: invalid UTF-8 at byte \d+"),
    "sft_train.duplicate_id.jsonl": ("sft", {}, r"sft_train\.jsonl:3: duplicate id \"a\" \(first at .*sft_train\.jsonl:1\)"),
    "sft_train.too_long.jsonl": ("sft", {"sft": {"overlong": "error"}},
                                 r"sft_train\.jsonl:2: prompt \+ response of \d+ tokens exceed sft\.max_length=96"),
    "sft_eval.leaked.jsonl": ("sft", {}, r"sft_eval\.jsonl:2: the same demonstration is in the training split at "
                                         r".*sft_train\.jsonl:1 \(train/eval leakage"),
    "pairs_train.chosen_equals_rejected.jsonl": ("reward", {}, r"pairs_train\.jsonl:2: chosen and rejected are identical"),
    "pairs_train.missing_field.jsonl": ("reward", {}, r"pairs_train\.jsonl:2: missing field 'rejected'"),
    "pairs_train.wrong_type.jsonl": ("reward", {}, r"pairs_train\.jsonl:1: field 'chosen' must be a non-empty list of \{role, content\} messages"),
    "ppo_prompts.empty.jsonl": ("ppo", {}, r"ppo_prompts\.jsonl:2: field 'prompt' is empty"),
    "ppo_prompts.too_long.jsonl": ("ppo", {"ppo": {"overlong": "error", "max_prompt_length": 20}},
                                   r"ppo_prompts\.jsonl:2: \d+ tokens exceed ppo\.max_prompt_length=20"),
}
PARAMS_CASES = {
    "params.not_yaml.yaml": ("sft", r"params\.not_yaml\.yaml:3: not valid YAML: expected ',' or ']'"),
    "params.unknown_key.yaml": ("sft", r"params\.yaml: sft\.lrr: unknown key"),
    "params.out_of_range.yaml": ("reward", r"params\.yaml: reward\.batch_size: expected an integer >= 1, got 0"),
    "params.wrong_type.yaml": ("ppo", r"params\.yaml: ppo\.kl_coef: expected a float, got 'fast'$"),
    "params.clip_out_of_range.yaml": ("ppo", r"params\.yaml: ppo\.clip_eps: expected a float > 0\.0 and < 1\.0, got 1\.5"),
}


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny finished run: data/prepared and outputs/{sft,reward,ppo} (the earlier outputs that a
    failing run must leave alone), and params.yaml."""
    from pipeline.stages import reward, sft
    from pipeline.stages import ppo as ppo_stage

    root = tmp_path_factory.mktemp("bad_inputs")
    write_params(root / "params.yaml", TINY)
    prepare_run(from_dict(DataConfig, TINY["data"], "params.yaml: "), root / "data/prepared")
    params = from_dict(Params, {k: v for k, v in TINY.items() if k != "data"}, "params.yaml: ")
    sft.run(params, root / "data/prepared", root / "outputs/sft", progress=False)
    reward.run(params, root / "data/prepared", root / "outputs/sft/model", root / "outputs/reward", progress=False)
    ppo_stage.run(params, root / "data/prepared", root / "outputs/sft/model", root / "outputs/reward/model",
                  root / "outputs/ppo", progress=False)
    return root


def _argv(stage: str, params: Path, data: Path, out: Path, sft_dir: Path | None = None,
          reward_dir: Path | None = None) -> list[str]:
    args = [a.format(data=data, out=out) for a in STAGE_ARGS[stage]]
    if sft_dir is not None:
        args[args.index(f"{out}/sft/model")] = str(sft_dir)
    if reward_dir is not None:
        args[args.index(f"{out}/reward/model")] = str(reward_dir)
    return [stage, "--params", str(params), "--no-progress", *args]


def _fails_cleanly(argv: list[str], work: Path, capsys, expected: str) -> str:
    """Run the CLI in-process: exit status 2, one stderr line matching `expected`, nothing changed."""
    before = _snapshot(work)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    import re
    assert re.search(expected, lines[0]), lines[0]
    assert _snapshot(work) == before
    return lines[0]


def _bad_data(work: Path, tmp_path: Path, name: str) -> Path:
    data = tmp_path / "data"
    shutil.copytree(work / "data/prepared", data)
    target = name.split(".")[0] + ".jsonl"
    shutil.copy(CORPUS / name, data / target)
    if name == "sft_eval.leaked.jsonl":       # the leak needs a training file holding the same record
        shutil.copy(CORPUS / "sft_train.leaked.jsonl", data / "sft_train.jsonl")
    return data


def test_corpus_is_complete():
    assert sorted(p.name for p in CORPUS.iterdir()) == sorted([*DATA_CASES, *PARAMS_CASES, "sft_train.leaked.jsonl"])


@pytest.mark.parametrize("name", sorted(DATA_CASES))
def test_bad_data_line(name, work, tmp_path, capsys):
    stage, override, expected = DATA_CASES[name]
    write_params(tmp_path / "params.yaml", merge(TINY, override))
    data = _bad_data(work, tmp_path, name)
    _fails_cleanly(_argv(stage, tmp_path / "params.yaml", data, work / "outputs"), work, capsys,
                   rf"^error: {tmp_path}/data/{expected}")


@pytest.mark.parametrize("name", sorted(PARAMS_CASES))
def test_bad_params(name, work, tmp_path, capsys):
    stage, expected = PARAMS_CASES[name]
    if name == "params.not_yaml.yaml":
        params = tmp_path / name
        shutil.copy(CORPUS / name, params)
    else:
        params = tmp_path / "params.yaml"
        write_params(params, merge(TINY, YAML(typ="safe", pure=True).load((CORPUS / name).read_text())))
    _fails_cleanly(_argv(stage, params, work / "data/prepared", work / "outputs"), work, capsys,
                   rf"^error: ({tmp_path}/)?{expected}")


# ---- Checkpoints ---------------------------------------------------------------------------------

def _edit_tokenizer(src: Path, dest: Path, **special: str | None) -> Path:
    """A copy of checkpoint `src` whose tokenizer lacks the given special tokens (set to None)."""
    shutil.copytree(src, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(special)
    cfg_path.write_text(json.dumps(cfg))
    st = dest / "special_tokens_map.json"
    if st.exists():
        m = {k: v for k, v in json.loads(st.read_text()).items() if k not in special}
        st.write_text(json.dumps(m))
    return dest


def test_policy_folder_holding_a_reward_model(work, tmp_path, capsys):
    _fails_cleanly(_argv("ppo", work / "params.yaml", work / "data/prepared", work / "outputs",
                         sft_dir=work / "outputs/reward/model"), work, capsys,
                   rf"^error: {work}/outputs/reward/model: weights of another model than LlamaForCausalLM "
                   rf"\(unexpected score\.weight\)$")


def test_reward_folder_holding_a_policy(work, tmp_path, capsys):
    _fails_cleanly(_argv("ppo", work / "params.yaml", work / "data/prepared", work / "outputs",
                         reward_dir=work / "outputs/sft/model"), work, capsys,
                   rf"^error: {work}/outputs/sft/model: weights of another model than "
                   rf"LlamaForSequenceClassification \(missing score\.weight\)$")


def test_checkpoint_of_another_architecture(work, tmp_path, capsys):
    """An SFT folder whose weights do not fit its config (another width): no silent re-init."""
    other = tmp_path / "other"
    shutil.copytree(work / "outputs/sft/model", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_size"], cfg["intermediate_size"] = 64, 128
    (other / "config.json").write_text(json.dumps(cfg))
    _fails_cleanly(_argv("reward", work / "params.yaml", work / "data/prepared", work / "outputs", sft_dir=other),
                   work, capsys, rf"^error: {other}: ")


def test_encoder_checkpoint_is_not_a_policy(work, tmp_path, capsys):
    """A BERT encoder folder: transformers would build a BertLMHeadModel around it with a fresh
    head; the missing weights are reported instead."""
    from transformers import BertConfig, BertModel
    BertModel(BertConfig(vocab_size=200, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path / "bert")
    shutil.copy(work / "outputs/sft/model/tokenizer.json", tmp_path / "bert")
    shutil.copy(work / "outputs/sft/model/tokenizer_config.json", tmp_path / "bert")
    _fails_cleanly(_argv("ppo", work / "params.yaml", work / "data/prepared", work / "outputs",
                         sft_dir=tmp_path / "bert"), work, capsys,
                   rf"^error: {tmp_path}/bert: weights of another model than BertLMHeadModel \(missing cls\.")


@pytest.mark.parametrize("token", ["eos_token", "pad_token"])
def test_tokenizer_without_special_token(token, work, tmp_path, capsys):
    broken = _edit_tokenizer(work / "outputs/sft/model", tmp_path / "sft", **{token: None})
    _fails_cleanly(_argv("ppo", work / "params.yaml", work / "data/prepared", work / "outputs", sft_dir=broken),
                   work, capsys, rf"^error: {broken}: tokenizer has no {token.split('_')[0]} token")


def test_pickled_weights_are_refused(work, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file
    pickled = tmp_path / "sft"
    shutil.copytree(work / "outputs/sft/model", pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    _fails_cleanly(_argv("ppo", work / "params.yaml", work / "data/prepared", work / "outputs", sft_dir=pickled),
                   work, capsys, rf"^error: {pickled}: no safetensors weights")


def test_real_process_exit_status_and_single_line(work, tmp_path):
    """The same contract through a real interpreter: status 2, one line on stderr, no traceback."""
    data = _bad_data(work, tmp_path, "sft_train.malformed_json.jsonl")
    before = _snapshot(work)
    proc = subprocess.run([sys.executable, "-m", "pipeline",
                           *_argv("sft", work / "params.yaml", data, work / "outputs")],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: {data}/sft_train.jsonl:3: malformed JSON: Expecting ',' " \
                                                   f"delimiter (column {len((CORPUS / 'sft_train.malformed_json.jsonl').read_text().splitlines()[2]) + 1})"
    assert "Traceback" not in proc.stderr + proc.stdout
    assert _snapshot(work) == before
