"""Jobs released at once on threads: the concurrency check of evaluate and the throughput
runs of bench share it (a module of its own, so an edit to the benchmark re-runs no evaluate)."""

from __future__ import annotations

import threading
import time
from typing import Callable


def run_concurrently(jobs: list[Callable[[], object]]) -> tuple[list[object], float]:
    """Run every job in its own thread, all released at once; their results (in order) and the
    wall time in seconds from the release to the last finish. A job's exception is re-raised.

    ONNX Runtime releases the GIL inside session.run, so the threads really run in parallel.
    """
    barrier = threading.Barrier(len(jobs) + 1)
    results: list[object] = [None] * len(jobs)
    errors: list[BaseException] = []

    def work(i: int, job: Callable[[], object]) -> None:
        barrier.wait()
        try:
            results[i] = job()
        except BaseException as e:  # re-raised in the calling thread below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return results, elapsed
