"""Every runtime on the same ONNX files, timed in the same interleaved rounds (quantpipe.bench)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quantpipe import bench, profiling
from quantpipe.runtimes.base import Check, Runtime, describe_kernels, kernel_table
from quantpipe.schemas.bench import BenchParams


def time_runtimes(runtimes: dict[str, dict[str, Runtime]], reference: str, models: dict[str, Path],
                  checks: dict[str, dict[str, Check]], variant: str, x: np.ndarray,
                  threads: tuple[int, ...], cores: int, p: BenchParams,
                  clock: bench.TimeBudget | None = None, max_streams: int | None = None) -> dict:
    """Latency and throughput of models[variant] and models["fp32"] (and models["bf16"], the
    FP32 file in BF16, when given) on every runtime that can run them (runtimes[model]: the
    runtimes of that model's precision; checks: base.check per model), all in the same
    interleaved rounds; `reference` names the runtime the others are measured against.

    Returns "latency" and "throughput" of the variant on `runtime` (the reference runtime, or
    for the bf16 row the first trusted runtime that runs BF16) with rows_against and
    throughput_against FP32 on the reference runtime (the keys every earlier bench had),
    "runtimes": per runtime its version and settings and, for the others, parity, why it
    failed, and its rows against FP32 on the reference runtime (and the FP32 model's own on it
    under "baseline"), and "best": the fastest trusted runtime and configuration against the
    best trusted FP32 one (best_configuration), and against the best BF16 one when timed.
    Each measurement takes its share of `clock` (bench.seconds by default); throughput runs
    configurations of at most max_streams streams (bench.check_memory's).
    """
    clock = clock or bench.TimeBudget(p.seconds, len(threads) * len(p.batch_sizes)
                                      + len(bench.stream_configs(cores)))
    # A runtime that failed parity is still timed (its rows are shown, marked failed).
    timed = [(model, name) for model, by_runtime in checks.items()
             for name, c in by_runtime.items() if c.runs]
    grid = bench.latency_grid(
        lambda count: {(m, e): runtimes[m][e].runner(models[m], count) for m, e in timed},
        x, threads, p, desc=f"bench {variant} latency", clock=clock)
    ips = bench.throughput_grid(
        lambda config: {(m, e): runtimes[m][e].pool(models[m], config.streams, config.threads)
                        for m, e in timed},
        x, cores, p, desc=f"bench {variant} throughput", clock=clock, max_streams=max_streams,
        measured=bench.from_latency(grid, cores, max(p.batch_sizes)))
    largest, fp32 = max(p.batch_sizes), ("fp32", reference)

    def record(model: str, name: str) -> dict:
        c = checks[model][name]
        out = {"parity": c.parity.as_dict()} if c.parity else {}
        if c.failed:
            out["failed"] = c.failed
        if c.runs:
            out["latency"] = bench.rows_against(grid, (model, name), fp32)
            out["throughput"] = bench.throughput_against(ips, (model, name), fp32, largest, cores)
        return out

    records = {}
    for name, runtime in runtimes[variant].items():
        entry = {"title": runtime.title, "version": runtime.version()}
        if name == reference and checks[variant][name].parity is None:
            entry["reference"] = True
        else:
            entry.update(record(variant, name))
            if variant != "fp32" and name in checks["fp32"]:
                entry["baseline"] = record("fp32", name)
        if checks[variant][name].runs:
            entry["settings"] = runtime.settings(models[variant], cores)
        records[name] = entry
    trusted = {model: [name for name, c in by_runtime.items() if not c.failed]
               for model, by_runtime in checks.items()}
    # The runtime of the row's keys: the reference, or for the bf16 row the first trusted BF16
    # runtime; when none is trusted, the first that ran (the row is then marked failed).
    ran = [name for name, c in checks[variant].items() if c.runs]
    lead = reference if reference in trusted[variant] else (trusted[variant] or ran)[0]
    best = bench.best_configuration(grid, ips, variant, trusted[variant] or ran, "fp32",
                                    trusted["fp32"])
    if "bf16" in models and variant not in ("fp32", "bf16") and trusted["bf16"]:
        bench.add_versus(best, grid, ips, "bf16", trusted["bf16"])
    return {"runtime": lead,
            "latency": bench.rows_against(grid, (variant, lead), fp32),
            "throughput": bench.throughput_against(ips, (variant, lead), fp32, largest, cores),
            "runtimes": records, "best": best}


# Profiled runs at the largest batch: enough for a stable per-node median, fewer (at least
# PROFILE_MIN_RUNS) where they would take more than their share of bench.seconds.
PROFILE_RUNS = 20
PROFILE_MIN_RUNS = 3


def profile(runtimes: dict[str, Runtime], model: Path, checks: dict[str, Check], x: np.ndarray,
            threads: tuple[int, ...], machine: dict, input_shape: tuple[int, ...], p: BenchParams,
            level, clock: bench.TimeBudget, timings: dict, *, ort: bool) -> dict:
    """What the model runs on: "kernels", each runtime's kernels at the largest batch (those that
    ran it); with `ort`, ONNX Runtime's "memory" in a fresh process (bench.memory_profile) and its
    "kernel_profile" (where the time goes), each in its share of `clock`, sized by a run's median
    at the largest batch in `timings` (time_runtimes')."""
    largest = bench.batch_of(x, max(p.batch_sizes))
    cost_ms = timings["latency"][f"threads{threads[0]}"][f"bs{max(p.batch_sizes)}"]["p50_ms"]
    out = {"kernels": {name: kernel_table(runtime.kernels(model, largest, threads[0],
                                                          machine["cpu_flags"]))
                       for name, runtime in runtimes.items()
                       if checks[name].runs and hasattr(runtime, "kernels")}}
    if ort:
        # The peak comes with the first runs (the arena, then its memory pattern): 5 runs after
        # the first, fewer where a run at the largest batch takes more than 0.1 s.
        out["memory"] = bench.memory_profile(model, input_shape, p.batch_sizes, threads=threads[0],
                                             level=level, budget=clock.share(),
                                             runs=max(1, min(5, int(100 / max(cost_ms, 1e-6)))))
        share = clock.share()
        runs = PROFILE_RUNS if share is None else max(PROFILE_MIN_RUNS, min(
            PROFILE_RUNS, int(share / max(cost_ms / 1e3, 1e-9))))
        out["kernel_profile"] = profiling.profile_model(model, largest, level=level,
                                                        threads=threads[0], runs=runs)
    return out


def end_to_end(postprocess, runtime: Runtime, reference: Runtime, models: dict[str, Path],
               variant: str, x: np.ndarray, threads: tuple[int, ...], p: BenchParams,
               clock: bench.TimeBudget | None = None) -> dict:
    """What an application waits for: the model, then the task's `postprocess` (a detector's
    decode + NMS, the same code for every variant), on `runtime` (the row's), interleaved with
    FP32's on the reference the same way."""
    def runner(rt: Runtime, path: Path, count: int):
        run = rt.runner(path, count)
        return lambda batch: postprocess(run(batch))

    return bench.latency_table(
        lambda count: {variant: runner(runtime, models[variant], count),
                       "fp32": runner(reference, models["fp32"], count)},
        variant, x, threads, p, desc=f"bench {variant} end to end", clock=clock)


def describe_timings(timings: dict) -> list[str]:
    """Lines for the console: the reference runtime's rows, its throughput, each other runtime's
    parity (or why it was left out) and the fastest configuration per batch size."""
    lines = []
    for count, rows in timings["latency"].items():
        for bs, r in rows.items():
            extra = f", x{r['speedup']:.2f} vs fp32" if "speedup" in r else ""
            lines.append(f"{bs}, {count}: p50 {r['p50_ms']:.3f} ms{extra}")
    throughput = timings["throughput"]
    top = throughput["best"]
    extra = f", x{throughput['speedup']:.2f} vs fp32's best" if "speedup" in throughput else ""
    lines.append(f"throughput at bs{throughput['batch_size']}: {top['ips']:.0f} img/s with "
                 f"{top['streams']} stream(s) x {top['threads']} thread(s){extra}")
    # What the others were checked against: the reference runtime (FP32 on it, for the bf16 row).
    reference = next((name for name, entry in timings["runtimes"].items() if entry.get("reference")),
                     "FP32 on the reference runtime")
    for name, entry in timings["runtimes"].items():
        if "parity" in entry:
            par = entry["parity"]
            lines.append(f"{name} vs {reference} on the test split: agreement "
                         f"{par['agreement']:.2%}, max output difference {par['max_abs_diff']:.3g}")
        if "failed" in entry:
            lines.append(f"{name} is left out of best: {entry['failed']}")
    for bs, row in timings["best"]["latency"].items():
        extra = f", x{row['speedup']:.2f} vs FP32's best" if "speedup" in row else ""
        lines.append(f"fastest at {bs}: {row['runtime']}, {row['threads']} thread(s), p50 "
                     f"{row['p50_ms']:.3f} ms{extra}")
    top = timings["best"].get("throughput")
    if top:
        extra = f", x{top['speedup']:.2f} vs FP32's best" if "speedup" in top else ""
        lines.append(f"most throughput: {top['runtime']}, {top['streams']} stream(s) x "
                     f"{top['threads']} thread(s), {top['ips']:.0f} img/s{extra}")
    return lines


def describe_bench(out: dict) -> list[str]:
    """Lines for the console of bench's record: describe_timings, then the kernels each runtime
    ran, the fresh process's load time and peak RSS, and where ORT's kernel time went."""
    lines = describe_timings(out)
    lines += [f"{name} kernels: {describe_kernels(found.values())}"
              for name, found in out["kernels"].items()]
    if "memory" in out:
        memory, profile = out["memory"], out["kernel_profile"]
        lines.append(f"fresh process: load {memory['load_ms']:.1f} ms, peak RSS "
                     + ", ".join(f"{bs} {mb:.0f} MB" for bs, mb in memory["peak_rss_mb"].items()))
        lines.append(f"kernel time at bs{profile['batch_size']}: "
                     f"{profiling.describe_profile(profile)}")
    return lines
