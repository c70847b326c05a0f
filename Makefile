# The two commands of the README:
#   make pipeline   set up .venv if needed, then run the whole pipeline (dvc repro) on the default
#   make test       set up .venv if needed, then run the tests
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
# Stage commands in dvc.yaml call `python`: make it the venv's.
export PATH := $(BIN):$(PATH)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install pipeline test lock bench snakemake slurm

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -e '.[dev]'
	touch $@

install: $(VENV)/.installed

pipeline: install
	dvc repro
	@echo
	@echo "Done."
	@echo "  Report:      outputs/evaluate/report.md (with scores.png, kl_frontier.png, samples.md)"
	@echo "  Metrics:     .venv/bin/dvc metrics show   (files: outputs/*/metrics.json; step logs outputs/*/*.tsv)"
	@echo "  Checkpoints: outputs/{sft,reward,ppo}/model (Hugging Face format)"
	@echo "  MLflow UI:   .venv/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db"

# The same stages under Snakemake: on this machine, or as SLURM jobs (see profiles/).
snakemake: install
	$(BIN)/snakemake --profile profiles/local

slurm: install
	$(BIN)/snakemake --profile profiles/slurm

# The tests include a real SLURM run: scripts/slurm-local.sh starts a one-node cluster on this
# machine (installing slurm-wlm with apt if needed; root), and does nothing if one is running.
test: install
	bash scripts/slurm-local.sh start
	pytest -q

# Benchmarks (not part of the tests): PPO vs TRL on identical work, GAE vs the seed's loop, stage times.
bench: install
	$(BIN)/pip install -q -c requirements.lock -e '.[dev,bench]'
	$(BIN)/python benchmarks/gae.py
	$(BIN)/python benchmarks/ppo_vs_trl.py
	$(BIN)/python benchmarks/stages.py

lock: install
	$(BIN)/pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu/torch==\1/' > requirements.lock.new
	mv requirements.lock.new requirements.lock
