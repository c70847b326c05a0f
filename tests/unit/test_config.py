"""Typed, frozen, validated configuration: the shipped params.yaml, exact error messages, the CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import (
    DataConfig, ModelConfig, Params, SamplingConfig, SFTConfig, flatten, from_dict, read_yaml, to_dict,
)
from pipeline.errors import ConfigError, UserError
from pipeline.stages.registry import load_params   # the whole check, stage batch shapes included

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "params.yaml"


def write_params(tmp_path: Path, text: str, name: str = "params.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_error(tmp_path: Path, text: str) -> str:
    """The error of `text` loaded as a user's `--params params.yaml`, from the folder holding it."""
    write_params(tmp_path, text)
    with pytest.raises(ConfigError) as err, contextlib.chdir(tmp_path):
        load_params("params.yaml")
    return str(err.value)


# ---- The shipped file ---------------------------------------------------------------------------


def test_shipped_params_equal_dataclass_defaults():
    assert load_params(SHIPPED) == Params()


def test_shipped_params_list_every_field():
    # Equality above would still hold if params.yaml left a key out; every key must be documented there.
    raw = read_yaml(SHIPPED)
    # A stage's `distributed` is an override mapping (empty by default) merged over the top level.
    assert set(flatten(raw)) == {k for k in flatten(to_dict(Params())) if ".distributed." not in k}
    assert all(raw[s]["distributed"] == {} for s in ("sft", "reward", "ppo"))
    assert flatten(raw) == {k: v for k, v in flatten(to_dict(Params())).items() if ".distributed." not in k}


def test_shipped_values_spot_check():
    p = load_params(SHIPPED)
    assert p.sft.lr == 2e-3 and isinstance(p.sft.lr, float)
    assert p.sft.epochs == 8.0 and isinstance(p.sft.epochs, float)
    assert p.sft.batch_size == 32 and isinstance(p.sft.batch_size, int)
    assert p.model.name_or_path is None
    assert p.sft.sampling == SamplingConfig(max_new_tokens=48, temperature=1.0, top_k=0, top_p=1.0)
    assert p.data.label_temperature == 0.5


# ---- Error messages -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("sft:\n  lr: fast\n",
     "params.yaml: sft.lr: expected a positive float, got 'fast'"),
    ("sft:\n  batch_size: 3.5\n",
     "params.yaml: sft.batch_size: expected an integer >= 1, got 3.5 (float)"),
    ("sft:\n  batch_size: true\n",
     "params.yaml: sft.batch_size: expected an integer >= 1, got True (bool)"),
    ("model:\n  trust_remote_code: \"yes\"\n",
     "params.yaml: model.trust_remote_code: expected true or false, got 'yes'"),
    ("model:\n  arch: bert\n",
     "params.yaml: model.arch: expected one of 'llama', 'gpt2', got 'bert'"),
    ("data:\n  eval_title_fraction: 1.0\n",
     "params.yaml: data.eval_title_fraction: expected a float > 0.0 and < 1.0, got 1.0 (float)"),
    ("sft:\n  sampling:\n    top_p: 1.5\n",
     "params.yaml: sft.sampling.top_p: expected a float > 0.0 and <= 1.0, got 1.5 (float)"),
    ("sft:\n  lr: 0\n",
     "params.yaml: sft.lr: expected a positive float, got 0.0 (float)"),
    ("sft:\n  lr: .nan\n",
     "params.yaml: sft.lr: expected a positive float, got nan (float)"),
    ("model:\n  hidden_size: 130\n",
     "params.yaml: model.hidden_size: 130 is not divisible by model.num_heads=4"),
    ("model:\n  name_or_path: \"\"\n",
     "params.yaml: model.name_or_path: expected a non-empty string, got ''"),
    ("sft: 3\n",
     "params.yaml: sft: expected a mapping of keys, got 3 (int)"),
    ("data:\n  aspect_contrast: 0.75\n  corrupt_contrast: 0.5\n",
     "params.yaml: data.corrupt_contrast: 0.5 + data.aspect_contrast=0.75 + data.aspect_exchange=0.0 exceeds 1 "
     "(all are fractions of the same training pairs)"),
    ("data:\n  aspect_contrast: 0.5\n  corrupt_contrast: 0.25\n  aspect_exchange: 0.3\n",
     "params.yaml: data.corrupt_contrast: 0.25 + data.aspect_contrast=0.5 + data.aspect_exchange=0.3 exceeds 1 "
     "(all are fractions of the same training pairs)"),
    ("model:\n  attn_implementation: flash_attention_2\n",
     "params.yaml: reward.shared_prompt: needs an attention that takes a custom mask (eager or sdpa); "
     "flash_attention_2 does not. Set reward.shared_prompt: false"),
    ("reward:\n  packing: true\n",
     "params.yaml: reward.packing: packs whole sequences, not reward.shared_prompt's branch rows; set "
     "reward.shared_prompt: false to pack, or reward.packing: false"),
])
def test_error_messages(tmp_path, text, message):
    assert load_error(tmp_path, text) == message


def known(cls: type) -> str:
    return ", ".join(sorted(f.name for f in dataclasses.fields(cls)))


def test_unknown_keys(tmp_path):
    # The known lists are derived from the dataclasses (sections get added as stages land);
    # the subset checks pin the names this file relies on.
    assert {"data", "model", "sft"} <= {f.name for f in dataclasses.fields(Params)}
    assert known(SFTConfig).startswith("batch_size, dataset, distributed, epochs, eval_every, lora, lr, ")
    assert known(SamplingConfig) == "max_new_tokens, stop_token, temperature, top_k, top_p"
    assert load_error(tmp_path, "sfft:\n  lr: 0.1\n") == f"params.yaml: sfft: unknown key (known: {known(Params)})"
    assert load_error(tmp_path, "sft:\n  lrr: 0.1\n") == \
        f"params.yaml: sft.lrr: unknown key (known: {known(SFTConfig)})"
    assert load_error(tmp_path, "sft:\n  sampling:\n    topp: 0.9\n") == \
        "params.yaml: sft.sampling.topp: unknown key (known: max_new_tokens, stop_token, temperature, top_k, top_p)"


def test_integer_out_of_range_message(tmp_path):
    assert load_error(tmp_path, "sft:\n  batch_size: 0\n") == \
        "params.yaml: sft.batch_size: expected an integer >= 1, got 0 (int)"


def test_integer_out_of_range_is_rejected(tmp_path):
    # The range check itself works (only the wording above is off).
    msg = load_error(tmp_path, "sft:\n  batch_size: 0\n")
    assert msg.startswith("params.yaml: sft.batch_size: expected a") and msg.endswith("integer >= 1, got 0 (int)")
    msg = load_error(tmp_path, "data:\n  n_sft: 7\n")
    assert msg.startswith("params.yaml: data.n_sft: ") and msg.endswith(">= 8, got 7 (int)")


def test_top_level_not_a_mapping_message(tmp_path):
    assert load_error(tmp_path, "- 1\n- 2\n") == "params.yaml: expected a mapping of keys, got [1, 2] (list)"


def test_error_names_the_file_by_the_path_it_was_given(tmp_path):
    """As given: a relative path as typed (two recipes of one name in two folders stay apart), an
    absolute one whole."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    path = write_params(folder, "sft:\n  lr: fast\n", name="exp7.yaml")
    for given, named in ((path, str(path)), (Path("recipes/exp7.yaml"), "recipes/exp7.yaml"),
                         (Path("./recipes/exp7.yaml"), "recipes/exp7.yaml")):
        with pytest.raises(ConfigError) as err, contextlib.chdir(tmp_path):
            load_params(given)
        assert str(err.value) == f"{named}: sft.lr: expected a positive float, got 'fast'"
    # A folder name with a colon in it is part of the file's name, not the key.
    (tmp_path / "run:7").mkdir()
    odd = write_params(tmp_path / "run:7", "distributed:\n  num_processes: 2\n")
    with pytest.raises(ConfigError) as err:
        load_params(odd)
    assert str(err.value) == f"{odd}: distributed.backend: several processes need backend: deepspeed"


def test_not_yaml(tmp_path):
    path = write_params(tmp_path, "a: [1, 2")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:1: not valid YAML: ")
    assert "\n" not in msg
    assert isinstance(err.value, UserError)


def test_nesting_depth_is_refused_while_scanning(tmp_path):
    """Block-style nesting one level past MAX_PARAMS_DEPTH is refused at the line that goes too
    deep; at the limit, the file is read (deep nesting is only refused, never truncated)."""
    from pipeline.config import MAX_PARAMS_DEPTH

    def nested(levels: int) -> str:
        return "".join(f"{'  ' * i}k{i}:\n" for i in range(levels - 1)) + f"{'  ' * (levels - 1)}k: 1\n"
    at_limit = write_params(tmp_path, nested(MAX_PARAMS_DEPTH), name="ok.yaml")
    value = read_yaml(at_limit)
    for i in range(MAX_PARAMS_DEPTH - 1):
        value = value[f"k{i}"]
    assert value == {"k": 1}
    with pytest.raises(ConfigError) as err:
        read_yaml(write_params(tmp_path, nested(MAX_PARAMS_DEPTH + 1), name="deep.yaml"))
    assert str(err.value) == (f"{tmp_path / 'deep.yaml'}:{MAX_PARAMS_DEPTH + 1}: not valid YAML: nested deeper than "
                              f"{MAX_PARAMS_DEPTH} levels")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: no such params file"


def test_not_utf8(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_bytes(b"sft:\n  lr: \xff\n")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: invalid UTF-8 at byte 11"


# ---- Values as DVC writes them ------------------------------------------------------------------


def test_unquoted_exponent_is_a_float(tmp_path):
    # `dvc exp run -S sft.lr=3e-05` writes exactly this; PyYAML would return the string '3e-05'.
    p = load_params(write_params(tmp_path, "sft:\n  lr: 3e-05\n  epochs: 2\n"))
    assert p.sft.lr == 3e-05 and type(p.sft.lr) is float
    assert p.sft.epochs == 2.0 and type(p.sft.epochs) is float   # int accepted for a float field
    assert p.sft.batch_size == 32                                # untouched keys keep defaults
    assert p.data == DataConfig() and p.model == ModelConfig()


def test_partial_override_merges_with_defaults(tmp_path):
    p = load_params(write_params(tmp_path, "sft:\n  sampling:\n    top_k: 5\nmodel:\n  arch: gpt2\n"))
    assert p.sft == dataclasses.replace(SFTConfig(), sampling=SamplingConfig(top_k=5))
    assert p.model == ModelConfig(arch="gpt2")


def test_frozen(tmp_path):
    p = load_params(SHIPPED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.sft.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.sft.sampling.top_p = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.data = DataConfig()  # type: ignore[misc]
    assert p.sft.lr == 2e-3


def test_from_dict_where_prefix():
    with pytest.raises(ConfigError) as err:
        from_dict(SamplingConfig, {"top_k": -1}, "x.yaml: sft.sampling")
    msg = str(err.value)  # the article is checked by test_integer_out_of_range_message
    assert msg.startswith("x.yaml: sft.sampling.top_k: expected a") and msg.endswith("integer >= 0, got -1 (int)")
    # A null section is an error, not "the defaults": omitting it or `{}` gives those.
    with pytest.raises(ConfigError, match=r"^x\.yaml: s: is null; omit it, or write \{\}, for the defaults$"):
        from_dict(SamplingConfig, None, "x.yaml: s")
    assert from_dict(SamplingConfig, {}, "x.yaml: s") == SamplingConfig()


def test_flatten():
    nested = {"sft": {"lr": 1e-3, "sampling": {"top_p": 0.9, "top_k": 0}}, "data": {"seed": 1}, "x": None}
    assert flatten(nested) == {"sft.lr": 1e-3, "sft.sampling.top_p": 0.9, "sft.sampling.top_k": 0,
                               "data.seed": 1, "x": None}
    assert flatten({}) == {}
    assert flatten({"a": {}}) == {}
    assert flatten({"a": 1}, prefix="p.") == {"p.a": 1}
    # metrics.json's names
    assert flatten({"eval": {"accuracy": 0.7, "gold": {"gap": 1}}, "n": 2}, sep="/") == \
        {"eval/accuracy": 0.7, "eval/gold/gap": 1, "n": 2}


# ---- The CLI ------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_cli_check_bad_params(tmp_path):
    bad = write_params(tmp_path, "data:\n  seed: 0\nsft:\n  lr: fast\n", name="bad_params.yaml")
    proc = run_cli("check", "--params", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [f"error: {bad}: sft.lr: expected a positive float, got 'fast'"]
    assert proc.stdout == ""


def test_cli_check_missing_file(tmp_path):
    proc = run_cli("check", "--params", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: {tmp_path / 'nope.yaml'}: no such params file"]


def test_cli_check_good_params():
    proc = run_cli("check", "--params", "params.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "params.yaml: ok\n"


# ---- distributed: one top-level section, overridden per stage -----------------------------------


def test_stage_distributed_merges_over_top_level(tmp_path):
    p = load_params(write_params(tmp_path, "distributed:\n  backend: deepspeed\n  zero_stage: 2\n"
                                           "ppo:\n  distributed:\n    zero_stage: 3\n    offload_frozen: true\n"))
    assert p.distributed.zero_stage == 2
    assert (p.sft.distributed.backend, p.sft.distributed.zero_stage) == ("deepspeed", 2)
    assert (p.ppo.distributed.backend, p.ppo.distributed.zero_stage, p.ppo.distributed.offload_frozen) == \
        ("deepspeed", 3, True)
    assert p.reward.distributed == p.sft.distributed


def test_distributed_errors_name_the_key(tmp_path):
    assert load_error(tmp_path, "distributed:\n  zero_stage: 4\n") == \
        "params.yaml: distributed.zero_stage: expected an integer >= 0 and <= 3, got 4 (int)"
    assert load_error(tmp_path, "ppo:\n  distributed:\n    precision: fp8\n") == \
        "params.yaml: ppo.distributed.precision: expected one of 'fp32', 'bf16', 'fp16', got 'fp8'"
    assert load_error(tmp_path, "distributed:\n  num_processes: 2\n") == \
        "params.yaml: distributed.backend: several processes need backend: deepspeed"
    assert load_error(tmp_path, "distributed:\n  backend: deepspeed\n  offload_param: true\n  zero_stage: 2\n") == \
        "params.yaml: distributed.offload_param: needs zero_stage 3, got 2"
    # 3 processes cannot split the global batch of 32 evenly.
    assert load_error(tmp_path, "sft:\n  distributed:\n    backend: deepspeed\n    num_processes: 3\n") == \
        "params.yaml: sft.batch_size: 32 must be divisible by processes x gradient_accumulation_steps = 3"
    assert "ppo.minibatch_size" in load_error(tmp_path, "distributed:\n  backend: deepspeed\n  num_processes: 64\n"
                                                       "sft:\n  batch_size: 64\nreward:\n  batch_size: 64\n")
    assert load_error(tmp_path, "ppo:\n  shared_backbone: true\n  distributed:\n    backend: deepspeed\n").startswith(
        "params.yaml: ppo.shared_backbone: runs with distributed.backend: none")


def test_device_memory_gb_range(tmp_path):
    # The memory plan's device size (GiB per rank): null asks the device; a value must be positive.
    assert load_params(write_params(tmp_path, "{}\n")).distributed.device_memory_gb is None
    assert load_params(write_params(tmp_path, "ppo:\n  distributed:\n    device_memory_gb: 80\n")
                       ).ppo.distributed.device_memory_gb == 80.0
    assert load_error(tmp_path, "distributed:\n  device_memory_gb: 0\n") == \
        "params.yaml: distributed.device_memory_gb: expected a float > 0.0 and <= 1000000.0, got 0.0 (float)"
    assert load_error(tmp_path, "sft:\n  distributed:\n    device_memory_gb: -1.5\n") == \
        "params.yaml: sft.distributed.device_memory_gb: expected a float > 0.0 and <= 1000000.0, got -1.5 (float)"


def test_ppo_logprob_settings(tmp_path):
    # recompute_logprobs: auto (default), and the booleans params.yaml / dvc exp run -S users pass.
    assert load_params(write_params(tmp_path, "{}\n")).ppo.recompute_logprobs == "auto"
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        p = load_params(write_params(tmp_path, f"ppo:\n  recompute_logprobs: {text}\n"))
        assert p.ppo.recompute_logprobs is value or p.ppo.recompute_logprobs == value
    assert load_params(write_params(tmp_path, "ppo:\n  tis_cap: 2\n")).ppo.tis_cap == 2.0
    assert load_error(tmp_path, "ppo:\n  tis_cap: 1.0\n") == \
        "params.yaml: ppo.tis_cap: expected a float > 1.0, got 1.0 (float)"
    assert load_error(tmp_path, "ppo:\n  logprob_check_rows: 0\n") == \
        "params.yaml: ppo.logprob_check_rows: expected an integer >= 1, got 0 (int)"
    # 1 == True slips through a Literal check; only YAML's booleans and `auto` are accepted.
    assert load_error(tmp_path, "ppo:\n  recompute_logprobs: 1\n") == \
        "params.yaml: ppo.recompute_logprobs: expected auto, true or false, got 1"
    assert load_error(tmp_path, "ppo:\n  recompute_logprobs: always\n").startswith(
        "params.yaml: ppo.recompute_logprobs: expected one of 'auto', True, False, got 'always'")
    # TIS weights pi_old / pi_sampler: identically 1 when pi_old is the sampler's.
    assert load_error(tmp_path, "ppo:\n  tis_cap: 2.0\n  recompute_logprobs: false\n").startswith(
        "params.yaml: ppo.tis_cap: 2.0 weights tokens by pi_old / pi_sampler")



def test_sampling_calls_are_sized_by_rows_or_by_tokens_never_both(tmp_path):
    """rollout_max_tokens (null by default) sizes the sampling calls by tokens; grpo inherits it;
    beside rollout_micro_batch_size it is refused, naming both keys."""
    assert load_params(write_params(tmp_path, "{}\n")).ppo.rollout_max_tokens is None
    text = "ppo:\n  rollout_max_tokens: 4096\ngrpo:\n  rollout_max_tokens: 512\n"
    p = load_params(write_params(tmp_path, text))
    assert (p.ppo.rollout_max_tokens, p.grpo.rollout_max_tokens) == (4096, 512)
    assert load_error(tmp_path, "ppo:\n  rollout_max_tokens: 0\n") == \
        "params.yaml: ppo.rollout_max_tokens: expected an integer >= 1, got 0 (int)"
    for section in ("ppo", "grpo"):
        text = f"{section}:\n  rollout_max_tokens: 512\n  rollout_micro_batch_size: 8\n"
        assert load_error(tmp_path, text) == (
            f"params.yaml: {section}.rollout_max_tokens: 512 and {section}.rollout_micro_batch_size: 8 both "
            "size the sampling calls; set one (rollout_micro_batch_size: 0 or rollout_max_tokens: null)")

# ---- The prompts section ------------------------------------------------------------------------


def test_the_removed_dtype_key_is_refused_by_name(tmp_path):
    """A params file written for the old `model.dtype` is told why the key went, not silently read."""
    message = load_error(tmp_path, "model:\n  dtype: bfloat16\n")
    assert message.startswith("params.yaml: model.dtype: no longer a key: a model loads in the dtype its role needs")
    assert message.endswith("delete the key")


def test_moved_keys_name_their_new_place(tmp_path):
    for section in ("ppo", "grpo"):
        message = load_error(tmp_path, f"{section}:\n  dataset:\n    path: prompts.jsonl\n")
        assert message == (f"params.yaml: {section}.dataset: moved to prompts.dataset; write it there "
                           "(the old key is not read)")


def test_gold_judge_is_an_explicit_switch_refused_with_own_data(tmp_path):
    from pipeline.data import inputs
    assert inputs.judge(Params()) is not None                          # the default task's data: on
    for key in ("sft", "reward", "prompts"):
        text = f"{key}:\n  dataset:\n    path: mine.jsonl\n"
        assert load_error(tmp_path, text) == (
            f"params.yaml: prompts.gold_judge: the default task's gold annotator judges the default task's own "
            f"data only, and {key}.dataset.path is set; set prompts.gold_judge: false")
        own = load_params(write_params(tmp_path, text + "prompts:\n  gold_judge: false\n"
                                       if key != "prompts" else text + "  gold_judge: false\n"))
        assert inputs.judge(own) is None and getattr(own, key).dataset.path == "mine.jsonl"
    # Off by choice on the default task: no gold metrics, nothing refused.
    assert inputs.judge(load_params(write_params(tmp_path, "prompts:\n  gold_judge: false\n"))) is None


def test_grpo_errors_name_grpo_keys(tmp_path):
    """The grpo stage runs PPO's code from its own section: every error names `grpo.*`."""
    from pipeline.data import inputs
    from pipeline.models.reward_source import FunctionSource
    message = load_error(tmp_path, "grpo:\n  reward_source: no_such_module_xyz:f\n")
    assert message.startswith("params.yaml: grpo.reward_source: cannot import module 'no_such_module_xyz'")
    with pytest.raises(ConfigError, match=r"^grpo.reward_source: 'pipeline.tasks.reviews:gold_scores' failed on a probe"):
        FunctionSource("pipeline.tasks.reviews:gold_scores", probe=(None, None), key="grpo.reward_source")  # type: ignore[arg-type]
    message = load_error(tmp_path, "grpo:\n  detector:\n    action: stop\n  save_every: 20\n")
    assert "grpo.detector.action" in message and "grpo.save_every=20" in message and "ppo." not in message

    class Tok:   # whitespace tokens, no chat template: a prompt's length is its word count
        chat_template = None
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text.split())))}
    with pytest.raises(UserError, match=r"^p:1: \d+ tokens exceed grpo.max_prompt_length=4"):
        inputs.fit_prompts([("p:1", "one two three four five six seven")], Tok(), 4, "error", "grpo.max_prompt_length")
