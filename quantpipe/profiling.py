"""ONNX Runtime's profile of one session: the kernel time per node and per op type, and the one
line that sums it up (bench writes it, report.md quotes it)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from quantpipe import onnxutil


def kernel_profile(session, x: np.ndarray, *, runs: int, top: int = 5) -> dict:
    """Where the time goes: ORT's per-node kernel times on batch x.

    `session` must have been made with profiling on (onnxutil.make_session(profile_prefix=...)).
    Each node's time is its median over runs + 1 runs (the first is the warm-up, and a median
    of the rest is not moved by it). Times exclude ORT's per-run overhead outside the kernels.
    """
    run = onnxutil.session_runner(session)
    for _ in range(runs + 1):
        run(x)
    events = json.loads(Path(session.end_profiling()).read_text())
    per_node: dict[tuple[str, str], list[float]] = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            key = (event["name"].removesuffix("_kernel_time"), event["args"]["op_name"])
            per_node.setdefault(key, []).append(event["dur"] / 1e3)  # microseconds -> ms
    nodes = sorted(((node, op, float(np.median(ms))) for (node, op), ms in per_node.items()),
                   key=lambda item: -item[2])
    total = sum(ms for _, _, ms in nodes)
    by_op: dict[str, float] = {}
    for _, op, ms in nodes:
        by_op[op] = by_op.get(op, 0.0) + ms
    return {"batch_size": len(x), "runs": runs, "kernel_ms": round(total, 4),
            "by_op_ms": {op: round(ms, 4) for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "top_nodes": [{"node": node, "op": op, "ms": round(ms, 4),
                           "share": round(ms / total, 3) if total else 0.0}
                          for node, op, ms in nodes[:top]]}


def profile_model(model: Path, x: np.ndarray, *, level, threads: int, runs: int) -> dict:
    """kernel_profile of `model` in a session of its own on `threads` threads (profiling slows
    every run a little, so it is never the timed session)."""
    with tempfile.TemporaryDirectory() as tmp:
        session = onnxutil.make_session(model, level=level, threads=threads,
                                        profile_prefix=f"{tmp}/ort")
        return {"threads": threads, **kernel_profile(session, x, runs=runs)}


def describe_profile(profile: dict, ops: int = 3) -> str:
    """'4.02 ms (QLinearConv 94%, NhwcMaxPool 5%)': the kernel time and its main op types
    (at most `ops`, each at least 1% of the time)."""
    total = profile["kernel_ms"]
    # Sorted here: JSON round trips (write_json sorts keys) lose the order kernel_profile gave.
    ranked = sorted(profile["by_op_ms"].items(), key=lambda kv: -kv[1])[:ops]
    parts = [f"{op} {ms / total:.0%}" for op, ms in ranked if total and ms >= 0.01 * total]
    return f"{total:.2f} ms ({', '.join(parts)})" if parts else f"{total:.2f} ms"
