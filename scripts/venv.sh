#!/usr/bin/env bash
# Create or repair the project's virtual environment and install the pinned packages into it
# (`make install`; every make target that runs the pipeline or the tests calls it first).
#
#   bash scripts/venv.sh [.venv]
#
# PYTHON   the interpreter (default: the newest of python3.13, python3.12, python3.11 on PATH)
# TORCH    which torch build: empty (pip's own choice: on Linux x86_64 PyPI's torch is the CUDA
#          build, several GB, what a GPU machine needs) | cpu (the CPU-only build, ~200 MB, from
#          download.pytorch.org/whl/cpu) | cu126, cu128, ... (that CUDA build from its index)
#
# A venv made by an unsupported Python, one that no longer runs (its interpreter moved or was
# removed), or one of another Python than PYTHON asks for is removed and rebuilt, with one line
# saying why. A .venv that is a link (to another checkout's venv) is used as it is, never installed into. Packages are installed again when pyproject.toml or a lock (requirements*.lock) changed, or when
# TORCH asks for another build than the venv has.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
SUPPORTED="3.11 3.12 3.13"

version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
supported() { case " $SUPPORTED " in *" $1 "*) return 0;; *) return 1;; esac; }

if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
    command -v "$py" >/dev/null || { echo "venv: PYTHON=$py: no such interpreter" >&2; exit 1; }
else
    py=
    # The first that runs: a pyenv shim is on PATH for versions it does not have, and fails.
    for cand in python3.13 python3.12 python3.11 python3; do
        if command -v "$cand" >/dev/null && v=$(version_of "$cand") && supported "$v"; then py=$cand; break; fi
    done
    [ -n "$py" ] || { echo "venv: needs Python 3.11, 3.12 or 3.13 on PATH (python3.13, python3.12 or python3.11), or PYTHON=<interpreter>" >&2; exit 1; }
fi
want=$(version_of "$py") || { echo "venv: $py does not run" >&2; exit 1; }
supported "$want" || { echo "venv: $py is Python $want; this project needs one of $SUPPORTED (set PYTHON=...)" >&2; exit 1; }

if [ -L "$VENV" ]; then
    # A link to another checkout's venv (a copy sharing it, as the tests' scratch repositories do):
    # an editable install from here would point that venv at this folder, so it is used as it is.
    version_of "$VENV/bin/python" >/dev/null || { echo "venv: $VENV links to a venv whose python does not run" >&2; exit 1; }
    exit 0
fi
if [ -e "$VENV" ]; then
    have=$(version_of "$VENV/bin/python" || true)
    why=
    if [ -z "$have" ]; then why="its python does not run"
    elif ! supported "$have"; then why="it was made with Python $have, not one of $SUPPORTED"
    elif [ -n "${PYTHON:-}" ] && [ "$have" != "$want" ]; then why="it was made with Python $have and PYTHON=$PYTHON is $want"
    fi
    if [ -n "$why" ]; then
        echo "venv: rebuilding $VENV with $py (Python $want): $why"
        rm -rf "$VENV"
    fi
fi
[ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"

torch_args=()
case "${TORCH:-}" in
    "") ;;
    cpu|cu[0-9]*) torch_args=(--extra-index-url "https://download.pytorch.org/whl/${TORCH}") ;;
    *) echo "venv: TORCH=$TORCH: expected cpu or a CUDA tag such as cu126 (empty: pip's default build)" >&2; exit 1 ;;
esac
stamp=$VENV/.installed
recorded=$(cat "$stamp" 2>/dev/null || true)
recorded=${recorded:-torch=}      # an empty stamp: made before TORCH existed, with pip's default build
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt requirements.lock ] \
        && [ "$stamp" -nt requirements-dev.lock ] \
        && [ "$recorded" = "torch=${TORCH:-}" ]; then
    exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${torch_args[@]}" -c requirements.lock -c requirements-dev.lock -e '.[dev]'
if [ -f "$stamp" ] && [ "$recorded" != "torch=${TORCH:-}" ]; then
    # The pinned version is already there, as the other build: pip would keep it.
    echo "venv: replacing torch with the ${TORCH:-default} build"
    "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "${torch_args[@]}" \
        "$(grep -E '^torch==' requirements.lock)"
fi
echo "torch=${TORCH:-}" > "$stamp"
