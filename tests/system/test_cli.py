"""The command line as a user meets it: help and defaults, `--version`, `recipe --list`, progress
in logs (plain lines, no carriage-return frames), and no DeepSpeed accelerator notice on CPU."""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tomllib

import pytest

from conftest import BIN, REPO, run, run_env
from pipeline.__main__ import _parser, commands, main
from pipeline.progress import Progress, track


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_option_has_help_and_says_its_default():
    subs = _subparsers()
    assert set(subs) == set(commands())
    for name, sub in subs.items():
        text = sub.format_help().split("\noptions:\n")[1]
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, (name, action.option_strings)
            if action.nargs == 0:    # a flag (--list, --no-progress): off unless given
                continue
            # The option's entry in the help text, up to the next option.
            entry = re.search(r"^  " + re.escape(action.option_strings[-1]) + r"\b(.*?)(?=\n  -|\Z)", text, re.S | re.M)
            assert entry and "default" in entry.group(1), (name, action.option_strings, text)
    sft = " ".join(subs["sft"].format_help().split())     # argparse wraps lines
    for option, default in (("--data DATA", "data/prepared"), ("--out OUT", "outputs/sft"),
                            ("--params PARAMS", "params.yaml")):
        assert re.search(re.escape(option) + r" [^-]*\(default: " + re.escape(default) + r"\)", sft), option
    ppo = " ".join(subs["ppo"].format_help().split())
    assert ("--sft SFT the supervised fine-tuned (SFT) policy checkpoint (a Hugging Face model folder) "
            "(default: outputs/sft/model)") in ppo
    assert "--reward REWARD the reward model checkpoint (a Hugging Face model folder) (default: outputs/reward/model)" in ppo


def test_help_from_the_command_line():
    out = run([sys.executable, "-m", "pipeline", "evaluate", "--help"], REPO).stdout
    flat = " ".join(out.split())
    assert flat.startswith("usage: python -m pipeline evaluate")
    assert "--ppo PPO the PPO policy checkpoint (a Hugging Face model folder) (default: outputs/ppo/model)" in flat
    assert "(default: outputs/evaluate)" in flat


def test_version_is_the_installed_package_version():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proc = run([sys.executable, "-m", "pipeline", "--version"], REPO)
    assert proc.stdout == f"python -m pipeline {version}\n"


def test_help_and_version_name_the_command_as_it_was_invoked():
    """The console script, bin/pipeline and `python -m pipeline` each call themselves by the name
    the user typed, and the description is whole sentences."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    env = {k: v for k, v in run_env().items() if k != "PIPELINE_PROG"}
    for argv, name in (([str(BIN / "rlhf-pipeline")], "rlhf-pipeline"), (["bin/pipeline"], "bin/pipeline"),
                       ([sys.executable, "-m", "pipeline"], "python -m pipeline")):
        assert run([*argv, "--version"], REPO, env=env).stdout == f"{name} {version}\n"
        out = run([*argv, "--help"], REPO, env=env).stdout
        assert out.startswith(f"usage: {name} [-h]"), out
        description = " ".join(out.split("\n\n")[1].split())
        assert description.startswith(f"{name} <command> --params params.yaml ...: the one entry point")
        assert description.endswith("and exits with status 2.") and "installed as" not in description
        assert f"`{name} <command> --help` lists a command's options." in out
        assert run([*argv, "check", "--help"], REPO, env=env).stdout.startswith(f"usage: {name} check ")


def test_global_options_are_taken_after_the_command_too(monkeypatch):
    monkeypatch.delenv("PIPELINE_LOG_LEVEL", raising=False)
    parse = _parser().parse_args
    assert (parse(["check", "-v"]).verbose_after, parse(["check", "-v"]).verbose) == (1, 0)
    both = parse(["-v", "check", "-v", "--params", "p.yaml"])
    assert both.verbose + both.verbose_after == 2 and str(both.params) == "p.yaml"
    assert parse(["check", "--log-level", "debug"]).log_level == "DEBUG"
    assert parse(["--log-level", "info", "check"]).log_level == "INFO"      # not reset by the command's
    assert parse(["--log-level", "info", "check", "--log-level", "error"]).log_level == "ERROR"   # the last
    proc = run([str(BIN / "rlhf-pipeline"), "check", "-v", "--params", str(REPO / "params.yaml")], REPO)
    assert proc.returncode == 0 and proc.stdout.endswith("params.yaml: ok\n")
    version = run([str(BIN / "rlhf-pipeline"), "check", "--version"], REPO).stdout
    assert version.startswith("rlhf-pipeline check ")


def test_recipe_list_names_each_recipe_with_its_first_comment_line(capsys):
    assert main(["recipe", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    files = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(lines) == len(files) >= 2
    for line, path in zip(lines, files):
        first = next(li for li in path.read_text().splitlines() if li.startswith("#")).lstrip("# ").strip()
        name, description = line.split(None, 1)
        assert (name, description) == (path.stem, first)
    assert lines[3].startswith("tldr-pythia-1b ") and "TL;DR summarisation with Pythia 1B" in lines[3]
    assert lines[2].startswith("hub-rehearsal ") and "checkpoint packaged as hub ones are" in lines[2]
    assert lines[0].startswith("demo ") and "A first look in minutes" in lines[0]
    # Neither a name nor --list: one line saying what to give.
    assert main(["recipe"]) == 2
    assert capsys.readouterr().err == "error: recipe: name a recipe (python -m pipeline recipe --list shows them)\n"


# ---- progress ---------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_is_a_line_every_five_percent():
    log = io.StringIO()
    for _ in track(range(1000), 1000, "sft", stream=log):
        pass
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and len(lines) == 20
    assert [int(re.match(r"sft: (\d+)/1000 steps \((\d+)%\)", li).group(1)) for li in lines] == \
        list(range(50, 1001, 50))
    assert lines[9].startswith("sft: 500/1000 steps (50%), ") and " elapsed, ~" in lines[9] and "left" in lines[9]
    assert lines[-1].startswith("sft: 1000/1000 steps (100%), ") and "left" not in lines[-1]


def test_progress_lines_carry_the_postfix_and_resume_where_the_run_was():
    log = io.StringIO()
    bar = Progress(40, "ppo", unit="iterations", initial=30, stream=log)
    for i in range(10):
        bar.update(1, {"score": f"{i:.2f}", "kl": "0.10", "gold": "1.50", "detector": "ok"})
    bar.close()
    lines = log.getvalue().splitlines()
    # Resumed at 75%: a line at 80, 85, 90, 95 and 100%.
    assert [li.split(",")[0] for li in lines] == [f"ppo: {n}/40 iterations ({100 * n // 40}%)" for n in (32, 34, 36, 38, 40)]
    assert lines[-1].endswith("; score=9.00 kl=0.10 gold=1.50 detector=ok")
    # A short loop: a line per step, the last at 100%.
    log = io.StringIO()
    list(track(range(3), 3, "reward", stream=log))
    assert log.getvalue().splitlines()[-1].startswith("reward: 3/3 steps (100%)") and len(log.getvalue().splitlines()) == 3


def test_progress_on_a_terminal_is_a_bar_and_disabled_is_silent():
    tty = _Terminal()
    list(track(range(50), 50, "sft", stream=tty))
    assert "\r" in tty.getvalue() and "50/50" in tty.getvalue()      # tqdm's frames
    quiet = io.StringIO()
    list(track(range(50), 50, "sft", stream=quiet, enabled=False))
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError, match="every must be a percentage"):
        Progress(10, "x", every=0)


# ---- DeepSpeed on CPU -------------------------------------------------------------------------

NOTICE = "Setting accelerator to CPU"


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_deepspeed_cpu_notice_is_silenced_and_other_warnings_are_not():
    # Without a GPU a plain import prints the notice (so the check below can fail here) ...
    import torch
    assert (NOTICE in _python("import deepspeed")) == (not torch.cuda.is_available())
    # ... the pipeline's import (distributed.init, engines) does not, and DeepSpeed's logger still warns.
    out = _python("from pipeline.training.distributed import import_deepspeed\n"
                  "from pipeline.training.engines import deepspeed_config, validate_deepspeed_config\n"
                  "from pipeline.config import DistributedConfig\n"
                  "import_deepspeed()\n"
                  "validate_deepspeed_config(deepspeed_config(DistributedConfig(backend='deepspeed', zero_stage=2),"
                  " world_size=1, micro_batch_size=2, accumulation_steps=1, max_grad_norm=1.0, lr=1e-3,"
                  " weight_decay=0.0), 1)\n"
                  "from deepspeed.utils import logger\n"
                  "logger.warning('still shown')\n")
    assert NOTICE not in out and "still shown" in out


def test_commands_that_build_no_model_import_no_model_library(tmp_path):
    """The CLI's parser, `check`, and a stage command that only launches its processes read the
    stage registry and the params and import neither transformers nor DeepSpeed (seconds per process
    at every Snakemake job, launch and check); the launched copies load them to build models."""
    from conftest import TINY, merge, write_params
    params = tmp_path / "params.yaml"
    write_params(params, merge(TINY, {"distributed": {"backend": "deepspeed", "num_processes": 2}}))
    out = _python(
        "import sys\n"
        "from pipeline import __main__ as cli\n"
        "from pipeline.training import stopping\n"
        "def launch(cmd):\n"
        "    loaded = sorted(m for m in ('transformers', 'deepspeed', 'peft', 'mlflow') if m in sys.modules)\n"
        "    print('launching', cmd[0].rsplit('/', 1)[-1], 'with', loaded)\n"
        "    return 0\n"
        "stopping.launch = launch\n"
        f"assert cli.main(['check', '--params', {str(params)!r}]) == 0\n"
        f"assert cli.main(['sft', '--params', {str(params)!r}, '--out', {str(tmp_path / 'sft')!r}]) == 0\n")
    assert "params.yaml: ok" in out and "launching torchrun with []" in out, out
    assert not (tmp_path / "sft").exists()


def test_log_level_from_flags_and_environment(monkeypatch, capsys):
    import logging
    from pipeline.__main__ import configure_logging
    logger = logging.getLogger("pipeline")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logger.level)
    monkeypatch.delenv("PIPELINE_LOG_LEVEL", raising=False)
    configure_logging(None, 0)
    assert logger.level == logging.WARNING
    logging.getLogger("pipeline.tracking.mlflow_sink").info("hidden")
    configure_logging(None, 1)
    assert logger.level == logging.INFO and os.environ["PIPELINE_LOG_LEVEL"] == "INFO"   # the launched copies inherit it
    logging.getLogger("pipeline.tracking.mlflow_sink").info("MLflow: registered x")
    configure_logging("DEBUG", 0)
    assert logger.level == logging.DEBUG and len(logger.handlers) == 1
    err = capsys.readouterr().err
    assert "MLflow: registered x" in err and "hidden" not in err
    # Each line says when and how serious, in logging's own format: `2026-12-06 14:03:59 INFO ...`.
    (line,) = err.splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO MLflow: registered x", line), line
    logging.getLogger("pipeline.stages.ppo").warning("ppo: resuming from x at iteration 2")
    assert re.fullmatch(r"\S+ \S+ WARNING ppo: resuming from x at iteration 2\n", capsys.readouterr().err)


def test_results_go_to_stdout_bare_and_the_log_to_stderr(capsys, monkeypatch):
    """A command's printed result stays clean for a pipe (`... headline | grep`) at any log level."""
    import logging
    logger = logging.getLogger("pipeline")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logger.level)
    assert main(["--log-level", "debug", "headline", "--outputs", str(REPO / "outputs")]) == 0
    logging.getLogger("pipeline.x").info("a log line")
    out = capsys.readouterr()
    assert out.out.splitlines()[1].startswith("verdict: ") and "INFO" not in out.out
    assert out.err.endswith(" INFO a log line\n")


def test_console_command_is_the_module_entry_point():
    proc = subprocess.run([str(BIN / "rlhf-pipeline"), "--log-level", "info", "check", "--params",
                           str(REPO / "params.yaml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    bad = subprocess.run([str(BIN / "rlhf-pipeline"), "--log-level", "LOUD", "check"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'LOUD'" in bad.stderr


def test_headline_names_the_run_folder_within_its_width(tmp_path, monkeypatch):
    """The headline's first line names the outputs folder: relative inside the working directory,
    under ~ in the home folder, and cut to its last parts when a long checkout path would pass 99
    columns."""
    from pipeline.measurement.headline import WIDTH, shown
    deep = tmp_path.joinpath(*(["a-folder-name-as-long-as-a-users-project-folders"] * 4), "outputs")
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep.parent)
    assert shown(deep) == "outputs"
    monkeypatch.chdir(tmp_path.parent)
    cut = shown(deep)
    assert len(f"run in {cut}/") <= WIDTH and cut.startswith("...") and cut.endswith(
        "a-folder-name-as-long-as-a-users-project-folders/outputs")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert shown(tmp_path / "x" / "outputs") == "~/x/outputs"


def test_headline_of_the_committed_run_fits_100_columns_and_states_its_numbers(tmp_path, capsys):
    import json
    assert main(["headline", "--outputs", str(REPO / "outputs")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert max(map(len, out)) < 100 and out[1].startswith("verdict: ")
    ev = json.loads((REPO / "outputs/evaluate/metrics.json").read_text())
    win = ev["win_rate"]
    gold = next(line for line in out if line.strip().startswith("by the gold annotator"))
    assert gold.split()[4:] == [f"{win['ppo_vs_sft_gold']:.1%}",
                                f"{win['ppo_vs_sft_gold_low']:.1%}-{win['ppo_vs_sft_gold_high']:.1%}"]
    ppo = next(line for line in out if line.strip().startswith("ppo "))
    assert ppo.split()[1] == f"{ev['ppo']['gold']:.2f}" and ppo.split()[7] == f"{ev['ppo']['kl']:.2f}"
    assert [line.split()[0] for line in out if line.startswith("  ") and "±" in line][0] == "sft"
    assert main(["headline", "--outputs", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith("evaluate/metrics.json: no such file (run the pipeline first: make pipeline)")
