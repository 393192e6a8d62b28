"""Experiment sweeps on a Dask cluster (scripts/sweep.py): real parts only.

A real `distributed.LocalCluster` with 2 worker processes (made by the script, or by the test
and given as --scheduler), a bare git repository as the git remote, and a DVC remote: a local
directory, or S3 served by moto (conftest.s3_endpoint). The project is the tiny pipeline,
run and committed once (the baseline), pushed to both remotes as a team would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PROBE, ROOT, TINY_PARAMS, dvc, git, make_project, reproduce
from quantpipe import sweep as sweeps
from quantpipe.errors import UserError

SWEEP = ROOT / "scripts" / "sweep.py"
GRID = ("-S", "quantize_static.calibrate_method=MinMax,Entropy",
        "-S", "quantize_static.per_channel=true,false")
NAMES = {f"calibrate_method-{m}_per_channel-{c}" for m in ("MinMax", "Entropy")
         for c in ("True", "False")}
SUMMARY = "metrics/summary.json"
# QAT off: it is another branch, and the sweep varies only quantize_static.
SWEEP_PARAMS = {**TINY_PARAMS, "quantize_qat": {"enabled": False}}


def test_grid_is_dvc_exp_runs_syntax_and_names_follow_the_values_that_vary():
    jobs = sweeps.jobs_for(["quantize_static.calibrate_method=MinMax,Entropy",
                            "bench.batch_sizes=[1,8],[1,64]", "train.epochs=2"],
                           "git@example.com:team/quantpipe.git", "a" * 40, None)
    assert [j.overrides for j in jobs] == [
        ("quantize_static.calibrate_method=MinMax", "bench.batch_sizes=[1,8]", "train.epochs=2"),
        ("quantize_static.calibrate_method=MinMax", "bench.batch_sizes=[1,64]", "train.epochs=2"),
        ("quantize_static.calibrate_method=Entropy", "bench.batch_sizes=[1,8]", "train.epochs=2"),
        ("quantize_static.calibrate_method=Entropy", "bench.batch_sizes=[1,64]", "train.epochs=2")]
    # Valid git ref names, one per experiment; the key that does not vary is left out.
    assert [j.name for j in jobs] == [
        "calibrate_method-MinMax_batch_sizes-1-8", "calibrate_method-MinMax_batch_sizes-1-64",
        "calibrate_method-Entropy_batch_sizes-1-8", "calibrate_method-Entropy_batch_sizes-1-64"]
    for job in jobs:
        git(ROOT, "check-ref-format", f"refs/exps/{job.name}")
    with pytest.raises(UserError, match="two experiments would share a name"):
        sweeps.jobs_for(["prepare.path=inputs/x,inputs_x"], "url", "a" * 40, None)


def test_error_line_prefers_the_stages_own_message():
    dvc_output = ("Running stage 'quantize_static':\n"
                  "error: params.yaml: quantize_static.calibrate_method = 'Bogus' is not allowed\n"
                  "ERROR: failed to reproduce 'quantize_static': failed to run: python "
                  "-m stages.quantize_static --fp32 models/fp32.onnx, exited with 2\n")
    assert sweeps.error_line(dvc_output) == \
        "error: params.yaml: quantize_static.calibrate_method = 'Bogus' is not allowed"
    assert sweeps.error_line(dvc_output.split("\n", 2)[2]).startswith("ERROR: failed to repro")
    assert sweeps.error_line("fatal: repository 'x' does not exist\n") == \
        "fatal: repository 'x' does not exist"


def committed_run(dest: Path, params: dict) -> Path:
    repo = make_project(dest, params)
    assert "quantize_static" in reproduce(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "Baseline run")
    return repo


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    return committed_run(tmp_path_factory.mktemp("sweep-baseline"), SWEEP_PARAMS)


def published(run: Path, where: Path, url: str, shared: dict[str, str] | None = None) -> Path:
    """A copy of a committed run with a bare git remote (origin) and a default DVC remote in
    the committed .dvc/config, both pushed: what a team has before it sweeps."""
    repo = where / "project"
    shutil.copytree(run, repo, symlinks=True)
    origin = where / "origin.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(origin)], check=True)
    dvc(repo, "remote", "add", "-d", "storage", url)
    for key, value in (shared or {}).items():
        dvc(repo, "remote", "modify", "storage", key, value)
    git(repo, "add", ".dvc/config")
    git(repo, "commit", "-qm", "DVC remote")
    git(repo, "remote", "add", "origin", str(origin))
    git(repo, "push", "-q", "origin", "main")
    dvc(repo, "push", "--run-cache")
    return repo


def sweep(repo: Path, *args: str, out: Path) -> tuple[subprocess.CompletedProcess, float, dict]:
    """Run scripts/sweep.py in repo; (process, wall seconds, the -o rows file)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SWEEP), *args, "-o", str(out)], cwd=repo,
                          capture_output=True, text=True, timeout=1200)
    return proc, time.perf_counter() - start, json.loads(out.read_text()) if out.exists() else {}


def shown(repo: Path) -> dict[str, dict]:
    """Experiment name -> its data in `dvc exp show --json` (experiments of HEAD)."""
    rows = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    head = git(repo, "rev-parse", "HEAD").strip()
    base = next(row for row in rows if row["rev"] == head)
    return {exp["name"]: exp["revs"][0]["data"] for exp in base.get("experiments") or []}


# Slow (make test-slow): with the baseline run it adds over a minute to `make test`.
@pytest.mark.slow
def test_sweep_on_s3_reports_a_failing_experiment_and_finishes_the_others(baseline, tmp_path,
                                                                         s3_endpoint):
    repo = published(baseline, tmp_path, "s3://quantpipe/dvcstore",
                     shared={"endpointurl": s3_endpoint})
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]  # the workers' own environment, as in CI
    proc, _, result = sweep(repo, "--workers", "2",
                            "-S", "quantize_static.calibrate_method=Percentile,Bogus",
                            out=tmp_path / "rows.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one experiment failed
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {"calibrate_method-Percentile", "calibrate_method-Bogus"}
    bad, good = rows["calibrate_method-Bogus"], rows["calibrate_method-Percentile"]
    why = ("error: params.yaml: quantize_static.calibrate_method = 'Bogus' is not allowed; "
           "use one of ['MinMax', 'Entropy', 'Percentile', 'Distribution']")
    assert bad["error"] == why and "metrics" not in bad
    assert f"calibrate_method-Bogus: failed: {why}" in proc.stderr
    assert good["ran"] == [PROBE, "quantize_static", "evaluate@static", "bench@static", "report"]
    static = good["metrics"]["summary"]["static"]
    assert 0.5 < static["accuracy"] <= 1 and good["metrics"]["quantize_static"][
        "calibrate_method"] == "Percentile"
    table = proc.stdout
    assert re.search(r"^\| calibrate_method-Percentile \| Percentile \| 0\.\d{3} \|", table, re.M)
    assert re.search(r"^\| calibrate_method-Bogus \| Bogus \| failed: error: ", table, re.M)
    # Nothing secret went into a task, a log line or the result.
    assert secret not in proc.stdout + proc.stderr + (tmp_path / "rows.json").read_text()

    # The coordinator pulled the experiment: dvc exp show lists it with its metrics.
    experiments = shown(repo)
    assert set(experiments) == {"calibrate_method-Percentile"}
    data = experiments["calibrate_method-Percentile"]
    assert data["metrics"][SUMMARY]["data"]["static"] == static
    assert data["params"]["params.yaml"]["data"]["quantize_static"]["calibrate_method"] == \
        "Percentile"
    # Outputs and the run cache are in the bucket, the experiment on the git remote.
    import boto3
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    keys = [obj["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket="quantpipe", Prefix="dvcstore/") for obj in page.get("Contents", [])]
    assert any(k.startswith("dvcstore/runs/") for k in keys)
    refs = git(repo, "ls-remote", "origin", "refs/exps/*")
    assert "calibrate_method-Percentile" in refs and "Bogus" not in refs


def test_sweep_needs_the_commit_on_the_git_remote(tmp_path):
    # The check comes before any work: a committed project without a run is enough.
    repo = published(make_project(tmp_path / "unrun", SWEEP_PARAMS), tmp_path,
                     str(tmp_path / "store"))
    git(repo, "commit", "-q", "--allow-empty", "-m", "not pushed")
    proc, _, _ = sweep(repo, *GRID, out=tmp_path / "rows.json")
    head = git(repo, "rev-parse", "--short=7", "HEAD").strip()
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: commit {head} (HEAD) is not on git remote 'origin': workers clone it from "
        "there (git push origin HEAD)")


# --- the full scenario: 4 experiments, a killed worker, a re-submission ----------------------

def _processes_in(path: Path) -> list[int]:
    """Pids whose working directory is under path."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")).is_relative_to(path):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _kill_worker_mid_experiment(workdir: Path, sweeping: subprocess.Popen) -> tuple[Path, int]:
    """Wait until some worker is running a stage, then SIGKILL that Dask worker process (the
    parent of the experiment's process-group leader); (the experiment's workspace, its pid)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and sweeping.poll() is None:
        for log in workdir.glob("*/log"):
            if "Running stage 'quantize_static'" in log.read_text(errors="replace"):
                leaders = [pid for pid in _processes_in(log.parent / "repo")
                           if os.getpgid(pid) == pid]
                if leaders:
                    stat = Path(f"/proc/{leaders[0]}/stat").read_text()
                    worker = int(stat.rsplit(")", 1)[1].split()[1])  # ppid
                    os.kill(worker, signal.SIGKILL)
                    return log.parent, worker
        time.sleep(0.2)
    pytest.fail(f"no experiment reached quantize_static (sweep exit code {sweeping.poll()})")


@pytest.mark.slow
def test_sweep_survives_a_killed_worker_and_a_resubmission_runs_no_stage(tmp_path_factory,
                                                                         tmp_path):
    from distributed import LocalCluster

    run = committed_run(tmp_path_factory.mktemp("sweep-kill"), SWEEP_PARAMS)
    repo = published(run, tmp_path, str(tmp_path / "dvc-store"))
    workdir = tmp_path / "workspaces"
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        args = [sys.executable, str(SWEEP), "--scheduler", cluster.scheduler_address,
                "--workdir", str(workdir), *GRID]
        start = time.perf_counter()
        with open(tmp_path / "first.out", "w") as stdout, \
                open(tmp_path / "first.err", "w") as stderr:
            first = subprocess.Popen([*args, "-o", str(tmp_path / "first.json")], cwd=repo,
                                     stdout=stdout, stderr=stderr, text=True)
            killed, killed_pid = _kill_worker_mid_experiment(workdir, first)
            first.wait(timeout=1200)
        first_s = time.perf_counter() - start
        out, err = (tmp_path / "first.out").read_text(), (tmp_path / "first.err").read_text()
        assert first.returncode == 0, out + err
        rows = {r["name"]: r for r in json.loads((tmp_path / "first.json").read_text())["rows"]}
        assert set(rows) == NAMES and all("metrics" in r for r in rows.values()), out + err

        # The killed worker's experiment ran again in another worker process, from a fresh
        # clone; its half-run workspace is left, and nothing of it still runs (the process
        # group went with the worker).
        name = killed.name.split(".")[0]
        assert "quantize_static" in rows[name]["ran"] and rows[name]["pid"] != killed_pid
        time.sleep(2)
        assert _processes_in(killed) == []
        # The baseline's own params re-ran nothing and report the committed numbers.
        baseline_summary = json.loads((repo / SUMMARY).read_text())
        assert rows["calibrate_method-MinMax_per_channel-True"]["ran"] == [PROBE]
        assert rows["calibrate_method-MinMax_per_channel-True"]["metrics"]["summary"] == \
            baseline_summary
        for r in rows.values():
            machine = r["metrics"]["machine"]
            assert machine["cpu"] == baseline_summary["machine"]["cpu"]
            assert f"| {r['name']} |" in out

        experiments = shown(repo)
        assert set(experiments) == NAMES
        for exp, data in experiments.items():
            assert data["metrics"][SUMMARY]["data"] == rows[exp]["metrics"]["summary"]

        # The same sweep again: every stage is restored from the shared run cache.
        proc, again_s, result = sweep(repo, "--scheduler", cluster.scheduler_address,
                                      "--workdir", str(workdir), *GRID,
                                      out=tmp_path / "again.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    again = {r["name"]: r for r in result["rows"]}
    assert all(r["ran"] == [PROBE] for r in again.values()), {n: r["ran"] for n, r in again.items()}
    changed = NAMES - {"calibrate_method-MinMax_per_channel-True"}  # the rest re-ran the branch
    assert all({"quantize_static", "evaluate@static", "bench@static", "report"} <=
               set(again[n]["restored"]) for n in changed)
    for n in NAMES:  # identical results, bench timings included
        assert again[n]["metrics"]["summary"] == rows[n]["metrics"]["summary"]
    # What the run cache saves is in the times (informative only: the stages lists above are
    # the check; a timed assertion flakes with the machine's load).
    print(f"first sweep {first_s:.0f} s (one worker killed), again {again_s:.0f} s")
