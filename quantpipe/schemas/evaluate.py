"""params.yaml `evaluate`: batch size and the batch-consistency tolerances per variant."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from quantpipe.params import check


@dataclass(frozen=True)
class BatchTolerance:
    """Max |batched - single-sample| logit difference allowed per variant (logit units)."""
    fp32: float = 1e-3
    static: float = 1e-3
    qat: float = 1e-3
    # Dynamic quantization picks activation scales per batch, so each row depends on its
    # batch-mates by about one quantization step (~0.05 logits here).
    dynamic: float = 0.25
    # The FP32 file in BF16 (OpenVINO): its kernels may block a batch differently from a
    # single sample, and BF16 keeps 8 bits of mantissa.
    bf16: float = 0.05

    def __post_init__(self) -> None:
        for key in ("fp32", "static", "dynamic", "qat", "bf16"):
            check(getattr(self, key) > 0, f"evaluate.batch_consistency_atol.{key}",
                  getattr(self, key), "a number > 0")


@dataclass(frozen=True)
class EvaluateParams:
    SECTION: ClassVar[str] = "evaluate"

    batch_size: int = 256
    batch_consistency_atol: BatchTolerance = field(default_factory=BatchTolerance)

    def __post_init__(self) -> None:
        check(self.batch_size >= 1, "evaluate.batch_size", self.batch_size, "an integer >= 1")
