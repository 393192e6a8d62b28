"""Tail latency in decisions: which of several measured configurations to choose.

A median alone hides what a server's slowest requests wait. On 16 cores, ONNX Runtime's INT8 at
batch 1 had p50 0.131 ms and p90 3.85 ms (its workers woken late): choosing by p50 would ship
that. The rule, used by bench's `best` and the report's `recommended`: the fastest median, unless
its tail is loose (p99 over LOOSE_TAIL x its p50). A loose option then ranks as if its median
were SAME_SPEED slower or a LOOSE_TAIL-th of its p99, whichever is more (`pace`), and the option
of the lowest pace is chosen: one as fast (within SAME_SPEED) with a tight tail, a slower one
whose median is under a third of the loose p99, or a loose one of a shorter tail. On this
project's AVX2 EPYC, static at batch 1 on 2 threads of ONNX Runtime had p50 0.222 ms and p99
1.46 ms, OpenVINO's 2 threads 0.319 ms and 0.423 ms: 44% slower at the median, a p99 3.4x
shorter, what a server with a latency target takes.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T")

# p99 over this many times p50: the tail is loose. A steady kernel at batch 1 keeps p99 within
# ~2x p50 on a shared 2-core machine (scheduler jitter); 3x is a tail the user feels.
LOOSE_TAIL = 3.0
# Medians within this fraction are the same speed: run-to-run noise at bs1 is about that.
SAME_SPEED = 0.10


def ratio(p50_ms: float, p99_ms: float) -> float:
    return p99_ms / p50_ms if p50_ms > 0 else float("inf")


def tight(p50_ms: float, p99_ms: float) -> bool:
    return ratio(p50_ms, p99_ms) <= LOOSE_TAIL


def pace(p50_ms: float, p99_ms: float) -> float:
    """The median an option ranks by: its p50 when its tail is tight; when loose, its p50
    SAME_SPEED slower or p99 / LOOSE_TAIL, whichever is more."""
    if tight(p50_ms, p99_ms):
        return p50_ms
    return max(p50_ms * (1 + SAME_SPEED), p99_ms / LOOSE_TAIL)


def choose(options: Iterable[T], p50: Callable[[T], float], p99: Callable[[T], float],
           pick: T | None = None) -> T:
    """`pick` (default: the option of the lowest p50) unless its tail is loose: then the option
    of the lowest `pace`, a tight one on a tie, `pick` when none ranks before it."""
    options = list(options)
    if pick is None:
        pick = min(options, key=p50)
    if tight(p50(pick), p99(pick)):
        return pick

    def rank(o: T) -> tuple[float, bool, bool]:
        return pace(p50(o), p99(o)), not tight(p50(o), p99(o)), o is not pick
    return min([pick, *options], key=rank)


def describe(p50_ms: float, p99_ms: float) -> str:
    """'p99 0.214 ms (x1.9 p50)', with 'loose' when it is."""
    r = ratio(p50_ms, p99_ms)
    return f"p99 {p99_ms:.3f} ms (x{r:.1f} p50{', loose' if r > LOOSE_TAIL else ''})"
