#!/usr/bin/env python3
"""Experiment sweeps on a Dask cluster: every `dvc exp run` on a worker, every result in `dvc exp show`.

    python scripts/sweep.py -S quantize_static.calibrate_method=MinMax,Entropy,Percentile \\
        -S quantize_static.per_channel=true,false                 # a LocalCluster here
    python scripts/sweep.py --scheduler tcp://10.0.0.5:8786 -S train.model=resnet18,mobilenet_v2

`-S` is `dvc exp run`'s own grid syntax (`key=a,b`, `file:key=...`, lists as `[1,8]`), parsed
by DVC itself; one experiment per combination. Each experiment is one Dask task. The worker
clones the commit from the project's git remote into a fresh directory, `dvc pull --run-cache`,
`dvc exp run --pull -n <name> -S ...` (a stage anyone already ran with the same inputs is
restored from the run cache, not re-run), `dvc push --run-cache` and `dvc exp push`. The
coordinator (this script) then `dvc exp pull`s every experiment that succeeded, so
`dvc exp show` lists them as if they had run here, and prints a table with the machine each
one was measured on.

What a worker needs: the project's environment (`make env`; run `dask worker` from it), `git`
access to the remote and credentials for the DVC remote in its own environment (AWS_* variables,
~/.aws, `dvc remote modify --global`). Tasks carry the git URL, the commit and the params only.

The commit must be on the git remote and its `.dvc/config` must name a default DVC remote.
Faults: a worker that dies mid-experiment has its task run again elsewhere by Dask (a fresh
clone; the dead worker's `dvc` is killed with it); an experiment that fails (bad params, a
gate) is a row with its one-line error and does not stop the others; a failure to clone, pull
or push is retried (--retries). Exit code 1 when any experiment failed.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import logging
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the coordinator's table and output use quantpipe
VARIANTS = ("static", "dynamic", "qat")

# --- on the worker: standard library (+ dvc, from the worker's `make env`) only -------------

RAN = re.compile(r"^Running stage '([^']+)'", re.M)
RESTORED = re.compile(r"^Stage '([^']+)' is cached - skipping run", re.M)

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


def _run_cache_entries(repo: Path) -> dict[tuple[str, str], Path]:
    """Every run-cache entry in repo's cache: (key, value) -> its file
    (<cache>/runs/<key[:2]>/<key>/<value>)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as project:
        runs = Path(project.stage_cache.cache_dir)
    return {(p.parent.name, p.name): p for p in runs.glob("*/*/*")}


def _push_run_cache_outputs(repo: Path, before: set[tuple[str, str]]) -> None:
    """Push the outputs that this run's new run-cache entries restore.

    `dvc push --run-cache` (DVC 3.67) uploads the entries but not the `cache: false` metrics and
    plots they restore (it pushes only what the workspace tracks); without them another worker
    cannot restore the stage and runs it again.
    """
    import yaml
    from dvc.repo import Repo
    from dvc_data.hashfile.hash_info import HashInfo

    objs = set()
    for key, path in _run_cache_entries(repo).items():
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
        _step([sys.executable, "-m", "dvc", "pull", "--run-cache", "--allow-missing"], repo, log)
        before = set(_run_cache_entries(repo))
        exp_start = time.perf_counter()
        flags = [arg for o in job.overrides for arg in ("-S", o)]
        rc, text = _run([sys.executable, "-m", "dvc", "exp", "run", "--pull", "-n", job.name,
                         *flags], repo, log)
        row.update(exp_seconds=round(time.perf_counter() - exp_start, 1),
                   ran=RAN.findall(text), restored=RESTORED.findall(text))
        if rc:
            row.update(error=error_line(text), log_tail=text.splitlines()[-15:])
            return row
        # Outputs first, then the run-cache entries: an entry must never reach the remote
        # before what it restores (DVC tries only the newest entry of a stage).
        _push_run_cache_outputs(repo, before)
        _step([sys.executable, "-m", "dvc", "push", "--run-cache"], repo, log)
        _step([sys.executable, "-m", "dvc", "exp", "push", "-f", "--no-cache", "origin", job.name],
              repo, log)
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
            slug = re.sub(r"[^A-Za-z0-9.-]+", "-", value).strip("-.") or "empty"
            parts.append(f"{key.rsplit('.', 1)[-1].split(':')[-1]}-{re.sub(r'[.]{2,}', '.', slug)}")
    digest = hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:7]
    return "_".join(parts)[:80] or f"sweep-{digest}"


def jobs_for(set_params: list[str], git_url: str, rev: str, workdir: str | None) -> list[Job]:
    combos = grid(set_params)
    keys = {o.split("=", 1)[0] for combo in combos for o in combo}
    varying = {k for k in keys if len({o for c in combos for o in c if o.startswith(f"{k}=")}) > 1}
    jobs = [Job(experiment_name(c, varying), git_url, rev, c, workdir) for c in combos]
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: two experiments would share a name ({names}): vary fewer keys "
                         "at once or make the values differ in more than punctuation")
    return jobs


def check_commit(project: Path, remote: str, rev: str) -> tuple[str, str]:
    """(git URL, full commit) the workers can clone; one clear error line otherwise."""
    try:
        url = git("remote", "get-url", remote, cwd=project)
    except subprocess.CalledProcessError:
        raise SystemExit(f"error: no git remote '{remote}' in {project}: workers clone the "
                         f"commit from it (git remote add {remote} <url>, or --git-remote)")
    if urlsplit(url).password:
        raise SystemExit(f"error: git remote '{remote}' has a password in its URL; it would be "
                         "sent to every worker: use SSH keys or a credential helper")
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=project)
    subprocess.run(["git", "fetch", "-q", remote], cwd=project, capture_output=True)
    on_remote = git("branch", "-r", "--contains", sha, "--list", f"{remote}/*", cwd=project)
    if not on_remote:
        raise SystemExit(f"error: commit {sha[:7]} ({rev}) is not on git remote '{remote}': "
                         f"workers clone it from there (git push {remote} HEAD)")
    config = configparser.ConfigParser(strict=False)
    try:
        config.read_string(git("show", f"{sha}:.dvc/config", cwd=project))
    except (subprocess.CalledProcessError, configparser.Error):
        pass
    if not config.get("core", "remote", fallback=None):
        raise SystemExit(f"error: commit {sha[:7]} has no default DVC remote in .dvc/config: "
                         "workers push results there (dvc remote add -d ...; git commit "
                         ".dvc/config; dvc push --run-cache)")
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=project)
    if dirty:
        files = ", ".join(line[3:] for line in dirty.splitlines()[:5])
        print(f"note: uncommitted changes ({files}) are not part of the sweep: workers run "
              f"commit {sha[:7]} as pushed", file=sys.stderr)
    return url, sha


def client_for(scheduler: str | None, workers: int):
    """A Dask client: to the given scheduler, or to a LocalCluster of `workers` processes with
    one thread each (an experiment benchmarks with the cores it finds; two on one machine would
    time each other)."""
    from distributed import Client, LocalCluster

    if scheduler:
        return Client(scheduler, timeout="30s")
    # Worker logs stay quiet: each failure is one line from this script.
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           host="127.0.0.1", dashboard_address=None,
                           silence_logs=logging.CRITICAL)
    return Client(cluster)


def submit_all(client, jobs: list[Job], retries: int) -> list[dict]:
    """Run every job; rows in job order. Progress bar on stderr; a failure printed as it comes."""
    import cloudpickle
    from distributed import as_completed
    from tqdm import tqdm

    if __name__ != "__main__":  # imported (tests): workers cannot import this script by name
        cloudpickle.register_pickle_by_value(sys.modules[__name__])

    futures = {client.submit(run_experiment, job, retries=retries, pure=False,
                             key=f"{job.name}-{os.urandom(4).hex()}"): job for job in jobs}
    rows = {}
    with tqdm(total=len(jobs), desc="sweep", unit="exp", file=sys.stderr) as bar:
        for future in as_completed(futures):
            job = futures[future]
            try:
                row = future.result()
            except Exception as e:  # retries used up, or the task's workers kept dying
                row = {"name": job.name, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
            row["params"] = dict(o.split("=", 1) for o in job.overrides)
            rows[job.name] = row
            if "error" in row:
                bar.write(f"{job.name}: failed: {row['error']}", file=sys.stderr)
            bar.update()
    return [rows[job.name] for job in jobs]


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
    cores = next((r["metrics"]["machine"].get("cores") for r in rows if "metrics" in r), None)
    head = ["experiment", *(k.rsplit(".", 1)[-1] for k in varying), "accuracy", "drop (pp)",
            "agreement", f"1 thread {small}", f"1 thread {big}", f"all cores ({cores}) {big}",
            "throughput", "fallback", "machine", "worker", "stages run", "s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        params = [r["params"].get(k, "") for k in varying]
        ran = ", ".join(s for s in r.get("ran", []) if s != "machine") or "none"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-S", "--set-param", action="append", required=True, metavar="KEY=V1,V2",
                        help="dvc exp run's grid syntax; repeat for a product")
    parser.add_argument("--scheduler", metavar="tcp://HOST:8786",
                        help="a running Dask scheduler; default: a LocalCluster on this machine")
    parser.add_argument("--workers", type=int, default=1,
                        help="LocalCluster worker processes (default 1: benchmarks do not share "
                             "the cores)")
    parser.add_argument("--git-remote", default="origin", help="where workers clone from")
    parser.add_argument("--rev", default="HEAD", help="the commit to sweep (must be pushed)")
    parser.add_argument("--retries", type=int, default=2,
                        help="re-runs of a task whose clone/pull/push failed")
    parser.add_argument("--workdir", help="workspaces on each worker (default <tmp>/quantpipe-sweep)")
    parser.add_argument("--variant", choices=VARIANTS, default="static", help="the table's variant")
    parser.add_argument("-o", "--output", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)

    project = Path.cwd()
    url, sha = check_commit(project, args.git_remote, args.rev)
    jobs = jobs_for(args.set_param, url, sha, args.workdir)
    print(f"{len(jobs)} experiment(s) on {sha[:7]}: {', '.join(j.name for j in jobs)}",
          file=sys.stderr)
    start = time.perf_counter()
    with client_for(args.scheduler, args.workers) as client:
        rows = submit_all(client, jobs, args.retries)
        cluster = getattr(client, "cluster", None)
    if cluster is not None:
        cluster.close()
    seconds = time.perf_counter() - start
    done = [r["name"] for r in rows if "metrics" in r]
    if done:
        pulled = subprocess.run([sys.executable, "-m", "dvc", "exp", "pull", "-f", "--no-cache",
                                 args.git_remote, *done], cwd=project, capture_output=True, text=True)
        if pulled.returncode:
            print(f"error: dvc exp pull: {error_line(pulled.stdout + pulled.stderr)}",
                  file=sys.stderr)
            return 1
    print(table(rows, args.variant))
    ran = sum(len([s for s in r.get("ran", []) if s != "machine"]) for r in rows)
    restored = sum(len(r.get("restored", [])) for r in rows)
    failed = len(rows) - len(done)
    print(f"\n{len(done)} of {len(rows)} experiment(s) done in {seconds:.0f} s; stages run: {ran}, "
          f"restored from the run cache: {restored}; failed: {failed}. "
          f"`dvc exp show` lists them.", file=sys.stderr)
    if args.output:
        from quantpipe.io import write_json

        write_json(args.output, {"commit": sha, "seconds": round(seconds, 1), "rows": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
