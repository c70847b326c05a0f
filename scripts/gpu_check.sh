#!/usr/bin/env bash
# GPU check: PPO with DeepSpeed ZeRO-3 + bf16 on a ~1B-parameter model built from a
# config (random weights, no download), a few iterations; prints, as each is measured, the memory
# plan next to the measured memory, rollout and update tokens/s, MFU, and the sampler/trainer
# log-prob difference and first-minibatch ratio with recompute on and off (see scripts/gpu_check.py).
#
#   bash scripts/gpu_check.sh --install-wheels .whl  # the GPU machine: first install the wheels
#                                                    # scripts/gpu_wheels.sh gathered (README: GPU check)
#   bash scripts/gpu_check.sh                        # a GPU machine with this project's environment
#   bash scripts/gpu_check.sh --tiny                 # the same code path with a tiny model on CPU
#
# Other options go to gpu_check.py (--iterations N, --out results.json). The whole check, install
# included, ends within 8 minutes: a hard timeout, and gpu_check.py skips an iteration it cannot
# finish in time. Uses .venv's python when there is one (here), else python3 (the GPU machine's).
set -u
cd "$(dirname "$0")/.."
START=$SECONDS
LIMIT=480   # the issue's 8 minutes
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 PIPELINE_TRACKING=off
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"

args=()
while [ $# -gt 0 ]; do
    case $1 in
        --install-wheels)
            wheels=${2:?"gpu_check: --install-wheels needs the folder scripts/gpu_wheels.sh filled"}
            shift 2
            if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
                echo "gpu_check: $wheels: no wheels; run 'bash scripts/gpu_wheels.sh $wheels' first and carry it"
                exit 2
            fi
            # A fresh folder each run: two versions of one package must never meet there.
            site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
            trap 'rm -rf "$site"' EXIT
            PY=python3
            PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
                "$wheels"/*.whl || { echo "gpu_check: installing $wheels into $site failed"; exit 1; }
            export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
            echo "gpu_check: installed $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site in $((SECONDS - START))s"
            ;;
        *) args+=("$1"); shift ;;
    esac
done

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PY" - <<'EOF' || { echo "gpu_check: torch/deepspeed/transformers not importable with $PY"; exit 1; }
import importlib.metadata as md
import torch, deepspeed, transformers
print("python", __import__("sys").version.split()[0], "cuda", torch.cuda.is_available(), "|",
      ", ".join(f"{n} {md.version(n)}" for n in ("torch", "deepspeed", "transformers", "tokenizers",
                                                 "huggingface-hub", "safetensors", "accelerate", "pydantic")))
EOF
left=$((LIMIT - (SECONDS - START) - 15))   # 15 s for the interpreter to stop and the folder to go
# gpu_check.py plans its iterations against 20 s less, so the hard timeout is only a backstop.
timeout --signal=INT --kill-after=10 "$left" "$PY" scripts/gpu_check.py --budget-s $((left - 20)) ${args[@]+"${args[@]}"}
status=$?
[ $status -eq 124 ] && echo "gpu_check: stopped at the ${LIMIT} s limit; the numbers above stand"
echo "gpu_check: exit $status after $((SECONDS - START))s"
exit $status
