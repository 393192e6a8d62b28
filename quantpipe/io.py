"""Atomic file output and the stage entry point.

Every stage writes to a temporary sibling and renames it into place at the end, so a stage
killed half-way never leaves a file that a later `dvc repro` would take as finished.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

from quantpipe.errors import UserError


@contextlib.contextmanager
def atomic_path(path: Path | str, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    # The writer's pid in the name tells a later run whether this temp dir is still in use.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp",
                                dir=path.parent))
    target = tmp if is_dir else tmp / path.name
    try:
        yield target
        if is_dir:
            # mkdtemp makes the directory private (0700); publish it with the usual mode.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(target, 0o777 & ~umask)
            if path.exists():
                shutil.rmtree(path)
        os.replace(target, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temps(path: Path) -> None:
    """Delete temp siblings of `path` (`.NAME.PID.XXXX.tmp`) whose writer is no longer alive.

    A SIGKILLed stage cannot clean up after itself; its half-written temp dir would otherwise
    stay beside the output for good (DVC never takes it as the output, but nothing removes it).
    """
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = stale.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue  # another process is writing it right now
        shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def resources(images: int, seconds: float, budget_mb: float | None = None,
              workers_peak_rss_mb: float | None = None) -> dict:
    """What a stage cost, for its metrics: this process's peak resident memory (MB; VmHWM, which
    unlike ru_maxrss does not start from the parent's size at fork), its worker processes' when
    it has any, images per second, and the memory budget it planned within
    (quantpipe.budget.Budget.total_mb)."""
    from quantpipe.memprobe import high_water_mb

    return {"peak_rss_mb": round(high_water_mb(), 1),
            **({} if workers_peak_rss_mb is None else
               {"workers_peak_rss_mb": round(workers_peak_rss_mb, 1)}),
            **({} if budget_mb is None else {"memory_budget_mb": round(budget_mb)}),
            "images": images, "seconds": round(seconds, 2),
            "images_per_second": round(images / max(seconds, 1e-9), 1)}


def write_bytes(path: Path | str, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: Path | str, obj: object) -> None:
    # Sorted keys and a trailing newline keep `git diff` of metrics readable and stable.
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path | str) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found; run the stage that writes it (dvc repro)") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e}); re-run the stage that writes it") from None


# The ONNX variants evaluate and bench run on, as dvc.yaml's foreach lists them.
VARIANTS = ("fp32", "dynamic", "static", "qat", "bf16")


def skipped_model(path: Path | str) -> str | None:
    """Why models/<variant>.onnx holds no model, or None when it does.

    A stage with nothing to quantize (quantize_qat for a model brought as ONNX, or disabled)
    writes its output empty, so DVC has its output and evaluate, bench and report pass over it.
    """
    path = Path(path)
    if path.exists() and path.stat().st_size == 0:
        return f"{path} is empty: the stage that writes it skipped (see metrics/quantize_{path.stem}.json)"
    return None


def stage_args(stage: str, argv: list[str], *paths: str, variant: bool = False) -> SimpleNamespace:
    """A stage's command line as dvc.yaml writes it: `python -m stages.<stage> [<variant>]
    --<name> <path> ...`, every name in `paths` given once. dvc.yaml declares each path as a
    dep or an out of the stage, and the stage takes it from there: no path is written twice.
    Returns the paths (as Path) by name, and `variant` when the stage takes one."""
    usage = (f"usage: python -m stages.{stage}" + (f" {{{'|'.join(VARIANTS)}}}" if variant else "")
             + "".join(f" --{name} PATH" for name in paths))
    args, rest = {}, list(argv)
    if variant:
        if not rest or rest[0] not in VARIANTS:
            raise UserError(f"{usage} (the variant is missing or unknown)")
        args["variant"] = rest.pop(0)
    while rest:
        flag = rest.pop(0)
        name = flag.removeprefix("--").replace("-", "_")
        if not flag.startswith("--") or name not in paths or name in args or not rest:
            raise UserError(f"{usage} (got {flag!r})")
        args[name] = Path(rest.pop(0))
    missing = [name for name in paths if name not in args]
    if missing:
        raise UserError(f"{usage} (--{missing[0]} is missing)")
    return SimpleNamespace(**args)


def run_stage(main: Callable[[list[str]], None]) -> None:
    """Run a stage's main(argv): a UserError becomes one line on stderr and exit code 2. First
    it names any stage run the kernel killed since the last stage ended (quantpipe.watch), and
    marks this one as running.

    Set QUANTPIPE_DEBUG=1 to get the full traceback instead.
    """
    from quantpipe import watch

    # Python's default SIGTERM action exits without unwinding, leaving atomic_path's temp dirs
    # behind; as SystemExit the `finally` blocks run (exit code 143, as for a shell).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    report_killed()
    script = Path(sys.argv[0])  # python -m stages.<name>: the stage script's path
    stage = script.stem + (f"@{sys.argv[1]}" if sys.argv[1:2] and sys.argv[1] in VARIANTS else "")
    try:
        with watch.running(stage) if script.parent.name == "stages" else contextlib.nullcontext():
            main(sys.argv[1:])
    except UserError as e:
        if os.environ.get("QUANTPIPE_DEBUG") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def report_killed(out=sys.stderr) -> int:
    """One warning line per stage run killed since it was last reported (quantpipe.watch);
    how many."""
    from quantpipe import watch
    from quantpipe.memprobe import machine_memory_mb

    found = watch.killed()
    for record in found:
        print(f"warning: {watch.explain(record, machine_memory_mb())}", file=out)
    return len(found)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
