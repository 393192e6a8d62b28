# quantpipe: `make repro` runs the pipeline, `make test` the tests. Both set up the environment
# first: the active virtualenv when VIRTUAL_ENV is set, otherwise ./.venv (created here).
SHELL := /bin/bash
.DEFAULT_GOAL := repro

VENV := $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),$(CURDIR)/.venv)
BIN := $(VENV)/bin
# The Python ./.venv is made with (3.11, 3.12 or 3.13: scripts/check_python.py says so before
# anything is created or downloaded).
PYTHON ?= python3
# The install is redone only when the pinned requirements change (the stamp names their hash).
REQ_HASH := $(shell cat requirements.txt constraints.txt | sha256sum | cut -c1-16)
STAMP := $(VENV)/.quantpipe-deps-$(REQ_HASH)
# dvc.yaml runs `python -m stages.<name> ...`: the environment's python must come first on PATH.
export PATH := $(BIN):$(PATH)
export DVC_NO_ANALYTICS := 1
REV ?= main
# Every DVC command here waits for DVC's repository lock instead of failing after 3 s (a run
# that lost the lock after a stage would lose that stage's result), and one that takes the lock
# stops at once while another run's stage is going (quantpipe/dvcrun.py).
DVC := python -m quantpipe.dvcrun

.PHONY: env pull repro test test-all test-slow docs diff diff-all review gate plots clean

# quantpipe itself is installed editable (the checkout's code is what runs), and again whenever
# the installed one is another checkout's (several clones sharing one virtualenv). Checked from
# / so that the working directory's own quantpipe/ does not answer for the installed one.
env: $(STAMP)
	@cd / && $(BIN)/python -c "import quantpipe, sys; sys.exit(not quantpipe.__file__.startswith('$(CURDIR)/'))" 2>/dev/null \
	  || $(BIN)/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$(CURDIR)"

$(STAMP): requirements.txt constraints.txt
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) scripts/check_python.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -r requirements.txt -c constraints.txt
	@rm -f $(VENV)/.quantpipe-deps-* && touch $@

# What the default DVC remote has of this revision's outputs and run cache (CI, a fresh clone):
# `dvc repro` then re-runs only what it lacked. Without a default remote, or when the remote
# cannot be reached (no credentials: a pull request from a fork), it says so and goes on.
pull: env
	@if remote=$$(dvc remote default 2>/dev/null); then \
	  echo "Pulling from DVC remote '$$remote' (what it has; dvc repro makes the rest)."; \
	  $(DVC) pull --run-cache --allow-missing \
	    || echo "warning: dvc pull from '$$remote' failed; dvc repro rebuilds what is missing."; \
	else echo "No default DVC remote (.dvc/config): nothing to pull; dvc repro rebuilds every output."; fi

repro: env
	$(DVC) repro
	@echo
	@cat metrics/report.md
	@echo "Outputs: data/ (splits, calibration), models/ (model.pt, exported/fp32/dynamic/static/qat .onnx),"
	@echo "         metrics/ (summary.json, report.md, per-stage JSON). Compare with: make diff"

# `slow` tests (every torchvision family end to end; the Dask sweeps: S3, a killed worker, a
# re-submission; the forced re-run's identical bytes; detection folders; every documented
# command) are left to test-all and test-slow (run by hand before a change lands; CI runs `test`).
# Two pytest workers (pytest-xdist), one test file each at a time: most of a test's time is one
# single-threaded stage process, so both cores work (15 minutes where one worker took 20, when
# this was set up; 12 now). Files go out in collection order (--no-loadscope-reorder; xdist's
# default sends the files with most tests first), which tests/conftest.py starts with the
# minute-long pipeline runs.
test: env
	python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" tests

test-all: env
	python -m pytest -q tests

# Two workers, a file each at a time, as `test`: the documents' commands (one file, about an
# hour: the longest) run beside the other slow files. The slowest ten are listed at the end.
test-slow: env
	python -m pytest -q -n 2 --dist loadfile -m slow --durations=10 tests

# The measured tables of README.md and docs/, rewritten from the committed metrics/*.json
# (tests/test_docs.py fails while a document and the metrics disagree).
docs: env
	python -m quantpipe.docs

# Code review: the summary metrics and the params of the work tree against REV (default
# main), and whether both were measured on the same kind of machine. `make diff-all` adds
# every metrics file (per-class accuracy, all percentiles, ...).
diff: env
	@python -m quantpipe.machine compare $(REV)
	$(DVC) metrics diff --md --targets metrics/summary.json -- $(REV)
	$(DVC) params diff --md $(REV)

diff-all: env
	@python -m quantpipe.machine compare $(REV)
	$(DVC) metrics diff --md $(REV)
	$(DVC) params diff --md $(REV)

# The review Markdown of the work tree against REV (scripts/review.sh): the comment CI posts on a
# pull request (.github/workflows/review.yml).
review: env
	@bash scripts/review.sh $(REV)

# The regression gate: the work tree's metrics against REV's, with the tolerances of params.yaml
# `review` (quantpipe/review.py). One line per breach and exit 1 when accuracy, speed (same kind
# of machine only), size or a report gate regressed.
gate: env
	@python -m quantpipe.review gate $(REV)

plots: env
	$(DVC) plots show -o plots
	@echo "open plots/index.html"

clean:
	rm -rf .venv plots .pytest_cache
