"""Tail latency in decisions: which of several measured configurations to choose.

A median alone hides what a server's slowest requests wait. On 16 cores, ONNX Runtime's INT8 at
batch 1 had p50 0.131 ms and p90 3.85 ms (its workers woken late): choosing by p50 would ship
that. The rule, used by bench's `best` and the report's `recommended`: the fastest median, unless
its tail is loose (p99 over LOOSE_TAIL x its p50) and another option within SAME_SPEED of its
median has a tight one; then the fastest of those.
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


def choose(options: Iterable[T], p50: Callable[[T], float], p99: Callable[[T], float],
           pick: T | None = None) -> T:
    """`pick` (default: the option of the lowest p50) unless its tail is loose and an option
    within SAME_SPEED of its p50 has a tight tail: then the fastest such option."""
    options = list(options)
    if pick is None:
        pick = min(options, key=p50)
    if tight(p50(pick), p99(pick)):
        return pick
    near = [o for o in options if tight(p50(o), p99(o)) and p50(o) <= p50(pick) * (1 + SAME_SPEED)]
    return min(near, key=p50) if near else pick


def describe(p50_ms: float, p99_ms: float) -> str:
    """'p99 0.214 ms (x1.9 p50)', with 'loose' when it is."""
    r = ratio(p50_ms, p99_ms)
    return f"p99 {p99_ms:.3f} ms (x{r:.1f} p50{', loose' if r > LOOSE_TAIL else ''})"
