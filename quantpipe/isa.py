"""The CPU's instruction-set flags, and what they decide about INT8 arithmetic (not speed):
whether ONNX Runtime's INT8 kernels overflow 8-bit weights, hence the session option that keeps
them exact and the weights `reduce_range: auto` writes.

Small and seldom changed on purpose: every stage that opens an ONNX Runtime session imports it
(quantpipe.onnxutil), so a change here re-runs them all. quantpipe.machine (what the measuring
stages record) builds on it.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Iterable

from quantpipe.errors import UserError

# What of the machine decides INT8 arithmetic rather than speed (int8_record): the quantize
# stages depend on this file alone, so a machine that only measures differently (other cores,
# AMX, versions) re-measures without re-quantizing (or re-training QAT).
INT8_FILE = Path("metrics/int8.json")
# reduce_range of quantize_static, quantize_dynamic and quantize_qat: 7-bit weights where this
# machine's INT8 kernels need them (reduce_range_for), 8-bit elsewhere.
AUTO = "auto"


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: model and flags unknown, cores from os.cpu_count()
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The ISA flags of `cpuinfo` (this CPU's when None), as /proc/cpuinfo spells them (empty
    off Linux)."""
    if cpuinfo is None:
        return set(_this_cpu_flags())
    cpus = parse_cpuinfo(cpuinfo)
    return set(next((c["flags"] for c in cpus if c.get("flags")), "").split())


@functools.cache
def _this_cpu_flags() -> frozenset[str]:
    # read once per process: the engines resolve reduce_range: auto per call (a library caller
    # may pass it), and the CPU does not change under a running process
    return frozenset(cpu_flags(read_cpuinfo()))


def int8_saturates(flags: Iterable[str]) -> bool:
    """Whether ONNX Runtime's INT8 kernels can saturate on a CPU with these ISA flags: on x86
    without VNNI (AVX2, or AVX-512 without VNNI) MLAS's U8S8 kernels add pairs of u8 x s8
    products in 16 bits (vpmaddubsw), which 8-bit weights overflow. Weights within [-64, 64]
    (reduce_range) cannot: 2 x 255 x 64 < 2**15."""
    flags = set(flags)
    return "avx2" in flags and not flags & {"avx512_vnni", "avx_vnni"}


def int8_record(machine: dict) -> dict:
    """metrics/int8.json for `machine` (probe()): whether 8-bit weights overflow ONNX Runtime's
    INT8 kernels there (int8_saturates), which is what reduce_range: auto decides on."""
    return {"int8_saturates": int8_saturates(f for f, has in machine["cpu_flags"].items() if has)}


def load_int8(path: Path = INT8_FILE) -> dict:
    """metrics/int8.json as the quantize stages read it; a UserError if it is unusable."""
    from quantpipe.io import read_json

    record = read_json(path)
    if not isinstance(record.get("int8_saturates"), bool):
        raise UserError(f"{path}: 'int8_saturates' is {record.get('int8_saturates')!r}, not true "
                        "or false; re-create it with `dvc repro machine`")
    return record


def reduce_range_for(value: bool | str, int8: dict | None = None) -> bool:
    """A quantizer's reduce_range on a machine (`int8`: its int8_record, metrics/int8.json; this
    CPU when None): true or false as set; AUTO: 7-bit weights where its INT8 kernels saturate
    (int8_saturates), so the model runs ONNX Runtime's fast U8S8 kernels exactly there (with
    8-bit weights it needs session.x64quantprecision's exact U8U8 kernels, 1.3x slower on an
    AVX2 EPYC); 8-bit, the finer weights, on every other CPU."""
    if value != AUTO:
        return bool(value)
    return int8_saturates(cpu_flags()) if int8 is None else int8["int8_saturates"]


class ReduceRange:
    """Mixin of the params sections with a `reduce_range` key (quantize_static,
    quantize_dynamic, quantize_qat): true, false or AUTO, and the value on a machine."""

    def check_reduce_range(self) -> None:
        # params.check's line, without importing params.py into every stage that imports this
        if not (isinstance(self.reduce_range, bool) or self.reduce_range == AUTO):
            raise UserError(f"{self.SECTION}.reduce_range = {self.reduce_range!r} is not allowed; "
                            f"use true, false or {AUTO}")

    def on_machine(self, int8: dict):
        """These params with reduce_range decided for the machine that quantizes (`int8`:
        metrics/int8.json), a bool."""
        return dataclasses.replace(self, reduce_range=reduce_range_for(self.reduce_range, int8))


def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """One {field: value} per processor block of /proc/cpuinfo."""
    blocks = []
    for block in text.strip().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" in fields:
            blocks.append(fields)
    return blocks
