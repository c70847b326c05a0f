# The README's commands (docs/guide/ has the rest):
#   make pipeline   set up .venv if needed, then run the whole pipeline (dvc repro) on the default
#   make test       set up .venv if needed, then run the tests
#   make test-fast  the unit and stage tiers only: the edit-test loop
PYTHON ?=
TORCH ?=
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
# Stage commands in dvc.yaml call `python`: make it the venv's.
export PATH := $(BIN):$(PATH)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install pipeline compare test test-fast lock bench snakemake slurm slurm-setup commit register \
	remote push offline-page gpu-check demo hub-rehearsal

# PYTHON: the interpreter (default: the newest of python3.13, 3.12, 3.11); TORCH: empty (picked from
# this machine: the CPU-only build without an NVIDIA GPU, PyPI's default, CUDA, build with one) | cpu |
# pypi | cu126, ... (see scripts/venv.sh).
install:
	@PYTHON='$(PYTHON)' TORCH='$(TORCH)' bash scripts/venv.sh $(VENV)

pipeline: install
	$(BIN)/rlhf-pipeline recover-lock
	dvc repro
	@echo
	@echo "Done."
	@echo "  Report:      outputs/evaluate/report.md (with scores.png, kl_frontier.png, samples.md)"
	@echo "  Headline:    .venv/bin/rlhf-pipeline headline"
	@echo "  Metrics:     outputs/*/metrics.json, step logs outputs/*/*.tsv (.venv/bin/dvc metrics show --json)"
	@echo "  Checkpoints: outputs/{sft,reward,ppo}/model (Hugging Face format)"
	@echo "  MLflow UI:   .venv/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db"

# A first look in minutes (README.md, `make demo`, has the measured time): the whole pipeline on
# recipes/demo.yaml in .demo/seed-$(SEED)/ (a copy of the project; this checkout's outputs/ and dvc.lock
# stay as they are).
SEED ?= 0
demo: install
	$(BIN)/python scripts/demo.py --seed $(SEED)

# The hub path rehearsed offline (recipes/hub-rehearsal.yaml): a bf16, BPE, chat-template, no-pad
# checkpoint built here, then the whole pipeline from it in .rehearsal/repo (minutes; docs/guide/own-model-and-data.md).
hub-rehearsal: install
	$(BIN)/python scripts/hub_rehearsal.py run

# The alignment methods side by side (compare/dvc.yaml): the default pipeline if needed, then DPO,
# GRPO, rejection-sampling fine-tuning and their comparison with PPO, SFT and best-of-n.
compare: install
	$(BIN)/rlhf-pipeline recover-lock
	$(BIN)/rlhf-pipeline recover-lock --lock compare/dvc.lock
	dvc repro compare/dvc.yaml
	@echo
	@echo "Done. Comparison: outputs/compare/report.md (with gold_vs_kl.png)"

# The same stages under Snakemake: on this machine, or as SLURM jobs (see profiles/).
snakemake: install
	$(BIN)/snakemake --profile profiles/local

slurm: install
	$(BIN)/snakemake --profile profiles/slurm

# Committing and sharing a run (docs/guide/sharing.md):
#   make commit                       git add dvc.lock, params.yaml and the run's changed outputs/ files
#                                     (after checking `dvc status` is clean); COMMIT=1 also commits them
#                                     as "pipeline run <UTC time>", MSG="..." with that message
#   make remote REMOTE=<path or URL>  this checkout's DVC remote (.dvc/config.local); the committed
#                                     default is ../rlhf-dvc-storage, a folder beside the checkout
#   make register [VERSION=v1.2.0]    a version of each model of dvc.yaml's artifacts at HEAD: annotated
#                                     git tags <name>@<version> (GTO's form), what `dvc artifacts get`
#                                     and model registries read; without VERSION the next patch version
#   make push                         the models and prepared data (DVC's cache) to the DVC remote
commit: install
	bash scripts/commit-run.sh

register: install
	@git diff --quiet HEAD -- dvc.lock || { echo "make register: dvc.lock differs from HEAD's; register a committed run (make commit COMMIT=1)" >&2; exit 1; }
	@for name in $$($(BIN)/python -c "from dvc.repo import Repo; print(*Repo('.').artifacts.read().get('dvc.yaml', {}))"); do \
		$(BIN)/gto register $$name HEAD $(if $(VERSION),--version $(VERSION)) || exit 1; done
	@echo "Share the versions with: git push origin --tags"

remote: install
	@test -n "$(REMOTE)" || { echo "usage: make remote REMOTE=<folder or URL>   (now:)"; $(BIN)/dvc remote list; exit 2; }
	$(BIN)/dvc remote modify --local storage url '$(REMOTE)'
	$(BIN)/dvc remote list

push: install
	$(BIN)/dvc push

# Re-render the measured numbers of README.md and docs/guide/*.md (their `<!-- rendered: ... -->`
# blocks) from the committed data files: outputs/, dvc.lock, docs/compare_methods.tsv, docs/frontier.md,
# docs/data/*.json. tests/system/test_docs.py fails while a page differs from its rendering.
# ARGS=--this-run: after a run of your own (made here), first name it in docs/data/committed-run.json.
.PHONY: docs
docs:
	$(BIN)/python scripts/render_docs.py $(ARGS)

# Rewrite .dvc/plots/offline.html (the page of `dvc plots show`, vega inline) and its NOTICE from the
# venv's copies of vega, vega-lite and vega-embed, e.g. after a Snakemake upgrade.
offline-page: install
	$(BIN)/python scripts/dvc_offline_page.py

# A SLURM cluster on this machine for the tests' SLURM tier and for trying profiles/slurm: installs
# slurm-wlm with apt if it is missing and writes /etc/slurm/slurm.conf (Debian/Ubuntu, root; nothing
# when a cluster is up). A system change, so only on request: `make test` never runs it.
slurm-setup:
	bash scripts/slurm-local.sh start

# The tests; the SLURM tier runs where a cluster answers (`make slurm-setup`), else it is skipped
# with its reason. TEST_WORKERS pytest-xdist processes, one test file each at a time (a file's
# module fixtures are built once); 0 runs them in this one process. Each runs torch at one thread;
# three on two cores, because the system tests spend much of their time waiting (SLURM's scheduling
# and time limits, subprocesses starting, launchers meeting), and a third worker fills those waits.
# The files go out in the order tests/conftest.py gives them (the SLURM tier's first).
TEST_WORKERS ?= 3
TEST_DURATIONS ?= 15
test: install
	@scontrol ping 2>/dev/null | grep -q "is UP" || echo "make test: no SLURM cluster answers," \
		"the SLURM tier is skipped (make slurm-setup starts one on this machine, as root)"
	pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=$(TEST_DURATIONS)

# The unit and stage tiers (math by equivalence, each stage on tiny inputs): no SLURM, no dvc repro,
# no process groups of the system tier.
test-fast: install
	pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit tests/stages

# Every stage on this machine's GPUs on a locally built model (plain PyTorch and DeepSpeed at one
# process; two processes over NCCL too when two GPUs are visible): memory plan vs measured peak,
# tokens/s, MFU, log-prob differences, CPU work while on the GPU; exit 1 on any failure. ARGS passes
# options, e.g. ARGS="--budget-s 900 --out gpu_check.json".
gpu-check: install
	$(BIN)/python scripts/gpu_check.py $(ARGS)

# Benchmarks (not part of the tests): PPO vs TRL on identical work, GAE vs the seed's loop, stage times.
bench: install
	$(BIN)/pip install -q -c requirements.lock -c requirements-dev.lock -c requirements-bench.lock -e '.[dev,bench]'
	$(BIN)/python benchmarks/gae.py
	$(BIN)/python benchmarks/ppo_vs_trl.py
	$(BIN)/python benchmarks/stages.py

# The locks from what is installed: requirements.lock (the pipeline), requirements-<extra>.lock (what
# each extra adds). Upgrade a pin in pyproject.toml, install without the locks, then run this.
lock: install
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python scripts/lock.py
