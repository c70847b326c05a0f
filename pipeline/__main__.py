"""`python -m pipeline <stage> --params params.yaml ...` (installed as the `rlhf-pipeline`
command too): the one entry point of every stage.

The params file is loaded and validated in full before any stage starts computing. User errors
(bad params, bad data, a wrong checkpoint) print one line naming the file and key or line, and exit
with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import logging
import os
import signal
import sys
from pathlib import Path

from .training import stopping

if __name__ == "__main__":   # before the imports below, which take seconds (training/stopping.py)
    stopping.while_starting()

from .training import distributed   # noqa: E402 (the signals above come first)
from .config import check_process_shape
from .errors import ConfigError, DataError, Stopped, UserError
from .stages import registry
from .stages.spec import default_path


# The commands that are not stages: name -> (help, default paths). The stages come from the registry
# (pipeline/stages/registry.py): each stage module's SPEC gives its help, input folders and options.
TOOLS: dict[str, tuple[str, dict[str, str]]] = {
    "frontier": ("plot gold and RM score against KL across DVC experiments", {"out": "outputs/frontier.png"}),
    "headline": ("print a finished run's headline in under 100 columns: verdict, win rates with their "
                 "intervals, gold, RM score and KL per policy, RM accuracy, stage times", {"outputs": "outputs"}),
    "check": ("validate the params file (and with --data the inputs every stage reads) and exit", {}),
    "recipe": ("merge recipes/<name>.yaml into the params file (validated first)", {}),
    "plan": ("print each stage's memory plan per rank against the device, and refuse one that does not fit",
             {"data": default_path("data")}),
    "recover-lock": ("set aside a dvc.lock that a kill cut short (DVC rewrites it in place), so dvc repro "
                     "can run again", {}),
    "detect": ("replay the over-optimisation detector (params' ppo.detector) over a PPO train.tsv", {}),
}


def commands() -> dict[str, tuple[str, dict[str, str]]]:
    """Every command: the stages in pipeline order, then the tools."""
    stages = {name: (spec.help, {**{f: default_path(f) for f in spec.inputs}, "out": spec.output})
              for name, spec in registry.specs().items()}
    return {**stages, **TOOLS}


def read_tsv(path: Path) -> list[dict[str, str]]:
    """A step log's rows as dicts of strings (the detector converts what it reads)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f, delimiter="\t"))
    except FileNotFoundError:
        raise DataError(f"{path}: no such step log (run the ppo stage first)") from None


def check_inputs(params, data_dir: Path) -> None:
    """Read every input the stages read, through the same loaders and checks they run before their
    first step (records, schemas, leakage, pairs, stats.json), without building a model: each
    stage's own `check_inputs` (its SPEC's)."""
    for spec in registry.specs().values():
        if spec.check_inputs is not None:
            spec.check_inputs(params, data_dir)


# What the tools' path options name; a stage's input folder is the model its stage declares (or
# the prepared data), its --out its SPEC's `out_help`. Defaults are the paths dvc.yaml passes.
PATH_HELP = {
    "data": "the prepared data folder (what the prepare stage writes)",
    "outputs": "the folder holding the stages' output folders (sft/, reward/, ppo/, evaluate/)",
}
TOOL_OUT_HELP = {"frontier": "the figure to write (a table of the points is printed)"}


def path_help(name: str, specs: dict) -> str:
    """An option's help: a tool's path, or the checkpoint of the stage of that name."""
    model = specs[name].model if name in specs else None
    if name in PATH_HELP or model is None:
        return PATH_HELP.get(name, f"the {name} stage's checkpoint (a Hugging Face model folder)")
    return f"{model.what} checkpoint (a Hugging Face model folder)"


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, once `pip install -e .` has run)."""
    try:
        return importlib.metadata.version("rlhf-pipeline")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (the package is not installed: pip install -e .)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default; flags (default off) and options whose default
    is "none given" (None) say in their help what happens without them instead."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


# The console script pyproject.toml installs; bin/pipeline names itself in PIPELINE_PROG.
CONSOLE_SCRIPT = "rlhf-pipeline"
DESCRIPTION = ("%(prog)s <command> --params params.yaml ...: the one entry point of every stage of the "
               "pipeline and of its tools. The params file is validated in full before anything runs; a user "
               "error prints one line naming the file and the key or line, and exits with status 2.")


def program() -> str:
    """The command as the user invoked it, for usage lines and --version: the console script
    (`rlhf-pipeline`), bin/pipeline as typed (it runs `python -m pipeline` and says how it was
    called in PIPELINE_PROG), else `python -m pipeline`."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if name == CONSOLE_SCRIPT:
        return name
    if name == "__main__.py" and os.environ.get("PIPELINE_PROG"):
        return os.environ["PIPELINE_PROG"]
    return "python -m pipeline"


def _global_options(p: argparse.ArgumentParser, after_command: bool) -> None:
    """--version, -v and --log-level, accepted before the command and after it (`rlhf-pipeline
    check -v`). After it they keep defaults of their own: argparse copies every value a command's
    parser sets over the top-level one, so -v counts there separately (`verbose_after`, added up
    in `main`) and --log-level is set only when given."""
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                   help="print the package version and exit")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   dest="verbose_after" if after_command else "verbose",
                   help="more of the pipeline's log: -v its INFO messages, -vv DEBUG (default: warnings "
                        "only)")
    p.add_argument("--log-level",
                   default=argparse.SUPPRESS if after_command else os.environ.get("PIPELINE_LOG_LEVEL"),
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper,
                   help="the pipeline's log level, overriding -v (default: $PIPELINE_LOG_LEVEL, which dvc "
                        "repro and snakemake pass to the stages, else WARNING)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=program(), description=DESCRIPTION,
                                 epilog="`%(prog)s <command> --help` lists a command's options.",
                                 formatter_class=_HelpFormatter)
    _global_options(ap, after_command=False)
    sub = ap.add_subparsers(dest="stage", required=True, metavar="command")
    specs = registry.specs()
    stages_planned = [n for n, s in specs.items() if s.plan is not None]
    for stage, (help_text, paths) in commands().items():
        p = sub.add_parser(stage, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        _global_options(p, after_command=True)
        for name, default in paths.items():
            what = (specs[stage].out_help if stage in specs else TOOL_OUT_HELP[stage]) if name == "out" \
                else path_help(name, specs)
            p.add_argument(f"--{name}", type=Path, default=Path(default), help=what)
        spec = specs.get(stage)
        if stage not in ("frontier", "recover-lock", "headline"):
            p.add_argument("--params", type=Path, default=Path("params.yaml"),
                           help="the params file, validated in full before anything runs")
            p.add_argument("--no-progress", action="store_true",
                           help="no progress bar on a terminal, no progress lines in a log (the training "
                                "stages show them; default: shown)")
        if stage == "check":
            p.add_argument("--data", type=Path, default=None,
                           help="also read and validate every input the stages read from this prepared folder "
                                "(and the datasets params name), as they do before training (default: the params "
                                "file only)")
        if stage == "plan":
            p.add_argument("--stage", dest="plan_stage", choices=stages_planned, default=None,
                           help="only this stage (default: all)")
        if spec is not None and spec.add_options is not None:
            spec.add_options(p)
        if stage == "recover-lock":
            p.add_argument("--lock", type=Path, default=Path("dvc.lock"), help="the lock file to check")
        if stage == "detect":
            p.add_argument("train_tsv", type=Path, help="a PPO step log, e.g. outputs/ppo/train.tsv")
        if stage == "recipe":
            p.add_argument("name", nargs="?", default=None, help="a file of recipes/ without .yaml")
            p.add_argument("--list", action="store_true", help="list the recipes with their first comment line and exit")
            p.add_argument("--out", type=Path, default=None, help="where to write (default: the params file)")
        if spec is not None and spec.distributed:
            # Per node on a cluster (the params file is shared): e.g. --node-rank $SLURM_NODEID.
            p.add_argument("--node-rank", type=int, default=None,
                           help="override distributed.node_rank (default: params', or SLURM_NODEID in a "
                                "multi-node SLURM job)")
            p.add_argument("--master-addr", default=None,
                           help="override distributed.master_addr (default: params', or the job's first node "
                                "in a multi-node SLURM job)")
    return ap


def quiet_libraries() -> None:
    """Library output that is noise in a stage's log: DeepSpeed's CPU-fallback notice (whoever
    imports it), and, when stderr is not a terminal, transformers' own progress bars (loading and
    saving weights) and MLflow's (copying a logged model's files), whose carriage-return frames pile
    up in a log file as ours would."""
    distributed.silence_cpu_fallback_notice()
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # copying a model's files
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()


LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def configure_logging(level: str | None, verbose: int) -> None:
    """The `pipeline.*` loggers at `level` (or by -v count), one line per record on stderr; the
    libraries' loggers keep their own levels. The launched copies of a multi-process stage inherit
    it through PIPELINE_LOG_LEVEL. Python's own fallback printed only warnings, and INFO was lost."""
    name = level or ("DEBUG" if verbose >= 2 else "INFO" if verbose == 1 else "WARNING")
    logger = logging.getLogger("pipeline")
    logger.setLevel(name)
    if not any(getattr(h, "_pipeline", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        # A time and a level on every line (the messages name their stage); a log of hours is read
        # by when things happened. Only stderr: the results a command prints on stdout stay bare.
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_TIME_FORMAT))
        handler._pipeline = True
        logger.addHandler(handler)
        logger.propagate = False
    os.environ["PIPELINE_LOG_LEVEL"] = name


def run_tool(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The commands that are not stages."""
    if args.stage == "headline":
        from .measurement import headline
        default = tuple(name for name, spec in registry.specs().items() if spec.pipeline == "default")
        print("\n".join(headline.lines(args.outputs, default)))
        return 0
    if args.stage == "recover-lock":
        from .workflow import lockfile
        print(lockfile.recover(args.lock))
        return 0
    if args.stage == "recipe":
        from .workflow import recipes
        if args.list:
            names = recipes.names()
            width = max(map(len, names), default=0)
            for name in names:
                print(f"{name:<{width}}  {recipes.describe(name)}")
            return 0
        if args.name is None:
            raise ConfigError(f"recipe: name a recipe ({program()} recipe --list shows them)")
        out = args.out or args.params
        written = recipes.apply(args.name, args.params, out, registry.shape_checked("load"),
                                registry.cluster_checked(), registry.registered())
        print(f"recipe {args.name}: wrote {' and '.join(map(str, written))}")
        return 0
    params = registry.load_params(args.params)
    if args.stage == "detect":
        from .ppo import detector
        print(detector.summary(read_tsv(args.train_tsv), params.ppo.detector))
        return 0
    if args.stage == "plan":
        from .training import memory_plan
        plans = {n: s.plan for n, s in registry.specs().items() if s.plan is not None}
        return memory_plan.main(params, args.data, {args.plan_stage: plans[args.plan_stage]} if args.plan_stage else plans)
    if args.data is not None:   # check
        check_inputs(params, args.data)
    print(f"{args.params}: ok" + (f"; {args.data}: ok" if args.data is not None else ""))
    return 0


def run_stage(args: argparse.Namespace, argv: list[str] | None) -> int:
    """A stage: its params checked, launched on its processes when it has several, then its
    module's `run(params, *folders, out, progress=..., **options)` and its console summary."""
    spec = registry.spec(args.stage)
    # The warning signal of a time limit (SLURM's --signal) never kills a stage: a training stage
    # handles it (stops after its step, training/stopping.py), the others go on to their end.
    signal.signal(stopping.warning_signal(), signal.SIG_IGN)
    params = registry.load_params(args.params)
    if spec.distributed:
        node_rank, master_addr = args.node_rank, args.master_addr
        if node_rank is None and getattr(params, args.stage).distributed.num_nodes > 1:
            # One copy per node of a SLURM job (see pipeline/workflow/cluster.py): rank and master from SLURM.
            from .workflow.cluster import slurm_node
            node_rank, slurm_master = slurm_node()
            master_addr = master_addr or slurm_master
        params = distributed.with_node(params, args.stage, node_rank, master_addr)
        if spec.shape == "start":   # before launching: the method's batches against its processes
            check_process_shape(params, args.stage)
        dist = getattr(params, args.stage).distributed
        if distributed.needs_launch(dist):
            # Re-run this very command under the launcher, one copy per process.
            cmd = distributed.launch_command(dist, sys.argv[1:] if argv is None else argv)
            print(f"{args.stage}: launching {dist.world_size} processes: {' '.join(cmd)}", flush=True)
            return stopping.launch(cmd)   # forwards a stop signal to the processes (training/stopping.py)
    out = args.out
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise DataError(f"{out}: --out names an existing file; the {args.stage} stage writes a folder there")
    quiet_libraries()   # here, not before a launch: a launching command loads no library that prints
    module = registry.module(args.stage)   # this stage's code only
    folders = {name: getattr(args, name) for name in spec.inputs}   # --data, --sft, ... as declared
    options = {k: v for k, v in vars(args).items() if k not in _COMMON and k not in folders}
    metrics = module.run(params, *folders.values(), out, progress=not args.no_progress, **options)
    if not metrics:   # ranks other than 0 of a multi-process run
        return 0
    print("\n".join(spec.console(metrics, {**folders, "out": out})))
    return 0


# Arguments every stage command has, which are not the stage's own options.
_COMMON = {"stage", "verbose", "verbose_after", "log_level", "out", "params", "no_progress", "node_rank",
           "master_addr"}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, args.verbose + args.verbose_after)
    if args.stage == "frontier":
        from .measurement import frontier
        frontier.main(args.out)
        return 0
    try:
        return run_tool(args, argv) if args.stage in TOOLS else run_stage(args, argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Stopped as err:   # a signal stopped a training stage after saving its checkpoint
        print(str(err), file=sys.stderr)
        return stopping.EXIT_STOPPED


if __name__ == "__main__":
    code = main()
    # A rank of a launched group ends without the interpreter's finalization (why: end_process).
    # The module is loaded only where a stage ran in a group.
    launched = sys.modules.get("pipeline.training.distributed")
    if launched is not None:
        launched.end_process(code)
    sys.exit(code)
