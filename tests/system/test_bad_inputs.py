"""Bad input never costs finished work: every file of the corpus in tests/bad_inputs/ (and the
broken checkpoints built below) makes the stage that reads it exit with status 2 and one line
`error: <file>:<line or key>: what is wrong`, with no traceback, and leaves every output of earlier
runs byte for byte as it was.

The methods' stages (grpo, rs, dpo, compare, recipes) and the user's reward function meet the same
contract in the tests at the end of this file, one family per test.

Corpus file names say where a case goes: `<prepared file>.<case>.jsonl` replaces that file of
data/prepared; `params.<case>.yaml` is merged into the tiny params (or, for `not_yaml`, is the
params file itself)."""

from __future__ import annotations

import hashlib
import json
import os
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from conftest import HELPERS, REPO, TINY, merge, run_env, write_params
from pipeline.__main__ import main
from pipeline.config import Params, from_dict
from pipeline.stages import rs
from pipeline.stages.prepare import write as prepare_run
from pipeline.config import DataConfig

CORPUS = REPO / "tests" / "bad_inputs"
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
    """Every file's sha256 but the stage folders' lock files (they name the last run that held them)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


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


@pytest.mark.parametrize("given, folder, expected", [
    ("sft_dir", "outputs/reward/model", r"LlamaForCausalLM \(unexpected score\.weight\)"),       # a policy folder
    ("reward_dir", "outputs/sft/model", r"LlamaForSequenceClassification \(missing score\.weight\)"),   # a reward one
])
def test_a_model_folder_holding_the_other_kind_of_model(work, capsys, given, folder, expected):
    _fails_cleanly(_argv("ppo", work / "params.yaml", work / "data/prepared", work / "outputs",
                         **{given: work / folder}), work, capsys,
                   rf"^error: {work}/{folder}: weights of another model than {expected}$")


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


# ---- Hostile inputs: each family through the CLI in a child process ------------------------
#
# A child per family runs its cases one after another through `pipeline.__main__.main` (in-process
# there, so a case costs no interpreter start) and reports each case's status and stderr; the
# child's peak memory above what importing the libraries took (the CUDA build of torch alone maps
# more than the CPU build's whole run) and its exit show an abort or a runaway allocation; its timeout, a hang. The
# timeout is a hang guard only, several times the slowest case here: how fast a bad input is refused
# is not a contract the tests time (these machines are shared and noisy).

DRIVER = r"""
import contextlib, io, json, resource, sys, time
from pipeline.__main__ import main
import torch, transformers, safetensors.torch  # noqa: the libraries' own footprint is the baseline
BASE_KB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for case in json.loads(sys.argv[1]):
    err, t0 = io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(case)
    except BaseException as e:   # anything escaping main is a broken contract
        rc = f"escaped {type(e).__name__}: {str(e)[:300]}"
    print("CASE" + json.dumps({"rc": rc, "stderr": err.getvalue()[-4000:], "seconds": time.perf_counter() - t0}),
          flush=True)
print("GROWTH_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - BASE_KB, flush=True)
"""
MAX_LINE, HANG_SECONDS, MAX_KB = 500, 120.0, 768 << 10


def _family(cases: list[tuple[list[str], str]], work: Path) -> list[str]:
    """Run (argv, expected regex of the error line) cases in one child; assert the contract for
    each: exit status 2, exactly one `error:` line of at most MAX_LINE characters matching, no
    traceback, no hang, peak memory under MAX_KB above the imported libraries', earlier outputs
    byte-identical."""
    import re
    before = _snapshot(work)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([argv for argv, _ in cases])], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=HANG_SECONDS * len(cases))
    results = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("CASE")]
    assert proc.returncode == 0 and len(results) == len(cases), proc.stderr[-3000:]
    lines = []
    for (argv, expected), r in zip(cases, results):
        errors = [line for line in r["stderr"].splitlines() if line.startswith("error: ")]
        assert r["rc"] == 2 and len(errors) == 1 and "Traceback" not in r["stderr"], (argv, r)
        assert len(errors[0]) <= MAX_LINE and re.search(expected, errors[0]), (argv, errors[0])
        lines.append(errors[0])
    growth = int(proc.stdout.split("GROWTH_KB")[1])
    assert 0 <= growth < MAX_KB, growth
    assert _snapshot(work) == before
    return lines


def _params_with(tmp_path: Path, name: str, override: dict) -> Path:
    path = tmp_path / f"{name}.yaml"
    write_params(path, merge(TINY, override))
    return path


def _data_with(work: Path, tmp_path: Path, name: str, files: dict[str, bytes | None]) -> Path:
    """A copy of the prepared data with files replaced (None: made a FIFO)."""
    import os
    data = tmp_path / name
    shutil.copytree(work / "data/prepared", data)
    for rel, content in files.items():
        (data / rel).unlink()
        if content is None:
            os.mkfifo(data / rel)
        else:
            (data / rel).write_bytes(content)
    return data


def _line(**row) -> bytes:
    return (json.dumps(row) + "\n").encode()


def test_hostile_paths_that_are_not_regular_files(work, tmp_path):
    import os
    (tmp_path / "folder_data").mkdir()
    folder = _data_with(work, tmp_path, "d1", {})
    (folder / "sft_train.jsonl").unlink()
    (folder / "sft_train.jsonl").mkdir()
    fifo = _data_with(work, tmp_path, "d2", {"pairs_train.jsonl": None})
    os.symlink("/dev/zero", tmp_path / "zero.yaml")
    ckpt = tmp_path / "sft_fifo"
    shutil.copytree(work / "outputs/sft/model", ckpt)
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    p = work / "params.yaml"
    _family([
        (_argv("sft", p, folder, work / "outputs"), r"sft_train\.jsonl: is a folder, not a file$"),
        (_argv("reward", p, fifo, work / "outputs"), r"pairs_train\.jsonl: not a regular file \(a FIFO, device or socket\)"),
        (_argv("sft", tmp_path / "zero.yaml", work / "data/prepared", work / "outputs"),
         r"zero\.yaml: not a regular file"),
        (_argv("reward", p, work / "data/prepared", work / "outputs", sft_dir=ckpt),
         rf"{ckpt}/model\.safetensors: not a regular file"),
    ], work)


def test_hostile_json_and_yaml_beyond_parser_limits(work, tmp_path):
    deep = _data_with(work, tmp_path, "d1", {"sft_train.jsonl": b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}\n"})
    digits = _data_with(work, tmp_path, "d2", {"pairs_train.jsonl": b'{"prompt": "a", "chosen": "b", "rejected": "c", '
                                                                      b'"id": ' + b"9" * 6000 + b"}\n"})
    laughs = tmp_path / "laughs.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]"
                                                           for i in range(1, 9)]
    laughs.write_text("\n".join(lines) + "\n")
    huge_string = _params_with(tmp_path, "huge_string", {"sft": {"dataset": {"path": "x" * 200_000}}})
    huge_int = tmp_path / "huge_int.yaml"
    huge_int.write_text("sft:\n  batch_size: " + "9" * 6000 + "\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("sft: " + "[" * 5000 + "]" * 5000 + "\n")
    p = work / "params.yaml"
    lines = _family([
        (_argv("sft", p, deep, work / "outputs"), r"sft_train\.jsonl:1: malformed JSON: nested too deeply$"),
        (_argv("reward", p, digits, work / "outputs"), r"pairs_train\.jsonl:1: malformed JSON: Exceeds the limit"),
        (_argv("sft", laughs, work / "data/prepared", work / "outputs"), r"laughs\.yaml:1: YAML anchors and aliases"),
        (_argv("sft", huge_string, work / "data/prepared", work / "outputs"),
         r"sft\.dataset\.path: a string of 200000 characters; at most 4096$"),
        (_argv("sft", huge_int, work / "data/prepared", work / "outputs"), r"huge_int\.yaml: not valid YAML: "),
        (_argv("sft", nested, work / "data/prepared", work / "outputs"),
             r"nested\.yaml:1: not valid YAML: nested deeper than 32 levels$"),
    ], work)
    assert all(len(line) < 300 for line in lines)


def test_hostile_text_that_is_not_unicode_and_records_too_large(work, tmp_path):
    surrogate = _data_with(work, tmp_path, "d1", {"sft_train.jsonl": b'{"prompt": "Review \\ud800 it .", '
                                                                      b'"response": "the film is good ."}\n'})
    pair_surrogate = _data_with(work, tmp_path, "d2", {"pairs_train.jsonl": b'{"prompt": "a", "chosen": "b \\udfff", '
                                                                           b'"rejected": "c", "id": "x"}\n'})
    big = _data_with(work, tmp_path, "d3", {"sft_train.jsonl": _line(prompt="p", response="word " * 1_000_000)})
    big_pair = _data_with(work, tmp_path, "d4", {"pairs_train.jsonl": _line(prompt="p " * 600_000, chosen="a",
                                                                           rejected="b", id="1")})
    p = work / "params.yaml"
    _family([
        (_argv("sft", p, surrogate, work / "outputs"),
         r"sft_train\.jsonl:1: field 'prompt' is not valid Unicode \(a lone surrogate"),
        (_argv("reward", p, pair_surrogate, work / "outputs"), r"pairs_train\.jsonl:1: field 'chosen' is not valid Unicode"),
        (_argv("sft", p, big, work / "outputs"), r"sft_train\.jsonl:1: a record of \d+ bytes; at most 1048576"),
        (_argv("reward", p, big_pair, work / "outputs"), r"pairs_train\.jsonl:1: a record of \d+ bytes"),
    ], work)


def test_hostile_corrupt_checkpoints(work, tmp_path):
    def copy(name: str) -> Path:
        shutil.copytree(work / "outputs/sft/model", tmp_path / name)
        return tmp_path / name
    truncated = copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    lying = copy("lying")
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 20], "data_offsets": [0, 1 << 62]}}).encode()
    (lying / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    bad_tok = copy("bad_tok")
    (bad_tok / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    empty = tmp_path / "empty"
    empty.mkdir()
    # Resumable state of this very run (same params, same inputs: the fingerprint matches) gone bad.
    resumable = tmp_path / "outputs"
    shutil.copytree(work / "outputs/sft", resumable / "sft")
    (resumable / "sft/checkpoint/rng_rank0.pt").write_bytes(b"not a tensor file")
    resumable_state = tmp_path / "outputs2"
    shutil.copytree(work / "outputs/sft", resumable_state / "sft")
    (resumable_state / "sft/checkpoint/state.json").write_text("[1, 2]")
    p = work / "params.yaml"
    _family([
        (_argv("reward", p, work / "data/prepared", work / "outputs", sft_dir=truncated),
         rf"{truncated}: cannot load as AutoModelForSequenceClassification \(SafetensorError: "),
        (_argv("reward", p, work / "data/prepared", work / "outputs", sft_dir=lying), rf"{lying}: cannot load as "),
        (_argv("reward", p, work / "data/prepared", work / "outputs", sft_dir=bad_tok),
         rf"{bad_tok}: cannot load the tokenizer \("),
        (_argv("reward", p, work / "data/prepared", work / "outputs", sft_dir=empty), rf"{empty}: "),
        (_argv("sft", p, work / "data/prepared", resumable),
         rf"^error: {resumable}/sft/checkpoint: cannot load the resumable checkpoint [^/]*; "
         r"delete that folder to start afresh$"),
        (_argv("sft", p, work / "data/prepared", resumable_state),
         r"checkpoint/state\.json: expected a JSON object, got list; "
         r"delete the folder holding it to start afresh$"),
    ], work)


def test_a_corrupt_checkpoint_at_a_long_path_is_named_once_and_the_advice_is_whole(tmp_path):
    """A CI checkout or a home folder can be 150 characters deep: the message names the folder
    once, keeps the loader's reason as far as it fits, and always ends with what to do."""
    from pipeline.errors import MAX_MESSAGE, CheckpointError
    from pipeline.training.resume import load_rng, read_state
    deep = tmp_path.joinpath(*["a-rather-long-folder-of-a-ci-runner"] * 5) / "outputs/sft/checkpoint"
    assert len(str(deep)) >= 150
    deep.mkdir(parents=True)
    (deep / "rng_rank0.pt").write_bytes(b"not a tensor file")
    with pytest.raises(CheckpointError) as err:
        load_rng(deep, 0)
    message = str(err.value)
    assert message.startswith(f"{deep}: cannot load the resumable checkpoint (UnpicklingError: ")
    assert message.endswith("; delete that folder to start afresh") and message.count(str(deep)) == 1
    assert len(message) <= MAX_MESSAGE
    (deep / "state.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError) as err:
        read_state(deep, "fingerprint")
    assert str(err.value) == (f"{deep}/state.json: expected a JSON object, got list; "
                              "delete the folder holding it to start afresh")
    # Deeper than a whole line: the middle goes, the start (the path's root) and the advice stay.
    deeper = tmp_path.joinpath(*["a-rather-long-folder-of-a-ci-runner"] * 16)
    deeper.mkdir(parents=True)
    (deeper / "rng_rank0.pt").write_bytes(b"not a tensor file")
    with pytest.raises(CheckpointError) as err:
        load_rng(deeper, 0)
    message = str(err.value)
    assert len(message) == MAX_MESSAGE and message.startswith(str(tmp_path))
    assert message.endswith("; delete that folder to start afresh") and "..." in message


def test_hostile_reward_source_functions_fail_before_any_model(work, tmp_path):
    (tmp_path / "empty_mod.py").write_text("")
    (tmp_path / "wrong_count.py").write_text("def score(prompts, responses):\n    return [1.0, 2.0]\n")
    (tmp_path / "one_arg.py").write_text("def score(prompts):\n    return [0.0]\n")
    cases = {"os_system": ("os:system", r"ppo\.reward_source: 'os:system' is a builtin_function_or_method, not a Python function"),
             "missing_module": ("no_such_module_xyz:f", r"ppo\.reward_source: cannot import module 'no_such_module_xyz'"),
             "empty_module": ("empty_mod:score", r"ppo\.reward_source: module 'empty_mod' has no 'score'"),
             "one_arg": ("one_arg:score", r"ppo\.reward_source: 'one_arg:score' does not take \(prompts, responses\)"),
             "wrong_count": ("wrong_count:score", r"ppo\.reward_source: 'wrong_count:score' must return 1 finite score")}
    import os
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}"
    try:
        _family([(_argv("ppo", _params_with(tmp_path, name, {"ppo": {"reward_source": spec}}), work / "data/prepared",
                        work / "outputs"), expected) for name, (spec, expected) in cases.items()], work)
    finally:
        os.environ["PYTHONPATH"] = env_path


def test_hostile_values_valid_json_but_not_data_and_null_sections(work, tmp_path):
    margin = {"reward": {"dataset": {"margin_column": "margin"}}}
    rows = [json.loads(line) for line in (work / "data/prepared/pairs_train.jsonl").read_text().splitlines()]
    nan = _data_with(work, tmp_path, "d1", {"pairs_train.jsonl": b"".join(
        _line(**r, margin=1.0) for r in rows[:2]) + b'{"prompt": "a", "chosen": "b", "rejected": "c", "id": "z", '
                                                     b'"margin": NaN}\n'})
    inf = _data_with(work, tmp_path, "d2", {"pairs_train.jsonl": b"".join(_line(**r, margin=1.0) for r in rows[:1])
                                            + b'{"prompt": "a", "chosen": "b", "rejected": "c", "id": "z", '
                                              b'"margin": 1e400}\n'})
    ragged = tmp_path / "ragged_{split}.csv"
    for split in ("train", "test"):
        (tmp_path / f"ragged_{split}.csv").write_text("prompt,chosen,rejected\na,b,c\nd,e,f,g\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    null_section = tmp_path / "null.yaml"
    null_section.write_text("sft: null\n")
    null_nested = _params_with(tmp_path, "null_nested", {"sft": {"lora": None}})
    _family([
        (_argv("reward", _params_with(tmp_path, "m", margin), nan, work / "outputs"),
         r"pairs_train\.jsonl:3: malformed JSON: NaN is not JSON"),
        (_argv("reward", _params_with(tmp_path, "m2", margin), inf, work / "outputs"),
         r"pairs_train\.jsonl:2: margin field 'margin' must be finite, got inf"),
        (_argv("reward", _params_with(tmp_path, "csv", {"reward": {"dataset": {"path": str(ragged)}},
                                                       "prompts": {"gold_judge": False}}),
               work / "data/prepared", work / "outputs"), r"ragged_train\.csv: cannot load dataset: .*Expected 3 fields in line 3, saw 4"),
        (_argv("sft", empty, work / "data/prepared", work / "outputs"), r"empty\.yaml: the params file is empty"),
        (_argv("sft", null_section, work / "data/prepared", work / "outputs"), r"null\.yaml: sft: is null; omit it"),
        (_argv("sft", null_nested, work / "data/prepared", work / "outputs"), r"null_nested\.yaml: sft\.lora: is null"),
    ], work)


def test_hostile_output_path_that_is_a_file(work, tmp_path):
    (tmp_path / "a_file").write_text("keep me")
    p = work / "params.yaml"
    _family([
        (["sft", "--params", str(p), "--no-progress", "--data", str(work / "data/prepared"), "--out",
          str(tmp_path / "a_file")], r"a_file: --out names an existing file"),
        (["evaluate", "--params", str(p), "--data", str(work / "data/prepared"), "--sft", str(work / "outputs/sft/model"),
          "--reward", str(work / "outputs/reward/model"), "--ppo", str(work / "outputs/ppo/model"),
          "--out", str(tmp_path / "a_file")], r"a_file: --out names an existing file"),
    ], work)
    assert (tmp_path / "a_file").read_text() == "keep me"


@pytest.mark.parametrize("stage,broken", [
    ("sft", {"eval_prompts.jsonl": b'{"prompt": ""}\n'}),
    ("reward", {"sft_eval.jsonl": b'{"prompt": "p", "response": 3}\n'}),
    ("reward", {"stats.json": b'{"noise_ceiling": {"pairs_eval": "high"}}'}),
    ("reward", {"eval_prompts.jsonl": b'{"prompt": "p"} trailing\n'}),
])
def test_inputs_read_after_training_are_validated_before_it(stage, broken, work, tmp_path):
    """A bad line in an input the stage reads only after training fails at once: no training step
    runs, so the resumable checkpoint of an earlier run is left byte-identical."""
    out = tmp_path / "outputs"
    shutil.copytree(work / "outputs", out)
    data = _data_with(work, tmp_path, "data", broken)
    other = _params_with(tmp_path, "other", {stage: {"lr": 1e-5}})     # another config: it would train afresh
    ckpt_before = _snapshot(out / stage / "checkpoint")
    (line,) = _family([(_argv(stage, other, data, out), rf"{data}/{next(iter(broken))}")], work)
    assert _snapshot(out / stage / "checkpoint") == ckpt_before


def test_fuzzed_inputs_keep_the_contract(work, tmp_path):
    """Random mutations of the tiny run's prepared files and params (byte flips, truncation,
    duplicated or deleted lines, values of another type, huge numbers, garbage) through the
    validation every stage runs before training (`python -m pipeline check --data`): each case
    ends with status 0, or 2 and one short `error:` line; never an escaped exception, a signal, a
    hang or more than 1 GB. The seed is printed, so a failure can be replayed."""
    import random
    seed = random.randrange(1 << 30)
    print(f"fuzz seed {seed}")
    shutil.copytree(work / "data/prepared", tmp_path / "data")
    proc = subprocess.run([sys.executable, str(HELPERS / "fuzz_inputs.py"), str(work / "params.yaml"),
                           str(tmp_path / "data"), str(seed), "300"], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=900)   # a hang guard only
    results = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("CASE")]
    assert proc.returncode == 0 and len(results) == 300, (seed, proc.stderr[-3000:])
    for r in results:
        errors = [line for line in r["stderr"].splitlines() if line.startswith("error: ")]
        ok = r["rc"] == 0 or (r["rc"] == 2 and len(errors) == 1 and len(errors[0]) <= MAX_LINE)
        assert ok and "Traceback" not in r["stderr"], (seed, r)
    assert 0 <= int(proc.stdout.split("GROWTH_KB")[1]) < MAX_KB
    assert sum(r["rc"] == 2 for r in results) > 100          # the mutations do break inputs


# ---- The methods' stages (grpo, rs, dpo, compare, recipes) and the user's code ----------------------


def _stage(stage: str, params: Path, work: Path, out: Path, data: Path | None = None, *extra: str) -> list[str]:
    """argv of `stage` on the work run's data and models, writing to `out` (outside the work run)."""
    inputs = {"grpo": ["--sft", "outputs/sft/model", "--reward", "outputs/reward/model"],
              "ppo": ["--sft", "outputs/sft/model", "--reward", "outputs/reward/model"],
              "rs": ["--sft", "outputs/sft/model", "--reward", "outputs/reward/model"],
              "compare": ["--sft", "outputs/sft/model", "--reward", "outputs/reward/model"],
              "dpo": ["--sft", "outputs/sft/model"], "reward": ["--sft", "outputs/sft/model"], "sft": []}[stage]
    return [stage, "--params", str(params), "--no-progress", "--data", str(data or work / "data/prepared"),
            *[str(work / a) if a.startswith("outputs/") else a for a in inputs], "--out", str(out), *extra]


def test_errors_name_the_stages_own_keys(work, tmp_path):
    _family([
        (_stage("grpo", _params_with(tmp_path, "g1", {"grpo": {"overlong": "error", "max_prompt_length": 5}}), work,
                tmp_path / "grpo"), r"ppo_prompts\.jsonl:1: \d+ tokens exceed grpo\.max_prompt_length=5"),
        (_stage("grpo", _params_with(tmp_path, "g2", {"grpo": {"reward_source": "os:system"}}), work, tmp_path / "grpo"),
         r"g2\.yaml: grpo\.reward_source: 'os:system' is a builtin"),
        (_stage("rs", _params_with(tmp_path, "r1", {"rs": {"overlong": "error", "max_length": 10}}), work,
                tmp_path / "rs"), r"winners\.jsonl:2: prompt \+ response of \d+ tokens exceed rs\.max_length=10 "
                                  r"\(rs\.overlong: truncate or drop"),
        (_stage("sft", _params_with(tmp_path, "d1", {"sft": {"distributed": {"zero_stage": 2}}}), work, tmp_path / "sft"),
         r"d1\.yaml: sft\.distributed\.backend: zero_stage and offload need backend: deepspeed"),
    ], work)


def test_what_raised_tracebacks_is_one_line(work, tmp_path):
    from transformers import AutoModelForCausalLM
    from pipeline.data.tokenizer import load_tokenizer

    # A policy of another vocabulary: one token more, its embeddings grown to match.
    other = tmp_path / "other/model"
    tok = load_tokenizer(work / "outputs/sft/model")
    tok.add_tokens(["zzz-not-in-sft"])
    model = AutoModelForCausalLM.from_pretrained(work / "outputs/sft/model")
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(other)
    tok.save_pretrained(other)
    # A method's folder whose metrics.json was cut short.
    cut = shutil.copytree(work / "outputs/ppo", tmp_path / "cut", ignore=shutil.ignore_patterns("checkpoint"))
    (cut / "metrics.json").write_bytes((cut / "metrics.json").read_bytes()[:40])
    (tmp_path / "not_yaml.yaml").write_text("sft: [1, 2\n")
    (tmp_path / "folder").mkdir()
    p = work / "params.yaml"
    _family([
        (_stage("compare", p, work, tmp_path / "compare", None, "--policy", f"other={other}"),
         rf"{other}: the other policy's vocabulary differs from the SFT policy's"),
        (_stage("compare", p, work, tmp_path / "compare", None, "--policy", f"ppo={cut}/model"),
         rf"{cut}/metrics\.json: malformed JSON"),
        (["recipe", "demo", "--params", str(tmp_path / "not_yaml.yaml")], r"not_yaml\.yaml:2: not valid YAML"),
        (["recipe", "demo", "--params", str(p), "--out", str(tmp_path / "folder")],
         rf"--out {tmp_path}/folder: is a folder"),
        (_stage("sft", _params_with(tmp_path, "lora", {"sft": {"lora": {"r": 4, "target_modules": "nope_proj"}}}),
                work, tmp_path / "sft"),
         r"sft\.lora\.target_modules: nope_proj names no layer of this model \(its layers with weights: .*q_proj"),
        (_stage("grpo", _params_with(tmp_path, "glora", {"grpo": {"lora": {"r": 4, "target_modules": "qproj"}}}),
                work, tmp_path / "grpo"), r"grpo\.lora\.target_modules: qproj names no layer"),
    ], work)


def test_a_reused_winners_file_that_does_not_hold_winners_is_sampled_again(tmp_path, caplog):
    header = {"fingerprint": "fp", "stats": {"rs/prompts": 2.0}}
    good = {"prompt": "p", "response": "r", "rm": 0.5}
    cases = {"null response": [header, good, {**good, "response": None}],
             "rm not a number": [header, {**good, "rm": "high"}],
             "rm not finite": [header, {**good, "rm": 1e400}],
             "stats not numbers": [{**header, "stats": {"x": "y"}}, good],
             "cut short": None}
    for name, rows in cases.items():
        path = tmp_path / f"{name}.jsonl"
        if rows is None:
            path.write_text(json.dumps(header) + "\n" + json.dumps(good)[:10])
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with caplog.at_level(logging.WARNING, logger="pipeline.stages.sampled"):
            caplog.clear()
            assert rs.read_winners(path, "fp") is None, name
        assert "cannot be reused" in caplog.text and "sampling again" in caplog.text, name
    path.write_text(json.dumps(header) + "\n" + json.dumps(good) + "\n")     # a good one is reused
    rows, stats = rs.read_winners(path, "fp")
    assert [r["response"] for r in rows] == ["r"] and stats == {"rs/prompts": 2.0}


def test_bad_input_taken_as_good_is_refused(work, tmp_path):
    (tmp_path / "exits.py").write_text("import sys\ndef score(prompts, responses):\n    sys.exit(0)\n")
    (tmp_path / "hard_exit.py").write_text("import os\ndef score(prompts, responses):\n    os._exit(0)\n")
    repo_params = (REPO / "params.yaml").read_bytes()
    user = tmp_path / "user.yaml"
    shutil.copy(work / "params.yaml", user)
    before = user.read_bytes()
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}"
    try:
        _family([
            # A policy name becomes a TSV cell, a metric name and part of a file name.
            (_stage("compare", work / "params.yaml", work, tmp_path / "compare", None, "--policy",
                    f"a\tb={work}/outputs/ppo/model"), r"--policy 'a\\tb=.*': a policy name is a letter, then letters"),
            (_stage("compare", work / "params.yaml", work, tmp_path / "compare", None, "--policy",
                    f"x/../y={work}/outputs/ppo/model"), r"a policy name is a letter"),
            # A reward function that exits the interpreter does not end the stage as if it had finished.
            (_stage("ppo", _params_with(tmp_path, "e1", {"ppo": {"reward_source": "exits:score"}}), work,
                    tmp_path / "ppo"), r"ppo\.reward_source: 'exits:score' tried to exit the interpreter \(exit code 0\) "
                                       r"on a probe pair"),
            (_stage("grpo", _params_with(tmp_path, "e2", {"grpo": {"reward_source": "hard_exit:score"}}), work,
                    tmp_path / "grpo"), r"grpo\.reward_source: 'hard_exit:score' tried to exit the interpreter"),
            # A recipe is a name in recipes/, never a path (`../params` is the repository's params.yaml).
            (["recipe", "../params", "--params", str(user)], r"recipe ../params: no such recipe"),
            (["recipe", "/etc/passwd", "--params", str(user)], r"recipe /etc/passwd: no such recipe"),
        ], work)
    finally:
        os.environ["PYTHONPATH"] = env_path
    assert user.read_bytes() == before and (REPO / "params.yaml").read_bytes() == repo_params


def test_a_reward_function_that_blocks_is_stopped_at_its_time_bound(work, tmp_path):
    (tmp_path / "blocks.py").write_text("import time\ndef score(prompts, responses):\n    time.sleep(3600)\n")
    (tmp_path / "spins.py").write_text("def score(prompts, responses):\n    while True:\n        pass\n")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}"
    try:
        _family([
            (_stage("ppo", _params_with(tmp_path, "t1", {"ppo": {"reward_source": "blocks:score", "reward_timeout": 1.5}}),
                    work, tmp_path / "ppo"), r"ppo\.reward_source: 'blocks:score' did not return within 1\.5 s on a "
                                             r"probe pair \(raise the bound with the section's reward_timeout\)"),
            (_stage("grpo", _params_with(tmp_path, "t2", {"grpo": {"reward_source": "spins:score", "reward_timeout": 1}}),
                    work, tmp_path / "grpo"), r"grpo\.reward_source: 'spins:score' did not return within 1 s"),
        ], work)
    finally:
        os.environ["PYTHONPATH"] = env_path


def test_pairs_identical_once_tokenized_are_refused(work, tmp_path):
    rows = [json.loads(line) for line in (work / "data/prepared/pairs_train.jsonl").read_text().splitlines()]
    unknown = {**rows[1], "chosen": "zzzq qqqz .", "rejected": "qqqz zzzq ."}        # unknown words: <unk> <unk>
    spacing = {**rows[1], "chosen": "a  good film .", "rejected": "a good film ."}   # the same words
    d1 = _data_with(work, tmp_path, "d1", {"pairs_train.jsonl": b"".join(_line(**r) for r in [rows[0], unknown, *rows[2:]])})
    d2 = _data_with(work, tmp_path, "d2", {"pairs_train.jsonl": b"".join(_line(**r) for r in [rows[0], spacing, *rows[2:]])})
    p = work / "params.yaml"
    _family([
        (_stage("reward", p, work, tmp_path / "rm", d1), r"pairs_train\.jsonl:2: chosen and rejected are identical "
                                                          r"once tokenized \(4 tokens"),
        (_stage("dpo", p, work, tmp_path / "dpo", d2), r"pairs_train\.jsonl:2: chosen and rejected are identical once "
                                                        r"tokenized"),
    ], work)
