"""A stage that the kernel kills leaves no message of its own (DVC prints "exited with -9"): each
stage run leaves a marker while it runs, with its resident memory so far, and the next stage
that starts names a run whose marker outlived its process, with the likely cause.

Markers live in .dvc/tmp/quantpipe/running/ (DVC's own scratch folder, which git ignores): one
JSON file per running stage, rewritten every few seconds with the process's peak resident
memory, removed when the stage ends in any way a process can see (success, an error, SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

RUNNING = Path(".dvc/tmp/quantpipe/running")
# Seconds between the marker's updates (a read of /proc/self/status and a small file).
INTERVAL = 0.5
# A killed stage whose last recorded peak reached this share of the machine's memory was most
# likely killed for memory (the kernel's OOM killer, or a container's memory limit).
OOM_SHARE = 0.8


def _high_water_mb() -> float:
    from quantpipe.memprobe import high_water_mb

    return high_water_mb()


@contextlib.contextmanager
def running(stage: str, root: Path = Path(".")) -> Iterator[None]:
    """Mark `stage` (as DVC names it, e.g. "bench@static") as running for the duration of
    the block; a no-op outside a DVC project (no .dvc folder)."""
    if not (root / ".dvc").is_dir():
        yield
        return
    folder = root / RUNNING
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"{stage}.json"
    record = {"stage": stage, "pid": os.getpid(), "started": time.time(), "peak_rss_mb": 0.0}
    stop = threading.Event()

    def write() -> None:
        record["peak_rss_mb"] = round(_high_water_mb(), 1)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, marker)

    def keep_writing() -> None:
        while not stop.wait(INTERVAL):
            with contextlib.suppress(OSError):
                write()

    write()
    thread = threading.Thread(target=keep_writing, name="quantpipe-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        marker.unlink(missing_ok=True)


def killed(root: Path = Path(".")) -> list[dict]:
    """The markers of stage runs whose process is gone without removing them (killed), oldest
    first; each is removed once read, so a kill is reported once."""
    folder = root / RUNNING
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            path.unlink(missing_ok=True)
            continue
        if _alive(int(record.get("pid", 0))):
            continue
        path.unlink(missing_ok=True)
        found.append(record)
    return sorted(found, key=lambda r: r.get("started", 0))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def explain(record: dict, machine_mb: float) -> str:
    """One line: which stage was killed, when, and the likely cause."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.get("started", 0)))
    peak = float(record.get("peak_rss_mb", 0.0))
    head = (f"stage '{record.get('stage', '?')}' (started {when}) was killed before it ended, "
            f"at {peak:,.0f} MiB resident or more")
    if peak >= OOM_SHARE * machine_mb:
        return (f"{head} of this machine's {machine_mb:,.0f} MiB: most likely the kernel's "
                "out-of-memory killer; lower resources.memory_mb in params.yaml (the memory each "
                "stage plans within), or the batch and calibration keys docs/troubleshooting.md "
                "names, then run it again")
    return (f"{head}, under this machine's {machine_mb:,.0f} MiB at its last sample: a signal "
            "from outside (SIGKILL, a container or CI timeout) or one sudden allocation; its "
            "outputs were not replaced: run it again, and if it dies at the same point lower "
            "resources.memory_mb in params.yaml")
