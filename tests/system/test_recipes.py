"""Recipes (recipes/*.yaml): each validates merged over the shipped params, keeps the values its
source states, and yields the stage commands and cluster resources its setup needs. (They name hub
models and datasets, so they cannot run here.)"""

from __future__ import annotations

import re

import pytest

from ruamel.yaml import YAML

from conftest import BIN, REPO, copy_repo, run
from pipeline.workflow import recipes, stage_graph
from pipeline.stages import registry
from pipeline.workflow.cluster import JobShape, check_shape, shapes_in_profile, slurm_resources

SHAPE_CHECKED = registry.cluster_checked()
from pipeline.errors import ConfigError


def test_recipes_exist():
    assert recipes.names() == ["demo", "hh-rlhf-pythia-1.4b", "hub-rehearsal", "tldr-pythia-1b"]


def test_the_hub_rehearsal_tunes_sft_and_the_reward_model_at_a_hub_learning_rate_from_its_local_base():
    _, p, jobs = recipes.render("hub-rehearsal", REPO / "params.yaml")
    assert p.model.name_or_path == "hub-rehearsal/base" and jobs == {}   # scripts/hub_rehearsal.py writes it there
    assert p.sft.lr <= 2e-5 and p.reward.lr <= 2e-5 and p.prompts.gold_judge
    assert p.sft.max_length >= 128 and p.reward.max_length >= 128      # ChatML prompts in BPE tokens


@pytest.mark.parametrize("name", ["hh-rlhf-pythia-1.4b", "tldr-pythia-1b"])
def test_recipe_validates_and_gives_gpu_jobs(name):
    _, params, jobs = recipes.render(name, REPO / "params.yaml")
    _, profile = recipes.profile_with(REPO / "profiles/slurm/config.yaml", jobs)
    shapes = shapes_in_profile(profile, ("prepare", *SHAPE_CHECKED))
    check_shape(params, shapes, SHAPE_CHECKED)    # nodes and GPUs match the distributed settings
    for stage in SHAPE_CHECKED:                   # evaluate samples best-of-n on the GPUs too
        res = slurm_resources(shapes[stage])
        assert res["gres"] == "gpu:8" and res["nodes"] == 1
        assert getattr(params, stage).distributed.num_processes == 8
        assert getattr(params, stage).distributed.precision == "bf16"
    # every job, GPU or not, gets the profile's warning signal (a stage stops cleanly on it)
    assert shapes["prepare"] == JobShape(gpus=0, nodes=1, cpus_per_task=1, warning="URG")
    assert "gres" not in slurm_resources(shapes["prepare"])
    assert params.model.name_or_path.startswith("EleutherAI/pythia-")


def test_tldr_recipe_has_the_published_values():
    """Huang et al. 2024 (N+ implementation details): lr 3e-6, 4 PPO epochs, KL 0.05, 53 response
    tokens at temperature 0.7, missing-EOS score -1, critic from the RM, rewards normalised."""
    _, p, _ = recipes.render("tldr-pythia-1b", REPO / "params.yaml")
    assert (p.sft.lr, p.reward.lr, p.ppo.lr) == (3e-6, 3e-6, 3e-6)
    assert (p.ppo.ppo_epochs, p.ppo.kl_coef, p.ppo.missing_eos_score, p.ppo.critic_init) == (4, 0.05, -1.0, "reward")
    assert (p.ppo.sampling.max_new_tokens, p.ppo.sampling.temperature) == (53, 0.7)
    assert p.prompts.sampling == p.ppo.sampling   # measured as trained
    assert p.reward.normalize is True
    assert p.prompts.dataset.path == "trl-lib/tldr" and p.reward.dataset.path == "trl-lib/tldr-preference"
    assert p.prompts.gold_judge is False


def test_recipe_command_writes_params_and_snakemake_plans_the_stages(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    proc = run([str(BIN / "python"), "-m", "pipeline", "recipe", "hh-rlhf-pythia-1.4b"], repo)
    assert "wrote params.yaml and profiles/slurm/config.yaml" in proc.stdout
    text = (repo / "params.yaml").read_text()
    assert "name_or_path: EleutherAI/pythia-1.4b-deduped" in text and "slurm" not in text
    assert "# Every hyperparameter of the pipeline" in text          # params.yaml's own comments kept
    profile = (repo / "profiles/slurm/config.yaml").read_text()
    assert "# snakemake --profile profiles/slurm" in profile          # the profile's comments kept too
    resources = YAML(typ="safe", pure=True).load(profile)["set-resources"]
    assert resources["ppo"] == {"runtime": 1440, "gpus": 8, "cpus_per_task": 32, "mem_mb": 384000}
    assert resources["prepare"]["cpus_per_task"] == 1                 # stages the recipe leaves alone
    run([str(BIN / "python"), "-m", "pipeline", "check"], repo)
    dry = run([str(BIN / "snakemake"), "-n", "-p", "--forceall", "--profile", "profiles/slurm"], repo).stdout
    for stage in stage_graph.load(repo / "dvc.yaml"):
        assert f"{stage.cmd} > logs/{stage.name}.log 2>&1" in dry
    assert "gres=gpu:8" in dry.replace(" ", "")          # the GPU stages' resources, as Snakemake plans them
    # A recipe whose jobs do not fit its process shape writes neither file.
    before = (repo / "params.yaml").read_text(), profile
    (repo / "recipes/misfit.yaml").write_text("distributed: {backend: deepspeed, num_processes: 4}\n"
                                              "slurm:\n  sft: {gpus: 8}\n")
    proc = run([str(BIN / "python"), "-m", "pipeline", "recipe", "misfit"], repo, check=False)
    assert proc.returncode != 0 and "set-resources sft.gpus: 8 GPUs per node but sft.distributed.num_processes=4" in proc.stderr
    assert ((repo / "params.yaml").read_text(), (repo / "profiles/slurm/config.yaml").read_text()) == before


def test_unknown_recipe_and_bad_recipe_values(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"recipe nope: no such recipe \(known: demo, hh-rlhf-pythia-1.4b, hub-rehearsal, tldr-pythia-1b\)"):
        recipes.render("nope", REPO / "params.yaml")
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "broken.yaml").write_text("ppo:\n  kl_coef: -1\n")
    monkeypatch.setattr(recipes, "FOLDER", folder)
    given = re.escape(str(REPO / "params.yaml"))   # the params file as given
    with pytest.raises(ConfigError, match=rf"broken.yaml over {given}: ppo.kl_coef: expected a float >= 0.0, "
                                          "got -1"):
        recipes.render("broken", REPO / "params.yaml")


def test_demo_is_the_default_shortened_in_its_own_copy(tmp_path):
    """scripts/demo.py's set-up: a git copy of the tracked files without the committed run, the
    demo recipe merged into its params and every stage's seed set; the checkout is left as it is."""
    import importlib.util
    import subprocess
    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    before = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    repo = tmp_path / "seed-3"
    demo.copy_project(repo)
    assert not (repo / "outputs").exists() and not (repo / "dvc.lock").exists() and (repo / "dvc.yaml").is_file()
    recipes.apply("demo", repo / "params.yaml", repo / "params.yaml")
    demo.set_seeds(repo / "params.yaml", 3)
    from pipeline.config import load_params
    params, default = load_params(repo / "params.yaml"), load_params(REPO / "params.yaml")
    assert demo.seeded() == ["sft", "reward", "ppo", "evaluate"]   # the default pipeline's stages that train or measure
    assert [getattr(params, s).seed for s in demo.seeded()] == [3, 3, 3, 3]
    assert params.ppo.iterations < default.ppo.iterations and params.reward.epochs < default.reward.epochs
    assert (params.model, params.ppo.kl_coef, params.ppo.lr) == (default.model, default.ppo.kl_coef, default.ppo.lr)
    assert subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout == before
