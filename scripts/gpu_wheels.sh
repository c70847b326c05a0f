#!/usr/bin/env bash
# Gather, into an ignored folder, the wheels that the GPU machine lacks for scripts/gpu_check.sh.
#
#   bash scripts/gpu_wheels.sh [DIR]     # default DIR: .whl (in .gitignore and .git/info/exclude)
#
# The GPU machine (one H200, Python 3.12, no network) has torch 2.11 (CUDA 13), transformers 5.17,
# peft and accelerate, and no deepspeed, ruamel.yaml, dvc or mlflow. We use its torch (a CUDA torch
# wheel is gigabytes; transformers 5.24 needs >= 2.6, DeepSpeed >= 2.0; our own code has not run on
# 2.11 here, where no 2.11 wheel can be fetched: the first GPU run is that check) and carry, at our pins in
# requirements.lock, what it lacks plus transformers: 5.17 still calls the KV cache argument
# `past_key_values`, and the `cache=` that our sampler passes (pipeline/models/generation.py) is
# swallowed there without an error, so every sampled token after the prompt is drawn from a model
# that sees only the previous token (measured on a tiny Llama: sampler vs full-forward log-probs
# differ by 0.11 under 5.17, by 5e-7 under 5.24). Pure-Python wheels are downloaded, deepspeed (a
# source archive only) is built here into a pure-Python wheel whose CUDA ops compile just in time
# there (the default check needs none: PPO uses torch's AdamW unless optimizer offload is on), and
# pydantic_core, the one compiled package, is fetched as its CPython 3.12 manylinux wheel.
# Everything that travels must stay under 64 MiB; the wheels may take 60 MiB of it.
#
# tests/test_gpu_check.py reads the three lists below: every third-party import of the code the
# check runs, and every requirement of a carried wheel, must be on the machine or carried.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl}"
LIMIT_MIB=60
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

# The GPU machine's Python packages (kind nvidia-h200, /work/.library/device/KINDS.md, as read
# there on 2026-11-17).
MACHINE_PACKAGES="
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
"
# Versions seen there (KINDS.md's pip list row, 2026-11): the carried wheels' requirements are
# checked against them; a package not named here has an unknown version there.
MACHINE_VERSIONS="
accelerate==1.15.0 huggingface-hub==1.33.0 jaxtyping==0.3.11 numpy==2.5.2 safetensors==0.8.0
sentencepiece==0.2.2 tokenizers==0.23.2 torch==2.11.0 transformers==5.17.0 triton==3.6.0
"
# What we carry: distribution (version: its pin in requirements.lock), how, and why.
WHEELS="
deepspeed          build   not there; only a source archive on PyPI: its pure-Python wheel is built here
hjson              pure    not there; deepspeed reads its config with it
pydantic           pure    not there; deepspeed validates its config with it
pydantic_core      binary  pydantic's compiled core (CPython 3.12 manylinux wheel)
annotated-types    pure    not there; pydantic needs it
typing-inspection  pure    not there; pydantic needs it
typing_extensions  pure    there, but pydantic 2.14 needs >= 4.16 and the version there is unknown
ruamel.yaml        pure    not there; pipeline/config.py reads params with it (no C extension needed)
transformers       pure    there as 5.17, which drops our sampler's cache= argument without an error
"

norm() { tr 'A-Z' 'a-z' <<<"$1" | sed -E 's/[-_.]+/-/g'; }
pin_of() {   # the version requirements.lock pins for a distribution name, in any spelling
    local want line
    want=$(norm "$1")
    while IFS= read -r line; do
        [[ $line == *==* ]] || continue
        if [ "$(norm "${line%%==*}")" = "$want" ]; then echo "${line#*==}"; return 0; fi
    done < requirements.lock
    echo "gpu_wheels: $1 has no pin in requirements.lock" >&2
    return 1
}

work="$DEST.partial"
rm -rf "$work"
mkdir -p "$work"
while read -r name how _; do
    [ -n "$name" ] || continue
    version=$(pin_of "$name")
    echo "gpu_wheels: $name==$version ($how)"
    case $how in
        build)   # DS_BUILD_OPS=0: no op compiled here; they compile on first use there
            DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$work" "$name==$version" ;;
        pure|binary)
            "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                -d "$work" "$name==$version" ;;
        *) echo "gpu_wheels: unknown kind $how for $name" >&2; exit 1 ;;
    esac
done <<<"$WHEELS"

# One wheel per listed package, no more (two versions of one package stop the install there).
expected=$(grep -c '[^[:space:]]' <<<"$WHEELS")
found=$(find "$work" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$found" -ne "$expected" ]; then
    echo "gpu_wheels: $found wheels in $work for $expected packages:" >&2
    ls "$work" >&2
    exit 1
fi
rm -rf "$DEST"
mv "$work" "$DEST"
grep -qxF "/$DEST/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$DEST/" >> .git/info/exclude; }

ls -l "$DEST"
wheels=$(find "$DEST" -maxdepth 1 -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
# du reports a file that git lists but another change deleted, and still prints the total.
tree=$( (git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null || true) | tail -1 | cut -f1)
awk -v n="$found" -v w="$wheels" -v t="$tree" -v lim="$LIMIT_MIB" 'BEGIN {
    printf "gpu_wheels: %d wheels, %.1f MiB (limit %d MiB); with the working tree that travels: %.1f MiB of 64\n",
           n, w / 1048576, lim, (w + t) / 1048576 }'
if [ "$wheels" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_wheels: the wheels exceed $LIMIT_MIB MiB" >&2
    exit 1
fi
echo "gpu_wheels: on the GPU machine: bash scripts/gpu_check.sh --install-wheels $DEST (README: GPU check)"
