#!/usr/bin/env bash
# GPU check of issue 6: PPO with DeepSpeed ZeRO-3 + bf16 on a ~1B-parameter model built from a
# config (random weights, no download), a few iterations; prints rollout and update tokens/s,
# GPU memory per model, peak memory and MFU as each is measured (see scripts/gpu_check.py).
#
#   bash scripts/gpu_check.sh           # on one GPU; ends within 8 minutes (a hard timeout)
#   bash scripts/gpu_check.sh --tiny    # the same code path with a tiny model on CPU
#
# Needs this repository's Python environment with a CUDA build of torch; uses .venv when present.
set -u
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 PIPELINE_TRACKING=off
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PY" -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'deepspeed', deepspeed.__version__)" \
    || { echo "gpu_check: torch/deepspeed not importable with $PY"; exit 1; }
# 470 s leaves room for the launcher's own start inside the 8 minutes.
timeout --signal=INT --kill-after=10 470 "$PY" scripts/gpu_check.py "$@"
status=$?
[ $status -eq 124 ] && echo "gpu_check: stopped at the 470 s limit; the numbers above stand"
exit $status
