#!/usr/bin/env bash
# Code review of a pipeline change: what the work tree (a PR's head in CI) changed against a
# base revision, as Markdown a reviewer (or a CI job posting a PR comment) can read.
#
#   scripts/review.sh [BASE [PLOTS_DIR]]
#
#   BASE       git revision to compare with. Default: origin/main if it exists, else main.
#              A remote-tracking ref that is not there yet (a shallow CI checkout) is fetched
#              from origin first.
#   PLOTS_DIR  where `dvc plots diff` writes its HTML. Default: plots/review (git-ignored).
#
# Run it from anywhere inside the repository, with `dvc` on PATH (source .venv/bin/activate).
# Prints, in order:
#   1. the DVC remote data fetch for the comparison, or why it was skipped;
#   2. `dvc metrics diff --md BASE`  - changed metrics (summary.json, eval/bench JSON, ...),
#      preceded by a line saying whether BASE and the workspace were measured on the same kind
#      of machine (CPU, INT8 ISA flags, cores, onnxruntime/torch versions: metrics/machine.json);
#   3. `dvc params diff --md BASE`   - changed params.yaml keys;
#   4. where `dvc plots diff BASE` wrote index.html (latency, accuracy vs size, confusion, ...).
#
# What needs a pull: metrics and plots of this project are `cache: false`, i.e. committed to
# git, so metrics diff and plots diff need nothing from remote storage. The fetch below only
# matters for metrics/plots a dvc.yaml keeps in the DVC cache; it is restricted to those
# (`--type metrics --type plots`), downloads into the cache without touching the work tree,
# and covers the work tree's revision. For BASE, `dvc plots diff` reads cached plot data of an
# old revision straight from the default remote when it is not in the local cache.
#
# CI example (GitHub Actions, after checkout and installing requirements):
#   - run: bash scripts/review.sh origin/${{ github.base_ref }} > review.md
# with the remote's credentials in the job's environment (AWS_ACCESS_KEY_ID, ...), never in
# .dvc/config.
set -euo pipefail

if ! command -v dvc >/dev/null; then
    echo "review.sh: dvc not on PATH (source .venv/bin/activate)" >&2
    exit 2
fi
cd "$(dvc root)"
# DVC commands that take the repository lock go through quantpipe.dvcrun (--wait-for-lock, and
# a stop with the reason while another run's stage is going), with the python beside `dvc`.
dvc_python=$(dirname "$(command -v dvc)")/python

has_rev() { git rev-parse --verify --quiet "$1^{commit}" >/dev/null; }

if [[ $# -ge 1 ]]; then
    base=$1
elif has_rev origin/main; then
    base=origin/main
elif has_rev main; then
    base=main
else
    base=origin/main  # not here yet: fetched below
fi
plots_dir=${2:-plots/review}

if ! has_rev "$base" && git remote get-url origin >/dev/null 2>&1; then
    # origin/<branch> (or a bare branch name) that is not in this clone yet, e.g. a shallow
    # CI checkout of the PR head only.
    branch=${base#origin/}
    echo "Fetching '$branch' from origin (base '$base' is not in this clone)." >&2
    if git fetch --quiet --no-tags origin "+refs/heads/$branch:refs/remotes/origin/$branch"; then
        base=origin/$branch
    fi
fi
if ! has_rev "$base"; then
    echo "review.sh: unknown base revision '$base'" >&2
    exit 2
fi

if remote=$(dvc remote default 2>/dev/null) && [[ -n $remote ]]; then
    echo "Fetching cached metrics and plots from DVC remote '$remote'." >&2
    if ! "$dvc_python" -m quantpipe.dvcrun fetch --quiet --type metrics --type plots; then
        # Not fatal: metrics diff reads git; plots missing from storage show as errors below.
        echo "warning: dvc fetch from '$remote' failed; comparing what is available." >&2
    fi
else
    echo "No default DVC remote configured: skipping the pull (metrics and plots of this" \
         "project are in git, so the comparison does not need it)." >&2
fi

short=$(git rev-parse --short "$base")
echo "## Metrics: workspace vs $base ($short)"
echo
# Latency, throughput and memory belong to the machine that measured them: say so first.
# (quantpipe.machine needs only the standard library, so any python3 will do.)
python3 -m quantpipe.machine compare "$base"
echo
dvc metrics diff --md "$base"
echo
echo "## Params: workspace vs $base ($short)"
echo
dvc params diff --md "$base"
echo
echo "## Plots"
echo
mkdir -p "$plots_dir"  # dvc plots diff -o does not create missing parent folders
dvc plots diff "$base" -o "$plots_dir" >/dev/null  # its stdout is just the file:// URL
echo "Plots of workspace vs $base: $(pwd)/$plots_dir/index.html"
