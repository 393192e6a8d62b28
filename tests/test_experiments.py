"""Experiment sweeps through DVC's queue, the accuracy-vs-latency (Pareto) table built from
`dvc exp show --json`, and the code-review recipe scripts/review.sh.

How DVC behaves here (3.67), and so how the tests drive it:
- `dvc exp run --queue` stashes each experiment as a commit on top of HEAD; a queue worker
  runs it in a temporary clone (.dvc/tmp/exps/tmp*) that holds only what git tracks. The
  pipeline's baseline run (dvc.lock, metrics) must be committed, and its outputs in the local
  cache: then an experiment checks the unchanged stages out of the cache and re-runs only the
  static branch. Without a committed dvc.lock every experiment would re-run the whole pipeline.
- `dvc queue start -j 2` returns at once after spawning 2 detached celery workers (threads
  pool, one experiment per worker). Workers shut down by themselves about 10 s after the queue
  is empty; `dvc queue status` lists every task with Queued / Running / Success / Failed. So
  the test waits for each queued experiment to reach Success or Failed (not for "nothing is
  running": between being taken from the queue and starting, a task shows in neither), with
  a timeout, and the teardown stops the workers (`dvc queue stop --kill`) and waits for their
  processes (pids in .dvc/tmp/exps/celery/dvc-exp-worker-N.pid) to exit.
- `dvc exp run --run-all -j 2` would do start + wait in one blocking call; the queue is what a
  team uses interactively (keep working while the sweep runs), so it is what is tested.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PROBE, ROOT, copy_project, dvc, git, reproduce, set_params

REVIEW = ROOT / "scripts" / "review.sh"
PARETO = ROOT / "scripts" / "pareto.py"
STATIC_BRANCH = {PROBE, "quantize_static", "evaluate@static", "bench@static", "report"}
SUMMARY = "metrics/summary.json"
QUEUE_TIMEOUT_S = 300






@pytest.fixture(scope="module")
def baseline(tiny_run, tmp_path_factory) -> Path:
    """A copy of the session's full tiny run, committed (dvc.lock, metrics) and cached."""
    run, ran = tiny_run
    assert "train" in ran
    repo = copy_project(run, tmp_path_factory.mktemp("experiments") / "repo")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "Baseline run")
    assert git(repo, "status", "--porcelain") == ""
    return repo


def _worker_pids(repo: Path) -> list[int]:
    """Live dvc queue worker processes of this repo (checked by their command line)."""
    pids = []
    for pidfile in (repo / ".dvc/tmp/exps/celery").glob("dvc-exp-worker-*.pid"):
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"queue-worker" in cmdline:
            pids.append(pid)
    return pids


@pytest.fixture
def queue(baseline):
    """The baseline repo; afterwards no queue worker of it is left running."""
    yield baseline
    dvc(baseline, "queue", "stop", "--kill", check=False)
    deadline = time.monotonic() + 30
    while _worker_pids(baseline) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in _worker_pids(baseline):  # did not stop in time: ours, so end it
        os.kill(pid, signal.SIGKILL)
    assert not _worker_pids(baseline)


def queue_statuses(repo: Path) -> dict[str, str]:
    """Experiment name -> status from `dvc queue status` (rows: task, name, created, status)."""
    proc = dvc(repo, "queue", "status", check=False)
    statuses = {}
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and re.fullmatch(r"[0-9a-f]{7}", fields[0]):
            statuses[fields[1]] = fields[-1]
    return statuses


# Seconds without a live worker, with tasks still queued, before the queue is started again.
RESTART_AFTER_S = 20


def start_queue(repo: Path) -> float:
    dvc(repo, "queue", "start", "-j", "2")
    return time.monotonic()


def wait_for(repo: Path, names: list[str], started: float) -> dict[str, str]:
    """Wait until every named experiment is Success or Failed.

    DVC's workers sometimes exit while tasks are still queued (treeverse/dvc#10562, #8165);
    the documented remedy is another `dvc queue start`, so when no worker has been alive for
    RESTART_AFTER_S seconds and a task is still Queued, this starts the queue again.
    """
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    while True:
        statuses = queue_statuses(repo)
        if all(statuses.get(name) in ("Success", "Failed") for name in names):
            return statuses
        if _worker_pids(repo):
            started = time.monotonic()
        elif any(statuses.get(name) == "Queued" for name in names) \
                and time.monotonic() - started > RESTART_AFTER_S:
            started = start_queue(repo)
        if time.monotonic() > deadline:
            logs = "\n".join(f"{log.name}: ...{log.read_text()[-1500:]}" for log in
                             sorted((repo / ".dvc/tmp/exps/celery").glob("dvc-exp-worker-*.out")))
            pytest.fail(f"queue not done after {QUEUE_TIMEOUT_S} s: {statuses}\n{logs}")
        time.sleep(2)


def stages_run(repo: Path, name: str) -> set[str]:
    log = dvc(repo, "queue", "logs", name).stdout
    return set(re.findall(r"Running stage '([^']+)'", log))


@pytest.mark.slow  # two queued experiments through DVC's celery workers, ~80 s
def test_queued_sweep_shows_both_experiments_with_metrics(queue, tmp_path):
    repo = queue
    queued = dvc(repo, "exp", "run", "--queue",
                 "-S", "quantize_static.calibrate_method=MinMax,Percentile")
    names = re.findall(r"Queued experiment '([^']+)'", queued.stdout + queued.stderr)
    assert len(names) == 2, queued.stdout + queued.stderr
    statuses = wait_for(repo, names, start_queue(repo))
    for name in names:
        assert statuses[name] == "Success", dvc(repo, "queue", "logs", name, check=False).stdout

    shown = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    (tmp_path / "exp_show.json").write_text(json.dumps(shown))
    head = git(repo, "rev-parse", "HEAD").strip()
    base_row = next(row for row in shown if row["rev"] == head)
    base_summary = base_row["data"]["metrics"][SUMMARY]["data"]
    by_method = {}
    for exp in base_row["experiments"]:
        data = exp["revs"][0]["data"]
        method = data["params"]["params.yaml"]["data"]["quantize_static"]["calibrate_method"]
        by_method[method] = (exp["name"], data["metrics"][SUMMARY]["data"])
    assert sorted(by_method) == ["MinMax", "Percentile"]
    assert {name for name, _ in by_method.values()} == set(names)
    for _, summary in by_method.values():
        static = summary["static"]
        assert 0.5 < static["accuracy"] <= 1.0
        assert set(static["speedup"]) == {"bs1", "bs8"}
        assert all(value > 0 for value in static["speedup"].values())

    # MinMax is the committed value: that experiment re-ran nothing and reports the baseline's
    # numbers; Percentile re-ran only the static branch (all else came from the cache).
    minmax, percentile = by_method["MinMax"][0], by_method["Percentile"][0]
    assert by_method["MinMax"][1] == base_summary
    assert stages_run(repo, minmax) == {PROBE}
    assert stages_run(repo, percentile) == STATIC_BRANCH

    table = dvc(repo, "exp", "show", "--md").stdout
    assert minmax in table and percentile in table
    assert "static.accuracy" in table and "static.speedup.bs8" in table

    # The Pareto recipe on this very output: stdin -> CSV, file -> JSON, and DVC renders it.
    from_stdin = subprocess.run([sys.executable, str(PARETO)], input=json.dumps(shown),
                                capture_output=True, text=True, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(from_stdin)))
    assert {row["experiment"] for row in rows} == {"main", minmax, percentile}
    assert all(row["batch_size"] == "8" and row["pareto"] in ("true", "false") for row in rows)
    out = tmp_path / "pareto.json"
    subprocess.run([sys.executable, str(PARETO), str(tmp_path / "exp_show.json"), "-o", str(out)],
                   check=True, capture_output=True)
    records = {row["experiment"]: row for row in json.loads(out.read_text())}
    static = by_method["Percentile"][1]["static"]
    assert records[percentile]["static_accuracy"] == static["accuracy"]
    assert records[percentile]["static_p50_ms"] == static["latency_p50_ms"]["bs8"]
    assert any(row["pareto"] for row in records.values())
    csv_path = repo / "plots" / "pareto.csv"
    csv_path.parent.mkdir(exist_ok=True)
    csv_path.write_text(from_stdin)
    dvc(repo, "plots", "show", "plots/pareto.csv", "-x", "static_p50_ms", "-y", "static_accuracy",
        "--template", "scatter", "-o", str(tmp_path / "pareto_plot"))
    assert percentile in (tmp_path / "pareto_plot/index.html").read_text()


def test_pareto_flags_dominated_points_and_skips_rows_without_metrics():
    def row(rev, name, accuracy, latency):
        summary = {"static": {"accuracy": accuracy, "latency_p50_ms": latency}}
        return {"rev": rev, "name": name,
                "data": {"metrics": {SUMMARY: {"data": summary}}}}

    base = row("a" * 40, "main", 0.90, {"bs1": 0.1, "bs8": 9.0, "bs64": 2.0})
    base["experiments"] = [
        {"name": "fast", "revs": [row("b" * 40, "fast", 0.90, {"bs1": 0.1, "bs64": 1.0})]},
        {"name": "accurate", "revs": [row("c" * 40, "accurate", 0.95, {"bs64": 3.0})]},
        {"name": "dominated", "revs": [row("d" * 40, "dominated", 0.89, {"bs64": 1.5})]},
        {"name": "queued", "revs": [{"rev": "e" * 40, "name": "queued", "data": None}]},
    ]
    workspace = row("workspace", None, 0.80, {"bs64": 0.5})  # skipped unless asked for
    proc = subprocess.run([sys.executable, str(PARETO)], input=json.dumps([workspace, base]),
                          capture_output=True, text=True, check=True)
    rows = {r["experiment"]: r for r in csv.DictReader(io.StringIO(proc.stdout))}
    assert list(rows) == ["fast", "dominated", "main", "accurate"]  # by latency
    # bs64 is the largest batch (numerically, not as text: bs8 < bs64).
    assert rows["main"]["static_p50_ms"] == "2.0" and rows["main"]["batch_size"] == "64"
    assert {name for name, r in rows.items() if r["pareto"] == "true"} == {"fast", "accurate"}
    assert "skipping queued" in proc.stderr
    with_ws = subprocess.run([sys.executable, str(PARETO), "--include-workspace", "--format",
                              "json"], input=json.dumps([workspace, base]),
                             capture_output=True, text=True, check=True)
    front = {r["experiment"] for r in json.loads(with_ws.stdout) if r["pareto"]}
    assert front == {"workspace", "fast", "accurate"}  # fastest of all: on the front


def test_review_script_reports_metrics_and_param_changes(baseline, tmp_path):
    # A reviewer's clone sharing the baseline's DVC cache (`dvc cache dir --local`): outputs
    # are checked out, not recomputed. No DVC remote is configured.
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(baseline), str(clone)], check=True)
    dvc(clone, "cache", "dir", "--local", str(baseline / ".dvc/cache"))
    dvc(clone, "checkout")
    git(clone, "checkout", "-q", "-b", "percentile")
    set_params(clone, {"quantize_static": {"calibrate_method": "Percentile"}})
    # The sweep test may have left this exact run in the shared run cache: then DVC restores
    # it instead of running it, but the same stages are reproduced.
    assert reproduce(clone) == STATIC_BRANCH
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "Calibrate with Percentile")

    def review(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(["bash", str(REVIEW), *args], cwd=clone / "stages",
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def check(proc: subprocess.CompletedProcess, base: str) -> None:
        out = proc.stdout
        assert "No default DVC remote configured: skipping the pull" in proc.stderr
        head, rest = out.split("### Metrics (metrics/summary.json)")
        # Both sides were measured here: the review says so before the numbers, then the gate.
        assert f"## quantpipe review: workspace vs {base} (" in head.splitlines()[0]
        assert f"Machine: {base} and the workspace were measured on the same kind of machine" \
            in head.splitlines()[2], head
        assert re.search(rf"^\*\*Gate (passed|failed)\*\*: .* against {re.escape(base)} ", head, re.M), head
        metrics, rest = rest.split("### Params")
        assert re.search(rf"^\| Path +\| Metric +\| {re.escape(base)} +\| workspace +\| Change",
                         metrics, re.M), metrics
        assert re.search(r"^\| metrics/summary\.json +\| static\.\S+ ", metrics, re.M), metrics
        params, recommended = rest.split("### Recommended (workspace)")
        assert re.search(r"^\| params\.yaml +\| quantize_static\.calibrate_method +\| MinMax +"
                         r"\| Percentile +\|", params, re.M), params
        assert "**Recommended** (by latency" in recommended
        html = clone / "plots/review/index.html"
        assert "`plots/review/index.html`" in out and html.stat().st_size > 0

    check(review(), "origin/main")  # the default base: origin/main, the clone's upstream
    # A CI checkout without the base branch: review.sh fetches it from origin first.
    git(clone, "update-ref", "-d", "refs/remotes/origin/main")
    fetched = review("origin/main")
    assert "Fetching 'main' from origin" in fetched.stderr
    check(fetched, "origin/main")

    unknown = subprocess.run(["bash", str(REVIEW), "no-such-branch"], cwd=clone,
                             capture_output=True, text=True, timeout=60)
    assert unknown.returncode != 0 and "unknown base revision 'no-such-branch'" in unknown.stderr
