"""Latency measurement: warm-up, then timed runs interleaved across models in rounds.

Interleaving matters on a shared 2-core machine: clock and load drift over seconds, and timing
model A fully before model B would put that drift into the A/B ratio.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from quantpipe.params import BenchParams

# CPU flags that decide whether INT8 can be fast (VNNI: u8*s8 dot products in one instruction).
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")

Runner = Callable[[np.ndarray], object]


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    std_ms: float
    throughput: float  # samples per second at the median latency
    runs: int


def summarize(seconds: list[float], batch_size: int) -> Latency:
    ms = np.asarray(seconds) * 1e3
    p50 = float(np.percentile(ms, 50))
    return Latency(p50_ms=round(p50, 5), p90_ms=round(float(np.percentile(ms, 90)), 5),
                   p99_ms=round(float(np.percentile(ms, 99)), 5),
                   mean_ms=round(float(ms.mean()), 5), std_ms=round(float(ms.std()), 5),
                   throughput=round(batch_size / (p50 / 1e3), 1), runs=len(ms))


def measure(runners: dict[str, Runner], x: np.ndarray, *, warmup: int, runs: int,
            rounds: int, tick: Callable[[], None] = lambda: None) -> dict[str, Latency]:
    """Time each runner on the same batch x; rounds alternate the order of the runners."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():
        for _ in range(warmup):
            run(x)
    names = list(runners)
    for r in range(rounds):
        per_round = runs // rounds + (r < runs % rounds)  # exactly `runs` in all
        for name in names if r % 2 == 0 else reversed(names):
            run = runners[name]
            for _ in range(per_round):
                start = time.perf_counter()
                run(x)
                times[name].append(time.perf_counter() - start)
        tick()
    return {name: summarize(t, len(x)) for name, t in times.items()}


def session_runner(session) -> Runner:
    """A runner that feeds a batch to an ORT session's single input."""
    name = session.get_inputs()[0].name
    return lambda batch: session.run(None, {name: batch})


def latency_table(runners_for: Callable[[int], dict[str, Runner]], variant: str, x: np.ndarray,
                  p: BenchParams, desc: str) -> dict[str, dict[str, dict]]:
    """{"threadsT": {"bsN": row}} over p.threads and p.batch_sizes, with a progress bar.

    runners_for(threads) gives the runners of `variant` and "fp32", timed in the same
    interleaved rounds; a row of any other variant than fp32 also holds the FP32 median
    (baseline_p50_ms) and speedup = FP32 p50 / its p50, so machine drift cancels out.
    """
    from tqdm import tqdm

    results: dict[str, dict[str, dict]] = {}
    with tqdm(total=len(p.threads) * len(p.batch_sizes) * p.rounds, desc=desc, unit="round") as bar:
        for threads in p.threads:
            runners = runners_for(threads)
            for bs in p.batch_sizes:
                lat = measure(runners, batch_of(x, bs), warmup=p.warmup, runs=p.runs,
                              rounds=p.rounds, tick=lambda: bar.update(1))
                row = as_dict(lat[variant])
                if variant != "fp32":
                    row["baseline_p50_ms"] = lat["fp32"].p50_ms
                    row["speedup"] = round(lat["fp32"].p50_ms / lat[variant].p50_ms, 4)
                results.setdefault(f"threads{threads}", {})[f"bs{bs}"] = row
    return results


def batch_of(x: np.ndarray, size: int) -> np.ndarray:
    """The first `size` samples of x, repeated if x is shorter. (size, C, S, S)"""
    reps = -(-size // len(x))
    return np.ascontiguousarray(np.concatenate([x] * reps)[:size])


def machine_info() -> dict:
    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:  # not Linux: the flags stay unknown
        pass
    from importlib.metadata import version  # no need to import torch just for its version

    return {"cpu": model, "cpu_flags": {f: f in flags for f in CPU_FLAGS},
            "onnxruntime": version("onnxruntime"), "torch": version("torch"),
            "python": platform.python_version()}


def as_dict(latency: Latency) -> dict:
    return asdict(latency)


def kernel_profile(session, x: np.ndarray, *, runs: int, top: int = 5) -> dict:
    """Where the time goes: ORT's per-node kernel times on batch x.

    `session` must have been made with profiling on (onnxutil.make_session(profile_prefix=...)).
    Each node's time is its median over runs + 1 runs (the first is the warm-up, and a median
    of the rest is not moved by it). Times exclude ORT's per-run overhead outside the kernels.
    """
    run = session_runner(session)
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


def describe_profile(profile: dict, ops: int = 3) -> str:
    """'4.02 ms (QLinearConv 94%, NhwcMaxPool 5%)': the kernel time and its main op types
    (at most `ops`, each at least 1% of the time)."""
    total = profile["kernel_ms"]
    # Sorted here: JSON round trips (write_json sorts keys) lose the order kernel_profile gave.
    ranked = sorted(profile["by_op_ms"].items(), key=lambda kv: -kv[1])[:ops]
    parts = [f"{op} {ms / total:.0%}" for op, ms in ranked if total and ms >= 0.01 * total]
    return f"{total:.2f} ms ({', '.join(parts)})" if parts else f"{total:.2f} ms"
