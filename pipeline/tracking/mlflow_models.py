"""MLflow models of a stage's checkpoint: the policies in the transformers flavour, the reward model as
a pyfunc that applies its normalisation offset; each logged as a model of the stage's run and
registered as a new version of its registered model, which the stage declares (its SPEC's `model`,
tracking/model_card.py `ModelFacts`): e.g. sft -> rlhf-sft-policy, ppo -> rlhf-policy (transformers,
text-generation, with its tokenizer), reward -> rlhf-reward-model (pyfunc: a DataFrame of prompt,
response -> normalised scores).

The names match the DVC artifacts of dvc.yaml, so a model has one name in both registries.

Why a model is saved from the stage's finished `model/` folder and not from the object in memory:
that folder is the checkpoint DVC caches and evaluate reads, so the registered version is exactly
it (whatever engine, adapter or sharding trained it), and the logging can't disturb training state.

Each model carries its environment pinned to the versions that wrote it (`mlflow models serve`
and `mlflow.pyfunc.spark_udf` build it from requirements.txt; an unpinned `transformers` would be
whatever release is newest that day), and the reward model's pyfunc carries, as code, only the part
of the `pipeline` package its scoring imports. A logged model is listed among its run's outputs, as
MLflow's own `Model.log` lists it.

`PIPELINE_LOG_MODELS=off` keeps MLflow runs without models (a 7B policy is 14 GB per version).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import mlflow.pyfunc
import pandas as pd

from ..errors import ConfigError
from .model_card import ModelFacts

log = logging.getLogger(__name__)

# What a loader needs, by distribution name, pinned by `pinned` to the installed versions: declared
# here, since inferring them would load the model in a subprocess (mlflow's requirement inference),
# seconds to minutes per stage for nothing. transformers loads through huggingface_hub and reads
# the weights with safetensors, the tokenizer with tokenizers; numpy is what torch's and pandas'
# builds were made against.
POLICY_NEEDS = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy")
# The reward model's pyfunc imports pandas (its input) and the vendored pipeline modules, whose
# pipeline/config.py reads YAML with ruamel (the checkpoint loader imports the config's classes).
REWARD_NEEDS = (*POLICY_NEEDS, "pandas", "ruamel.yaml")
PACKAGE = Path(__file__).resolve().parents[1]      # the `pipeline` package; the RM's model carries part of it


def enabled() -> bool:
    value = (os.environ.get("PIPELINE_LOG_MODELS") or "on").strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"environment variable PIPELINE_LOG_MODELS: expected 'on' or 'off', got {value!r}")
    return value == "on"


def pinned(names: tuple[str, ...]) -> list[str]:
    """`name==version` of each installed distribution. A local version label (torch's `+cpu`,
    `+cu128`) is dropped: PyPI serves no such file, and `==2.13.0` admits every local build of
    2.13.0, so a GPU host installs its own."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in names]


def vendored(dest: Path) -> Path:
    """The modules of the `pipeline` package the reward model's pyfunc can import, copied to
    `dest/pipeline` (with its package folders): this module and every project module it imports,
    at any depth and inside functions too (found by reading their imports, as DVC's code deps are;
    pipeline/workflow/code_deps.py). The rest of the package (the stages, PPO, the training loops)
    has nothing to do with scoring. The folder to give MLflow as code."""
    from ..workflow.code_deps import imports
    root = PACKAGE.parent
    todo, seen = {Path(__file__).resolve()}, set()
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo |= imports(root, f) - seen
    for f in seen:
        target = dest / f.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    return dest / PACKAGE.name


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Warnings true of every model this pipeline logs, that say nothing the user can act on:
    mlflow.transformers finds no hub model card or licence for a local folder, and mlflow.pyfunc
    says the RM's predict has no type hints (deliberately: MLflow would read them as a schema) and
    that a Python object is pickled (the class is the pipeline's own, its module carried as code)."""
    loggers = [logging.getLogger(name) for name in ("mlflow.transformers", "mlflow.pyfunc")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def save_policy(model_dir: Path, dest: Path) -> None:
    """The causal LM and tokenizer of `model_dir` as an MLflow transformers model in `dest`
    (`mlflow.transformers.load_model` gives a text-generation pipeline)."""
    import mlflow.transformers
    from ..models.checkpoints import load_policy
    # By its absolute path: mlflow.transformers looks the model's name up on the hub for a model
    # card and licence, and a relative path (`outputs/sft/model`) reads as a hub repository id,
    # which offline costs about a minute of retries per stage; an absolute path is no repository id,
    # so the lookups fail at once.
    model, tok = load_policy(Path(model_dir).resolve())
    with _quiet():
        mlflow.transformers.save_model({"model": model, "tokenizer": tok}, str(dest), task="text-generation",
                                       pip_requirements=pinned(POLICY_NEEDS))


class PipelineRewardModel(mlflow.pyfunc.PythonModel):
    """pyfunc body of the reward model: `predict(DataFrame[prompt, response])` -> normalised scores,
    i.e. `pipeline.models.reward_model.score_texts` (raw score minus the offset in its config).
    The DataFrame hint tells MLflow to pass the input as it comes (a hint it can't turn into a
    schema is skipped silently; none at all draws a warning at every import)."""

    def load_context(self, context: Any) -> None:
        from ..models.reward_model import load_reward_model
        self.model, self.tok = load_reward_model(context.artifacts["reward_model"])
        self.max_length = int(context.model_config["max_length"])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict | None = None) -> list[float]:
        from ..models.reward_model import score_texts
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        missing = {"prompt", "response"} - set(frame.columns)
        if missing:
            raise ValueError(f"reward model input: missing columns {sorted(missing)} (expected prompt, response)")
        scores = score_texts(self.model, self.tok, [str(p) for p in frame["prompt"]],
                             [str(r) for r in frame["response"]], self.max_length)
        return scores.tolist()

def reward_signature() -> Any:
    """The reward model's schema: two text columns in, one score out."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema
    return ModelSignature(inputs=Schema([ColSpec("string", "prompt"), ColSpec("string", "response")]),
                          outputs=Schema([ColSpec("double")]))


INPUT_EXAMPLE = {"prompt": ["Review the film Silent River . Focus on the music ."],
                 "response": ["the music is warm and the score lingers . a fine film ."]}


def save_reward_model(model_dir: Path, dest: Path, max_length: int) -> None:
    """The reward model of `model_dir` as an MLflow pyfunc model in `dest`, with its signature and
    an input example; the folder travels as its artifact `reward_model` (loadable with
    from_pretrained too) and the modules of `pipeline` that score it as its code (`vendored`), so it
    loads wherever its pinned requirements are installed. The pyfunc scores through
    `score_texts` itself, not a copy of it: its scores are the pipeline's, cuts to `max_length` included."""
    with _quiet(), tempfile.TemporaryDirectory(prefix="mlflow-code-") as code:
        mlflow.pyfunc.save_model(str(dest), python_model=PipelineRewardModel(),
                                 artifacts={"reward_model": str(model_dir)},
                                 model_config={"max_length": int(max_length)},
                                 code_paths=[str(vendored(Path(code)))],
                                 pip_requirements=pinned(REWARD_NEEDS),
                                 signature=reward_signature(), input_example=pd.DataFrame(INPUT_EXAMPLE))


def save_model(stage: str, facts: ModelFacts, model_dir: Path, dest: Path, config: dict[str, Any]) -> None:
    if facts.kind == "reward":
        save_reward_model(model_dir, dest, config.get(f"{stage}.max_length", 512))
    else:
        save_policy(model_dir, dest)


def create_logged(client: Any, experiment_id: str, run_id: str, stage: str, params: dict[str, str],
                  tags: dict[str, str]) -> str:
    """The stage's MLflow logged model, created when its run starts, holding the run's params (as the
    run logs them); its id (the run's metric points name it)."""
    return client.create_logged_model(experiment_id, name=stage, source_run_id=run_id,
                                      tags={**tags, "stage": stage}, params=params).model_id


def log_and_register(client: Any, run_id: str, stage: str, facts: ModelFacts, model_dir: Path,
                     config: dict[str, Any], tags: dict[str, str], model_id: str, step: int = 0) -> str:
    """Save the stage's model (the one `facts` describe) into its logged model `model_id` (made by
    `create_logged`), mark it READY, list it among the run's outputs at `step` (the run's last) and
    register it; the version."""
    from mlflow.entities import LoggedModelOutput
    name = facts.registered
    with tempfile.TemporaryDirectory(prefix=f"mlflow-{stage}-") as tmp:
        dest = Path(tmp) / "model"
        save_model(stage, facts, model_dir, dest, config)
        client.log_model_artifacts(model_id, str(dest))
        client.finalize_logged_model(model_id, "READY")
    # The run's Outputs in MLflow's UI, and `run.outputs.model_outputs`: what `Model.log` records
    # for a model it logs (mlflow/models/model.py); a logged model made by hand gets no such link.
    client.log_outputs(run_id, [LoggedModelOutput(model_id, step=step)])
    logged = client.get_logged_model(model_id)
    from mlflow.exceptions import MlflowException
    try:
        client.create_registered_model(name, description=facts.description)
    except MlflowException:
        client.get_registered_model(name)   # made before, or just now by a parallel experiment; else this raises
    # The source is the logged model's storage location, not `models:/<id>`: the SQLite registry
    # resolves such a URI through the process-wide tracking URI, not this client's
    # (mlflow/store/model_registry/sqlalchemy_store.py), and a queued experiment's cwd is elsewhere.
    version = client.create_model_version(name, source=logged.artifact_location, run_id=run_id,
                                          tags=tags, model_id=model_id)
    return version.version

