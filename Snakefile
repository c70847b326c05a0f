# Snakemake entry point for cluster runs (SLURM profiles). Its rules will be derived from dvc.yaml,
# the single source of truth for the stage graph, so the two cannot drift; until then, run the
# pipeline with `make pipeline` (dvc repro).
