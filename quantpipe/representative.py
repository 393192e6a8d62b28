"""Does the calibration set represent the data the model will see? Its inputs and FP32's outputs
on it, against the test split's.

A failure practitioners report: calibration images of daytime scenes, half the validation set
at night, points of mAP lost until the calibration set matched. Static quantization fixes every
activation range from the calibration set, so a set that is brighter, darker or emptier than
the data leaves the ranges wrong for the rest. Each measure is a per-image number; the two sets
differ when their means are apart by more than MAX_DIFFERENCE pooled standard deviations
(Cohen's d: 0.5 is a "medium" effect, 0.8 a large one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_DIFFERENCE = 0.5


@dataclass(frozen=True)
class Measure:
    name: str
    calibration: float  # mean over the calibration images
    test: float         # mean over the test images
    difference: float   # |means apart| / pooled std

    @property
    def differs(self) -> bool:
        return self.difference > MAX_DIFFERENCE

    def as_dict(self) -> dict:
        return {"calibration": round(self.calibration, 6), "test": round(self.test, 6),
                "difference": round(self.difference, 4), "differs": self.differs}

    def warning(self) -> str:
        return (f"the calibration set does not represent the test split: {self.name} averages "
                f"{self.calibration:.4g} on it vs {self.test:.4g} on test ({self.difference:.2f} "
                f"pooled standard deviations apart, > {MAX_DIFFERENCE}); draw calibration images "
                "like the data the model will see (prepare.calib_size, or your own calibration "
                "images), or expect a larger drop")


BATCH = 256  # images per read


def _measure(name: str, calib: np.ndarray, test: np.ndarray) -> Measure:
    calib, test = calib.astype(np.float64), test.astype(np.float64)
    pooled = np.sqrt((calib.var() + test.var()) / 2)
    gap = abs(calib.mean() - test.mean())
    difference = gap / pooled if pooled > 0 else (0.0 if gap == 0 else float("inf"))
    return Measure(name, float(calib.mean()), float(test.mean()), float(difference))


def input_measures(calib_x: np.ndarray, test_x: np.ndarray) -> list[Measure]:
    """uint8 (N, C, S, S) images (arrays, or splits on disk read a batch at a time): brightness
    (mean pixel) and contrast (pixel std) per image."""
    def per_image(x, f) -> np.ndarray:
        return np.concatenate([f(x[i:i + BATCH].reshape(-1, int(np.prod(x.shape[1:])))
                                 .astype(np.float32), axis=1)
                               for i in range(0, len(x), BATCH)] or [np.zeros(0, np.float32)])

    return [_measure("brightness (mean pixel, 0-255)", per_image(calib_x, np.mean),
                     per_image(test_x, np.mean)),
            _measure("contrast (pixel standard deviation)", per_image(calib_x, np.std),
                     per_image(test_x, np.std))]


def output_measures(calib: dict[str, np.ndarray], test: dict[str, np.ndarray]) -> list[Measure]:
    """Per-image statistics of FP32's outputs, by name (the same names in both)."""
    return [_measure(f"FP32's {name}", calib[name], test[name]) for name in calib]


def classifier_outputs(logits: np.ndarray) -> dict[str, np.ndarray]:
    z = logits - logits.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    return {"top-1 probability": p.max(1)}


def check(measures: list[Measure]) -> tuple[dict, list[str]]:
    """For the metrics: every measure, and a warning for each that differs."""
    return ({m.name: m.as_dict() for m in measures},
            [m.warning() for m in measures if m.differs])


def compare(calib_x, test_x, calib_out: np.ndarray, test_out: np.ndarray,
            statistics) -> tuple[dict, list[str]]:
    """check() on the inputs (uint8 images) and on FP32's outputs on them, summarized per image
    by `statistics` (the task's output_statistics)."""
    return check(input_measures(calib_x, test_x)
                 + output_measures(statistics(calib_out), statistics(test_out)))
