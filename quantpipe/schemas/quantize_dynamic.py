"""params.yaml `quantize_dynamic`: ONNX Runtime dynamic quantization (INT8 weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from onnxruntime.quantization import QuantType

from quantpipe import isa
from quantpipe.params import check


@dataclass(frozen=True)
class QuantizeDynamicParams(isa.ReduceRange):
    SECTION: ClassVar[str] = "quantize_dynamic"

    weight_type: QuantType = QuantType.QInt8
    per_channel: bool = False
    # 7-bit weights; auto: where 8-bit ones overflow the INT8 kernels (quantize_static.reduce_range).
    reduce_range: bool | str = isa.AUTO
    # Conv is left out on purpose: ConvInteger runs 4-5x slower than FP32 Conv on x86.
    op_types: tuple[str, ...] = ("MatMul", "Gemm")
    nodes_to_exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.check_reduce_range()
        # ORT reads an empty list as "everything", Conv (slow ConvInteger) included.
        check(bool(self.op_types), "quantize_dynamic.op_types", list(self.op_types),
              "a non-empty list of op types, e.g. [MatMul, Gemm]")
