"""The newer stages (grpo, rs, dpo, compare, recipes) and the user's code meet hostile input in the
contract of tests/system/test_bad_inputs.py: exit status 2, one `error:` line naming the file and
line or the stage's own key, no traceback, bounded time and memory, earlier outputs untouched.
One family per test, at least two cases each."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from conftest import REPO
from test_bad_inputs import _data_with, _family, _line, _params_with, work  # noqa: F401 - `work` is a fixture
from pipeline.stages import rs

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
        with caplog.at_level(logging.WARNING, logger="pipeline.stages.rs"):
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
