"""quantpipe.evaluate: accuracy/agreement arithmetic and the pre-deployment edge checks."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from helpers import OPSET, info_for, structured_images
from quantpipe import data, evaluate, models, onnxutil

SHAPE = (1, 12, 12)
LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
ALL_CHECKS = {"finite_zeros", "finite_max_value", "finite_min_value", "finite_beyond_max",
              "finite_beyond_min", "finite_test_samples", "batch_1", "batch_odd", "batch_large"}


# --- accuracy_metrics -------------------------------------------------------------------------

def _one_hot_logits(pred: list[int], k: int = 3) -> np.ndarray:
    logits = np.zeros((len(pred), k), np.float32)
    logits[np.arange(len(pred)), pred] = 1.0
    return logits


def test_accuracy_metrics_arithmetic():
    y = np.array([0, 0, 1, 1, 2, 2])
    ref = _one_hot_logits([0, 0, 1, 2, 2, 1])      # FP32: 4/6 right
    got = _one_hot_logits([0, 1, 1, 2, 2, 2])      # variant: 4/6 right, differently
    got[0, 0] = 1.5                                 # a logit error that keeps the top-1
    m = evaluate.accuracy_metrics(got, ref, y, num_classes=3)
    assert m["accuracy"] == pytest.approx(4 / 6, abs=1e-6)
    # Same top-1 as FP32 on samples 0, 2, 3, 4 (1 and 5 differ).
    assert m["agreement"] == pytest.approx(4 / 6, abs=1e-6)
    assert m["per_class_accuracy"] == {"0": 0.5, "1": 0.5, "2": 1.0}
    assert m["samples"] == 6
    # |got - ref|: sample 0 differs by 0.5; samples 1 and 5 by 1.0 in two places each.
    assert m["max_abs_logit_error"] == pytest.approx(1.0)
    assert m["mean_abs_logit_error"] == pytest.approx((0.5 + 2 + 2) / 18, abs=1e-6)


def test_accuracy_metrics_identical_logits():
    y = np.array([1, 0, 2, 1])
    logits = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    m = evaluate.accuracy_metrics(logits, logits, y, num_classes=3)
    assert m["agreement"] == 1.0
    assert m["max_abs_logit_error"] == m["mean_abs_logit_error"] == 0.0
    assert m["accuracy"] == pytest.approx(float((logits.argmax(1) == y).mean()), abs=1e-6)


def test_per_class_accuracy_skips_absent_classes():
    y = np.array([0, 0, 2])
    m = evaluate.accuracy_metrics(_one_hot_logits([0, 2, 2]), _one_hot_logits([0, 2, 2]), y, 3)
    assert m["per_class_accuracy"] == {"0": 0.5, "2": 1.0}


def test_confusion_rows():
    rows = evaluate.confusion_rows(np.array([0, 1]), np.array([1, 1]))
    assert rows == [{"actual": 0, "predicted": 1}, {"actual": 1, "predicted": 1}]
    assert all(type(v) is int for r in rows for v in r.values())  # JSON-serializable


# --- edge_checks ------------------------------------------------------------------------------

class BatchMeanSubtracted(nn.Module):
    """Logits minus their batch mean: each row depends on its batch-mates (a classic BN-in-train
    or reduction-over-the-wrong-axis export bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(SHAPE[1] * SHAPE[2], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, S, S) -> (B, K)
        logits = self.fc(torch.flatten(x, 1))
        return logits - logits.mean(dim=0, keepdim=True)


class SqrtFeatures(nn.Module):
    """NaN for negative inputs: the constant-input checks must catch it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(SHAPE[1] * SHAPE[2], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.sqrt(torch.flatten(x, 1)))


@pytest.fixture(scope="module")
def samples():
    split = structured_images(24, size=12, seed=5)
    info = info_for(split)
    return info, data.normalize(split.x, info)


@pytest.fixture(scope="module")
def cnn_session() -> ort.InferenceSession:
    torch.manual_seed(0)
    return _session(models.build_model("simple_cnn", 1, 12, 4))


def _session(model: nn.Module) -> ort.InferenceSession:
    proto = onnxutil.export_onnx(model, SHAPE, OPSET)
    return onnxutil.make_session(proto.SerializeToString(), level=LEVEL)


def _checks(session, samples, atol=1e-4):
    info, x = samples
    found = evaluate.edge_checks(session, info, x, odd_batch=7, large_batch=16, atol=atol)
    assert len(found) == len(ALL_CHECKS) and {c.name for c in found} == ALL_CHECKS
    return {c.name: c for c in found}


def test_edge_checks_pass_for_a_batch_independent_model(samples, cnn_session):
    checks = _checks(cnn_session, samples)
    failed = [c for c in checks.values() if not c.ok]
    assert failed == []
    assert "batch of 7" in checks["batch_odd"].detail
    assert "batch of 16" in checks["batch_large"].detail  # min(len(x)=24, large_batch=16)


def test_edge_checks_catch_a_batch_dependent_model(samples):
    torch.manual_seed(0)
    checks = _checks(_session(BatchMeanSubtracted()), samples)
    # A batch of one is the single-sample run itself, so only the larger batches can differ.
    assert checks["batch_1"].ok
    assert not checks["batch_odd"].ok and not checks["batch_large"].ok
    assert "atol" in checks["batch_odd"].detail
    assert all(c.ok for name, c in checks.items() if name.startswith("finite_"))


def test_edge_checks_catch_non_finite_outputs(samples):
    torch.manual_seed(0)
    checks = _checks(_session(SqrtFeatures()), samples)
    assert checks["finite_zeros"].ok and checks["finite_max_value"].ok
    assert not checks["finite_min_value"].ok and not checks["finite_beyond_min"].ok
    assert not checks["finite_test_samples"].ok  # normalized background pixels are negative


def test_edge_checks_constant_inputs_are_the_extreme_normalized_pixels(samples, cnn_session):
    info, _ = samples
    checks = _checks(cnn_session, samples)
    high = (1 - info.mean[0]) / info.std[0]
    low = -info.mean[0] / info.std[0]
    assert f"{high:+.3f}" in checks["finite_max_value"].detail
    assert f"{low:+.3f}" in checks["finite_min_value"].detail
    assert f"{4 * high:+.3f}" in checks["finite_beyond_max"].detail
