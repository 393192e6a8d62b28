"""Accuracy of a variant against the labels and against FP32, and edge-input checks."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnxruntime as ort

from quantpipe.concurrency import run_concurrently
from quantpipe.criterion import compare
from quantpipe.data import DataInfo
from quantpipe.onnxutil import parity_limit, run_batched, session_runner

Runner = Callable[[np.ndarray], np.ndarray]  # a batch -> the model's first output


def accuracy_metrics(logits: np.ndarray, ref_logits: np.ndarray, y: np.ndarray,
                     num_classes: int) -> dict:
    """Accuracy, top-1 agreement, flips (each direction, McNemar's p) and logit error vs the
    FP32 reference, per-class accuracy."""
    pred, ref_pred = logits.argmax(1), ref_logits.argmax(1)
    error = np.abs(logits.astype(np.float64) - ref_logits.astype(np.float64))
    flips = compare(pred, ref_pred, y)
    return {
        "accuracy": round(float((pred == y).mean()), 6),
        "agreement": flips.agreement,
        "fp32_right_int8_wrong": flips.fp32_right_int8_wrong,
        "int8_right_fp32_wrong": flips.int8_right_fp32_wrong,
        "flips": flips.flips,
        "mcnemar_p": flips.mcnemar_p,
        "max_abs_logit_error": round(float(error.max()), 6),
        "mean_abs_logit_error": round(float(error.mean()), 6),
        "per_class_accuracy": {str(c): round(float((pred[y == c] == c).mean()), 6)
                               for c in range(num_classes) if (y == c).any()},
        "samples": int(len(y)),
    }


def confusion_rows(y: np.ndarray, pred: np.ndarray) -> list[dict]:
    """One row per sample, the shape DVC's confusion plot template reads."""
    return [{"actual": int(a), "predicted": int(p)} for a, p in zip(y, pred)]


@dataclass(frozen=True)
class EdgeCheck:
    name: str
    ok: bool
    detail: str


def edge_checks(session: ort.InferenceSession | Runner, info: DataInfo, x: np.ndarray,
                odd_batch: int, large_batch: int, atol: float, callers: int,
                concurrency_atol: float, concurrent: list[Runner] | None = None,
                same: Callable[[np.ndarray, np.ndarray], float] | None = None) -> list[EdgeCheck]:
    """The practitioner's pre-deployment checklist on normalized (N, C, S, S) samples.

    Constant inputs (all zeros, the largest and smallest normalized pixel values and 4x beyond
    them) must give finite logits; batches of 1, an odd size and a large size must give, row by
    row, what the same samples give one at a time (within atol logit units; for a detector,
    `same` gives the share of detections that match, and a batch whose rows differ passes when
    all of them do); `callers` threads
    calling the session at once must each get what their input gives alone (within
    concurrency_atol; 0 means exactly). `session` may be another runtime's runner; `concurrent`
    then gives one runner per caller where that runtime's runner serves one call at a time
    (OpenVINO: one infer request per caller, as its servers do).
    """
    shape = (1, *info.input_shape)
    mean = np.asarray(info.mean, dtype=np.float32)
    std = np.asarray(info.std, dtype=np.float32)
    high, low = float(((1 - mean) / std).max()), float((-mean / std).min())
    constants = {"zeros": 0.0, "max_value": high, "min_value": low,
                 "beyond_max": 4 * high, "beyond_min": 4 * low}
    checks = []
    for name, value in constants.items():
        out = run_batched(session, np.full(shape, value, dtype=np.float32), batch_size=1)
        checks.append(EdgeCheck(f"finite_{name}", bool(np.isfinite(out).all()),
                                f"input {value:+.3f} everywhere{_non_finite(out)}"))

    n = min(len(x), large_batch)
    single = run_batched(session, x[:n], batch_size=1)  # (n, K), one sample per run
    checks.append(EdgeCheck("finite_test_samples", bool(np.isfinite(single).all()),
                            f"{n} test samples{_non_finite(single)}"))
    # Per unit of the largest logit, like export's parity: a dynamic model's batch-wide
    # activation scales move logits in the tens (EfficientNet) by more than logits near 1.
    finite = single[np.isfinite(single)]
    limit = parity_limit(finite, atol) if finite.size else atol
    scale = "" if limit == atol else f" x the largest logit, {np.abs(finite).max():.3g}"
    for name, size in (("batch_1", 1), ("batch_odd", odd_batch), ("batch_large", n)):
        batched = run_batched(session, x[:size], batch_size=size)
        with np.errstate(invalid="ignore"):  # inf - inf: equal values (infinities too) differ by 0
            gap = np.where(batched == single[:size], 0.0, np.abs(batched - single[:size]))
        diff = float(gap.max())
        detail = f"batch of {size}: max |batched - single| = {diff:.3g} (atol {atol:g}{scale})"
        ok = bool(diff <= limit)
        if not ok and same is not None:
            # A detector's raw rows can differ where the result does not: an INT8 kernel rounds
            # a proposal's score a step apart in another batch, two near-equal proposals swap
            # rows. What must not differ is what it detects.
            matched = same(batched, single[:size])
            ok = matched == 1.0
            detail += f"; detections matched {matched:.2%} of the single-sample runs' (need 100%)"
        checks.append(EdgeCheck(name, ok, detail))
    inputs = concurrent_inputs(x, callers, sizes=(1, odd_batch, min(32, large_batch)))
    run = session_runner(session) if isinstance(session, ort.InferenceSession) else session
    checks.append(concurrency_check(concurrent or run, inputs, atol=concurrency_atol))
    return checks


def concurrent_inputs(x: np.ndarray, callers: int, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """One batch per caller, each different: consecutive slices of x (wrapping around), their
    sizes cycling through `sizes`, so batches of different shapes run at the same time too."""
    inputs, start = [], 0
    for i in range(callers):
        size = sizes[i % len(sizes)]
        inputs.append(x[np.arange(start, start + size) % len(x)])
        start += size
    return inputs


def concurrency_check(run: Runner | list[Runner], inputs: list[np.ndarray], *,
                      atol: float, repeats: int = 3) -> EdgeCheck:
    """Concurrent requests: `run` (or, given a list, runner i for input i: one infer request
    each on one compiled model) is called from len(inputs) threads at once, each with its own
    input `repeats` times; every output must equal that input's output from a sequential call
    (within atol; 0 means exactly). A server shares one session between request threads, so a
    runtime (or a wrapper around it) that mixes up buffers between calls shows here.
    """
    runs = run if isinstance(run, list) else [run] * len(inputs)  # one per caller, or shared
    expected = [r(batch) for r, batch in zip(runs, inputs)]
    outputs, _ = run_concurrently([functools.partial(_outputs, r, batch, repeats)
                                   for r, batch in zip(runs, inputs)])
    gap = max(_difference(out, want) for outs, want in zip(outputs, expected) for out in outs)
    sizes = sorted({len(batch) for batch in inputs})
    tolerance = "exactly" if atol == 0 else f"atol {atol:g}"
    return EdgeCheck("concurrent_requests", bool(gap <= atol),
                     f"{len(inputs)} threads x {repeats} calls on one "
                     f"{'model, a request each,' if isinstance(run, list) else 'session'} at once, batches of "
                     f"{', '.join(map(str, sizes))}: max |concurrent - sequential| = {gap:.3g} "
                     f"({tolerance})")


def _outputs(run: Callable[[np.ndarray], np.ndarray], batch: np.ndarray, times: int) -> list:
    return [run(batch) for _ in range(times)]


def _difference(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b|; equal values (infinities, and NaN against NaN: the finite_* checks report
    those) differ by 0, an output of another shape by infinity."""
    if a.shape != b.shape:
        return float("inf")
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
        return float(np.where(same, 0.0, np.abs(a.astype(np.float64) - b)).max(initial=0.0))


def _non_finite(out: np.ndarray) -> str:
    """'' when every logit is finite, else how many are NaN/Inf (for a check's detail)."""
    nan, inf = int(np.isnan(out).sum()), int(np.isinf(out).sum())
    return f": {nan} NaN and {inf} Inf of {out.size} logits" if nan or inf else ""
