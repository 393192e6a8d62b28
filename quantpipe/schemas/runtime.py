"""params.yaml `runtime`: how every ONNX Runtime session of the pipeline is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from onnxruntime import GraphOptimizationLevel


@dataclass(frozen=True)
class RuntimeParams:
    SECTION: ClassVar[str] = "runtime"

    # The level you deploy with: QDQ pairs fuse into QLinear kernels only at EXTENDED or above.
    graph_optimization_level: GraphOptimizationLevel = GraphOptimizationLevel.ORT_ENABLE_ALL
