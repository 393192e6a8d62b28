"""Latency measurement: warm-up, then timed runs interleaved across models in rounds.

Interleaving matters on a shared 2-core machine: clock and load drift over seconds, and timing
model A fully before model B would put that drift into the A/B ratio.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

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
