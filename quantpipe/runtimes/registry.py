"""The inference engines bench.runtimes may name, by name. Adding one = a module with a class
implementing quantpipe.runtimes.base.Runtime, and its class in the list below (or
RUNTIMES.register(cls) from your own code before the bench runs)."""

from __future__ import annotations

from collections.abc import Sequence

from onnxruntime import GraphOptimizationLevel

from quantpipe.errors import UserError
from quantpipe.registry import Registry
from quantpipe.runtimes.base import Runtime
from quantpipe.runtimes.ort import OnnxRuntime
from quantpipe.runtimes.ov import OpenVino

# The reference: accuracy, the summary's latency/speedup keys and every parity check are its.
REFERENCE = OnnxRuntime.name
RUNTIMES = Registry("bench.runtimes", [OnnxRuntime, OpenVino])


def select(wanted: Sequence[str], *, level: GraphOptimizationLevel) -> dict[str, Runtime]:
    """The engines bench.runtimes names, built; one line naming the key for an unknown name or
    a list without the reference."""
    classes = {name: RUNTIMES.get(name) for name in wanted}
    if REFERENCE not in wanted:
        raise UserError(f"bench.runtimes = {list(wanted)} must include {REFERENCE} (the reference "
                        "every other engine is checked against)")
    return {name: cls(level) for name, cls in classes.items()}
