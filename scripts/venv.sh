#!/usr/bin/env bash
# Create or repair the project's virtual environment and install the pinned packages into it
# (`make install`; every make target that runs the pipeline or the tests calls it first).
#
#   bash scripts/venv.sh [--dry-run] [.venv]
#
# PYTHON   the interpreter (default: the newest of python3.13, python3.12, python3.11 on PATH)
# TORCH    which torch build. Unset: picked from this machine, with one line saying which and why:
#          the CPU-only build (~200 MB, from download.pytorch.org/whl/cpu) where no NVIDIA GPU is
#          found (no nvidia-smi on PATH that lists a GPU, no /proc/driver/nvidia/version), else
#          PyPI's default build (on Linux x86_64 the CUDA build, several GB, what a GPU needs); an
#          existing venv keeps the build it has. cpu | pypi (PyPI's default) | cu126, cu128, ...
#          (that CUDA build from its index) ask for one and replace the venv's torch if it differs.
# --dry-run  print the torch build it picks and the pip commands it would run; change nothing.
#
# A venv made by an unsupported Python, one that no longer runs (its interpreter moved or was
# removed), or one of another Python than PYTHON asks for is removed and rebuilt, with one line
# saying why. A .venv that is a link (to another checkout's venv) is used as it is, never installed
# into. Packages are installed again when pyproject.toml or a lock (requirements*.lock) changed, or
# when TORCH asks for another build than the venv has.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=
if [ "${1:-}" = --dry-run ]; then DRY_RUN=1; shift; fi
VENV=${1:-.venv}
SUPPORTED="3.11 3.12 3.13"
CPU_INDEX=https://download.pytorch.org/whl/cpu
# Where the NVIDIA kernel driver reports itself; the tests point this at a file of their own.
NVIDIA_PROC=${VENV_NVIDIA_PROC:-/proc/driver/nvidia/version}

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
    [ -z "$DRY_RUN" ] || echo "venv: $VENV links to another venv: used as it is, nothing installed"
    exit 0
fi
# The stamp of an install: `torch=<build>` (cpu, pypi, cu126, ...). Empty (a stamp written before
# TORCH existed) or `torch=` (before the build was picked from the machine): PyPI's default build.
stamp=$VENV/.installed
if [ -e "$VENV" ]; then
    have=$(version_of "$VENV/bin/python" || true)
    why=
    if [ -z "$have" ]; then why="its python does not run"
    elif ! supported "$have"; then why="it was made with Python $have, not one of $SUPPORTED"
    elif [ -n "${PYTHON:-}" ] && [ "$have" != "$want" ]; then why="it was made with Python $have and PYTHON=$PYTHON is $want"
    fi
    if [ -n "$why" ]; then
        echo "venv: rebuilding $VENV with $py (Python $want): $why"
        # --dry-run: as if removed (the stamp no longer counts, a new venv is made)
        if [ -n "$DRY_RUN" ]; then stamp=/nonexistent; else rm -rf "$VENV"; fi
    fi
fi
recorded=
if [ -f "$stamp" ]; then
    recorded=$(cat "$stamp")
    recorded=${recorded#torch=}
    recorded=${recorded:-pypi}
fi

# The torch build, and one line on why (printed when installing).
nvidia_gpu() {
    # nvidia-smi -L prints "GPU 0: <name> (UUID: ...)" per GPU, "No devices were found" without one.
    # Its output is read whole first: `nvidia-smi -L | grep -q` under pipefail fails when grep stops
    # at the first GPU's line and nvidia-smi, still writing the next, dies of SIGPIPE.
    local listed
    listed=$( { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null; } || true)
    if grep -q '^GPU [0-9]' <<<"$listed"; then
        echo "nvidia-smi lists a GPU"
    elif [ -e "$NVIDIA_PROC" ]; then
        echo "$NVIDIA_PROC exists (an NVIDIA driver is loaded)"
    else
        return 1
    fi
}
case "${TORCH:-}" in
    "")
        if [ -n "$recorded" ]; then
            build=$recorded
            because="the build this venv has (TORCH=cpu, pypi or cu126 replaces it)"
        elif found=$(nvidia_gpu); then
            build=pypi
            because="$found; TORCH=cpu installs the CPU-only build"
        else
            build=cpu
            because="no NVIDIA GPU here (no nvidia-smi on PATH lists one, no $NVIDIA_PROC);"
            because+=" TORCH=pypi installs PyPI's default build"
        fi ;;
    cpu|pypi|cu[0-9]*) build=$TORCH; because="as TORCH=$TORCH asks" ;;
    *) echo "venv: TORCH=$TORCH: expected cpu, pypi (PyPI's default build) or a CUDA tag such as cu126" \
            "(unset: picked from this machine)" >&2
       exit 1 ;;
esac
torch_args=()
case "$build" in
    pypi) name="PyPI's default build (on Linux x86_64 the CUDA build, several GB)" ;;
    cpu) torch_args=(--extra-index-url "$CPU_INDEX"); name="the CPU-only build ($CPU_INDEX)" ;;
    *) torch_args=(--extra-index-url "https://download.pytorch.org/whl/$build")
       name="the $build build (https://download.pytorch.org/whl/$build)" ;;
esac

if [ -z "$DRY_RUN" ] && [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] \
        && [ "$stamp" -nt requirements.lock ] && [ "$stamp" -nt requirements-dev.lock ] \
        && [ "$recorded" = "$build" ]; then
    exit 0
fi
echo "venv: torch: $name: $because"
# Each command runs, or under --dry-run is printed as it would run.
run() { if [ -n "$DRY_RUN" ]; then echo "$*"; else "$@"; fi; }
[ -x "$VENV/bin/python" ] && [ "$stamp" != /nonexistent ] || run "$py" -m venv "$VENV"
run "$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and alone from its build's index (its dependencies come with the rest, from PyPI):
# only this one name is looked up there, so a network that cannot reach the index costs one failed
# lookup, not one for every package, and pip then takes PyPI's torch (or a local wheel).
replace=()
if [ -n "$recorded" ] && [ "$recorded" != "$build" ]; then
    # The pinned version is already there, as the other build: pip would keep it.
    echo "venv: replacing torch with the $build build"
    replace=(--force-reinstall)
fi
if [ ${#torch_args[@]} -gt 0 ] || [ ${#replace[@]} -gt 0 ]; then
    run "$VENV/bin/python" -m pip install -q "${replace[@]}" --no-deps "${torch_args[@]}" \
        "$(grep -E '^torch==' requirements.lock)"
fi
run "$VENV/bin/python" -m pip install -q -c requirements.lock -c requirements-dev.lock -e '.[dev]'
# What pip installed: where the build's index is out of reach (a proxy, an offline mirror), pip
# takes PyPI's torch instead without failing (on Linux the CUDA build, several GB). Say so in one
# line, and record the build the venv has, so the next run neither repeats nor hides it.
if [ -z "$DRY_RUN" ] && [ "$build" != pypi ]; then
    got=$("$VENV/bin/python" -m pip show torch 2>/dev/null | sed -n 's/^Version: //p')
    if [ -n "$got" ] && [ "${got##*+}" != "$build" ]; then
        echo "venv: torch $got is installed, not $name: pip could not use that index and took" \
             "PyPI's build, which runs here too; TORCH=pypi keeps it, TORCH=$build with the index reachable replaces it" >&2
        build=pypi
    fi
fi
[ -n "$DRY_RUN" ] || echo "torch=$build" > "$stamp"
