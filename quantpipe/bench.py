"""Latency measurement: warm-up, then timed runs interleaved across models in rounds.

Interleaving matters on a shared 2-core machine: clock and load drift over seconds, and timing
model A fully before model B would put that drift into the A/B ratio.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Hashable

import numpy as np
import onnxruntime as ort

from quantpipe import onnxutil, tails
from quantpipe.errors import UserError
from quantpipe.concurrency import run_concurrently
from quantpipe.schemas.bench import ALL_CORES, POWERS, BenchParams

Runner = Callable[[np.ndarray], object]

# Untimed runs at the start of each runner's turn in a round (at most bench.warmup): the first
# run after another model's turn finds cold caches and sleeping workers, a cost of the
# interleaving, not of the model; 6 rounds of it would be 2% of 300 runs, the whole p99.
ROUND_WARMUP = 3


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


def within_budget(runs: int, rounds: int, seconds_per_run: float, budget: float | None) -> int:
    """`runs`, or fewer when they would take more than `budget` seconds in all (at least two
    per round: a median of something)."""
    if budget is None or seconds_per_run <= 0:
        return runs
    return max(2 * rounds, min(runs, int(budget / seconds_per_run)))


def _warm(runners: list[Runner], x: np.ndarray, warmup: int) -> float:
    """Run each runner `warmup` times; the seconds one run of each takes together, from the
    last warm-up runs (0 without warm-up: then no budget applies)."""
    total = 0.0
    for run in runners:
        for i in range(warmup):
            start = time.perf_counter()
            run(x)
            if i == warmup - 1:
                total += time.perf_counter() - start
    return total


def measure(runners: dict[str, Runner], x: np.ndarray, *, warmup: int, runs: int,
            rounds: int, tick: Callable[[], None] = lambda: None,
            budget: float | None = None) -> dict[str, Latency]:
    """Time each runner on the same batch x; rounds alternate the order of the runners.
    budget: seconds all the timed runs may take (within_budget), None for exactly `runs`."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    runs = within_budget(runs, rounds, _warm(list(runners.values()), x, warmup), budget)
    names = list(runners)
    for r in range(rounds):
        per_round = runs // rounds + (r < runs % rounds)  # exactly `runs` in all
        for name in names if r % 2 == 0 else reversed(names):
            run = runners[name]
            for _ in range(min(ROUND_WARMUP, warmup)):
                run(x)
            for _ in range(per_round):
                start = time.perf_counter()
                run(x)
                times[name].append(time.perf_counter() - start)
        tick()
    return {name: summarize(t, len(x)) for name, t in times.items()}


def resolve_threads(threads: tuple[int | str, ...], cores: int) -> tuple[int, ...]:
    """bench.threads as counts: "all" becomes `cores`, "powers" 1, 2, 4, ... below `cores`;
    repeats dropped, order kept."""
    counts: list[int] = []
    for t in threads:
        if t == ALL_CORES:
            counts.append(cores)
        elif t == POWERS:
            counts += [2 ** i for i in range(cores.bit_length()) if 2 ** i < cores]
        else:
            counts.append(int(t))
    return tuple(dict.fromkeys(counts))


def latency_grid(runners_for: Callable[[int], dict[Hashable, Runner]], x: np.ndarray,
                 threads: tuple[int, ...], p: BenchParams, desc: str
                 ) -> dict[str, dict[str, dict[Hashable, Latency]]]:
    """{"threadsT": {"bsN": {key: Latency}}} over `threads` and p.batch_sizes, with a progress
    bar: runners_for(threads) gives the runners (models, or a model on several runtimes) that
    are timed in the same interleaved rounds."""
    from tqdm import tqdm

    grid: dict[str, dict[str, dict[Hashable, Latency]]] = {}
    with tqdm(total=len(threads) * len(p.batch_sizes) * p.rounds, desc=desc, unit="round") as bar:
        for count in threads:
            runners = runners_for(count)
            for bs in p.batch_sizes:
                grid.setdefault(f"threads{count}", {})[f"bs{bs}"] = measure(
                    runners, batch_of(x, bs), warmup=p.warmup, runs=p.runs, rounds=p.rounds,
                    tick=lambda: bar.update(1), budget=p.max_seconds)
    return grid


def rows_against(grid: dict[str, dict[str, dict[Hashable, Latency]]], key: Hashable,
                 baseline: Hashable) -> dict[str, dict[str, dict]]:
    """{"threadsT": {"bsN": row}} of `key`; unless key is the baseline, a row also holds the
    baseline's median from the same rounds (baseline_p50_ms) and speedup = baseline p50 / its
    p50, so machine drift cancels out."""
    rows: dict[str, dict[str, dict]] = {}
    for count, by_size in grid.items():
        for bs, lat in by_size.items():
            row = as_dict(lat[key])
            if key != baseline:
                row["baseline_p50_ms"] = lat[baseline].p50_ms
                row["speedup"] = round(lat[baseline].p50_ms / lat[key].p50_ms, 4)
            rows.setdefault(count, {})[bs] = row
    return rows


def latency_table(runners_for: Callable[[int], dict[str, Runner]], variant: str, x: np.ndarray,
                  threads: tuple[int, ...], p: BenchParams, desc: str) -> dict[str, dict[str, dict]]:
    """The rows of `variant` (rows_against) timed with "fp32" (runners_for gives both)."""
    return rows_against(latency_grid(runners_for, x, threads, p, desc), variant, "fp32")


# --- throughput: filling every core ----------------------------------------------------------

@dataclass(frozen=True)
class StreamConfig:
    """`streams` sessions run concurrently (one request thread each), `threads` intra-op
    threads per session: streams x threads = the cores they fill."""
    streams: int
    threads: int

    @property
    def key(self) -> str:
        return f"streams{self.streams}_threads{self.threads}"


def stream_configs(cores: int) -> list[StreamConfig]:
    """Ways to fill `cores` cores: one session with every thread, then 2, 4, ... sessions of
    fewer threads, down to one single-threaded session per core. Powers of two (and `cores`
    itself) keep a 64-core machine to 7 configurations instead of every divisor."""
    streams = [s for s in (2 ** i for i in range(cores.bit_length())) if cores % s == 0]
    if cores not in streams:
        streams.append(cores)
    return [StreamConfig(s, cores // s) for s in streams]


def measure_throughput(pools: dict[str, list[Runner]], x: np.ndarray, *, batches: int,
                       warmup: int, rounds: int, tick: Callable[[], None] = lambda: None,
                       budget: float | None = None) -> dict[str, float]:
    """Images per second of each pool of runners (one runner per stream) on batch x.

    In each round a pool's runners run concurrently, `batches` batches in all, split evenly
    (fewer when all rounds would take more than `budget` seconds, see within_budget); the
    result is the median over rounds, whose order of pools alternates as in measure().
    """
    # One stream of each pool gives the time per batch; its streams run in parallel.
    per_batch = _warm([runners[0] for runners in pools.values()], x, warmup)
    for runners in pools.values():
        for run in runners[1:]:
            for _ in range(warmup):
                run(x)
    batches = within_budget(batches * rounds, rounds, per_batch, budget) // rounds
    rates: dict[str, list[float]] = {name: [] for name in pools}
    names = list(pools)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            runners = pools[name]
            per_stream = -(-batches // len(runners))
            _, seconds = run_concurrently([functools.partial(_repeat, run, x, per_stream)
                                           for run in runners])
            rates[name].append(per_stream * len(runners) * len(x) / seconds)
        tick()
    return {name: round(statistics.median(r), 1) for name, r in rates.items()}


def _repeat(run: Runner, x: np.ndarray, times: int) -> None:
    for _ in range(times):
        run(x)


def throughput_grid(pools_for: Callable[[StreamConfig], dict[Hashable, list[Runner]]],
                    x: np.ndarray, cores: int, p: BenchParams, desc: str
                    ) -> dict[Hashable, dict[StreamConfig, float]]:
    """{key: {configuration: images/s}} at the largest batch size, for every stream
    configuration of `cores` cores; pools_for(config) gives one runner per stream of each key,
    all timed in the same interleaved rounds."""
    from tqdm import tqdm

    configs = stream_configs(cores)
    batch = batch_of(x, max(p.batch_sizes))
    ips: dict[Hashable, dict[StreamConfig, float]] = {}
    with tqdm(total=len(configs) * p.rounds, desc=desc, unit="round") as bar:
        for config in configs:  # one configuration's sessions at a time: memory stays bounded
            rates = measure_throughput(pools_for(config), batch, batches=max(1, p.runs // p.rounds),
                                       warmup=p.warmup, rounds=p.rounds, tick=lambda: bar.update(1),
                                       budget=p.max_seconds)
            for key, rate in rates.items():
                ips.setdefault(key, {})[config] = rate
    return ips


def best_stream_config(ips: dict[StreamConfig, float]) -> dict:
    config = max(ips, key=ips.get)
    return {"streams": config.streams, "threads": config.threads, "ips": ips[config]}


def throughput_against(ips: dict[Hashable, dict[StreamConfig, float]], key: Hashable,
                       baseline: Hashable, batch_size: int, cores: int) -> dict:
    """{"batch_size", "cores", "ips": {config key: images/s}, "best": the best configuration}
    of `key`; unless key is the baseline, the same of the baseline from the same rounds
    ("baseline_ips", "baseline_best") and "speedup" = best / baseline_best: each side at the
    configuration that suits it, as each would be deployed."""
    result = {"batch_size": batch_size, "cores": cores,
              "ips": {c.key: rate for c, rate in ips[key].items()}, "best": best_stream_config(ips[key])}
    if key != baseline:
        result.update({"baseline_ips": {c.key: rate for c, rate in ips[baseline].items()},
                       "baseline_best": best_stream_config(ips[baseline])})
        result["speedup"] = round(result["best"]["ips"] / result["baseline_best"]["ips"], 4)
    return result


def best_configuration(grid: dict[str, dict[str, dict[tuple[str, str], Latency]]],
                       ips: dict[tuple[str, str], dict[StreamConfig, float]], model: str,
                       runtimes: list[str], baseline: str, baseline_runtimes: list[str]) -> dict:
    """The fastest way to run `model` over `runtimes` and every thread count / stream
    configuration benched: per batch size the lowest median latency, and the highest
    throughput. Unless model is the baseline, each also names the baseline's best over
    `baseline_runtimes` ("baseline", as rows name FP32 timed in the same rounds) and speedup =
    its best / the baseline's best (each side as it would be deployed). Keys of grid and ips
    are (model, runtime)."""
    sizes = next(iter(grid.values()))
    latency = {bs: _fastest(grid, model, runtimes, bs) for bs in sizes}
    throughput = _most(ips, model, runtimes) if ips else None
    if model != baseline:
        for bs, row in latency.items():
            row["baseline"] = _fastest(grid, baseline, baseline_runtimes, bs)
            row["speedup"] = round(row["baseline"]["p50_ms"] / row["p50_ms"], 4)
        if throughput is not None:
            throughput["baseline"] = _most(ips, baseline, baseline_runtimes)
            throughput["speedup"] = round(throughput["ips"] / throughput["baseline"]["ips"], 4)
    return {"latency": latency, **({"throughput": throughput} if throughput else {})}


def add_versus(best: dict, grid: dict[str, dict[str, dict[tuple[str, str], Latency]]],
               ips: dict[tuple[str, str], dict[StreamConfig, float]], other: str,
               runtimes: list[str]) -> None:
    """Beside each row of best_configuration's `best`, the best of model `other` (timed in the
    same rounds) over `runtimes` as `other` and speedup_vs_<other> = its best / the row's:
    INT8 against BF16, each side as it would be deployed."""
    for bs, row in best["latency"].items():
        row[other] = _fastest(grid, other, runtimes, bs)
        row[f"speedup_vs_{other}"] = round(row[other]["p50_ms"] / row["p50_ms"], 4)
    top = best.get("throughput")
    if top is not None:
        top[other] = _most(ips, other, runtimes)
        top[f"speedup_vs_{other}"] = round(top["ips"] / top[other]["ips"], 4)


def _fastest(grid: dict, name: str, among: list[str], bs: str) -> dict:
    """The lowest median of `name` over runtimes `among` and every thread count, unless its tail
    is loose and a configuration ranks before it by tails.pace (tails.choose)."""
    options = [(by_size[bs][(name, rt)], rt, count) for count, by_size in grid.items()
               for rt in among if (name, rt) in by_size[bs]]
    lat, runtime, count = tails.choose(options, p50=lambda o: o[0].p50_ms, p99=lambda o: o[0].p99_ms)
    return {"runtime": runtime, "threads": int(count.removeprefix("threads")), "p50_ms": lat.p50_ms,
            "p90_ms": lat.p90_ms, "p99_ms": lat.p99_ms}


def _most(ips: dict, name: str, among: list[str]) -> dict:
    rate, runtime = max((max(ips[(name, rt)].values()), rt) for rt in among if (name, rt) in ips)
    return {"runtime": runtime, **best_stream_config(ips[(name, runtime)])}


# --- memory and start-up ---------------------------------------------------------------------

MEMPROBE = Path(__file__).with_name("memprobe.py")


def memory_profile(model: Path, input_shape: tuple[int, ...], batch_sizes: tuple[int, ...], *,
                   threads: int, level: ort.GraphOptimizationLevel,
                   config: dict[str, str] | None = None, repeats: int = 3) -> dict:
    """Peak RSS and session-creation time of a fresh process that loads `model` and runs it,
    `repeats` processes per batch size (quantpipe/memprobe.py). Its session takes the `config`
    entries; by default those a deployed session of `model` sets (onnxutil.exact_int8_config_of).

    peak_rss_mb per batch size is the largest of its repeats (a limit must hold every time);
    load_ms and first_run_ms are medians; runtime_rss_mb is the process before any model.
    """
    if config is None:
        config = onnxutil.exact_int8_config_of(model, level)
    probes: dict[int, list[dict]] = {}
    for bs in batch_sizes:
        for _ in range(repeats):
            cmd = [sys.executable, str(MEMPROBE), str(model), "--batch", str(bs),
                   "--shape", ",".join(map(str, input_shape)), "--threads", str(threads),
                   "--level", level.name, "--config", *(f"{k}={v}" for k, v in config.items())]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise UserError(f"{model}: the memory probe failed at batch {bs}: {last[:200]}")
            probes.setdefault(bs, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
    every = [r for runs in probes.values() for r in runs]
    return {"threads": threads, "repeats": repeats,
            "runtime_rss_mb": round(statistics.median(r["runtime_rss_mb"] for r in every), 1),
            "load_ms": round(statistics.median(r["load_ms"] for r in every), 2),
            "peak_rss_mb": {f"bs{bs}": round(max(r["peak_rss_mb"] for r in runs), 1)
                            for bs, runs in probes.items()},
            "first_run_ms": {f"bs{bs}": round(statistics.median(r["first_run_ms"] for r in runs), 3)
                             for bs, runs in probes.items()}}


def batch_of(x: np.ndarray, size: int) -> np.ndarray:
    """The first `size` samples of x (an array or data.Normalized), repeated if x is shorter.
    (size, C, S, S)"""
    head = x[:size]
    reps = -(-size // len(head))
    return np.ascontiguousarray(np.concatenate([head] * reps)[:size])


def as_dict(latency: Latency) -> dict:
    return asdict(latency)
