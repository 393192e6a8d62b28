"""Accuracy of a variant against the labels and against FP32, and edge-input checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from quantpipe.data import DataInfo
from quantpipe.onnxutil import run_batched


def accuracy_metrics(logits: np.ndarray, ref_logits: np.ndarray, y: np.ndarray,
                     num_classes: int) -> dict:
    """Accuracy, top-1 agreement and logit error vs the FP32 reference, per-class accuracy."""
    pred, ref_pred = logits.argmax(1), ref_logits.argmax(1)
    error = np.abs(logits.astype(np.float64) - ref_logits.astype(np.float64))
    return {
        "accuracy": round(float((pred == y).mean()), 6),
        "agreement": round(float((pred == ref_pred).mean()), 6),
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


def edge_checks(session: ort.InferenceSession, info: DataInfo, x: np.ndarray,
                odd_batch: int, large_batch: int, atol: float) -> list[EdgeCheck]:
    """The practitioner's pre-deployment checklist on normalized (N, C, S, S) samples.

    Constant inputs (all zeros, the largest and smallest normalized pixel values and 4x beyond
    them) must give finite logits; batches of 1, an odd size and a large size must give, row by
    row, what the same samples give one at a time (within atol logit units).
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
    for name, size in (("batch_1", 1), ("batch_odd", odd_batch), ("batch_large", n)):
        batched = run_batched(session, x[:size], batch_size=size)
        with np.errstate(invalid="ignore"):  # inf - inf: equal values (infinities too) differ by 0
            gap = np.where(batched == single[:size], 0.0, np.abs(batched - single[:size]))
        diff = float(gap.max())
        checks.append(EdgeCheck(name, bool(diff <= atol),
                                f"batch of {size}: max |batched - single| = {diff:.3g} (atol {atol:g})"))
    return checks


def _non_finite(out: np.ndarray) -> str:
    """'' when every logit is finite, else how many are NaN/Inf (for a check's detail)."""
    nan, inf = int(np.isnan(out).sum()), int(np.isinf(out).sum())
    return f": {nan} NaN and {inf} Inf of {out.size} logits" if nan or inf else ""
