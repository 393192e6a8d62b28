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

from quantpipe import budget, onnxutil, tails
from quantpipe.errors import UserError
from quantpipe.concurrency import run_concurrently
from quantpipe.schemas.bench import ALL_CORES, POWERS, BenchParams

Runner = Callable[[np.ndarray], object]

# Untimed runs at the start of each runner's turn in a round (at most bench.warmup): the first
# run after another model's turn finds cold caches and sleeping workers, a cost of the
# interleaving, not of the model; 6 rounds of it would be 2% of 300 runs, the whole p99. They
# stop at ROUND_WARM_SECONDS of the runner's time: a run of 100 ms or more wakes its threads and
# streams its weights through the caches in its first microseconds anyway.
ROUND_WARMUP = 3
ROUND_WARM_SECONDS = 0.1
# Warm-up before timing: bench.warmup runs, but no more than WARM_SECONDS of one runner's time
# (the first run allocates; a second settles a fast model's arena and caches; a 1.5 s
# ResNet-50 batch needs neither 10 runs nor a second).
WARM_SECONDS = 1.0
# The fewest runs a measurement keeps when its share of bench.seconds would allow fewer: two
# rounds of one run (a spread of the speedup over rounds, of two: ResNet-50's five variants at
# 224 px then bench in about 9 minutes on 2 cores), or as many as MIN_SECONDS allow (a fast
# batch of one keeps a p99 of some meaning when the largest batch of a slow model has taken
# the whole budget).
MIN_ROUNDS = 2
MIN_SECONDS = 2.0


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    std_ms: float
    throughput: float  # samples per second at the median latency
    runs: int
    round_p50_ms: tuple[float, ...] = ()  # each round's median: the speedup's spread


def summarize(seconds: list[float] | list[list[float]], batch_size: int) -> Latency:
    """Percentiles of the timed runs (seconds), given flat or per round."""
    rounds = seconds if seconds and isinstance(seconds[0], list) else [seconds]
    ms = np.concatenate([np.asarray(r, dtype=float) for r in rounds]) * 1e3
    p50 = float(np.percentile(ms, 50))
    return Latency(p50_ms=round(p50, 5), p90_ms=round(float(np.percentile(ms, 90)), 5),
                   p99_ms=round(float(np.percentile(ms, 99)), 5),
                   mean_ms=round(float(ms.mean()), 5), std_ms=round(float(ms.std()), 5),
                   throughput=round(batch_size / (p50 / 1e3), 1), runs=len(ms),
                   round_p50_ms=tuple(round(float(np.median(r)) * 1e3, 5) for r in rounds if r)
                   if len(rounds) > 1 else ())


def plan_runs(runs: int, rounds: int, seconds_per_run: float,
              budget: float | None) -> tuple[int, int]:
    """(runs, rounds): `runs` in `rounds` when they fit in `budget` seconds; else the runs that
    fit, at least MIN_ROUNDS (or what MIN_SECONDS holds), in as many rounds (at most
    `rounds`)."""
    if budget is None or seconds_per_run <= 0:
        return runs, rounds
    least = min(runs, max(MIN_ROUNDS, int(MIN_SECONDS / seconds_per_run)))
    fit = max(least, min(runs, int(budget / seconds_per_run)))
    return fit, min(rounds, fit)


def _warm(runners: dict[str, Runner], x: np.ndarray, warmup: int) -> dict[str, float]:
    """Run each runner `warmup` times, fewer once its runs have taken WARM_SECONDS (two at
    least, unless the first alone did); the seconds of each one's last run (0 without warm-up:
    then no budget applies)."""
    cost = {}
    for name, run in runners.items():
        cost[name], spent = 0.0, 0.0
        for i in range(warmup):
            start = time.perf_counter()
            run(x)
            cost[name] = time.perf_counter() - start
            spent += cost[name]
            if spent >= WARM_SECONDS and (i >= 1 or cost[name] >= WARM_SECONDS):
                break
    return cost


def round_warmup(cost: float, warmup: int) -> int:
    """Untimed runs at the start of a runner's turn: ROUND_WARMUP, fewer for a slow runner."""
    return min(ROUND_WARMUP, warmup, int(ROUND_WARM_SECONDS / cost) if cost > 0 else ROUND_WARMUP)


def measure(runners: dict[str, Runner], x: np.ndarray, *, warmup: int, runs: int,
            rounds: int, tick: Callable[[], None] = lambda: None,
            budget: float | None = None) -> dict[str, Latency]:
    """Time each runner on the same batch x; rounds alternate the order of the runners.
    budget: seconds the measurement may take, warm-up included; runs and rounds are derived
    from the warm-up runs' cost (plan_runs); None for exactly `runs` in `rounds`."""
    start = time.perf_counter()
    costs = _warm(runners, x, warmup)
    left = None if budget is None else budget - (time.perf_counter() - start)
    per_run = sum(c * (1 + round_warmup(c, warmup) * rounds / runs) for c in costs.values())
    runs, rounds = plan_runs(runs, rounds, per_run, None if left is None else max(left, 0.0))
    times: dict[str, list[list[float]]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        per_round = runs // rounds + (r < runs % rounds)  # exactly `runs` in all
        for name in names if r % 2 == 0 else reversed(names):
            run = runners[name]
            for _ in range(round_warmup(costs[name], warmup)):
                run(x)
            times[name].append([])
            for _ in range(per_round):
                began = time.perf_counter()
                run(x)
                times[name][-1].append(time.perf_counter() - began)
        tick()
    return {name: summarize(t, len(x)) for name, t in times.items()}


class TimeBudget:
    """bench.seconds handed out measurement by measurement: each gets an equal share of what
    is left, so a cheap one leaves what it did not use to the ones after it. None: no limit."""

    def __init__(self, seconds: float | None, measurements: int) -> None:
        self.seconds, self.left = seconds, measurements
        self.end = None if seconds is None else time.perf_counter() + seconds

    def share(self) -> float | None:
        """Seconds for the next measurement."""
        if self.end is None:
            return None
        seconds = max(0.0, self.end - time.perf_counter()) / max(self.left, 1)
        self.left = max(self.left - 1, 0)
        return seconds

    def over(self) -> float:
        """Seconds past the budget so far (the fewest rounds of a slow model can overrun it)."""
        return 0.0 if self.end is None else max(0.0, time.perf_counter() - self.end)


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
                 threads: tuple[int, ...], p: BenchParams, desc: str,
                 clock: TimeBudget | None = None) -> dict[str, dict[str, dict[Hashable, Latency]]]:
    """{"threadsT": {"bsN": {key: Latency}}} over `threads` and p.batch_sizes, with a progress
    bar: runners_for(threads) gives the runners (models, or a model on several runtimes) that
    are timed in the same interleaved rounds, each measurement in its share of `clock` (by
    default bench.seconds over these measurements alone)."""
    from tqdm import tqdm

    clock = clock or TimeBudget(p.seconds, len(threads) * len(p.batch_sizes))
    grid: dict[str, dict[str, dict[Hashable, Latency]]] = {}
    with tqdm(total=len(threads) * len(p.batch_sizes) * p.rounds, desc=desc, unit="round") as bar:
        for count in threads:
            runners = runners_for(count)
            # The largest batch first: a slow model's fewest rounds there come out of the
            # budget before the small batches, whose runs are cheap, share what is left.
            timed = {bs: measure(runners, batch_of(x, bs), warmup=p.warmup, runs=p.runs,
                                 rounds=p.rounds, tick=lambda: bar.update(1), budget=clock.share())
                     for bs in sorted(p.batch_sizes, reverse=True)}
            grid[f"threads{count}"] = {f"bs{bs}": timed[bs] for bs in p.batch_sizes}
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
                spread = round_speedups(lat[baseline], lat[key])
                if spread:
                    row["speedup_range"] = {"low": min(spread), "high": max(spread)}
            rows.setdefault(count, {})[bs] = row
    return rows


def round_speedups(baseline: Latency, other: Latency) -> list[float]:
    """The speedup in each round: the baseline's median over `other`'s, both from that round
    (their turns were next to each other, so the machine's drift between rounds cancels)."""
    return [round(b / o, 4) for b, o in zip(baseline.round_p50_ms, other.round_p50_ms) if o > 0]


def latency_table(runners_for: Callable[[int], dict[str, Runner]], variant: str, x: np.ndarray,
                  threads: tuple[int, ...], p: BenchParams, desc: str,
                  clock: TimeBudget | None = None) -> dict[str, dict[str, dict]]:
    """The rows of `variant` (rows_against) timed with "fp32" (runners_for gives both)."""
    return rows_against(latency_grid(runners_for, x, threads, p, desc, clock), variant, "fp32")


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
    (fewer, and fewer rounds, when all would take more than `budget` seconds, see plan_runs);
    the result is the median over rounds, whose order of pools alternates as in measure().
    """
    start = time.perf_counter()
    # Every stream of a pool warms at once, a batch each; the time per batch is that of the
    # streams' batches side by side over their count.
    costs = _warm({name: functools.partial(_side_by_side, runners) for name, runners in pools.items()},
                  x, warmup)
    costs = {name: cost / len(pools[name]) for name, cost in costs.items()}
    left = None if budget is None else max(0.0, budget - (time.perf_counter() - start))
    total, rounds = plan_runs(batches * rounds, rounds, sum(costs.values()), left)
    batches = max(1, total // rounds)
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


def _side_by_side(runners: list[Runner], x: np.ndarray) -> None:
    run_concurrently([functools.partial(run, x) for run in runners])


def _repeat(run: Runner, x: np.ndarray, times: int) -> None:
    for _ in range(times):
        run(x)


def throughput_grid(pools_for: Callable[[StreamConfig], dict[Hashable, list[Runner]]],
                    x: np.ndarray, cores: int, p: BenchParams, desc: str,
                    clock: TimeBudget | None = None, max_streams: int | None = None,
                    measured: dict[Hashable, dict[StreamConfig, float]] | None = None
                    ) -> dict[Hashable, dict[StreamConfig, float]]:
    """{key: {configuration: images/s}} at the largest batch size, for every stream
    configuration of `cores` cores (of at most max_streams streams: check_memory's) not in
    `measured` (one stream of every core's threads is the latency grid's: from_latency);
    pools_for(config) gives one runner per stream of each key, all timed in the same
    interleaved rounds, each configuration in its share of `clock`."""
    from tqdm import tqdm

    ips = {key: dict(rates) for key, rates in (measured or {}).items()}
    done = {config for rates in ips.values() for config in rates}
    configs = [c for c in stream_configs(cores) if (max_streams is None or c.streams <= max_streams)
               and c not in done]
    clock = clock or TimeBudget(p.seconds, len(configs))
    batch = batch_of(x, max(p.batch_sizes))
    with tqdm(total=len(configs) * p.rounds, desc=desc, unit="round") as bar:
        for config in configs:  # one configuration's sessions at a time: memory stays bounded
            rates = measure_throughput(pools_for(config), batch, batches=max(1, p.runs // p.rounds),
                                       warmup=p.warmup, rounds=p.rounds, tick=lambda: bar.update(1),
                                       budget=clock.share())
            for key, rate in rates.items():
                ips.setdefault(key, {})[config] = rate
    return ips


def from_latency(grid: dict[str, dict[str, dict[Hashable, Latency]]], cores: int,
                 batch_size: int) -> dict[Hashable, dict[StreamConfig, float]]:
    """Images/s of one stream with every core's threads, from the latency grid where it holds
    that measurement (batch_size back to back on `cores` threads is the same work), else {}."""
    rows = grid.get(f"threads{cores}", {}).get(f"bs{batch_size}", {})
    return {key: {StreamConfig(1, cores): round(batch_size / (lat.p50_ms / 1e3), 1)}
            for key, lat in rows.items()}


def measurements(threads: tuple[int, ...], p: BenchParams, cores: int, *, end_to_end: bool,
                 profiled: bool) -> int:
    """How many measurements share a variant's bench.seconds: latency per thread count and
    batch size (twice with a task's post-processing timed end to end), throughput per stream
    configuration, and the memory probes and kernel profile."""
    latency = len(threads) * len(p.batch_sizes)
    streams = len(stream_configs(cores)) - (cores in threads)  # one is the latency grid's
    return latency * (2 if end_to_end else 1) + streams + (2 if profiled else 0)


def check_memory(memory: budget.Budget, models: dict[str, Path], runtimes: dict[str, dict],
                 input_shape: tuple[int, ...], p: BenchParams, cores: int) -> int:
    """The most streams the throughput configurations may run within the memory budget; one
    line naming the keys when even the latency
    sessions (one per model and runtime at the largest batch) do not fit. A session holds its
    model's weights twice (a copy and the prepacked layout) and, per stream running at once,
    a batch's input and live activations (quantpipe.budget.activations)."""
    largest = max(p.batch_sizes)
    costs = {}  # model -> (bytes per session, bytes per stream)
    for m, path in models.items():
        acts = budget.activations(onnxutil.load_model(path), input_shape)
        costs[m] = (2 * acts.weights, largest * (4 * int(np.prod(input_shape)) + acts.live))
    pairs = [(m, name) for m, by_runtime in runtimes.items() for name in by_runtime]

    def need(streams: int) -> int:
        # ONNX Runtime's streams are sessions of their own; OpenVINO's share one compiled model.
        return sum((streams if name == "onnxruntime" else 1) * costs[m][0] + streams * costs[m][1]
                   for m, name in pairs)

    if need(1) > memory.left_bytes():
        raise UserError(f"bench: {len(pairs)} sessions at batch {largest} need about "
                        f"{need(1) / 2**20:,.0f} MiB, more than {memory.source} MiB leaves; lower "
                        "bench.batch_sizes, drop a runtime of bench.runtimes or raise "
                        "resources.memory_mb")
    streams = max(c.streams for c in stream_configs(cores))
    while streams > 1 and need(streams) > memory.left_bytes():
        streams //= 2
    return streams


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
            spread = best_speedup_range(row["baseline"], row)
            if spread:
                row["speedup_range"] = spread
        if throughput is not None:
            throughput["baseline"] = _most(ips, baseline, baseline_runtimes)
            throughput["speedup"] = round(throughput["ips"] / throughput["baseline"]["ips"], 4)
    for row in latency.values():  # lists stay out of what the summary copies (DVC drops them)
        row.pop("round_p50_ms", None)
        row.get("baseline", {}).pop("round_p50_ms", None)
    return {"latency": latency, **({"throughput": throughput} if throughput else {})}


def add_versus(best: dict, grid: dict[str, dict[str, dict[tuple[str, str], Latency]]],
               ips: dict[tuple[str, str], dict[StreamConfig, float]], other: str,
               runtimes: list[str]) -> None:
    """Beside each row of best_configuration's `best`, the best of model `other` (timed in the
    same rounds) over `runtimes` as `other` and speedup_vs_<other> = its best / the row's:
    INT8 against BF16, each side as it would be deployed."""
    for bs, row in best["latency"].items():
        row[other] = _fastest(grid, other, runtimes, bs)
        row[other].pop("round_p50_ms", None)
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
            "p90_ms": lat.p90_ms, "p99_ms": lat.p99_ms,
            **({"round_p50_ms": list(lat.round_p50_ms)} if lat.round_p50_ms else {})}


def best_speedup_range(baseline: dict, best: dict) -> dict | None:
    """{"low", "high"}: the speedup of `best` over `baseline` (_fastest's rows) over the
    rounds: paired round by round when both were timed at one thread count (the same rounds),
    else the widest pairing of their round medians."""
    b, o = baseline.get("round_p50_ms"), best.get("round_p50_ms")
    if not b or not o:
        return None
    if baseline["threads"] == best["threads"] and len(b) == len(o):
        ratios = [x / y for x, y in zip(b, o)]
        return {"low": round(min(ratios), 4), "high": round(max(ratios), 4)}
    return {"low": round(min(b) / max(o), 4), "high": round(max(b) / min(o), 4)}


def _most(ips: dict, name: str, among: list[str]) -> dict:
    rate, runtime = max((max(ips[(name, rt)].values()), rt) for rt in among if (name, rt) in ips)
    return {"runtime": runtime, **best_stream_config(ips[(name, runtime)])}


# --- memory and start-up ---------------------------------------------------------------------

MEMPROBE = Path(__file__).with_name("memprobe.py")


def memory_profile(model: Path, input_shape: tuple[int, ...], batch_sizes: tuple[int, ...], *,
                   threads: int, level: ort.GraphOptimizationLevel,
                   config: dict[str, str] | None = None, repeats: int = 3,
                   budget: float | None = None, runs: int = 5) -> dict:
    """Peak RSS and session-creation time of a fresh process that loads `model` and runs it,
    `repeats` processes per batch size (quantpipe/memprobe.py) of `runs` runs after the first,
    fewer processes when the first ones show that all would take more than `budget` seconds (at
    least one per batch size). Its session
    takes the `config` entries; by default those a deployed session of `model` sets
    (onnxutil.exact_int8_config_of).

    peak_rss_mb per batch size is the largest of its repeats (a limit must hold every time);
    load_ms and first_run_ms are medians; runtime_rss_mb is the process before any model.
    """
    if config is None:
        config = onnxutil.exact_int8_config_of(model, level)
    probes: dict[int, list[dict]] = {}
    start = time.perf_counter()
    for i, bs in enumerate(batch_sizes):
        # This batch size's share of what is left: its first probe always runs, another while
        # the ones so far say it fits.
        share = None if budget is None else (budget - (time.perf_counter() - start)) / (
            len(batch_sizes) - i)
        began, done = time.perf_counter(), probes.setdefault(bs, [])
        while len(done) < repeats:
            spent = time.perf_counter() - began
            if done and share is not None and spent + spent / len(done) > share:
                break
            cmd = [sys.executable, str(MEMPROBE), str(model), "--batch", str(bs),
                   "--shape", ",".join(map(str, input_shape)), "--threads", str(threads),
                   "--level", level.name, "--runs", str(runs),
                   "--config", *(f"{k}={v}" for k, v in config.items())]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise UserError(f"{model}: the memory probe failed at batch {bs}: {last[:200]}")
            done.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    every = [r for runs in probes.values() for r in runs]
    return {"threads": threads, "repeats": min(len(runs) for runs in probes.values()),
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
    row = asdict(latency)
    row["round_p50_ms"] = list(latency.round_p50_ms)
    return row
