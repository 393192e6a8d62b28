"""The machine that measures: CPU model, the ISA flags that decide INT8 speed, usable cores, and
the runtime versions.

stages/machine.py writes this to metrics/machine.json on every `dvc repro` (an always-changed
stage that takes well under a second). Every stage whose numbers depend on the machine lists
that file as a dependency: on the same machine the file comes out byte-identical and nothing
downstream re-runs; on another machine its hash changes and DVC re-measures exactly those
stages. So the fields here must be stable on one machine: no clock speeds, loads or free memory.

`python -m quantpipe.machine compare BASE` (used by `make diff` and scripts/review.sh) says
whether BASE's metrics were measured on another machine than the workspace's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from quantpipe.errors import UserError
from quantpipe.isa import cpu_flags, parse_cpuinfo, read_cpuinfo

MACHINE_FILE = Path("metrics/machine.json")
# CPU flags (as /proc/cpuinfo spells them) that decide how fast INT8 and BF16 can be on x86:
# AVX2 and AVX-512 (BW: the byte/word ops of the AVX-512 u8s8 kernels) set the vector width;
# VNNI does a u8*s8 dot product in one instruction (avx512_vnni, or avx_vnni on 256-bit
# vectors); AMX multiplies whole tiles (amx_tile: the tile registers, amx_int8 and amx_bf16 the
# products on them); avx512_bf16 is a BF16 dot product on vectors, avx512_fp16 FP16 arithmetic.
CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8",
             "avx512_bf16", "amx_bf16", "avx512_fp16")
# Either gives native BF16: without both, BF16 is emulated in FP32 and slower than FP32 itself.
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")
# Versions recorded with every measurement; a new onnxruntime or openvino changes kernels, hence
# numbers.
PACKAGES = ("onnxruntime", "openvino", "torch", "numpy")
# What makes two machines differ for benchmarking purposes (python is recorded, not compared).
COMPARED = ("cpu", "cpu_flags", "cores", "logical_cpus", *PACKAGES)


def probe(cpuinfo: str | None = None, affinity: set[int] | None = None,
          cpu_quota: float | None = None) -> dict:
    """This machine, as metrics/machine.json records it. The arguments are for tests; by
    default they are read from /proc/cpuinfo, the process's CPU affinity and the cgroup quota."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
    if affinity is None:
        affinity = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else set(range(os.cpu_count() or 1))
    if cpu_quota is None:
        cpu_quota = cgroup_cpu_quota()
    cpus = parse_cpuinfo(cpuinfo)
    model = next((c["model name"] for c in cpus if c.get("model name")), "") \
        or platform.processor() or platform.machine()
    flags = cpu_flags(cpuinfo)
    return {"cpu": model,
            "cpu_flags": {f: f in flags for f in CPU_FLAGS},
            "cores": physical_cores(cpus, affinity, cpu_quota),
            "logical_cpus": len(affinity),
            **{name: _version(name) for name in PACKAGES},
            "python": platform.python_version()}


def bf16_missing(machine: dict) -> str | None:
    """Why this machine has no native BF16 (the bf16 row is skipped), or None when it has it."""
    flags = machine.get("cpu_flags", {})
    if any(flags.get(f) for f in NATIVE_BF16):
        return None
    return (f"this CPU has no native BF16 ({' or '.join(NATIVE_BF16)} in metrics/machine.json): "
            "emulated BF16 runs slower than FP32 and would mislead")


def load(path: Path = MACHINE_FILE) -> dict:
    """The machine record the measuring stages depend on; a UserError if it is unusable."""
    from quantpipe.io import read_json

    info = read_json(path)
    cores = info.get("cores")
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise UserError(f"{path}: 'cores' is {cores!r}, not a count; re-create it with "
                        "`dvc repro machine`")
    return info


def physical_cores(cpus: list[dict[str, str]], affinity: set[int], cpu_quota: float | None) -> int:
    """Physical cores this process may run on: distinct (socket, core) pairs among the CPUs in
    its affinity mask, capped by a cgroup CPU quota (a container limited to 2 CPUs of 64).

    Hyper-threads share one core's INT8 units, so "all cores" means physical cores, as in ONNX
    Runtime's default intra-op thread count.
    """
    pairs = {(c.get("physical id", "0"), c.get("core id", c["processor"]))
             for c in cpus if c["processor"].isdigit() and int(c["processor"]) in affinity}
    cores = len(pairs) or len(affinity) or 1
    if cpu_quota is not None:
        cores = min(cores, max(1, math.ceil(cpu_quota)))
    return cores


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 cpu.max, v1 cfs files), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu/cpu.cfs_quota_us").read_text())
        period = int((root / "cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _version(package: str) -> str | None:
    # Read from the installed metadata: importing torch just for its version takes seconds.
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def describe(machine: dict) -> str:
    """'AMD EPYC, 2 cores (2 logical CPUs); avx2, avx512f, avx512_vnni (no amx_int8);
    onnxruntime 1.32.0, torch 2.14.1' — for report.md and the review note."""
    flags = machine.get("cpu_flags", {})
    on = [f for f in CPU_FLAGS if flags.get(f)] + [f for f, v in flags.items() if v and f not in CPU_FLAGS]
    off = [f for f in CPU_FLAGS if f in flags and not flags[f]]
    isa = ", ".join(on) or "no AVX2/AVX-512/VNNI/AMX"
    if off:
        isa += f" (no {', '.join(off)})"
    cores = machine.get("cores")
    where = machine.get("cpu") or "unknown CPU"
    if cores:
        logical = machine.get("logical_cpus")
        where += f", {cores} core{'s' * (cores != 1)}"
        if logical and logical != cores:
            where += f" ({logical} logical CPUs)"
    versions = ", ".join(f"{p} {machine[p]}" for p in PACKAGES if machine.get(p))
    return f"{where}; {isa}" + (f"; {versions}" if versions else "")


def differences(base: dict, head: dict) -> list[str]:
    """What differs between two machine records, one 'field: base -> head' per field. Fields
    only one of them records (older metrics had fewer) are not compared."""
    diffs = []
    for key in COMPARED:
        if key not in base or key not in head:
            continue
        if key == "cpu_flags":
            changed = sorted(f for f in set(base[key]) & set(head[key]) if base[key][f] != head[key][f])
            diffs += [f"{f}: {_yes(base[key][f])} -> {_yes(head[key][f])}" for f in changed]
        elif base[key] != head[key]:
            diffs.append(f"{key}: {base[key]} -> {head[key]}")
    return diffs


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def recorded_machine(metrics: dict[str, str]) -> dict | None:
    """The machine recorded in a revision's metrics: metrics/machine.json, or for revisions
    older than it the `machine` of metrics/bench/static.json. metrics: path -> file text."""
    for path, pick in (("metrics/machine.json", lambda d: d),
                       ("metrics/bench/static.json", lambda d: d.get("machine"))):
        text = metrics.get(path)
        if text:
            try:
                found = pick(json.loads(text))
            except json.JSONDecodeError:
                continue
            if found:
                return found
    return None


def compare_note(base_rev: str, base: dict | None, head: dict | None) -> str:
    """The line `make diff` and scripts/review.sh print about where both sides were measured."""
    if base is None or head is None:
        side = f"{base_rev}" if base is None else "the workspace"
        return f"Machine: {side} records no machine (metrics/machine.json); latency figures may come from different machines."
    diffs = differences(base, head)
    if not diffs:
        return f"Machine: {base_rev} and the workspace were measured on the same kind of machine: {describe(head)}."
    return (f"**Measured on different machines** ({'; '.join(diffs)}). {base_rev}: {describe(base)}. "
            f"Workspace: {describe(head)}. Latency, speedup, throughput and memory differences "
            "include the machine change; compare both revisions on one machine (check out each "
            "and run `dvc repro`, which re-measures on this machine).")


def _git_show(rev: str, path: str) -> str | None:
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantpipe.machine")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("probe", help="print this machine as metrics/machine.json records it")
    compare = sub.add_parser("compare", help="say whether REV and the workspace were measured "
                                             "on different machines")
    compare.add_argument("rev")
    args = parser.parse_args(argv)
    if args.command == "probe":
        print(json.dumps(probe(), indent=2, sort_keys=True))
        return 0
    paths = ("metrics/machine.json", "metrics/bench/static.json")
    base = recorded_machine({p: _git_show(args.rev, p) for p in paths})
    head = recorded_machine({p: Path(p).read_text() for p in paths if Path(p).exists()})
    print(compare_note(args.rev, base, head))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
