"""params.yaml `quantize_qat`: quantization-aware training and its export parity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe import isa
from quantpipe.params import check


@dataclass(frozen=True)
class QuantizeQATParams(isa.ReduceRange):
    """Quantization-aware training (quantpipe.engines.qat): models/model.pt fine-tuned with fake
    quantization in the static variant's x86 scheme, exported as QDQ models/qat.onnx."""
    SECTION: ClassVar[str] = "quantize_qat"

    # false: the stage writes an empty models/qat.onnx and a metrics file saying it skipped.
    enabled: bool = True
    epochs: int = 2
    batch_size: int = 64
    # A tenth of train.lr: QAT moves trained weights onto the INT8 grid, it does not re-learn them.
    lr: float = 1e-4
    # S8 weights per output channel (as quantize_static.per_channel: true), or per tensor.
    per_channel: bool = True
    # 7-bit weights, trained as such (quantize_static.reduce_range; auto: on x86 without VNNI).
    reduce_range: bool | str = isa.AUTO
    # Optimizer steps after which BatchNorm normalizes with its running statistics (as at
    # inference) instead of each batch's; null: never frozen during the fine-tune. Steps after
    # which the fake-quant ranges stop following the batches; null: at the end.
    freeze_bn_after: int | None = 50
    freeze_observers_after: int | None = None
    # Samples per batch of the calibration pass that starts the ranges (min/max, as MinMax).
    calib_batch_size: int = 32
    # Parity of models/qat.onnx, its QDQ graph run as written, against the fake-quant PyTorch
    # model on the test split: rounding flips move logits by a few output steps (0.1-0.4 here);
    # a wrong export differs by whole logits and in its predictions.
    max_abs_diff: float = 1.0
    min_agreement: float = 0.99

    def __post_init__(self) -> None:
        self.check_reduce_range()
        for key in ("epochs", "batch_size", "calib_batch_size"):
            check(getattr(self, key) >= 1, f"quantize_qat.{key}", getattr(self, key), "an integer >= 1")
        check(0 < self.lr < 10, "quantize_qat.lr", self.lr, "a number in (0, 10), e.g. 1e-4")
        for key in ("freeze_bn_after", "freeze_observers_after"):
            value = getattr(self, key)
            check(value is None or value >= 0, f"quantize_qat.{key}", value,
                  "a number of optimizer steps >= 0, or null")
        check(self.max_abs_diff > 0, "quantize_qat.max_abs_diff", self.max_abs_diff, "a number > 0")
        check(0 < self.min_agreement <= 1, "quantize_qat.min_agreement", self.min_agreement,
              "a share in (0, 1], e.g. 0.99")
