#!/usr/bin/env python3
"""Experiment sweeps on a Dask cluster: each `dvc exp run` on a worker, all in `dvc exp show`.

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
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from quantpipe import dvcrun, sweep
from quantpipe.errors import UserError
from quantpipe.io import write_json
from quantpipe.report import QUANTIZED

ROOT = Path(__file__).resolve().parents[1]


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


def submit_all(client, jobs: list[sweep.Job], retries: int) -> list[dict]:
    """Run every job; rows in job order. Progress bar on stderr; a failure printed as it comes."""
    import cloudpickle
    from distributed import as_completed
    from tqdm import tqdm

    # By value: a worker runs this checkout's task code, whatever it has installed itself.
    cloudpickle.register_pickle_by_value(sweep)

    futures = {client.submit(sweep.run_experiment, job, retries=retries, pure=False,
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
    parser.add_argument("--workdir",
                        help="workspaces on each worker (default <tmp>/quantpipe-sweep)")
    parser.add_argument("--variant", choices=QUANTIZED, default="static",
                        help="the variant the table shows")
    parser.add_argument("-o", "--output", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)

    project = Path.cwd()
    url, sha, dirty = sweep.check_commit(project, args.git_remote, args.rev)
    if dirty:
        print(f"note: uncommitted changes ({', '.join(dirty[:5])}) are not part of the sweep: "
              f"workers run commit {sha[:7]} as pushed", file=sys.stderr)
    jobs = sweep.jobs_for(args.set_param, url, sha, args.workdir)
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
        pull = ["exp", "pull", "-f", "--no-cache", args.git_remote, *done]
        try:
            dvcrun.check_idle(project, pull)  # not while a run in this workspace needs the lock
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        pulled = subprocess.run(dvcrun.command(pull), cwd=project, capture_output=True, text=True)
        if pulled.returncode:
            print(f"error: dvc exp pull: {sweep.error_line(pulled.stdout + pulled.stderr)}",
                  file=sys.stderr)
            return 1
    print(sweep.table(rows, args.variant))
    ran = sum(len(sweep.stages_run(r)) for r in rows)
    restored = sum(len(r.get("restored", [])) for r in rows)
    failed = len(rows) - len(done)
    print(f"\n{len(done)} of {len(rows)} experiment(s) done in {seconds:.0f} s; stages run: {ran}, "
          f"restored from the run cache: {restored}; failed: {failed}. "
          f"`dvc exp show` lists them.", file=sys.stderr)
    if args.output:
        write_json(args.output, {"commit": sha, "seconds": round(seconds, 1), "rows": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        sys.exit(f"error: {e}")
