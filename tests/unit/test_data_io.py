"""Validated JSONL input, atomic outputs, SFT tokenization/collation and the word tokenizer."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import pytest
import torch

from pipeline.data.records import IGNORE, Example, collate_sft, load_demonstrations, tokenize_demonstrations
from pipeline.errors import DataError
from pipeline.files import atomic_dir, atomic_write_json, atomic_write_text, read_jsonl, write_jsonl
from pipeline.tasks import reviews
from pipeline.data.tokenizer import (
    BOS, EOS, PAD, build_word_tokenizer, decode_response, encode_prompt, encode_response,
)

OK = '{"prompt": "p", "response": "r"}'


@pytest.fixture(scope="module")
def tok():
    return build_word_tokenizer(reviews.vocabulary())


def write(tmp_path: Path, content: str | bytes, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def jsonl_error(path: Path) -> str:
    with pytest.raises(DataError) as err:
        read_jsonl(path, required=("prompt", "response"), nonempty=("prompt", "response"))
    return str(err.value)


# ---- read_jsonl ---------------------------------------------------------------------------------


def test_read_jsonl_valid_and_blank_lines(tmp_path):
    path = write(tmp_path, f'{OK}\n\n   \n{{"prompt": "a", "response": "b", "extra": 1}}\n\n')
    rows = read_jsonl(path, required=("prompt", "response"), nonempty=("prompt", "response"))
    assert rows == [{"prompt": "p", "response": "r"}, {"prompt": "a", "response": "b", "extra": 1}]


@pytest.mark.parametrize("lines, message", [
    # malformed JSON on line 3: the missing ',' is at column 16 ('{"prompt": "a" ' is 15 characters)
    ([OK, OK, '{"prompt": "a" "response": "b"}'], "3: malformed JSON: Expecting ',' delimiter (column 16)"),
    ([OK, "[1, 2]"], "2: expected a JSON object, got list"),
    (['"just a string"'], "1: expected a JSON object, got str"),
    ([OK, '{"prompt": "a"}'], "2: missing field 'response'"),
    (['{"prompt": "", "response": "b"}'], "1: field 'prompt' is empty"),
    ([OK, '{"prompt": "a", "response": " \\t\\n "}'], "2: field 'response' is empty"),
    (['{"prompt": 3, "response": "b"}'], "1: field 'prompt' must be a string, got int"),
    (['{"prompt": "a", "response": null}'], "1: field 'response' must be a string, got NoneType"),
    # blank lines are skipped but still counted: the bad record is on line 4
    ([OK, "", "   ", "[]"], "4: expected a JSON object, got list"),
])
def test_read_jsonl_errors(tmp_path, lines, message):
    path = write(tmp_path, "\n".join(lines) + "\n")
    assert jsonl_error(path) == f"{path}:{message}"


def test_read_jsonl_invalid_utf8(tmp_path):
    # '{"prompt": "' is 12 bytes, so the bad byte is at offset 12 of line 2
    path = write(tmp_path, OK.encode() + b'\n{"prompt": "\xff", "response": "r"}\n')
    assert jsonl_error(path) == f"{path}:2: invalid UTF-8 at byte 12"


@pytest.mark.parametrize("content", ["", "\n\n", "  \n\t\n"])
def test_read_jsonl_empty_file(tmp_path, content):
    path = write(tmp_path, content)
    assert jsonl_error(path) == f"{path}: no records"


def test_read_jsonl_missing_file(tmp_path):
    assert jsonl_error(tmp_path / "nope.jsonl") == f"{tmp_path / 'nope.jsonl'}: no such file"


def test_read_jsonl_nonempty_is_separate_from_required(tmp_path):
    path = write(tmp_path, '{"prompt": "a", "score": ""}\n')
    assert read_jsonl(path, required=("prompt", "score")) == [{"prompt": "a", "score": ""}]


def test_write_then_read_round_trip(tmp_path):
    rows = [{"prompt": "caf\u00e9 ?", "response": "ok ."}, {"prompt": "\u6f22\u5b57", "response": "x"}]
    write_jsonl(tmp_path / "r.jsonl", rows)
    assert load_demonstrations(tmp_path / "r.jsonl") == [{**r, "where": f"{tmp_path / 'r.jsonl'}:{i}"}
                                                          for i, r in enumerate(rows, start=1)]


# ---- Atomic outputs -----------------------------------------------------------------------------


def test_atomic_dir_success_replaces_whole_folder(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    (target / "shared.txt").write_text("old")
    with atomic_dir(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target
        assert list(tmp.iterdir()) == []
        (tmp / "shared.txt").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text("a")
        assert (target / "old.txt").read_text() == "old"  # old output intact until the end
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == ["shared.txt", "sub", "sub/a.txt"]
    assert (target / "shared.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or .old folder left


def test_atomic_dir_creates_missing_target(tmp_path):
    target = tmp_path / "a" / "b"
    with atomic_dir(target) as tmp:
        (tmp / "f").write_text("1")
    assert (target / "f").read_text() == "1"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b"]


def test_atomic_dir_failure_keeps_old_folder(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(target) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("boom")
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    assert (target / "old.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_atomic_dir_failure_without_old_folder(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "out"):
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_text(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    atomic_write_text(path, "one\n")
    atomic_write_text(path, "two \u00e9\n")
    assert path.read_text(encoding="utf-8") == "two \u00e9\n"
    assert [p.name for p in path.parent.iterdir()] == ["f.txt"]
    atomic_write_json(tmp_path / "sub" / "s.json", {"b": 1, "a": [1.5]})
    assert (tmp_path / "sub" / "s.json").read_text() == '{\n  "a": [\n    1.5\n  ],\n  "b": 1\n}\n'
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.txt", "s.json"]


def test_json_outputs_are_strict_json_with_null_for_an_undefined_number(tmp_path):
    # A rank correlation over scores that are all equal is NaN; Python would write a bare `NaN`,
    # which jq, JavaScript and json.loads(parse_constant=...) refuse.
    from scipy.stats import spearmanr
    undefined = float(spearmanr([1.0, 2.0, 3.0], [0.5, 0.5, 0.5]).statistic)
    atomic_write_json(tmp_path / "m.json", {"eval": {"spearman": undefined, "inf": float("inf"), "ok": 0.25},
                                            "rows": [float("-inf"), 1.0]})
    def refuse(name):
        raise ValueError(name)
    text = (tmp_path / "m.json").read_text()
    assert json.loads(text, parse_constant=refuse) == {"eval": {"spearman": None, "inf": None, "ok": 0.25},
                                                      "rows": [None, 1.0]}


def test_atomic_write_text_failure_keeps_old_file(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(path, "bad \ud800")  # a lone surrogate cannot be encoded as UTF-8
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_outputs_take_the_umask_mode_not_the_temporary_files(tmp_path, umask):
    """mkstemp/mkdtemp create private temporaries (0o600/0o700); what is renamed into place gets the
    mode open()/mkdir() would give, so a shared cache or run folder stays readable."""
    import matplotlib.pyplot as plt
    from pipeline.measurement.plots import save_figure
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "f.txt", "x\n")
        with atomic_dir(tmp_path / "folder") as d:
            (d / "inside.txt").write_text("y")
        save_figure(plt.figure(), tmp_path / "p.png")
        plain = tmp_path / "plain.txt"
        plain.write_text("z")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(tmp_path / "f.txt") == mode(plain) == 0o666 & ~umask
    assert mode(tmp_path / "p.png") == 0o666 & ~umask
    assert mode(tmp_path / "folder") == 0o777 & ~umask


# ---- Tokenizer ----------------------------------------------------------------------------------

PROMPT = "Write a review of the film Crimson Harbor . Discuss the music ."
RESPONSE = "the music was good . overall , I recommend it ."


def test_special_tokens(tok):
    ids = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}
    assert len(ids) == 4
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_encode_prompt_and_response(tok):
    p = encode_prompt(tok, PROMPT)
    # <bos> + 13 prompt words + "Response" ":"
    assert tok.convert_ids_to_tokens(p) == ["<bos>", *PROMPT.split(), "Response", ":"]
    assert p[0] == tok.bos_token_id and p.count(tok.bos_token_id) == 1
    r = encode_response(tok, RESPONSE)
    assert tok.convert_ids_to_tokens(r) == [*RESPONSE.split(), "<eos>"]
    assert tok.unk_token_id not in p + r


def test_decode_response_round_trip(tok):
    rng = random.Random(0)
    for i in range(50):
        prompt = reviews.make_prompt(reviews.TITLES[i], reviews.ASPECTS[i % 12], i % 3)
        text = reviews.sample_review(rng, prompt)
        ids = encode_response(tok, text)
        assert tok.unk_token_id not in ids
        assert decode_response(tok, ids) == text
        # generation continues after eos with pads/garbage: decoding stops at the first eos
        assert decode_response(tok, ids + [tok.pad_token_id, *ids]) == text
    assert decode_response(tok, encode_response(tok, RESPONSE)[:-1]) == RESPONSE  # no eos at all


# ---- SFT tokenization and collation -------------------------------------------------------------


def test_tokenize_and_collate(tok, tmp_path):
    rows = [{"prompt": PROMPT, "response": RESPONSE},
            {"prompt": "Review the film Iron Winter . Focus on the plot .", "response": "the plot was dull ."}]
    examples, truncated, _ = tokenize_demonstrations(rows, tok, max_length=96, source=tmp_path / "d.jsonl")
    assert truncated == 0
    # row 0: 16 prompt tokens + 11 response + eos; row 1: <bos> + 11 words + 2 marker = 14, 5 + eos
    assert [(len(e.input_ids), e.n_prompt) for e in examples] == [(28, 16), (20, 14)]
    batch = collate_sft(examples, tok.pad_token_id)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == mask.shape == labels.shape == (2, 28)
    assert ids.dtype == mask.dtype == labels.dtype == torch.long
    for i, e in enumerate(examples):
        n, n_p = len(e.input_ids), e.n_prompt
        assert ids[i, :n].tolist() == e.input_ids
        assert (ids[i, n:] == tok.pad_token_id).all()
        assert mask[i].tolist() == [1] * n + [0] * (28 - n)
        assert (labels[i, :n_p] == IGNORE).all()           # prompt
        assert labels[i, n_p:n].tolist() == e.input_ids[n_p:]  # response, incl. eos
        assert (labels[i, n:] == IGNORE).all()              # pads
        assert e.input_ids[n - 1] == tok.eos_token_id
        assert e.input_ids[0] == tok.bos_token_id
    # exact count of trained-on tokens: 12 + 6
    assert int((labels != IGNORE).sum()) == 18


def test_collate_hand_built():
    batch = collate_sft([Example([5, 6, 7, 2], 2), Example([5, 9], 1)], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2], [5, 9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 2], [-100, 9, -100, -100]]


def test_long_prompt_keeps_bos_and_the_format_and_loses_the_texts_left_end(tok, tmp_path):
    rows = [{"prompt": PROMPT, "response": RESPONSE}, {"prompt": PROMPT, "response": "the music was good ."}]
    examples, truncated, dropped = tokenize_demonstrations(rows, tok, max_length=20, source=tmp_path / "d.jsonl")
    assert dropped == 0
    assert truncated == 2
    # 16 + 12 = 28 > 20: 8 prompt tokens, bos + the last 5 of the text + "Response :";
    # 16 + 6 = 22 > 20: 14 prompt tokens, bos + the last 11 of the text + "Response :"
    e0, e1 = examples
    assert tok.convert_ids_to_tokens(e0.input_ids[:e0.n_prompt]) == \
        ["<bos>", ".", "Discuss", "the", "music", ".", "Response", ":"]
    assert e0.input_ids[e0.n_prompt:] == encode_response(tok, RESPONSE)
    assert len(e0.input_ids) == 20 and len(e1.input_ids) == 20
    assert e1.n_prompt == 14
    whole = encode_prompt(tok, PROMPT)
    assert e1.input_ids[:14] == whole[:1] + whole[3:]
    _, none, _ = tokenize_demonstrations(rows, tok, max_length=28, source=tmp_path / "d.jsonl")
    assert none == 0
    # overlong: drop leaves the long ones out and counts them instead.
    kept, truncated, dropped = tokenize_demonstrations(rows, tok, max_length=22, source=tmp_path / "d.jsonl",
                                                       overlong="drop")
    assert (len(kept), truncated, dropped) == (1, 0, 1) and kept[0].n_prompt == 16
    # The errors name the keys of the section the lengths come from (rs fine-tunes with its own).
    with pytest.raises(DataError, match=r"exceed rs\.max_length=22 \(rs\.overlong: truncate or drop"):
        tokenize_demonstrations(rows, tok, max_length=22, source=tmp_path / "d.jsonl", overlong="error", section="rs")


def test_response_longer_than_max_length(tok, tmp_path):
    source = tmp_path / "sft_train.jsonl"
    rows = [{"prompt": PROMPT, "response": "the plot was dull ."}, {"prompt": PROMPT, "response": RESPONSE}]
    with pytest.raises(DataError) as err:
        tokenize_demonstrations(rows, tok, max_length=10, source=source)
    assert str(err.value) == (f"{source}: record 2: response of 12 tokens exceeds sft.max_length=10 "
                              "(sft.overlong: drop skips such records)")


def test_a_stage_runs_under_a_4_gib_address_space_limit(tmp_path):
    """Clusters bound virtual memory (ulimit -v): reading an input allocates what the file holds,
    not the size limit (8 GiB), so SFT on the tiny params runs under RLIMIT_AS = 4 GiB."""
    import resource
    import subprocess
    import sys

    from conftest import REPO, TINY, run_env, write_params
    write_params(tmp_path / "p.yaml", TINY)
    env = {**run_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = lambda *args, **kw: subprocess.run([sys.executable, "-m", "pipeline", *args, "--params", "p.yaml"],  # noqa: E731
                                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, **kw)
    assert run("prepare", "--out", "data").returncode == 0
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))   # noqa: E731
    proc = run("sft", "--data", "data", "--out", "sft", "--no-progress", preexec_fn=limit)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "sft" / "model" / "model.safetensors").is_file()


def test_reading_an_input_allocates_what_the_file_holds(tmp_path):
    """Under a 1 GiB address-space limit a 5-byte file reads (its 8 GiB size limit is no allocation)."""
    import subprocess
    import sys

    from conftest import REPO
    (tmp_path / "small.txt").write_text("hello")
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
            "from pipeline.files import read_input; print(read_input(%r, limit=1 << 33))" % str(tmp_path / "small.txt"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert proc.stdout.strip() == "b'hello'"
