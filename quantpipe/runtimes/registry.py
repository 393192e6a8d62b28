"""The inference runtimes bench.runtimes may name, by name. Adding one = a module with a class
implementing quantpipe.runtimes.base.Runtime, and its class in the list below (or
RUNTIMES.register(cls) from your own code before the bench runs)."""

from __future__ import annotations

from collections.abc import Sequence

from onnxruntime import GraphOptimizationLevel

from quantpipe.errors import UserError
from quantpipe.machine import bf16_missing
from quantpipe.registry import Registry
from quantpipe.runtimes.base import Runtime
from quantpipe.runtimes.ort import OnnxRuntime
from quantpipe.runtimes.ov import OpenVino

# The reference: accuracy, the summary's latency/speedup keys and every parity check are its.
REFERENCE = OnnxRuntime.name
RUNTIMES = Registry("bench.runtimes", [OnnxRuntime, OpenVino])


def select(wanted: Sequence[str], *, level: GraphOptimizationLevel,
           precision: str = "fp32") -> dict[str, Runtime]:
    """The runtimes bench.runtimes names that run `precision` ("fp32": every one; "bf16": the
    FP32 file in BF16, where the runtime has such a mode), built; one line naming the key for an
    unknown name or a list without the reference."""
    classes = {name: RUNTIMES.get(name) for name in wanted}
    if REFERENCE not in wanted:
        raise UserError(f"bench.runtimes = {list(wanted)} must include {REFERENCE} (the reference "
                        "every other runtime is checked against)")
    if precision == "fp32":
        return {name: cls(level) for name, cls in classes.items()}
    return {name: cls(level, precision=precision) for name, cls in classes.items()
            if precision in getattr(cls, "precisions", ("fp32",))}


def unsupported(wanted: Sequence[str], precision: str) -> dict[str, str]:
    """The runtimes of bench.runtimes that cannot run `precision`, each with why."""
    out = {}
    for name in wanted:
        cls = RUNTIMES.get(name)
        if precision not in getattr(cls, "precisions", ("fp32",)):
            out[name] = getattr(cls, "lacks", {}).get(precision) or f"{cls.title} has no {precision} mode"
    return out


def bf16_skip(machine: dict, wanted: Sequence[str]) -> str | None:
    """Why the bf16 row is not measured on this machine, or None: a CPU without native BF16
    (metrics/machine.json's flags), or no runtime of bench.runtimes that computes in BF16."""
    why = bf16_missing(machine)
    lacking = unsupported(wanted, "bf16")
    if why or len(lacking) < len(wanted):
        return why
    return "no runtime of bench.runtimes computes in BF16 (" + "; ".join(
        f"{name}: {reason}" for name, reason in lacking.items()) + ")"
