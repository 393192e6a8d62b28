"""DVC as every quantpipe entry point runs it: `dvc --wait-for-lock`, and never while a stage of
another DVC command runs in the same workspace.

Why (DVC 3.67): `dvc repro` releases the repository lock (.dvc/tmp/lock) while a stage's command
runs and takes it back to record the result. Without --wait-for-lock it tries for 3 seconds and
then fails ("Unable to acquire lock") with the stage's work done but not recorded in dvc.lock.
Any DVC command that holds the lock at that moment can cause it: a second `dvc repro` (which
holds it while it collects the pipeline, then stops on the busy outputs), `dvc status`, `dvc
push`. On a loaded machine those holds last seconds. So:
- the runs we start wait for the lock (--wait-for-lock): nothing started beside them can make
  them lose a result;
- the commands we start that take the lock first check DVC's own list of running stages
  (.dvc/tmp/rwlock: the paths each running stage reads and writes, with its PID) and stop at
  once, naming the run, when there is one: a run started as plain `dvc repro` still has only
  3 seconds, and must not find our command holding the lock.
`dvc exp run` does not pass --wait-for-lock to its stages (its executor opens the repository
again without it), so an experiment run in the workspace keeps the 3-second limit (`dvc
--wait-for-lock exp run --temp` does not: its stages run in a directory of their own); ours run
in clones of their own (scripts/families.py, scripts/sweep.py).

    python -m quantpipe.dvcrun repro          # what `make repro` runs
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil

from quantpipe.errors import UserError

# DVC commands (first word, or first two for `exp`/`queue`) that take the repository lock.
# The read-only ones (metrics/params/plots diff, exp show, dag) do not, and may run beside a run.
LOCKING = {"add", "checkout", "commit", "destroy", "diff", "fetch", "freeze", "gc", "import",
           "import-url", "move", "pull", "push", "remove", "repro", "run", "stage", "status",
           "unfreeze", "update", "exp apply", "exp branch", "exp pull", "exp push",
           "exp remove", "exp run", "exp ls"}


def running_stages(root: Path) -> list[str]:
    """'PID n: command' of every live DVC process with a stage running in the workspace at
    `root`, from DVC's path locks (.dvc/tmp/rwlock), read under DVC's own guard."""
    from dvc.lock import make_lock

    tmp = root / ".dvc" / "tmp"
    path = tmp / "rwlock"
    if not path.exists():
        return []
    # The guard DVC holds for the milliseconds it takes to rewrite the file.
    with make_lock(str(tmp / "rwlock.lock"), tmp_dir=str(tmp), wait=True):
        try:
            locks = json.loads(path.read_text() or "{}")
        except (json.JSONDecodeError, OSError):
            return []  # DVC repairs or reports it itself
    infos = [*locks.get("write", {}).values()]
    for readers in locks.get("read", {}).values():
        infos += readers
    found = {}
    for info in infos:
        pid = int(info.get("pid", 0))
        if pid != os.getpid() and _is_dvc(pid):
            found[pid] = f"PID {pid}: {info.get('cmd', 'dvc')}"
    return sorted(found.values())


def _is_dvc(pid: int) -> bool:
    """A live process that is DVC (not another program that was given a dead run's PID)."""
    try:
        return any("dvc" in part for part in psutil.Process(pid).cmdline())
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False


def takes_lock(args: list[str]) -> bool:
    words = [a for a in args if not a.startswith("-")]
    if not words:
        return False
    return (" ".join(words[:2]) if words[0] in ("exp", "queue") else words[0]) in LOCKING


def check_idle(root: Path, args: list[str]) -> None:
    """A UserError naming the run when `dvc <args>` would take the lock from a running stage."""
    if not takes_lock(args):
        return
    busy = running_stages(root)
    if busy:
        raise UserError(f"a DVC run is going in this workspace ({'; '.join(busy)}; DVC lists it in "
                        f".dvc/tmp/rwlock): wait for it to finish, or stop it, then run "
                        f"`dvc {' '.join(args)}` again")


def command(args: list[str]) -> list[str]:
    """The argv that runs `dvc <args>` with this interpreter's DVC, waiting for the lock."""
    return [sys.executable, "-m", "dvc", "--wait-for-lock", *args]


def main(argv: list[str]) -> None:
    if not argv:
        raise UserError("usage: python -m quantpipe.dvcrun <dvc command and arguments>")
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    try:
        root = Path(Repo.find_root())
    except NotDvcRepoError:
        root = None  # DVC itself says so
    if root is not None:
        check_idle(root, argv)
    sys.stdout.flush()
    os.execv(sys.executable, command(argv))


if __name__ == "__main__":
    from quantpipe.io import run_stage

    run_stage(main)
