"""params.yaml `bench`: batch sizes, threads, timing rounds and the runtimes that run the models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check


# bench.threads' word for "every physical core of the machine that measures".
ALL_CORES = "all"
# bench.threads' word for the curve below it: 1, 2, 4, ... threads, each power of two under
# the core count (none more on 2 cores than 1; 1, 2, 4, 8 on 16).
POWERS = "powers"


@dataclass(frozen=True)
class BenchParams:
    SECTION: ClassVar[str] = "bench"

    batch_sizes: tuple[int, ...] = (1, 64)
    # Intra-op threads per session: counts, "all" (the physical cores recorded in
    # metrics/machine.json) or "powers" (1, 2, 4, ... below all: the threads curve). The first
    # entry is the headline (summary latency_p50_ms/speedup): all cores, ORT's default and what
    # people deploy with; the curve shows where INT8 stops scaling (1 thread: the per-core gain).
    threads: tuple[int | str, ...] = (ALL_CORES, POWERS)
    warmup: int = 10
    # Timed runs per (variant, batch size, threads), split into interleaved rounds; in
    # throughput mode, batches per configuration and round = runs // rounds.
    runs: int = 300
    rounds: int = 6
    # Seconds one variant's bench may spend timing: its latency and throughput measurements
    # (warm-up included), kernel profile and memory probes. Each measurement takes an equal
    # share of what is left (quantpipe.bench.TimeBudget); its runs and rounds follow from its
    # first runs' cost: bench.runs in bench.rounds where they fit, else fewer, at least 3
    # rounds of one run (the JSON records `runs` and each round's median, whose spread the
    # speedups state). With 60 s the five variants of ResNet-50 at 224 px and its PyTorch
    # baseline bench in about 10 minutes on 2 cores (each variant's fewest rounds at batch 64
    # take more than its share); the 28 px default model gets its 300 runs within it. null: no
    # limit.
    seconds: float | None = 60.0
    # Runtimes that run every variant's ONNX file, by their names in quantpipe.runtimes.registry
    # (which checks them). onnxruntime is the reference (the summary's latency/speedup keys and
    # every parity check are its); the others are timed beside it in the same rounds, and the
    # summary's `best` picks the fastest runtime that passed parity.
    runtimes: tuple[str, ...] = ("onnxruntime", "openvino")
    # Top-1 agreement with ONNX Runtime on the test split below which another runtime's outputs
    # are not trusted: its rows are marked failed and left out of `best`. Two runtimes' kernels
    # round differently; 99.5% leaves room for a few borderline samples, not for a wrong op.
    min_runtime_agreement: float = 0.995

    def __post_init__(self) -> None:
        check(bool(self.batch_sizes) and all(b >= 1 for b in self.batch_sizes),
              "bench.batch_sizes", list(self.batch_sizes), "a non-empty list of integers >= 1")
        check(bool(self.threads) and all(t in (ALL_CORES, POWERS) or (isinstance(t, int) and t >= 1)
                                         for t in self.threads),
              "bench.threads", list(self.threads),
              f"a non-empty list of integers >= 1, {ALL_CORES!r} (every physical core) or "
              f"{POWERS!r} (1, 2, 4, ... below every core)")
        check(self.warmup >= 0, "bench.warmup", self.warmup, "an integer >= 0")
        check(self.rounds >= 1, "bench.rounds", self.rounds, "an integer >= 1")
        check(self.seconds is None or self.seconds > 0, "bench.seconds", self.seconds,
              "a number of seconds > 0, or null")
        check(self.runs >= self.rounds, "bench.runs", self.runs, f"an integer >= bench.rounds ({self.rounds})")
        check(bool(self.runtimes) and len(set(self.runtimes)) == len(self.runtimes),
             "bench.runtimes", list(self.runtimes), "a non-empty list of distinct runtime names")
        check(0 <= self.min_runtime_agreement <= 1, "bench.min_runtime_agreement",
              self.min_runtime_agreement, "a number in [0, 1]")
