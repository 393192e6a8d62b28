"""Fixtures that build a throw-away copy of the project as its own git + DVC repository."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from dvc.repo import Repo
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
# `make test` runs two pytest-xdist workers on 2 cores, each starting stage processes: PyTorch's
# default of an OpenMP thread per core would put two busy threads on each core, and they wait for
# each other (measured: the tiny train stage 2-8x slower beside the other worker's load). One
# thread per process there; numbers are benchmarks' business, not the tests'.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# What a clone needs to run the pipeline; nothing generated is copied.
PROJECT_FILES = ("dvc.yaml", "params.yaml", ".dvcignore", ".gitignore", "stages", "quantpipe", "inputs",
                 ".dvc/config", ".dvc/.gitignore")

# Small enough that a full `dvc repro` takes well under a minute on 2 cores.
TINY_PARAMS = {
    "prepare": {"calib_size": 64},
    "train": {"model": "simple_cnn", "epochs": 1, "batch_size": 32},
    "quantize_qat": {"epochs": 1, "batch_size": 32},
    "evaluate": {"batch_size": 64},
    "bench": {"batch_sizes": [1, 8], "warmup": 2, "runs": 10, "rounds": 2},
    "gates": {"enforce": False},
}


# The files whose one pipeline run takes minutes, longest first: `make test`'s two workers start
# on them (its --no-loadscope-reorder keeps this order; xdist's own sends the files with most
# tests first), so no worker is left running one alone at the end (measured: the Ultralytics
# recipe, one test, went last and ran its 3.5 minutes with the other worker idle).
LONGEST_FIRST = ("test_detection.py", "test_ultralytics.py", "test_pipeline.py", "test_failures.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


def set_params(repo: Path, changes: dict) -> None:
    """Merge nested `changes` into repo/params.yaml."""
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())

    def merge(into: dict, new: dict) -> None:
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    merge(params, changes)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com",
                           *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def make_project(dest: Path, params: dict | None = None) -> Path:
    """Copy the project into dest, apply params, and commit it as a fresh git repo."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        src = ROOT / name
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, target)
    if params:
        set_params(dest, params)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "project")
    return dest


def copy_project(src: Path, dest: Path) -> Path:
    """A copy of a project repo — work tree, git, DVC cache and lock — to change freely
    (DVC's own temporary state is left behind: the copy rebuilds it)."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        return {"tmp"} & set(names) if Path(folder).name == ".dvc" else set()

    shutil.copytree(src, dest, symlinks=True, ignore=ignore)
    return dest


# The machine probe (dvc.yaml `machine`, always_changed): it runs on every `dvc repro`, and
# only when its output changes (another machine) does anything downstream re-run.
PROBE = "machine"


def reproduce(repo: Path, *targets: str, force: bool = False, run_cache: bool = True) -> set[str]:
    """`dvc repro` through DVC's Python API in repo; the names of the stages that ran (the
    always-changed PROBE among them, unless targets leave it out). run_cache=False is
    `--no-run-cache`: really run a stage whose inputs an earlier run already had."""
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        with Repo(str(repo)) as project:
            ran = project.reproduce(*targets, force=force, run_cache=run_cache)
    finally:
        os.chdir(cwd)
    return {stage.addressing for stage in ran}


def dvc(cwd: Path, *args: str, env: dict | None = None, check: bool = True,
        timeout: int = 300, **kwargs) -> subprocess.CompletedProcess:
    """The dvc CLI in a subprocess (this interpreter's), output captured; fails the test on a
    non-zero exit unless check=False."""
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd,
                          env=dict(os.environ) if env is None else env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        pytest.fail(f"`dvc {' '.join(args)}` exited {proc.returncode}\n"
                    f"{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, worker_id) -> tuple[Path, set[str]]:
    """One complete `dvc repro` with TINY_PARAMS per test run, and the stages it ran. Modules that
    start from a complete run take a copy (copy_project) instead of running the pipeline again;
    never change this one. pytest-xdist's workers share it: the first to need it builds it under
    a file lock, the others wait for it (one run of the pipeline instead of one per worker)."""
    if worker_id == "master":  # no xdist workers
        repo = make_project(tmp_path_factory.mktemp("tiny-run"), TINY_PARAMS)
        return repo, reproduce(repo)
    shared = tmp_path_factory.getbasetemp().parent / "tiny-run"  # the workers' common folder
    ran_file = shared / "ran.json"
    with FileLock(f"{shared}.lock"):
        if not ran_file.exists():  # written last: a worker whose run failed leaves none
            shutil.rmtree(shared, ignore_errors=True)
            ran = reproduce(make_project(shared / "repo", TINY_PARAMS))
            ran_file.write_text(json.dumps(sorted(ran)))
    return shared / "repo", set(json.loads(ran_file.read_text()))


@pytest.fixture(autouse=True, scope="session")
def _environment():
    """Stage commands run `python`: make it this interpreter; keep DVC offline and quiet."""
    old = dict(os.environ)
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    os.environ["DVC_NO_ANALYTICS"] = "1"
    os.environ.pop("QUANTPIPE_DEBUG", None)
    # Scripts run as subprocesses (scripts/sweep.py and its Dask workers) import this checkout's
    # quantpipe whichever checkout a shared virtualenv has installed; a stage run as
    # `python -m stages.<name>` in a copy still finds the copy's own first (its working directory).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    yield
    os.environ.clear()
    os.environ.update(old)


# --- a real S3 API (moto server): test_remote.py, test_sweep.py --------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def s3_endpoint(tmp_path, monkeypatch):
    """A real S3 API on 127.0.0.1 (moto_server) with bucket `quantpipe`; always stopped."""
    # Dummy credentials for the test process only (a CI job's secrets would come this way);
    # no ~/.aws files, no instance-metadata lookup (there is no network).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAQUANTPIPECI")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ci-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).parent / "moto_server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    log_path = tmp_path / "moto_server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # a loaded 2-core machine imports moto slowly
        while True:
            if server.poll() is not None:
                pytest.fail(f"moto_server exited {server.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(url, timeout=1):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"moto_server not answering on {url}:\n{log_path.read_text()}")
                time.sleep(0.1)
        import boto3
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="quantpipe")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
