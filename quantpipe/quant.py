"""ONNX Runtime quantization: pre-processing, the calibration reader, static and dynamic INT8.

The defaults are the fast path on x86 (DESIGN.md §3): QDQ with U8 activations and S8 weights,
per-channel, after quant_pre_process; dynamic quantization of MatMul/Gemm only.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                      quant_pre_process, quantize_dynamic, quantize_static)

from quantpipe.data import DataInfo, normalize
from quantpipe.errors import UserError
from quantpipe.params import QuantizeDynamicParams, QuantizeStaticParams

log = logging.getLogger(__name__)


class CalibrationReader(CalibrationDataReader):
    """Feeds uint8 (N, C, S, S) calibration images to ORT, normalized lazily batch by batch."""

    def __init__(self, x: np.ndarray, info: DataInfo, input_name: str, batch_size: int) -> None:
        self.x = x
        self.info = info
        self.input_name = input_name
        self.batch_size = batch_size
        self.position = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.position >= len(self.x):
            return None
        batch = self.x[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return {self.input_name: normalize(batch, self.info)}  # (b, C, S, S) float32

    def rewind(self) -> None:
        self.position = 0

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)


def graph_input(model: onnx.ModelProto) -> onnx.ValueInfoProto:
    """The model's single real input (initializers listed as inputs are skipped)."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise UserError(f"expected a model with one input, found {[i.name for i in inputs]}")
    return inputs[0]


def check_calibration(x: np.ndarray, info_shape: tuple[int, ...], model: onnx.ModelProto) -> None:
    """Fail before ORT does, deep inside, when the calibration set cannot feed the model."""
    if len(x) == 0:
        raise UserError("data/calibration: the calibration set is empty; raise prepare.calib_size")
    dims = [d.dim_value if d.HasField("dim_value") else None
            for d in graph_input(model).type.tensor_type.shape.dim]
    if len(dims) != 4 or any(d is not None and d != s for d, s in zip(dims[1:], x.shape[1:])):
        raise UserError(f"data/calibration: samples of shape {tuple(x.shape[1:])} do not fit the "
                        f"model input {dims}; re-run prepare with the model's image size/channels")


def preprocess(model_path: Path, out_path: Path) -> bool:
    """quant_pre_process (shape inference + fusions). Returns whether symbolic shape inference ran.

    Symbolic shape inference fails on some graphs; then retry without it rather than quantize
    an unprocessed model.
    """
    try:
        quant_pre_process(str(model_path), str(out_path))
        return True
    except Exception as e:  # ORT raises bare Exceptions from its shape inference
        log.warning("quant_pre_process: symbolic shape inference failed (%s); retrying without it",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        quant_pre_process(str(model_path), str(out_path), skip_symbolic_shape=True)
        return False


def slow_combination_warnings(p: QuantizeStaticParams) -> list[str]:
    """Settings known to make INT8 slower than FP32 on x86 CPUs, each with the faster choice."""
    found = []
    if p.activation_type == QuantType.QInt8:
        what = "QOperator with S8 activations" if p.quant_format == QuantFormat.QOperator \
            else "S8 activations"
        found.append(f"{what} (activation_type: QInt8) runs far slower than FP32 on x86 "
                     "(no U8S8 VNNI kernels); use activation_type: QUInt8 with weight_type: QInt8")
    if p.activation_type == QuantType.QUInt8 and p.weight_type == QuantType.QUInt8:
        found.append("U8 weights (weight_type: QUInt8) with U8 activations miss the x86 U8S8 "
                     "kernels; use weight_type: QInt8")
    return found


def quantize_static_model(model_path: Path, out_path: Path, reader: CalibrationReader,
                          p: QuantizeStaticParams) -> dict:
    """Pre-process then statically quantize `model_path` into `out_path`; returns facts for metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "preprocessed.onnx"
        symbolic = preprocess(model_path, pre)
        quantize_static(
            str(pre), str(out_path), reader,
            quant_format=p.quant_format, activation_type=p.activation_type,
            weight_type=p.weight_type, per_channel=p.per_channel, reduce_range=p.reduce_range,
            calibrate_method=p.calibrate_method,
            nodes_to_exclude=list(p.nodes_to_exclude) or None,
            op_types_to_quantize=list(p.op_types_to_quantize) or None,
            extra_options=dict(p.extra_options) or None)
    return {"symbolic_shape_inference": symbolic}


def quantize_dynamic_model(model_path: Path, out_path: Path, p: QuantizeDynamicParams) -> dict:
    """Pre-process then dynamically quantize (weights only) the ops in p.op_types."""
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "preprocessed.onnx"
        symbolic = preprocess(model_path, pre)
        quantize_dynamic(
            str(pre), str(out_path), op_types_to_quantize=list(p.op_types) or None,
            per_channel=p.per_channel, reduce_range=p.reduce_range, weight_type=p.weight_type,
            nodes_to_exclude=list(p.nodes_to_exclude) or None)
    return {"symbolic_shape_inference": symbolic}


def unknown_nodes(model: onnx.ModelProto, names: tuple[str, ...]) -> list[str]:
    """Names in nodes_to_exclude that are not in the model: a typo would silently do nothing."""
    present = {node.name for node in model.graph.node}
    return [n for n in names if n not in present]
