"""The reward stage's restart check (reward.restart, training/restart.py): the gate's arithmetic, its
validation pairs, and, on the tiny task, that a restarted run is exactly a fresh run with the next
attempt's seed, that a check which passes moves no bit, and that a run killed after a restart
resumes the new attempt."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import die_in_step, merge, step_rows, supervised_run, tiny_params
from pipeline.config import Params, RestartConfig, from_dict
from pipeline.data import inputs
from pipeline.data.preferences import Pair
from pipeline.errors import ConfigError, DataError
from pipeline.tracking.sinks import StepLog
from pipeline.training import restart

# 48 tiny pairs in batches of 16 for 4 epochs: 12 steps; the check averages the validation
# accuracy at steps 4 and 6.
CHECKED = {"reward": {"epochs": 4.0, "save_every": 2, "restart": {"at_step": 6, "window": 2}}}


def _params(bar, **reward) -> Params:
    return tiny_params(merge(CHECKED, {"reward": {**reward, "restart": {"min_accuracy": bar}}}))


def _gate(tmp_path, accuracies: dict[int, float], attempts_left: int = 1) -> restart.Gate:
    log = StepLog(tmp_path / "restart.tsv", restart.COLUMNS)
    seen = iter(accuracies.values())
    g = restart.Gate(at_step=6, window=2, every=2, bar=0.7, attempts_left=attempts_left, attempt=0,
                     evaluate=lambda: next(seen), log=log)
    for step in accuracies:
        g.observe(step)
    return g


def test_gate_averages_its_window_and_restarts_below_the_bar(tmp_path):
    g = _gate(tmp_path, {4: 0.6, 6: 0.75})
    assert g.steps == {4, 6}
    assert g.accuracy() == pytest.approx(0.675)
    short = g.verdict(6)
    assert isinstance(short, restart.Restarted) and short.accuracy == pytest.approx(0.675) and short.bar == 0.7
    assert g.verdict(4) is None                       # only at the check's step
    assert _gate(tmp_path, {4: 0.7, 6: 0.72}).verdict(6) is None          # 0.71 >= 0.7: kept
    assert _gate(tmp_path, {4: 0.1, 6: 0.1}, attempts_left=0).verdict(6) is None   # the last attempt trains on
    assert _gate(tmp_path, {6: 0.1}).accuracy() is None                   # a window not full says nothing


def test_active_and_seeds():
    on = RestartConfig(at_step=2500, window=3, min_accuracy=0.775)
    assert restart.active(on, 5000) and not restart.active(on, 2500) and not restart.active(on, 1000)
    assert not restart.active(RestartConfig(at_step=0), 5000)
    assert not restart.active(RestartConfig(min_accuracy=None), 5000)
    assert [restart.seed_of(3, k) for k in range(3)] == [3, 1003, 2003]


def test_a_window_before_step_one_is_refused():
    with pytest.raises(ConfigError, match=r"^params.yaml: reward.restart.at_step: 400 leaves no room for its window of 3 "
                                          r"evaluations every reward.eval_every=250 steps; set it to at least 501$"):
        from_dict(Params, {"reward": {"restart": {"at_step": 400}}}, "params.yaml: ")


def _pair(prompt: str, i: int) -> Pair:
    return Pair(prompt, f"good {i}", f"bad {i}", where=f"pairs.jsonl:{i}")


def test_validation_pairs_of_a_dataset_hold_out_whole_prompts(tmp_path):
    cfg = from_dict(Params, {"reward": {"dataset": {"path": "x.jsonl"}}, "prompts": {"gold_judge": False}},
                    "p: ").reward
    train = [_pair(f"prompt {i % 50}", i) for i in range(500)]
    kept, val = inputs.validation_pairs(cfg.dataset, tmp_path, train, 0.2, "reward.restart")
    assert len(kept) + len(val) == 500 and 40 < len(val) < 200
    assert not {p.prompt for p in kept} & {p.prompt for p in val}      # a prompt's pairs on one side
    assert inputs.validation_pairs(cfg.dataset, tmp_path, train, 0.2, "reward.restart") == (kept, val)
    with pytest.raises(ConfigError, match=r"^reward.restart.holdout: 0 with reward.dataset.path set"):
        inputs.validation_pairs(cfg.dataset, tmp_path, train, 0.0, "reward.restart")
    prepared = from_dict(Params, {}, "p: ").reward.dataset
    with pytest.raises(DataError, match=rf"^{tmp_path}/pairs_val.jsonl: missing; the restart check reads it"):
        inputs.validation_pairs(prepared, tmp_path, train, 0.0, "reward.restart")


def _rows(path: Path) -> list[tuple[int, int, float]]:
    with open(path, newline="") as f:
        return [(int(r["step"]), int(r["attempt"]), float(r["accuracy"])) for r in csv.DictReader(f, delimiter="\t")]


def _same_weights(one: Path, other: Path) -> bool:
    a, b = (load_file(folder / "model" / "model.safetensors") for folder in (one, other))
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.fixture(scope="module")
def restarted(tiny_data, tiny_sft, tmp_path_factory):
    """The tiny reward run whose check always fails (a bar of 1.0): one restart, then trained on."""
    out = tmp_path_factory.mktemp("restarted")
    return out, supervised_run("reward", _params(1.0), tiny_data, tiny_sft)(out)


def test_a_restarted_run_is_a_fresh_run_with_the_next_seed(restarted, tiny_data, tiny_sft, tmp_path):
    out, metrics = restarted
    rows = _rows(out / "restart.tsv")
    assert [(s, a) for s, a, _ in rows] == [(4, 0), (6, 0), (4, 1), (6, 1)]
    assert all(acc < 1.0 for _, _, acc in rows)
    assert metrics["train/restarts"] == 1 and metrics["train/seed"] == 1000 and metrics["train/steps"] == 12
    assert metrics["train/validation_accuracy"] == pytest.approx((rows[2][2] + rows[3][2]) / 2)

    fresh = supervised_run("reward", _params(None, seed=1000), tiny_data, tiny_sft)(tmp_path)
    assert _same_weights(out, tmp_path)
    for log in ("train.tsv", "eval.tsv"):        # the abandoned attempt leaves nothing in these
        assert step_rows(out / log) == step_rows(tmp_path / log), log
    assert fresh["eval/accuracy"] == metrics["eval/accuracy"] and fresh["train/restarts"] == 0
    assert "train/validation_accuracy" not in fresh and _rows(tmp_path / "restart.tsv") == []


def test_a_check_that_passes_moves_no_bit(tiny_data, tiny_sft, tmp_path):
    passed = supervised_run("reward", _params(0.01), tiny_data, tiny_sft)(tmp_path / "passed")
    off = supervised_run("reward", _params(None), tiny_data, tiny_sft)(tmp_path / "off")
    assert _same_weights(tmp_path / "passed", tmp_path / "off")
    assert passed["train/restarts"] == 0 and passed["train/seed"] == 0 and passed["eval/loss"] == off["eval/loss"]
    assert [(s, a) for s, a, _ in _rows(tmp_path / "passed/restart.tsv")] == [(4, 0), (6, 0)]


@pytest.mark.parametrize("killed_in", [2, 8])   # before the new attempt's first save (its marker), and after
def test_killed_after_a_restart_resumes_the_new_attempt(killed_in, restarted, tiny_data, tiny_sft, tmp_path,
                                                        monkeypatch):
    full, full_metrics = restarted
    go = supervised_run("reward", _params(1.0), tiny_data, tiny_sft)
    from pipeline.training import supervised
    real, seen = supervised.check_finite, {"n": 0}

    def dying(at, name, value):   # step `killed_in` of the restarted attempt (attempt 0 ends at step 6)
        if at == f"reward step {killed_in}" and name == "loss":
            seen["n"] += 1
            if seen["n"] == (2 if killed_in <= 6 else 1):
                raise KeyboardInterrupt
        return real(at, name, value)
    monkeypatch.setattr(supervised, "check_finite", dying)
    with pytest.raises(KeyboardInterrupt):
        go(tmp_path)
    state = json.loads((tmp_path / "checkpoint/state.json").read_text())
    assert state["attempt"] == 1 and state["step"] == (0 if killed_in == 2 else 6)
    monkeypatch.undo()
    resumed = go(tmp_path)
    assert _same_weights(full, tmp_path)
    assert _rows(tmp_path / "restart.tsv") == _rows(full / "restart.tsv")
    assert resumed["train/restarts"] == 1 and resumed["eval/accuracy"] == full_metrics["eval/accuracy"]
    for log in ("train.tsv", "eval.tsv"):
        assert step_rows(full / log) == step_rows(tmp_path / log), log
