"""Memory and start-up cost of one model in a fresh process (run by quantpipe.bench.memory_profile).

    python quantpipe/memprobe.py MODEL.onnx --batch 64 --shape 1,28,28 --threads 2 --level ORT_ENABLE_ALL \
        [--config session.x64quantprecision=1 ...]

Prints one JSON object: runtime_rss_mb (Python + numpy + onnxruntime imported, no model),
load_ms (InferenceSession creation: parse, optimize, allocate weights), first_run_ms (the first
inference, which allocates the activation arena), peak_rss_mb (the process's high-water mark
after a few more runs). A fresh process, because a benchmark process has already touched and
kept memory for every model it timed.

Deliberately imports nothing but numpy and onnxruntime (not quantpipe, not onnx, not torch), so
the peak is what a deployed inference process needs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def high_water_mb() -> float:
    """Peak resident set size of this process so far (VmHWM), MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    import resource  # not Linux: ru_maxrss (kB on Linux and BSD)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_memory_mb(meminfo: Path = Path("/proc/meminfo"),
                      cgroup: Path = Path("/sys/fs/cgroup")) -> float:
    """This machine's memory (MiB): MemTotal, or the cgroup's limit where it is lower (a
    container sees the host's MemTotal)."""
    total = None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) / 1024  # kB
    limits = []
    for path in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text) / 2**20)
    if total is None:
        raise OSError(f"{meminfo}: no MemTotal line")
    return min([total, *limits])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--shape", required=True, help="C,H,W of one sample")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--level", required=True, help="an ort.GraphOptimizationLevel name")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                        help="session config entries, as the deployed session sets them")
    args = parser.parse_args()

    import numpy as np
    import onnxruntime as ort

    runtime_mb = high_water_mb()
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, args.level)
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    for entry in args.config:
        key, value = entry.split("=", 1)
        options.add_session_config_entry(key, value)
    start = time.perf_counter()
    session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
    load_ms = (time.perf_counter() - start) * 1e3
    shape = (args.batch, *map(int, args.shape.split(",")))  # (B, C, H, W)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    feed = {session.get_inputs()[0].name: x}
    start = time.perf_counter()
    session.run(None, feed)
    first_run_ms = (time.perf_counter() - start) * 1e3
    for _ in range(args.runs):
        session.run(None, feed)
    print(json.dumps({"runtime_rss_mb": round(runtime_mb, 2), "load_ms": round(load_ms, 3),
                      "first_run_ms": round(first_run_ms, 3),
                      "peak_rss_mb": round(high_water_mb(), 2)}))


if __name__ == "__main__":
    main()
