"""ONNX Runtime quantization: pre-processing, the calibration reader, static and dynamic INT8.

The defaults are the fast path on x86 (DESIGN.md §3): QDQ with U8 activations and S8 weights,
per-channel, after quant_pre_process; dynamic quantization of MatMul/Gemm only.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                      QuantType, quant_pre_process, quantize_dynamic,
                                      quantize_static)

from quantpipe.data import DataInfo, normalize
from quantpipe.errors import UserError
from quantpipe.params import QuantizeDynamicParams, QuantizeStaticParams

log = logging.getLogger(__name__)

# Calibration samples used for the per-tensor SQNR table.
SENSITIVITY_SAMPLES = 64


class CalibrationReader(CalibrationDataReader):
    """Feeds uint8 (N, C, S, S) calibration images to ORT, normalized lazily batch by batch."""

    def __init__(self, x: np.ndarray, info: DataInfo, input_name: str, batch_size: int) -> None:
        self.x = x
        self.info = info
        self.input_name = input_name
        self.batch_size = batch_size
        self.start, self.end, self.position = 0, len(x), 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.position >= self.end:
            return None
        batch = self.x[self.position:min(self.position + self.batch_size, self.end)]
        self.position += self.batch_size
        return {self.input_name: normalize(batch, self.info)}  # (b, C, S, S) float32

    def rewind(self) -> None:
        self.position = self.start

    def set_range(self, start_index: int, end_index: int) -> None:
        """Read only samples [start_index, end_index) (ORT's CalibStridedMinMax slices)."""
        self.start, self.end = start_index, min(end_index, len(self.x))
        self.position = self.start

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
    if tuple(x.shape[1:]) != tuple(info_shape):
        raise UserError(f"data/calibration: samples of shape {tuple(x.shape[1:])} disagree with its "
                        f"meta.json ({tuple(info_shape)}); re-run `dvc repro -f prepare`")
    if len(dims) != x.ndim or any(d is not None and d != s for d, s in zip(dims[1:], x.shape[1:])):
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


def preprocess_checked(model_path: Path, out_path: Path, exclude: tuple[str, ...],
                       key: str) -> tuple[bool, onnx.ModelProto]:
    """preprocess(), then check that every name in `exclude` (params key `key`) is a node of
    the pre-processed graph, the one ORT quantizes. Returns (symbolic shape inference ran, model)."""
    symbolic = preprocess(model_path, out_path)
    model = onnx.load(str(out_path))
    missing = unknown_nodes(model, exclude)
    if missing:
        raise UserError(f"{key}: no node named {missing} in {model_path}; its nodes are "
                        f"{[n.name for n in model.graph.node][:30]}")
    return symbolic, model


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


def activation_bytes_per_sample(model: onnx.ModelProto) -> int:
    """Bytes of all float intermediate tensors for one sample (from shape inference).

    Calibration keeps these for every sample it has seen (histogram methods until the end),
    so this sets how many samples fit in a memory budget.
    """
    total = 0
    for info in model.graph.value_info:
        t = info.type.tensor_type
        if t.elem_type != onnx.TensorProto.FLOAT:
            continue
        dims = [d.dim_value for d in t.shape.dim[1:]]  # dim 0 is the batch
        if dims and all(d > 0 for d in dims):
            total += 4 * int(np.prod(dims))
    return total


def calibration_plan(model: onnx.ModelProto, p: QuantizeStaticParams, n_samples: int) -> tuple[int, dict]:
    """(samples to use, extra options) that keep calibration within p.calib_memory_mb.

    MinMax can reduce ranges as it goes (CalibMaxIntermediateOutputs, same result, bounded
    memory); Entropy/Percentile keep every output until the end (ORT issue #10503), so they get
    the first samples that fit.
    """
    per_sample = max(activation_bytes_per_sample(model), 1)
    fit = max(1, int(p.calib_memory_mb * 2**20 // per_sample))
    if p.calibrate_method == CalibrationMethod.MinMax:
        batches = max(1, fit // p.calib_batch_size)
        return n_samples, {"CalibMaxIntermediateOutputs": batches}
    if fit < n_samples:
        log.warning("quantize_static: %s calibration keeps every activation in memory; using %d of "
                    "%d samples to stay within calib_memory_mb = %d", p.calibrate_method.name, fit,
                    n_samples, p.calib_memory_mb)
    use = min(fit, n_samples)
    if use > p.calib_batch_size and use % p.calib_batch_size:
        # ORT's histogram collector stacks all batches into one array: a short last batch
        # makes it ragged and ORT fails, so only whole batches are used.
        log.warning("quantize_static: using %d of %d calibration samples, a multiple of "
                    "calib_batch_size = %d, as %s calibration needs equal batches",
                    use - use % p.calib_batch_size, use, p.calib_batch_size, p.calibrate_method.name)
        use -= use % p.calib_batch_size
    return use, {}


def calibrate(pre_path: Path, reader: CalibrationReader, p: QuantizeStaticParams, extra: dict,
              cache_path: Path) -> None:
    """Compute activation ranges once and save them where quantize_static reads its
    calibration cache, so every quantization of the fallback reuses them.

    Calibrating here also reaches the histogram sizes ORT's quantize_static does not pass on:
    with its Entropy defaults (128 bins searched for a 128-bin range) the only candidate is the
    full range, i.e. Entropy silently equals MinMax.
    """
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data

    options = {**extra, **p.extra_options}
    names = {"CalibTensorRangeSymmetric": "symmetric", "CalibMovingAverage": "moving_average",
             "CalibMovingAverageConstant": "averaging_constant",
             "CalibMaxIntermediateOutputs": "max_intermediate_outputs",
             "CalibPercentile": "percentile"}
    args = {arg: options[key] for key, arg in names.items() if key in options}
    if p.calibrate_method in (CalibrationMethod.Entropy, CalibrationMethod.Percentile):
        args["num_bins"] = p.calib_num_bins
        args["num_quantized_bins"] = p.calib_num_quantized_bins
    with tempfile.TemporaryDirectory() as tmp:
        calibrator = create_calibrator(
            pre_path, list(p.op_types_to_quantize) or None,
            augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=p.calibrate_method, extra_options=args)
        stride = options.get("CalibStridedMinMax")
        reader.rewind()
        if stride:  # as ORT does it: ranges collected over slices of the data, then merged
            for start in range(0, len(reader.x), stride):
                reader.set_range(start, start + stride)
                calibrator.collect_data(reader)
            reader.set_range(0, len(reader.x))
        else:
            calibrator.collect_data(reader)
        save_tensors_data(calibrator.compute_data(), cache_path,
                          smooth_quant=bool(options.get("SmoothQuant", False)))


def quantize_once(pre_path: Path, out_path: Path, reader: CalibrationReader,
                  p: QuantizeStaticParams, exclude: list[str], extra: dict, cache_path: Path,
                  quant_format: QuantFormat | None = None) -> None:
    reader.rewind()
    quantize_static(
        str(pre_path), str(out_path), reader, calibration_cache_path=str(cache_path),
        quant_format=quant_format or p.quant_format, activation_type=p.activation_type,
        weight_type=p.weight_type, per_channel=p.per_channel, reduce_range=p.reduce_range,
        calibrate_method=p.calibrate_method, nodes_to_exclude=exclude or None,
        op_types_to_quantize=list(p.op_types_to_quantize) or None,
        extra_options={**extra, **p.extra_options} or None)


# Ops that only move, clip or select values: leaving them in float regains nothing.
PASSTHROUGH_OPS = {"Relu", "Clip", "MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze",
                   "Unsqueeze", "Identity", "Gather", "Slice", "Split", "Resize"}


def sensitivity(pre_path: Path, qdq_path: Path, reader: CalibrationReader, workdir: Path) -> list[dict]:
    """Per-tensor SQNR (dB) of the quantized model against the float model, in graph order.

    `model_sqnr_db` compares each tensor with the float model's (errors of earlier layers
    included); `noise_added` is the noise-to-signal power the producing node adds itself
    (10^(-out/10) - 10^(-worst input/10)): noise adds up in power, not in dB, so the node to
    leave in float is the one that adds most.
    """
    from onnxruntime.quantization.qdq_loss_debug import (collect_activations,
                                                         compute_activation_error,
                                                         create_activation_matching,
                                                         modify_model_output_intermediate_tensors)

    aug_float, aug_qdq = workdir / "aug_float.onnx", workdir / "aug_qdq.onnx"
    modify_model_output_intermediate_tensors(str(pre_path), str(aug_float))
    modify_model_output_intermediate_tensors(str(qdq_path), str(aug_qdq))
    reader.rewind()
    float_acts = collect_activations(str(aug_float), reader)
    reader.rewind()
    qdq_acts = collect_activations(str(aug_qdq), reader)
    errors = compute_activation_error(create_activation_matching(qdq_acts, float_acts))
    sqnr = {name: float(err["xmodel_err"]) for name, err in errors.items() if "xmodel_err" in err}
    nodes = list(onnx.load(str(pre_path)).graph.node)  # topological order
    # ORT quantizes a Conv/Gemm output that feeds only a Relu/Clip with the activation's range
    # (negatives clipped), so such a tensor is compared after its activation.
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for i in node.input:
            consumers.setdefault(i, []).append(node)

    def effective(tensor: str) -> str:
        users = consumers.get(tensor, [])
        if len(users) == 1 and users[0].op_type in ("Relu", "Clip"):
            return effective(users[0].output[0])
        return tensor

    rows = []
    for node in nodes:
        if node.op_type in ("Relu", "Clip") and effective(node.input[0]) == node.output[0]:
            continue  # folded into its producer's row
        inputs = [sqnr[effective(i)] for i in node.input if effective(i) in sqnr]
        before = 10 ** (-min(inputs) / 10) if inputs else 0.0
        for out in map(effective, node.output):
            if out in sqnr:
                rows.append({"tensor": out, "node": node.name, "op_type": node.op_type,
                             "model_sqnr_db": round(sqnr[out], 3),
                             "noise_added": float(f"{10 ** (-sqnr[out] / 10) - before:.4g}")})
    return rows


def fallback_order(table: list[dict], already: list[str]) -> list[str]:
    """Nodes worth leaving in float, the one that adds most quantization noise first."""
    rows = sorted((r for r in table if r["node"] and r["op_type"] not in PASSTHROUGH_OPS),
                  key=lambda r: (-r["noise_added"], r["node"]))
    return list(dict.fromkeys(r["node"] for r in rows if r["node"] not in already))


@dataclass
class StaticResult:
    steps: list[dict]  # one per quantization: nodes left in float so far, and check()'s result
    fallback_nodes: list[str]
    sensitivity: list[dict]
    calib_samples_used: int
    symbolic_shape_inference: bool

    @property
    def accuracy_drop_pp(self) -> float:
        return self.steps[-1]["accuracy_drop_pp"]


def quantize_static_with_fallback(fp32_path: Path, out_path: Path, calib_x: np.ndarray,
                                  info: DataInfo, p: QuantizeStaticParams,
                                  check: Callable[[Path], dict]) -> StaticResult:
    """quant_pre_process, calibrate and quantize; then, while check(model) says its accuracy
    drop is real ("real_drop"; see quantpipe.criterion), leave the node that adds the most
    quantization noise (see sensitivity) in float and quantize again, at most
    p.max_fallback_steps times. All quantizations share one calibration. Writes the last model.

    check(path) -> {"val_accuracy", "accuracy_drop_pp", "real_drop": bool, ...}: one step."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        pre = workdir / "preprocessed.onnx"
        symbolic, pre_model = preprocess_checked(fp32_path, pre, p.nodes_to_exclude,
                                                 "quantize_static.nodes_to_exclude")
        n_calib, extra = calibration_plan(pre_model, p, len(calib_x))
        input_name = graph_input(pre_model).name
        reader = CalibrationReader(calib_x[:n_calib], info, input_name, p.calib_batch_size)
        # SQNR needs only a few batches; collect_activations keeps every output in memory.
        probe = CalibrationReader(calib_x[:SENSITIVITY_SAMPLES], info, input_name, p.calib_batch_size)

        excluded = list(p.nodes_to_exclude)
        cache = workdir / "calibration.json"
        calibrate(pre, reader, p, extra, cache)
        candidate = workdir / "quantized.onnx"
        quantize_once(pre, candidate, reader, p, excluded, extra, cache)
        # SQNR is read from a QDQ twin that keeps Relu/Clip: with them removed (ORT's default),
        # a tensor's pre-QDQ values would be the unclipped ones and its error meaningless.
        twin = workdir / "qdq_twin.onnx"
        quantize_once(pre, twin, reader, p, excluded, {**extra, "QDQKeepRemovableActivations": True},
                      cache, quant_format=QuantFormat.QDQ)
        table = sensitivity(pre, twin, probe, workdir)

        steps = [{"nodes_in_float": list(excluded), **check(candidate)}]
        ranked = fallback_order(table, excluded)
        fallback: list[str] = []
        while steps[-1]["real_drop"] and ranked and len(fallback) < p.max_fallback_steps:
            fallback.append(ranked.pop(0))
            log.warning("quantize_static: %s; leaving %s in float",
                        steps[-1].get("verdict", "accuracy drop"), fallback[-1])
            quantize_once(pre, candidate, reader, p, excluded + fallback, extra, cache)
            steps.append({"nodes_in_float": excluded + fallback, **check(candidate)})
        os.replace(candidate, out_path)
    return StaticResult(steps=steps, fallback_nodes=fallback, sensitivity=table,
                        calib_samples_used=n_calib, symbolic_shape_inference=symbolic)


def quantize_dynamic_model(model_path: Path, out_path: Path, p: QuantizeDynamicParams) -> dict:
    """Pre-process then dynamically quantize (weights only) the ops in p.op_types."""
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "preprocessed.onnx"
        symbolic, pre_model = preprocess_checked(model_path, pre, p.nodes_to_exclude,
                                                 "quantize_dynamic.nodes_to_exclude")
        op_types, include, exclude = dynamic_selection(pre_model, p.op_types, p.nodes_to_exclude)
        quantize_dynamic(
            str(pre), str(out_path), op_types_to_quantize=op_types, nodes_to_quantize=include,
            per_channel=p.per_channel, reduce_range=p.reduce_range, weight_type=p.weight_type,
            nodes_to_exclude=exclude or None)
    return {"symbolic_shape_inference": symbolic}


def dynamic_selection(model: onnx.ModelProto, op_types: tuple[str, ...],
                      exclude: tuple[str, ...]) -> tuple[list[str], list[str] | None, list[str]]:
    """(op types, nodes to quantize or None for all, nodes to exclude) as ORT's dynamic mode
    needs them. It rewrites every Gemm into `<name>_MatMul` + `<name>_Add` before selecting
    nodes, so "Gemm" and Gemm node names must be spelled as those MatMuls."""
    gemms = {n.name for n in model.graph.node if n.op_type == "Gemm"}
    exclude_out = [f"{n}_MatMul" if n in gemms else n for n in exclude]
    if "Gemm" not in op_types or "MatMul" in op_types:
        return sorted({*op_types, "MatMul"} if "Gemm" in op_types else set(op_types)), None, exclude_out
    # Gemm without MatMul: quantize the rewritten Gemms and nodes of the other listed types only.
    others = [t for t in op_types if t != "Gemm"]
    include = [n.name for n in model.graph.node if n.op_type in others]
    include += [f"{g}_MatMul" for g in sorted(gemms)]
    return sorted({*others, "MatMul"}), include, exclude_out


def unknown_nodes(model: onnx.ModelProto, names: tuple[str, ...]) -> list[str]:
    """Names in nodes_to_exclude that are not in the model: a typo would silently do nothing."""
    present = {node.name for node in model.graph.node}
    return [n for n in names if n not in present]
