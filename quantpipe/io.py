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
VARIANTS = ("fp32", "dynamic", "static", "qat")


def skipped_model(path: Path | str) -> str | None:
    """Why models/<variant>.onnx holds no model, or None when it does.

    A stage with nothing to quantize (quantize_qat for a model brought as ONNX, or disabled)
    writes its output empty, so DVC has its output and evaluate, bench and report pass over it.
    """
    path = Path(path)
    if path.exists() and path.stat().st_size == 0:
        return f"{path} is empty: the stage that writes it skipped (see metrics/quantize_{path.stem}.json)"
    return None


def variant_argument(argv: list[str]) -> str:
    """The single variant named on a stage's command line (`python stages/X.py <variant>`)."""
    if len(argv) != 2 or argv[1] not in VARIANTS:
        raise UserError(f"usage: python {argv[0]} {{{'|'.join(VARIANTS)}}}")
    return argv[1]


def run_stage(main: Callable[[], None]) -> None:
    """Run a stage's main(): a UserError becomes one line on stderr and exit code 2.

    Set QUANTPIPE_DEBUG=1 to get the full traceback instead.
    """
    # Python's default SIGTERM action exits without unwinding, leaving atomic_path's temp dirs
    # behind; as SystemExit the `finally` blocks run (exit code 143, as for a shell).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        main()
    except UserError as e:
        if os.environ.get("QUANTPIPE_DEBUG") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
