#!/usr/bin/env bash
# Code review of a pipeline change: what the work tree (a PR's head in CI) changed against a
# base revision, as Markdown a reviewer (or a CI job posting a PR comment) can read.
#
#   scripts/review.sh [BASE [PLOTS_DIR]]        (make review REV=BASE)
#
#   BASE       git revision to compare with. Default: origin/main if it exists, else main.
#              A remote-tracking ref that is not there yet (a shallow CI checkout) is fetched
#              from origin first.
#   PLOTS_DIR  where `dvc plots diff` writes its HTML. Default: plots/review (git-ignored).
#
# Run it from anywhere inside the repository, with `dvc` on PATH (source .venv/bin/activate).
# Prints the DVC remote data fetch for the comparison, or why it was skipped (stderr), then
# (stdout, the comment .github/workflows/review.yml posts on the pull request):
#   1. whether BASE and the workspace were measured on the same kind of machine (CPU, INT8 ISA
#      flags, cores, runtime versions: metrics/machine.json);
#   2. the regression gate's verdict (`make gate REV=BASE`, quantpipe/review.py): its breaches,
#      or that it passed; a breach does not stop this script (CI's gate step fails on it);
#   3. `dvc metrics diff --md --targets metrics/summary.json BASE` - the summary's changed
#      metrics (`make diff-all` shows every metrics file);
#   4. `dvc params diff --md BASE`   - changed params.yaml keys;
#   5. the report's recommended lines (what to ship per batch size) of the workspace;
#   6. where `dvc plots diff BASE` wrote index.html (latency, accuracy vs size, confusion, ...).
#
# What needs a pull: metrics and plots of this project are `cache: false`, i.e. committed to
# git, so metrics diff and plots diff need nothing from remote storage. The fetch below only
# matters for metrics/plots a dvc.yaml keeps in the DVC cache; it is restricted to those
# (`--type metrics --type plots`), downloads into the cache without touching the work tree,
# and covers the work tree's revision. For BASE, `dvc plots diff` reads cached plot data of an
# old revision straight from the default remote when it is not in the local cache.
#
# The remote's credentials come from the environment (AWS_ACCESS_KEY_ID, ... from CI secrets)
# or .dvc/config.local, never from .dvc/config.
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
echo "## quantpipe review: workspace vs $base ($short)"
echo
# Latency, throughput and memory belong to the machine that measured them: say so first.
"$dvc_python" -m quantpipe.machine compare "$base"
echo
# Exit 1 is a breach, said in the Markdown; anything else (2: bad params, no metrics) stops here.
"$dvc_python" -m quantpipe.review gate "$base" || [[ $? -eq 1 ]]
echo
echo "### Metrics (metrics/summary.json)"
echo
changed=$(dvc metrics diff --md --targets metrics/summary.json -- "$base")
echo "${changed:-No summary metric changed.}"
echo
echo "### Params"
echo
changed=$(dvc params diff --md "$base")
echo "${changed:-No param changed.}"
echo
echo "### Recommended (workspace)"
echo
"$dvc_python" -m quantpipe.review recommended
echo
echo "### Plots"
echo
mkdir -p "$plots_dir"  # dvc plots diff -o does not create missing parent folders
dvc plots diff "$base" -o "$plots_dir" >/dev/null  # its stdout is just the file:// URL
echo "Plots of workspace vs $base: \`$plots_dir/index.html\` (in CI: the build artifact \`review\`)."
