#!/usr/bin/env bash
# `make commit`: put a finished run into git. After `make pipeline`, git shows dvc.lock and the
# outputs DVC leaves to git (metrics, step logs, reports, plots: the `cache: false` outs); the models
# and the prepared data are in DVC's cache, and dvc.lock holds their hashes, so committing the lock
# is what records them (`make push` uploads them to the DVC remote).
#
# Stages (git add) dvc.lock, params.yaml and everything git reports changed under outputs/ (and
# compare/dvc.lock after `make compare`), after checking that the workspace is the run the lock
# files describe (`dvc status` clean). Commits only when
# asked: MSG="<message>", or COMMIT=1 for "pipeline run <UTC date and time>".
set -euo pipefail
cd "$(dirname "$0")/.."

dvc=.venv/bin/dvc
[ -x "$dvc" ] || dvc=dvc

# The default pipeline must be clean; the methods of compare/dvc.yaml only once they have been run
# here (compare/dvc.lock differs from HEAD's, or is new): a plain `make pipeline` does not run them.
pipelines=(dvc.yaml)
if [ -f compare/dvc.lock ] && { ! git ls-files --error-unmatch compare/dvc.lock >/dev/null 2>&1 \
                                || ! git diff --quiet HEAD -- compare/dvc.lock; }; then
    pipelines+=(compare/dvc.yaml)
fi
if ! "$dvc" status --quiet "${pipelines[@]}"; then
    echo "make commit: the workspace is not the run in dvc.lock (or compare/dvc.lock; a stage is out of date or was" \
         "interrupted); finish it with 'make pipeline' (or 'make compare') first. dvc status:" >&2
    "$dvc" status "${pipelines[@]}" >&2 || true
    exit 1
fi

git add -A -- dvc.lock params.yaml outputs
[ "${#pipelines[@]}" -gt 1 ] && git add -A -- compare/dvc.lock
if git diff --cached --quiet; then
    echo "make commit: nothing to commit: dvc.lock, params.yaml and outputs/ are as committed."
    exit 0
fi
echo "make commit: staged"
git diff --cached --stat | sed 's/^/  /'

# Tracked files changed but not staged: dvc.lock records the hashes of the code each stage imports,
# so a run made with uncommitted code changes needs them in the same commit to be reproducible.
others=$(git diff --name-only)
if [ -n "$others" ]; then
    echo "make commit: also changed, not staged (dvc.lock holds the hashes of the stages' code deps;" \
         "add what the run used):"
    printf '  %s\n' $others
fi

message=${MSG:-}
if [ -z "$message" ] && [ "${COMMIT:-0}" = 1 ]; then
    message="pipeline run $(date -u +%Y-%m-%dT%H:%MZ)"
fi
if [ -z "$message" ]; then
    echo "Commit with: git commit -m \"pipeline run $(date -u +%Y-%m-%d)\"   (or: make commit COMMIT=1 / MSG=\"...\")"
else
    git commit -q -m "$message"
    echo "make commit: committed $(git rev-parse --short HEAD) \"$message\""
fi
echo "Then: make push (models and data to the DVC remote: $("$dvc" remote default 2>/dev/null || echo none)) and git push."
