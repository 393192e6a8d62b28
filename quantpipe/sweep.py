"""Experiment sweeps on a Dask cluster: the task each worker runs and the coordinator's parts.

The task (`run_experiment`) is one `dvc exp run` from a fresh clone to the shared remotes. It
is shipped to workers by value (cloudpickle), so it uses only the standard library and the
`dvc` a worker's `make env` installed, never `quantpipe` itself: a worker may have another
checkout, or none. scripts/sweep.py is the command line.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from quantpipe.errors import UserError

# dvc.yaml's always_changed machine probe: it runs in every experiment (in well under a
# second), so "stages run" leaves it out.
PROBE = "machine"

# --- on the worker: standard library (+ dvc) only -------------------------------------------

RAN = re.compile(r"^Running stage '([^']+)'", re.M)
RESTORED = re.compile(r"^Stage '([^']+)' is cached - skipping run", re.M)
# Every task works in a clone of its own, where nothing else takes DVC's lock; waiting for it
# (quantpipe.dvcrun says why) costs nothing and keeps a result safe if someone does.
DVC = [sys.executable, "-m", "dvc", "--wait-for-lock"]

# Runs a command in its own process group and kills the whole group when its parent (the
# Dask worker) dies: a worker killed mid-experiment must not leave `dvc exp run` and its
# stage processes running beside the retry (they would skew its benchmarks).
REAPER = """\
import ctypes, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl
    os.killpg(0, signal.SIGKILL)
sys.exit(subprocess.call(sys.argv[2:]))
"""


class SweepError(Exception):
    """A step around the experiment (clone, pull, push) failed: worth retrying elsewhere."""


@dataclass(frozen=True)
class Job:
    """One experiment: what a task gets (no credentials)."""
    name: str
    git_url: str
    rev: str
    overrides: tuple[str, ...]  # `-S` arguments, one value each
    workdir: str | None = None  # on the worker; default <tmp>/quantpipe-sweep


def error_line(text: str) -> str:
    """The one line that says why a dvc command failed: a stage's `error: ...` (quantpipe's
    UserError), else DVC's last `ERROR: ...`, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for prefix in ("error: ", "ERROR: ", "ERROR "):
        found = [ln for ln in lines if ln.startswith(prefix)]
        if found:
            return found[-1]
    return lines[-1] if lines else "(no output)"


def _run(args: list[str], cwd: Path, log: Path) -> tuple[int, str]:
    """Run args (under REAPER) in cwd, output appended to log; (exit code, this output)."""
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_TERMINAL_PROMPT": "0",
           # Stage commands run `python`: the worker's environment, as `make env` made it.
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    start = log.stat().st_size if log.exists() else 0
    with log.open("a") as out:
        out.write(f"$ {' '.join(args)}\n")
        out.flush()
        rc = subprocess.call([sys.executable, "-c", REAPER, str(os.getpid()), *args], cwd=cwd,
                             env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return rc, log.read_bytes()[start:].decode(errors="replace")


def _step(args: list[str], cwd: Path, log: Path) -> str:
    rc, text = _run(args, cwd, log)
    if rc:
        raise SweepError(f"`{' '.join(args[:4])}` exited {rc} on {socket.gethostname()}: "
                         f"{error_line(text)}")
    return text


def _runs_dir(repo: Path) -> Path:
    """Where repo's run cache lives (<cache>/runs, wherever the worker's DVC keeps its cache)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as project:
        return Path(project.stage_cache.cache_dir)


def _run_cache_entries(runs: Path) -> dict[tuple[str, str], Path]:
    """Every run-cache entry under runs: (key, value) -> its file (runs/<key[:2]>/<key>/<value>)."""
    return {(p.parent.name, p.name): p for p in runs.glob("*/*/*")}


def _push_run_cache_outputs(repo: Path, runs: Path, before: set[tuple[str, str]]) -> None:
    """Push the outputs that this run's new run-cache entries restore.

    `dvc push --run-cache` (DVC 3.67) uploads the entries but not the `cache: false` metrics and
    plots they restore (it pushes only what the workspace tracks); without them another worker
    cannot restore the stage and runs it again.
    """
    import yaml
    from dvc.repo import Repo
    from dvc_data.hashfile.hash_info import HashInfo

    objs = set()
    for key, path in _run_cache_entries(runs).items():
        if key not in before:
            for out in yaml.safe_load(path.read_text()).get("outs", []):
                # Entries written before DVC 3 have no `hash: md5` (dos2unix md5s).
                objs.add(HashInfo("md5" if out.get("hash") == "md5" else "md5-dos2unix",
                                  out["md5"]))
    with Repo(str(repo)) as project:
        failed = project.cloud.push(objs).failed
    if failed:
        raise SweepError(f"could not push {len(failed)} run-cache output(s) from "
                         f"{socket.gethostname()}")


def run_experiment(job: Job) -> dict:
    """The Dask task: one experiment from a fresh clone to the shared remotes; a result row.

    Raises SweepError (Dask retries it) when cloning, pulling or pushing fails; a failing
    experiment returns a row with `error`.
    """
    start = time.perf_counter()
    base = Path(job.workdir or Path(tempfile.gettempdir()) / "quantpipe-sweep")
    base.mkdir(parents=True, exist_ok=True)
    ws = Path(tempfile.mkdtemp(prefix=f"{job.name}.", dir=base))
    log, repo = ws / "log", ws / "repo"
    row = {"name": job.name, "worker": socket.gethostname(), "pid": os.getpid()}
    try:
        _step(["git", "clone", "-q", "--no-checkout", job.git_url, str(repo)], ws, log)
        _step(["git", "checkout", "-q", "--detach", job.rev], repo, log)
        _step([*DVC, "pull", "--run-cache", "--allow-missing"], repo, log)
        runs = _runs_dir(repo)
        before = set(_run_cache_entries(runs))
        exp_start = time.perf_counter()
        flags = [arg for o in job.overrides for arg in ("-S", o)]
        rc, text = _run([*DVC, "exp", "run", "--pull", "-n", job.name, *flags], repo, log)
        row.update(exp_seconds=round(time.perf_counter() - exp_start, 1),
                   ran=RAN.findall(text), restored=RESTORED.findall(text))
        if rc:
            row.update(error=error_line(text), log_tail=text.splitlines()[-15:])
            return row
        # Outputs first, then the run-cache entries: an entry must never reach the remote
        # before what it restores (DVC tries only the newest entry of a stage).
        _push_run_cache_outputs(repo, runs, before)
        _step([*DVC, "push", "--run-cache"], repo, log)
        _step([*DVC, "exp", "push", "-f", "--no-cache", "origin", job.name], repo, log)
        row["metrics"] = {name: json.loads((repo / "metrics" / f"{name}.json").read_text())
                          for name in ("summary", "quantize_static", "machine")}
        return row
    finally:
        row["seconds"] = round(time.perf_counter() - start, 1)
        shutil.rmtree(ws, ignore_errors=True)


# --- on the coordinator ---------------------------------------------------------------------

def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def grid(set_params: list[str]) -> list[tuple[str, ...]]:
    """`-S` arguments -> one tuple of single-value overrides per experiment (DVC's parser)."""
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import get_hydra_sweeps

    sweeps = get_hydra_sweeps(to_path_overrides(set_params))
    return [tuple(o if path == "params.yaml" else f"{path}:{o}"
                  for path, overrides in sweep.items() for o in overrides) for sweep in sweeps]


def experiment_name(overrides: tuple[str, ...], varying: set[str]) -> str:
    """A readable, valid git ref name from the values that vary, e.g.
    calibrate_method-Entropy_per_channel-False; the same params give the same name."""
    parts = []
    for override in overrides:
        key, value = override.split("=", 1)
        if key in varying:
            # Git refs allow neither ':' '[' ' ' nor '..'; keep letters, digits, '.' and '-'.
            slug = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9.-]+", "-", value)).strip("-.")
            last = key.split(":")[-1].rsplit(".", 1)[-1]  # params.yaml:a.b.c -> c
            parts.append(f"{last}-{slug or 'empty'}")
    name = "_".join(parts)[:80].rstrip("-._")
    return name or f"sweep-{hashlib.sha1(chr(10).join(overrides).encode()).hexdigest()[:7]}"


def jobs_for(set_params: list[str], git_url: str, rev: str, workdir: str | None) -> list[Job]:
    """One Job per combination of the `-S` grid, named by experiment_name."""
    combos = grid(set_params)
    keys = {o.split("=", 1)[0] for combo in combos for o in combo}
    varying = {k for k in keys if len({o for c in combos for o in c if o.startswith(f"{k}=")}) > 1}
    jobs = [Job(experiment_name(c, varying), git_url, rev, c, workdir) for c in combos]
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise UserError(f"two experiments would share a name ({names}): vary fewer keys "
                        "at once or make the values differ in more than punctuation")
    return jobs


def check_commit(project: Path, remote: str, rev: str) -> tuple[str, str, list[str]]:
    """(git URL, full commit, tracked files with uncommitted changes) for workers to clone;
    UserError when they could not (no remote, commit not pushed, no default DVC remote)."""
    try:
        url = git("remote", "get-url", remote, cwd=project)
    except subprocess.CalledProcessError:
        raise UserError(f"no git remote '{remote}' in {project}: workers clone the "
                          f"commit from it (git remote add {remote} <url>, or --git-remote)")
    if urlsplit(url).password:
        raise UserError(f"git remote '{remote}' has a password in its URL; it would be "
                          "sent to every worker: use SSH keys or a credential helper")
    try:
        sha = git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=project)
    except subprocess.CalledProcessError:
        raise UserError(f"--rev {rev}: not a commit in {project}")
    subprocess.run(["git", "fetch", "-q", remote], cwd=project, capture_output=True)
    on_remote = git("branch", "-r", "--contains", sha, "--list", f"{remote}/*", cwd=project)
    if not on_remote:
        raise UserError(f"commit {sha[:7]} ({rev}) is not on git remote '{remote}': "
                          f"workers clone it from there (git push {remote} HEAD)")
    config = configparser.ConfigParser(strict=False)
    try:
        config.read_string(git("show", f"{sha}:.dvc/config", cwd=project))
    except (subprocess.CalledProcessError, configparser.Error):
        pass
    if not config.get("core", "remote", fallback=None):
        raise UserError(f"commit {sha[:7]} has no default DVC remote in .dvc/config: "
                          "workers push results there (dvc remote add -d ...; git commit "
                        ".dvc/config; dvc push --run-cache)")
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=project)
    return url, sha, [line[3:] for line in dirty.splitlines()]


def stages_run(row: dict) -> list[str]:
    """The stages an experiment ran, the probe left out."""
    return [s for s in row.get("ran", []) if s != PROBE]


def _x(value: float | None) -> str:
    return f"x{value:.2f}" if value is not None else "-"


def table(rows: list[dict], variant: str) -> str:
    """Markdown: the README's calibration-sweep columns, plus machine, worker and stages run."""
    from quantpipe.machine import describe

    keys = list(dict.fromkeys(k for r in rows for k in r["params"]))
    varying = [k for k in keys if len({r["params"].get(k) for r in rows}) > 1] or keys
    batches = sorted({int(bs[2:]) for r in rows if "metrics" in r
                      for bs in r["metrics"]["summary"][variant]["speedup"]})
    small, big = (f"bs{batches[0]}", f"bs{batches[-1]}") if batches else ("bs1", "bs1")
    head = ["experiment", *(k.rsplit(".", 1)[-1] for k in varying), "accuracy", "drop (pp)",
            "agreement", f"1 thread {small}", f"1 thread {big}", f"all cores {big}",
            "throughput", "fallback", "machine", "worker", "stages run", "s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        params = [r["params"].get(k, "") for k in varying]
        ran = ", ".join(stages_run(r)) or "none"
        if "metrics" not in r:
            cells = [r["name"], *params, f"failed: {r['error']}", *[""] * 9, ran,
                     f"{r.get('seconds', 0):.0f}"]
        else:
            m = r["metrics"]
            s, q = m["summary"][variant], m["quantize_static"]
            one = s["by_threads"].get("threads1", {}).get("speedup", {})
            fallback = ", ".join(q.get("nodes_in_float", [])) if variant == "static" else ""
            cells = [r["name"], *params, f"{s['accuracy']:.3f}", f"{s['accuracy_drop_pp']:.1f}",
                     f"{s['agreement']:.3f}", _x(one.get(small)), _x(one.get(big)),
                     _x(s["speedup"].get(big)), _x(s.get("throughput_speedup")),
                     fallback or "—", describe(m["machine"]).split(";")[0], r["worker"], ran,
                     f"{r['seconds']:.0f}"]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out)
