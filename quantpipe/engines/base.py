"""The interface of a static quantization engine (quantize_static.engine) and what it returns.

An engine takes the FP32 model, the calibration images and a judge (check: a candidate model ->
quantpipe.criterion's verdict against FP32 on the validation split and the pool) and writes one
QDQ model; when the judge says the drop is real it runs its own fallback. The stage does the rest
the same way for every engine: the verdict, `failed`, the metrics file. Engines are looked up by
name in quantpipe.engines.registry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import onnx

from quantpipe.budget import UNLIMITED, Budget
from quantpipe.criterion import Judged
from quantpipe.data import DataInfo
from quantpipe.schemas.quantize_static import QuantizeStaticParams


@dataclass(frozen=True)
class StaticJob:
    """Everything an engine gets."""
    fp32: Path                 # the FP32 model to quantize
    out: Path                  # where to write the QDQ model (a temporary path; the stage renames)
    calib_x: np.ndarray        # uint8 (N, C, S, S) calibration images
    info: DataInfo             # their normalization (quantpipe.data.normalize)
    params: QuantizeStaticParams
    check: Callable[[Path], Judged]  # a candidate model's verdict (quantpipe.criterion)
    pool_x: np.ndarray         # normalized pool images (train, not calibration) ...
    pool_ref: np.ndarray       # ... and FP32's top-1 on them: a label-free accuracy metric
    predict: Callable[[onnx.ModelProto, np.ndarray], np.ndarray]  # model, images -> top-1
    # Keep the nodes after the last compute node (graph.output_tail, a YOLO DFL conv counting
    # as decode) in float: a detector's decode, where one scale over pixels and probabilities
    # costs mAP (detect.float_decode).
    float_tail: bool = False
    # The stage's memory budget: calibration and the fallback's passes are sized to it.
    memory: Budget = UNLIMITED


class StaticEngine(Protocol):
    name: str  # its value of quantize_static.engine

    def warnings(self, p: QuantizeStaticParams) -> list[str]:
        """Settings known to be slow or ignored with this engine, each with the better choice."""

    def quantize(self, job: StaticJob) -> StaticResult:
        """Write job.out; fall back while job.check says the drop is real (at most
        job.params.max_fallback_steps steps)."""

    def settings(self, p: QuantizeStaticParams, result: StaticResult) -> dict:
        """The settings the written model was made with, for metrics/quantize_static.json."""


@dataclass
class StaticResult:
    engine: str
    # One per quantization tried: the rung, calibration method, nodes in float and the verdict;
    # "kept" marks the ones the ladder built on. The last kept step is the written model.
    steps: list[dict]
    fallback_nodes: list[str]  # nodes the fallback left in float (beyond nodes_to_exclude)
    nodes_in_float: list[str]  # every Conv/Gemm/MatMul of the written model still in float
    calibrate_method: str  # the calibration the written model uses
    sensitivity: list[dict]
    calib_samples_used: int
    symbolic_shape_inference: bool | None
    # The op types quantized (empty: every type ORT quantizes) and why (static_op_types).
    op_types_to_quantize: list[str] = dataclasses.field(default_factory=list)
    op_selection: str = ""
    tail_in_float: list[str] = dataclasses.field(default_factory=list)  # job.float_tail's nodes
    calib_batch_size: int | None = None  # samples per calibration run (the memory budget's)

    @property
    def final(self) -> dict:
        return [s for s in self.steps if s["kept"]][-1]

    @property
    def drop_pts(self) -> float:
        """The written model's drop in the task's validation score, in points."""
        return self.final["drop_pts"]

    def tried(self) -> str:
        """What the fallback tried, for the failure message."""
        parts = []
        for s in self.steps[1:]:
            what = {"calibration": f"calibrate_method {s['calibrate_method']}",
                    "attention": f"the attention ({len(s.get('candidate', []))} nodes) in float",
                    "first_last": f"first/last layers {s['nodes_in_float']} in float",
                    "node": f"{s.get('candidate')} in float",
                    "prune": f"{s['calibrate_method']} with {s['nodes_in_float']} in float",
                    "accuracy_control": "nncf.quantize_with_accuracy_control "
                                        f"({len(s['nodes_in_float'])} nodes in float)"}[s["rung"]]
            parts.append(f"{what}: drop {s['drop_pts']:.2f} points")
        return "; ".join(parts) or "nothing (max_fallback_steps = 0)"
