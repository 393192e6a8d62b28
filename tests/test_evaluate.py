"""quantpipe.evaluate: accuracy/agreement arithmetic and the pre-deployment edge checks."""

from __future__ import annotations

import threading

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
              "finite_beyond_min", "finite_test_samples", "batch_1", "batch_odd", "batch_large",
              "concurrent_requests"}


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
    found = evaluate.edge_checks(session, info, x, odd_batch=7, large_batch=16, atol=atol,
                                 callers=4, concurrency_atol=0.0)
    assert len(found) == len(ALL_CHECKS) and {c.name for c in found} == ALL_CHECKS
    return {c.name: c for c in found}


def test_edge_checks_pass_for_a_batch_independent_model(samples, cnn_session):
    checks = _checks(cnn_session, samples)
    failed = [c for c in checks.values() if not c.ok]
    assert failed == []
    assert "batch of 7" in checks["batch_odd"].detail
    assert "batch of 16" in checks["batch_large"].detail  # min(len(x)=24, large_batch=16)
    # 4 callers, batches of 1, 7 and 16 (the odd and large sizes), bit-identical to sequential.
    assert checks["concurrent_requests"].detail.startswith(
        "4 threads x 3 calls on one session at once, batches of 1, 7, 16: max |concurrent - "
        "sequential| = 0 (exactly)")


def test_edge_checks_catch_a_batch_dependent_model(samples):
    torch.manual_seed(0)
    checks = _checks(_session(BatchMeanSubtracted()), samples)
    # A batch of one is the single-sample run itself, so only the larger batches can differ.
    assert checks["batch_1"].ok
    assert not checks["batch_odd"].ok and not checks["batch_large"].ok
    assert "atol" in checks["batch_odd"].detail
    assert all(c.ok for name, c in checks.items() if name.startswith("finite_"))


def test_a_detectors_batches_are_judged_by_what_they_detect(samples):
    """Rows that differ between batch sizes pass when the detections match (an INT8 kernel
    rounding a proposal's score a step apart swaps near-equal rows), and fail when they do not."""
    info, x = samples
    torch.manual_seed(0)
    session = _session(BatchMeanSubtracted())  # its rows differ with the batch
    for matched, ok in ((1.0, True), (0.98, False)):
        seen = []

        def same(batched, single, matched=matched):
            seen.append((batched.shape, single.shape))
            return matched

        checks = {c.name: c for c in evaluate.edge_checks(
            session, info, x, odd_batch=7, large_batch=16, atol=1e-4, callers=4,
            concurrency_atol=0.0, same=same)}
        assert checks["batch_odd"].ok is ok and checks["batch_large"].ok is ok
        assert f"detections matched {matched:.2%} of the single-sample runs' (need 100%)" in \
            checks["batch_large"].detail
        assert seen[-1][0] == seen[-1][1] == (16, 4)  # the batch and the same rows run one by one
        assert checks["batch_1"].ok and "detections" not in checks["batch_1"].detail  # rows equal


class LargeLogits(nn.Module):
    """Logits in the hundreds, each row moved by its batch-mates by `mix` x their mean: a dynamic
    model's batch-wide activation scales do this, in proportion to the values."""

    def __init__(self, mix: float) -> None:
        super().__init__()
        self.fc, self.mix = nn.Linear(SHAPE[1] * SHAPE[2], 4), mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = 1000 * self.fc(torch.flatten(x, 1))
        return logits + self.mix * logits.mean(dim=0, keepdim=True)


def test_batch_consistency_is_judged_per_unit_of_the_largest_logit(samples):
    torch.manual_seed(0)
    # A millionth of the batch mean moves logits in the hundreds by ~1e-4 absolute: rounding
    # at this scale, not a batch bug; atol 1e-4 per unit of the largest logit lets it pass.
    checks = _checks(_session(LargeLogits(mix=1e-6)), samples)
    assert checks["batch_odd"].ok and checks["batch_large"].ok
    assert "x the largest logit" in checks["batch_odd"].detail
    gap = float(checks["batch_large"].detail.split("= ")[1].split()[0])
    assert gap > 1e-4  # an absolute atol would have failed it
    # A real dependence on batch-mates fails at any scale.
    checks = _checks(_session(LargeLogits(mix=0.1)), samples)
    assert not checks["batch_odd"].ok and not checks["batch_large"].ok


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


# --- concurrent requests ----------------------------------------------------------------------

class SwappingRunner:
    """Wraps a correct runner but, like a server that shares one output buffer between request
    threads, hands two overlapping calls each other's result. Sequential calls are unaffected.

    A call waits (up to 1 s, room for a loaded machine) for a partner; two calls that meet swap
    outputs.
    """

    def __init__(self, run) -> None:
        self.run = run
        self.lock = threading.Lock()
        self.waiting: dict | None = None

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        mine = {"out": self.run(batch), "swapped": threading.Event()}
        with self.lock:
            partner, self.waiting = self.waiting, (None if self.waiting else mine)
        if partner is not None:  # the second of a pair: exchange outputs, wake the first
            mine["out"], partner["out"] = partner["out"], mine["out"]
            partner["swapped"].set()
            return mine["out"]
        if not mine["swapped"].wait(1.0):
            with self.lock:
                if self.waiting is mine:  # nobody came: withdraw and answer correctly
                    self.waiting = None
                    return mine["out"]
            mine["swapped"].wait()  # a partner took this call just now: wait for its swap
        return mine["out"]


def test_concurrency_check_passes_a_shared_session(samples, cnn_session):
    _, x = samples
    inputs = evaluate.concurrent_inputs(x, 8, sizes=(1, 7, 16))
    check = evaluate.concurrency_check(onnxutil.session_runner(cnn_session), inputs, atol=0.0)
    assert check.ok and check.name == "concurrent_requests"
    assert "8 threads x 3 calls" in check.detail and "= 0 (exactly)" in check.detail


def test_concurrency_check_catches_outputs_swapped_between_threads(samples, cnn_session):
    _, x = samples
    inputs = evaluate.concurrent_inputs(x, 4, sizes=(3,))  # same shape: a swap is not a shape error
    swapping = SwappingRunner(onnxutil.session_runner(cnn_session))
    # Called one at a time the runner is correct ...
    for batch in inputs:
        np.testing.assert_array_equal(swapping(batch), onnxutil.session_runner(cnn_session)(batch))
    # ... but concurrent callers get each other's logits, and the check says so.
    check = evaluate.concurrency_check(swapping, inputs, atol=0.0)
    assert not check.ok
    gap = float(check.detail.split("= ")[1].split()[0])
    assert gap > 0.1  # whole logits of another sample, not rounding
    # A tolerance does not hide it either: the swapped logits are far apart.
    assert not evaluate.concurrency_check(swapping, inputs, atol=1e-3).ok


def test_concurrency_check_counts_an_output_of_another_shape_as_a_mismatch(samples, cnn_session):
    _, x = samples
    # Two callers, one batch of 1 and one of 2: every swap hands a caller the other shape (with
    # four, two pairs of the same size could meet instead).
    inputs = evaluate.concurrent_inputs(x, 2, sizes=(1, 2))
    swapping = SwappingRunner(onnxutil.session_runner(cnn_session))
    check = evaluate.concurrency_check(swapping, inputs, atol=1.0)
    assert not check.ok and "= inf" in check.detail


def test_concurrency_check_fails_in_the_stage_through_edge_checks(samples, cnn_session, monkeypatch):
    """edge_checks runs the check on the session it is given; a wrapper that swaps fails it."""
    info, x = samples
    real = evaluate.concurrency_check
    monkeypatch.setattr(evaluate, "concurrency_check",
                        lambda run, inputs, atol: real(SwappingRunner(run), inputs, atol=atol))
    checks = {c.name: c for c in evaluate.edge_checks(cnn_session, info, x, odd_batch=7,
                                                       large_batch=16, atol=1e-4, callers=4,
                                                       concurrency_atol=0.0)}
    assert not checks["concurrent_requests"].ok
    assert all(c.ok for name, c in checks.items() if name != "concurrent_requests")


def test_concurrent_inputs_are_different_slices_with_cycling_sizes():
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    inputs = evaluate.concurrent_inputs(x, 5, sizes=(1, 3))
    assert [len(b) for b in inputs] == [1, 3, 1, 3, 1]
    assert [b.ravel().tolist() for b in inputs] == [[0], [1, 2, 3], [4], [5, 6, 7], [8]]
    wrapped = evaluate.concurrent_inputs(x, 4, sizes=(4,))
    assert wrapped[2].ravel().tolist() == [8, 9, 0, 1]  # past the end: wraps around


def test_concurrency_check_reraises_a_callers_exception(samples):
    _, x = samples
    calls = []

    def failing(batch):
        calls.append(threading.current_thread().name)
        if len(calls) > 2:  # the sequential reference calls succeed, concurrent ones fail
            raise RuntimeError("session crashed")
        return batch.reshape(len(batch), -1)

    with pytest.raises(RuntimeError, match="session crashed"):
        evaluate.concurrency_check(failing, evaluate.concurrent_inputs(x, 2, sizes=(1,)), atol=0.0)
