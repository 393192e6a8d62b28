"""params.yaml `export`: the ONNX opset and the export parity tolerance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check


@dataclass(frozen=True)
class ExportParams:
    SECTION: ClassVar[str] = "export"

    # 18 is the lowest opset torch 2.14's dynamo exporter emits without a lossy conversion.
    opset: int = 18
    # FP32 ONNX vs PyTorch logits; typical float reordering noise is 1e-6..1e-5.
    max_abs_diff: float = 1e-4

    def __post_init__(self) -> None:
        check(18 <= self.opset <= 23, "export.opset", self.opset, "18..23")
        check(self.max_abs_diff > 0, "export.max_abs_diff", self.max_abs_diff, "a number > 0")
