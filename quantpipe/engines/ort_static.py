"""The `onnxruntime` static engine: ONNX Runtime's quantize_static with our calibration reader,
and its recovery ladder while the accuracy drop is real.

The defaults are the fast path on x86 (docs/design.md, "Defaults"): QDQ with U8 activations and
S8 weights, per channel, after quant_pre_process; Gemm/MatMul only on a transformer (attention,
and Gemm/MatMul holding most of the MACs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                      QuantType, quantize_static)

from quantpipe import budget, isa
from quantpipe.criterion import Judged
from quantpipe.data import DataInfo, first, normalize
from quantpipe.engines.base import StaticJob, StaticResult
from quantpipe.engines.graph import (COMPUTE_OPS, consumers, describe_mac_share,
                                    float_compute_nodes, float_decode, float_outputs,
                                    graph_input, mac_share,
                                    macs_by_node, percent, preprocess_checked, producers)
from quantpipe.errors import UserError
from quantpipe.schemas.quantize_static import QuantizeStaticParams

log = logging.getLogger(__name__)

# Calibration samples used for the per-tensor SQNR table.
SENSITIVITY_SAMPLES = 64


class CalibrationReader(CalibrationDataReader):
    """Feeds uint8 (N, C, S, S) calibration images (an array, or rows on disk) to ORT, read and
    normalized batch by batch."""

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


# Bytes per sample of the sessions below, in units of budget.Activations (measured on
# ResNet-50 at 224 px, 2 cores: 9.2 MB live and 101 MB of activations a sample). A lean session
# (lean_session) holds about 1.4x the live activations of its batch; the tensors a histogram
# calibrator keeps are stacked into one array at the end (twice), as are those of a debugging
# model that returns every tensor (1.5x while ORT reshapes them for output).
LEAN_LIVE = 2
KEPT_EVERY = 2


@dataclass(frozen=True)
class CalibrationPlan:
    samples: int     # calibration samples used
    batch_size: int  # samples per session run


def calibration_plan(acts: budget.Activations, sample_bytes: int, p: QuantizeStaticParams,
                     n_samples: int, left: int) -> CalibrationPlan:
    """How many calibration samples, and how many per run, fit in `left` bytes.

    MinMax uses every sample: ONNX Runtime reduces each batch to its minimum and maximum in the
    graph, so memory grows with the batch alone (p.calib_batch_size, or fewer when a batch does
    not fit; the ranges are the same). Entropy/Percentile keep every activation of every sample
    until the end (ORT issue #10503), so they get the first whole batches that fit.
    """
    run = sample_bytes + LEAN_LIVE * acts.live  # one sample through a lean session
    batch = min(p.calib_batch_size, n_samples, max(1, left // max(run, 1)))
    if left < run:
        raise UserError(f"quantize_static: one calibration sample needs about {run / budget.MB:,.0f} "
                        f"MiB of activations, more than the {left / budget.MB:,.0f} MiB the memory "
                        "budget leaves; raise resources.memory_mb")
    if batch < min(p.calib_batch_size, n_samples):
        log.warning("quantize_static: calibrating %d samples at a time instead of calib_batch_size "
                    "= %d, to stay within the memory budget (resources.memory_mb)", batch,
                    p.calib_batch_size)
    if p.calibrate_method == CalibrationMethod.MinMax:
        return CalibrationPlan(n_samples, batch)
    kept = KEPT_EVERY * max(acts.every, 1)
    fit = int((left - batch * run) // kept)
    if fit < 1:
        raise UserError(f"quantize_static: {p.calibrate_method.name} calibration keeps every "
                        f"activation of every sample ({kept / budget.MB:,.0f} MiB a sample), more "
                        "than the memory budget leaves; raise resources.memory_mb or use "
                        "quantize_static.calibrate_method: MinMax")
    if fit < n_samples:
        log.warning("quantize_static: %s calibration keeps every activation in memory; using %d of "
                    "%d samples to stay within the memory budget (resources.memory_mb)",
                    p.calibrate_method.name, fit, n_samples)
    use = min(fit, n_samples)
    batch = min(batch, use)
    if use > batch and use % batch:
        # ORT's histogram collector stacks all batches into one array: a short last batch
        # makes it ragged and ORT fails, so only whole batches are used.
        log.warning("quantize_static: using %d of %d calibration samples, a multiple of the "
                    "calibration batch (%d), as %s calibration needs equal batches",
                    use - use % batch, use, batch, p.calibrate_method.name)
        use -= use % batch
    return CalibrationPlan(use, batch)


def lean_session(path: Path | str) -> ort.InferenceSession:
    """A session for a model that returns or reduces every activation (calibration, SQNR): no
    graph optimization (ORT's calibrators use none, so every tensor keeps its name), each
    tensor freed once its readers have run (PRIORITY_BASED: ORT's default order ran the Reduce
    nodes its MinMax calibrator appends after the whole network, keeping every activation of a
    batch alive, 104 MB a sample for ResNet-50 at 224 px instead of 13) and no arena, which
    would keep the largest batch's memory for the rest of the stage."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def calibrate(pre_path: Path, reader: CalibrationReader, p: QuantizeStaticParams, extra: dict,
              cache_path: Path) -> None:
    """Compute activation ranges once and save them where quantize_static reads its
    calibration cache, so every quantization of the fallback reuses them. The reader's batch
    size is calibration_plan's.

    Calibrating here also reaches the histogram sizes ORT's quantize_static does not pass on:
    with its Entropy defaults (128 bins searched for a 128-bin range) the only candidate is the
    full range, i.e. Entropy silently equals MinMax.
    """
    from onnxruntime.quantization.calibrate import (TensorData, create_calibrator,
                                                    save_tensors_data)

    from quantpipe.engines.entropy import EntropyCollector

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
        calibrator.infer_session = lean_session(calibrator.augmented_model_path)
        if p.calibrate_method == CalibrationMethod.Entropy:  # ORT's thresholds, faster
            calibrator.collector = EntropyCollector(
                method=calibrator.method, symmetric=calibrator.symmetric,
                num_bins=calibrator.num_bins, num_quantized_bins=calibrator.num_quantized_bins,
                percentile=calibrator.percentile, scenario=calibrator.scenario)
        reader.rewind()
        try:
            calibrator.collect_data(reader)
        except ValueError:  # the histograms' numpy error on an infinite range: name the tensor
            names = [o.name for o in calibrator.infer_session.get_outputs()]
            require_finite([name for i, name in enumerate(names)
                            if name in calibrator.tensors_to_calibrate and not
                            all(np.isfinite(out[i]).all() for out in calibrator.intermediate_outputs)])
            raise
        ranges = calibrator.compute_data()
        require_finite([name for name, r in ranges.items() if isinstance(r, TensorData) and
                        hasattr(r, "lowest") and not np.isfinite(np.asarray(r.range_value, float)).all()])
        save_tensors_data(ranges, cache_path, smooth_quant=bool(options.get("SmoothQuant", False)))


def quantize_once(pre_path: Path, out_path: Path, reader: CalibrationReader,
                  p: QuantizeStaticParams, exclude: list[str], extra: dict, cache_path: Path,
                  quant_format: QuantFormat | None = None) -> None:
    """ONNX Runtime's quantize_static with the cached ranges, the model's outputs left float
    (graph.float_outputs)."""
    reader.rewind()
    quantize_static(
        str(pre_path), str(out_path), reader, calibration_cache_path=str(cache_path),
        quant_format=quant_format or p.quant_format, activation_type=p.activation_type,
        weight_type=p.weight_type, per_channel=p.per_channel,
        reduce_range=isa.reduce_range_for(p.reduce_range), calibrate_method=p.calibrate_method,
        nodes_to_exclude=exclude or None,
        op_types_to_quantize=list(p.op_types_to_quantize) or None,
        extra_options={**extra, **p.extra_options} or None)
    model = onnx.load(str(out_path))
    if float_outputs(model):
        onnx.save(model, str(out_path))


# Ops that only move, clip or select values: leaving them in float regains nothing.
PASSTHROUGH_OPS = {"Relu", "Clip", "MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze",
                   "Unsqueeze", "Identity", "Gather", "Slice", "Split", "Resize"}


def sensitivity(pre_path: Path, qdq_path: Path, reader: CalibrationReader, workdir: Path) -> list[dict]:
    """Per-tensor SQNR (dB) of the quantized model against the float model, in graph order.

    `model_sqnr_db` compares each tensor with the float model's (errors of earlier layers
    included); `noise_added` is the noise-to-signal power the producing node adds itself
    (10^(-out/10) - 10^(-worst input/10)): noise adds up in power, not in dB, so the node to
    leave in float is the one that adds most. Batch by batch (the reader's batch size:
    sensitivity_batch), so memory holds one batch of both models' activations.
    """
    from onnxruntime.quantization.qdq_loss_debug import modify_model_output_intermediate_tensors

    aug_float, aug_qdq = workdir / "aug_float.onnx", workdir / "aug_qdq.onnx"
    modify_model_output_intermediate_tensors(str(pre_path), str(aug_float))
    modify_model_output_intermediate_tensors(str(qdq_path), str(aug_qdq))
    sqnr = activation_sqnr(lean_session(aug_float), lean_session(aug_qdq), reader)
    pre = onnx.load(str(pre_path))
    nodes = list(pre.graph.node)  # topological order
    # ORT quantizes a Conv/Gemm output that feeds only a Relu/Clip with the activation's range
    # (negatives clipped), so such a tensor is compared after its activation.
    readers = consumers(pre)

    def effective(tensor: str) -> str:
        users = readers.get(tensor, [])
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


def activation_sqnr(float_session: ort.InferenceSession, qdq_session: ort.InferenceSession,
                    reader: CalibrationReader) -> dict[str, float]:
    """{tensor: SQNR in dB} of the QDQ model's dequantized activations against the float
    model's, over every batch of the reader: ONNX Runtime's qdq_loss_debug measure
    (create_activation_matching's pairs, compute_signal_to_quantization_noice_ratio's
    20 log10(|float| / |float - qdq|)), its norms summed over batches instead of over every
    batch held at once. A tensor the QDQ model computes without a QDQ pair of its own (the
    model's float outputs: graph.float_outputs) is compared as it is."""
    from onnxruntime.quantization.qdq_loss_debug import (_TENSOR_SAVE_POSTFIX,
                                                         create_activation_matching)
    from onnxruntime.quantization.quant_utils import (DEQUANT_OUTPUT_SUFFIX, QUANT_INPUT_SUFFIX,
                                                      TENSOR_NAME_QUANT_SUFFIX)

    # The names ORT's QDQ quantizer gives a pair's sides (matched by the pair's own name).
    suffixes = (QUANT_INPUT_SUFFIX, DEQUANT_OUTPUT_SUFFIX, TENSOR_NAME_QUANT_SUFFIX)

    def saved(session: ort.InferenceSession, batch: dict) -> dict[str, list[np.ndarray]]:
        names = [o.name for o in session.get_outputs()]
        return {name.removesuffix(_TENSOR_SAVE_POSTFIX): [value]
                for name, value in zip(names, session.run(None, batch))
                if name.endswith(_TENSOR_SAVE_POSTFIX)}

    signal: dict[str, float] = {}
    noise: dict[str, float] = {}
    reader.rewind()
    while (batch := reader.get_next()) is not None:
        qdq, flt = saved(qdq_session, batch), saved(float_session, batch)
        matched = create_activation_matching(qdq, flt)
        pairs = {name: (match["float"][0], match["post_qdq"][0]) for name, match in matched.items()
                 if match.get("float") is not None}
        pairs.update({name: (value[0], qdq[name][0]) for name, value in flt.items()
                      if name in qdq and name not in matched
                      and not any(f"{name}{s}" in qdq for s in suffixes)})
        for name, (ref, got) in pairs.items():
            ref = ref.astype(np.float64).ravel()
            diff = ref - got.astype(np.float64).ravel()
            signal[name] = signal.get(name, 0.0) + float(ref @ ref)
            noise[name] = noise.get(name, 0.0) + float(diff @ diff)
        del matched, pairs, qdq, flt
    eps = float(np.finfo(np.float32).eps)  # ORT's floor on either norm
    return {name: 20 * np.log10(max(np.sqrt(signal[name]), eps) / max(np.sqrt(noise[name]), eps))
            for name in signal}


def sensitivity_batch(float_acts: budget.Activations, qdq_acts: budget.Activations,
                      sample_bytes: int, cap: int, memory: budget.Budget) -> int:
    """Samples per batch of the SQNR pass: both debugging models return every activation."""
    return memory.batch(sample_bytes + KEPT_EVERY * (float_acts.every + qdq_acts.every)
                        + LEAN_LIVE * qdq_acts.live, cap=cap, fixed=KEPT_EVERY * qdq_acts.fixed,
                        what="quantize_static's sensitivity pass (both models' activations)")


def fallback_order(table: list[dict], already: list[str]) -> list[str]:
    """Nodes worth leaving in float, the one that adds most quantization noise first."""
    rows = sorted((r for r in table if r["node"] and r["op_type"] not in PASSTHROUGH_OPS),
                  key=lambda r: (-r["noise_added"], r["node"]))
    return list(dict.fromkeys(r["node"] for r in rows if r["node"] not in already))


def with_consumers(model: onnx.ModelProto, name: str) -> list[str]:
    """`name` and the nodes that read its output (through PASSTHROUGH_OPS). ORT quantizes a
    tensor while any of its producer or consumers is quantized, so an activation whose own
    range is the trouble stays in float only when all of them do."""
    nodes = {n.name: n for n in model.graph.node}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    group, frontier = [name], list(nodes[name].output)
    while frontier:
        for node in readers.get(frontier.pop(), []):
            if node.op_type in PASSTHROUGH_OPS:
                frontier.extend(node.output)
            elif node.name not in group:
                group.append(node.name)
    return group


# What marks a transformer block: attention multiplies two activations (Q by K, the
# attention weights by V) next to a Softmax or LayerNormalization.
ATTENTION_OPS = {"Softmax", "LayerNormalization"}
# Measured on vit_b_16 at 32 px (1 thread, bs32): every op quantized kept 89-91% agreement with
# FP32 on test; Gemm/MatMul only 98.9%, at the same speed (x2.7): the Adds, Softmax and
# LayerNormalization around them lose the most in INT8 and gain the least.
TRANSFORMER_OP_TYPES = ("Gemm", "MatMul")
# A graph with attention is a transformer when Gemm/MatMul hold more than this share of its
# MACs. A CNN with one attention block (YOLO11's C2PSA) holds most in Conv: quantizing
# Gemm/MatMul only would leave its convs, nearly all its arithmetic, in float (x1.02 at 1 thread).
TRANSFORMER_MAC_SHARE = 0.5


def attention_matmuls(model: onnx.ModelProto) -> list[str]:
    """MatMul nodes that multiply two activations, when the graph also has a Softmax or a
    LayerNormalization (a transformer's attention); empty for any other graph."""
    if not ATTENTION_OPS & {n.op_type for n in model.graph.node}:
        return []
    constants = {i.name for i in model.graph.initializer}
    constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and not constants & set(n.input[:2])]


# Ops that read a tensor only for its shape: the attention block's reshapes read the block's
# input through them, which would lead attention_core out of the block.
SHAPE_OPS = {"Shape", "Size"}


def attention_core(model: onnx.ModelProto) -> list[str]:
    """The attention MatMuls and every node joined to them by tensors without a compute node
    (or a Shape) in between: the reshapes, split, scale, Softmax and transposes of the block up
    to the convs around it, in graph order. ORT quantizes a tensor while its producer or any of
    its consumers is quantized (and runs DQ -> MatMul -> Q as an integer MatMul), so the
    attention computes in float only when all of these are left in float."""
    matmuls = attention_matmuls(model)
    produced, readers = producers(model), consumers(model)
    nodes = {n.name: n for n in model.graph.node}
    core, todo = set(matmuls), list(matmuls)
    while todo:
        node = nodes[todo.pop()]
        near = [produced[i] for i in node.input if i in produced]
        near += [c for out in node.output for c in readers.get(out, [])]
        for other in near:
            if other.name not in core and other.op_type not in COMPUTE_OPS | SHAPE_OPS:
                core.add(other.name)
                todo.append(other.name)
    return [n.name for n in model.graph.node if n.name in core]


def static_op_types(model: onnx.ModelProto, requested: tuple[str, ...],
                    sample_shape: tuple[int, ...] | None = None) -> tuple[tuple[str, ...], str]:
    """(op types ORT's quantize_static gets, empty for all; why): what op_types_to_quantize
    lists, else Gemm/MatMul only on a transformer (attention, and Gemm/MatMul holding most of
    the MACs: graph.mac_share, at one sample of sample_shape), else every op type: a CNN with
    an attention block gets its convs in INT8, its attention MatMuls with them (the ladder's
    first candidates for float)."""
    if requested:
        return requested, "quantize_static.op_types_to_quantize"
    macs = macs_by_node(model, sample_shape)
    shares = mac_share(model, macs)
    described = describe_mac_share(shares, sum(count is None for count in macs.values()))
    attention = attention_matmuls(model)
    if not attention:
        return (), f"{described}: every op type ORT quantizes (no attention in the graph)"
    found = (f"attention ({len(attention)} MatMul(s) of two activations beside "
             f"Softmax/LayerNormalization, e.g. {attention[0]})")
    matmul = sum(shares.get(op, 0.0) for op in TRANSFORMER_OP_TYPES)
    if not shares:  # no shapes to weigh by: a graph with attention is taken for a transformer
        return TRANSFORMER_OP_TYPES, f"{found} and {described}: Gemm/MatMul only, the transformer default"
    if matmul > TRANSFORMER_MAC_SHARE:
        return TRANSFORMER_OP_TYPES, (f"{found} with Gemm/MatMul {percent(matmul)} of MACs "
                                      f"({described}): Gemm/MatMul only, the transformer default")
    return (), (f"{described}: every op type, as Gemm/MatMul hold only {percent(matmul)} of "
                f"MACs; {found} first back to float if the drop is real")


def first_and_last(model: onnx.ModelProto, op_types: tuple[str, ...]) -> list[str]:
    """The first and last compute nodes ORT would quantize, in graph (topological) order."""
    kinds = set(op_types) & COMPUTE_OPS if op_types else COMPUTE_OPS
    nodes = [n.name for n in model.graph.node if n.op_type in kinds and n.name]
    return list(dict.fromkeys(nodes[:1] + nodes[-1:]))


def collect_outputs(pre_path: Path, reader: CalibrationReader, p: QuantizeStaticParams,
                    workdir: Path) -> dict[str, list[np.ndarray]]:
    """Every tensor ORT calibrates, per calibration batch: one inference pass, from which each
    calibration method's ranges are computed (cached_ranges) without running the model again."""
    from onnxruntime.quantization.calibrate import create_calibrator

    calibrator = create_calibrator(pre_path, list(p.op_types_to_quantize) or None,
                                   augmented_model_path=str(workdir / "augmented_all.onnx"),
                                   calibrate_method=CalibrationMethod.Entropy)
    session = calibrator.infer_session = lean_session(calibrator.augmented_model_path)
    names = [o.name for o in session.get_outputs()]
    outputs: dict[str, list[np.ndarray]] = {}
    reader.rewind()
    while (batch := reader.get_next()) is not None:
        for name, value in zip(names, session.run(None, batch)):
            if name in calibrator.tensors_to_calibrate:
                outputs.setdefault(name, []).append(value)
    # ORT's histograms span each tensor's range: an infinite value would stop them in numpy.
    require_finite([name for name, batches in outputs.items()
                    if not all(np.isfinite(b).all() for b in batches)])
    return outputs


def require_finite(names: list[str]) -> None:
    """One line for tensors whose calibration range is not finite (a log of 0, say): MinMax
    would make an infinite scale of it, the histograms fail."""
    if names:
        more = f" (and {len(names) - 1} more)" if names[1:] else ""
        raise UserError(f"quantize_static: tensor {names[0]} of the FP32 model{more} has non-finite "
                        "values on the calibration data; every tensor static quantization "
                        "calibrates needs a finite range: clamp the value before its log or "
                        "division in the model")


def cached_ranges(outputs: dict[str, list[np.ndarray]], method: CalibrationMethod,
                  p: QuantizeStaticParams, path: Path) -> Path:
    """Ranges by `method` from collect_outputs' tensors, saved as a calibration cache at `path`
    (ORT's own collectors: MinMax's min/max, Entropy's and Percentile's histograms)."""
    from onnxruntime.quantization.calibrate import (HistogramCollector, TensorsData,
                                                    save_tensors_data)

    from quantpipe.engines.entropy import EntropyCollector

    # create_calibrator's defaults: only Percentile is symmetric unless the user says.
    symmetric = bool(p.extra_options.get("CalibTensorRangeSymmetric",
                                         method == CalibrationMethod.Percentile))
    if method == CalibrationMethod.MinMax:
        ranges = {}
        for name, batches in outputs.items():
            low = np.float32(min(b.min() for b in batches))
            high = np.float32(max(b.max() for b in batches))
            if symmetric:
                low, high = -max(-low, high), max(-low, high)
            ranges[name] = (np.array(low), np.array(high))
        data = TensorsData(method, ranges)
    else:
        kind = EntropyCollector if method == CalibrationMethod.Entropy else HistogramCollector
        collector = kind(
            method=method.name.lower(), symmetric=symmetric, num_bins=p.calib_num_bins,
            num_quantized_bins=p.calib_num_quantized_bins,
            percentile=p.extra_options.get("CalibPercentile", 99.999), scenario="same")
        with contextlib.redirect_stdout(io.StringIO()):  # ORT prints its progress
            collector.collect(outputs)
            data = TensorsData(method, collector.compute_collection_result())
    save_tensors_data(data, path)
    return path


@dataclass
class Attempt:
    """One quantization the ladder tried: how it was made, the model and its judgement."""
    rung: str
    method: CalibrationMethod
    cache: Path
    nodes: list[str]
    path: Path
    judged: Judged
    record: dict  # the step as metrics/quantize_static.json lists it


def keep(best: Attempt, tried: list[Attempt]) -> Attempt:
    """The tried attempt that judges best (Judged.score), marked kept, if it beats `best`;
    else `best`."""
    winner = max(tried, key=lambda a: a.judged.score())
    if winner.judged.score() <= best.judged.score():
        return best
    winner.record["kept"] = True
    return winner


def node_round(best: Attempt, ranked: list[str], model: onnx.ModelProto, k: int,
               attempt: Callable[..., Attempt]) -> Attempt:
    """One round of the ladder's node rung: the top k nodes of `ranked` each in float alone
    (their weights or arithmetic are the trouble), then with their readers (their output range
    is); returns the attempt that regains most, or `best` when none changes a prediction or
    regains anything (the ladder then stops)."""
    top = [n for n in ranked if n not in best.nodes][:k]
    groups = [[n] for n in top] + [with_consumers(model, n) for n in top]
    candidates = [c for c in dict.fromkeys(tuple(n for n in g if n not in best.nodes)
                                           for g in groups) if c]
    log.warning("quantize_static: %s; trying %s in float", best.record["verdict"],
                [list(c) for c in candidates])
    tried = [attempt("node", best.method, best.cache, best.nodes + list(c), candidate=list(c))
             for c in candidates]
    if all(np.array_equal(a.judged.predictions, best.judged.predictions) for a in tried):
        log.warning("quantize_static: none of %s changes a prediction; stopping", top)
        return best
    kept = keep(best, tried)
    if kept is best:
        log.warning("quantize_static: none of %s regains accuracy; stopping", top)
    return kept


def prune(best: Attempt, plain: Attempt, ends: list[str],
          attempt: Callable[..., Attempt]) -> Attempt:
    """Once a node rung has met the criterion, the earlier rungs may no longer be needed: try
    the plain calibration back and/or the first and last layers back in INT8, and keep the one
    with the fewest nodes in float (faster) among those that judge at least as well."""
    lean = [n for n in best.nodes if n not in ends]
    options = [(calibration, nodes) for calibration in {best.method: best.cache,
                                                         plain.method: plain.cache}.items()
               for nodes in (lean, best.nodes) if (calibration[0], nodes) != (best.method, best.nodes)]
    options = [o for i, o in enumerate(options) if o not in options[:i]]
    tried = [attempt("prune", method, cache, nodes) for (method, cache), nodes in options]
    # Only what loses nothing: a model just inside the criterion can be a few test images
    # worse than the one that found it.
    fine = [a for a in tried if a.judged.score() >= best.judged.score()] + [best]
    choice = min(fine, key=lambda a: len(a.nodes))
    choice.record["kept"] = True
    return choice


def quantize_static_with_fallback(fp32_path: Path, out_path: Path, calib_x: np.ndarray,
                                  info: DataInfo, p: QuantizeStaticParams,
                                  check: Callable[[Path], Judged], *,
                                  memory: budget.Budget = budget.UNLIMITED,
                                  float_tail: bool = False) -> StaticResult:
    """quant_pre_process, calibrate and quantize (ORT) the op types static_op_types picks
    (with float_tail, never the decode after the last compute node: graph.float_decode)
    (Gemm/MatMul only on a transformer, by its share of MACs, unless p.op_types_to_quantize
    lists others); then, while check(model) says the accuracy drop is real
    (quantpipe.criterion), climb the recovery ladder, keeping a change only when it judges
    better (Judged.score):
    1. the other calibration methods, their ranges computed from one pass over the calibration
       set (collect_outputs);
    2. where every op type is quantized and the graph has attention (a CNN with an attention
       block: static_op_types), the attention in float: its MatMuls, Softmax and the reshapes
       between them and the convs around them (attention_core); then the first and last
       quantized layers in float (the usual suspects: raw pixels in, logits out);
    3. per node, up to p.max_fallback_steps rounds (node_round): the p.fallback_candidates
       nodes that add the most quantization noise (SQNR, see sensitivity) are each tried, alone
       and with the nodes that read their output (with_consumers), and the one that regains most
       is kept; a round in which none changes a single prediction or regains anything stops it;
    4. if a node of rung 3 met the criterion, rungs 1-2 are undone where that loses nothing
       (see prune, which also tries the attention back in INT8).
    Rungs 1-2 run only when max_fallback_steps > 0. Calibration and the SQNR pass run in
    batches that fit `memory` (calibration_plan, sensitivity_batch). Writes the kept model to
    out_path."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        pre = workdir / "preprocessed.onnx"
        symbolic, pre_model = preprocess_checked(fp32_path, pre, p.nodes_to_exclude,
                                                 "quantize_static.nodes_to_exclude")
        tail = [n for n in float_decode(pre_model)
                if n not in p.nodes_to_exclude] if float_tail else []
        p = dataclasses.replace(p, nodes_to_exclude=tuple(p.nodes_to_exclude) + tuple(tail))
        op_types, op_selection = static_op_types(pre_model, p.op_types_to_quantize,
                                                 tuple(calib_x.shape[1:]))
        p = dataclasses.replace(p, op_types_to_quantize=op_types)
        # Memory: what one sample costs the sessions below, planned before any runs.
        acts = budget.activations(pre_model, tuple(calib_x.shape[1:]))
        sample_bytes = 4 * int(np.prod(calib_x.shape[1:]))  # one normalized float32 input
        plan = calibration_plan(acts, sample_bytes, p, len(calib_x), memory.left_bytes())
        extra: dict = {}
        input_name = graph_input(pre_model).name
        reader = CalibrationReader(first(calib_x, plan.samples), info, input_name, plan.batch_size)

        excluded = list(p.nodes_to_exclude)
        cache = workdir / "calibration.json"
        calibrate(pre, reader, p, extra, cache)
        # SQNR is read from a QDQ twin that keeps Relu/Clip: with them removed (ORT's default),
        # a tensor's pre-QDQ values would be the unclipped ones and its error meaningless.
        twin = workdir / "qdq_twin.onnx"
        quantize_once(pre, twin, reader, p, excluded, {**extra, "QDQKeepRemovableActivations": True},
                      cache, quant_format=QuantFormat.QDQ)
        # SQNR needs only a few batches, of both models' every activation: sized to the budget.
        twin_acts = budget.activations(onnx.load(str(twin)), tuple(calib_x.shape[1:]))
        probe = CalibrationReader(first(calib_x, SENSITIVITY_SAMPLES), info, input_name,
                                  sensitivity_batch(acts, twin_acts, sample_bytes,
                                                    plan.batch_size, memory))
        table = sensitivity(pre, twin, probe, workdir)

        steps: list[dict] = []

        def attempt(rung: str, method: CalibrationMethod, cache: Path, nodes: list[str],
                    **about) -> Attempt:
            path = workdir / f"candidate{len(steps)}.onnx"
            quantize_once(pre, path, reader, dataclasses.replace(p, calibrate_method=method),
                          nodes, extra, cache)
            judged = check(path)
            record = {"rung": rung, "calibrate_method": method.name, "nodes_in_float": list(nodes),
                      **about, **judged.record, "kept": False}
            steps.append(record)
            return Attempt(rung, method, cache, list(nodes), path, judged, record)

        best = plain = attempt("plain", p.calibrate_method, cache, excluded)
        best.record["kept"] = True
        climb = p.max_fallback_steps > 0
        if climb and best.judged.real:
            log.warning("quantize_static: %s; trying other calibration methods", best.record["verdict"])
            hist = calibration_plan(acts, sample_bytes, dataclasses.replace(
                p, calibrate_method=CalibrationMethod.Entropy), plan.samples, memory.left_bytes())
            outputs = collect_outputs(pre, CalibrationReader(first(calib_x, hist.samples), info,
                                                             input_name, hist.batch_size), p, workdir)
            tried = [attempt("calibration", m, cached_ranges(outputs, m, p, workdir / f"{m.name}.json"),
                             best.nodes)
                     for m in CalibrationMethod if m != p.calibrate_method and m.name in
                     ("MinMax", "Entropy", "Percentile")]
            del outputs
            best = keep(best, tried)
        # A CNN's attention, quantized with its convs (static_op_types): the usual suspect of
        # a CNN with an attention block, whose MatMuls hold little of the arithmetic.
        core = [n for n in attention_core(pre_model) if n not in best.nodes] if not op_types else []
        if climb and best.judged.real and core:
            log.warning("quantize_static: %s; trying the attention %s in float",
                        best.record["verdict"], core)
            best = keep(best, [attempt("attention", best.method, best.cache, best.nodes + core,
                                       candidate=core)])
        ends = [n for n in first_and_last(pre_model, p.op_types_to_quantize) if n not in best.nodes]
        if climb and best.judged.real and ends:
            log.warning("quantize_static: %s; trying the first and last layers %s in float",
                        best.record["verdict"], ends)
            best = keep(best, [attempt("first_last", best.method, best.cache, best.nodes + ends)])
        ranked = fallback_order(table, best.nodes)
        for _ in range(p.max_fallback_steps):
            if not best.judged.real or not ranked:
                break
            before, best = best, node_round(best, ranked, pre_model, p.fallback_candidates, attempt)
            if best is before:
                break
            ranked = [n for n in ranked if n not in best.nodes]
        if not best.judged.real and best.rung == "node":
            best = prune(best, plain, ends + core, attempt)
        os.replace(best.path, out_path)
        in_float = float_compute_nodes(onnx.load(str(out_path)))
    return StaticResult(engine="onnxruntime", steps=steps,
                        fallback_nodes=[n for n in best.nodes if n not in excluded],
                        nodes_in_float=in_float, calibrate_method=best.method.name,
                        sensitivity=table, calib_samples_used=plan.samples,
                        calib_batch_size=plan.batch_size,
                        symbolic_shape_inference=symbolic, op_types_to_quantize=list(op_types),
                        op_selection=op_selection, tail_in_float=tail)


class OnnxRuntimeStatic:
    """quantize_static.engine: onnxruntime."""
    name = "onnxruntime"

    def warnings(self, p: QuantizeStaticParams) -> list[str]:
        return slow_combination_warnings(p)

    def quantize(self, job: StaticJob) -> StaticResult:
        return quantize_static_with_fallback(job.fp32, job.out, job.calib_x, job.info, job.params,
                                             job.check, memory=job.memory,
                                             float_tail=job.float_tail)

    def settings(self, p: QuantizeStaticParams, result: StaticResult) -> dict:
        return {"quant_format": p.quant_format.name, "activation_type": p.activation_type.name,
                "weight_type": p.weight_type.name, "per_channel": p.per_channel,
                "reduce_range": isa.reduce_range_for(p.reduce_range),
                "calibrate_method": result.calibrate_method,
                "calib_samples": result.calib_samples_used,
                "calib_batch_size": result.calib_batch_size,
                "op_types_to_quantize": result.op_types_to_quantize,
                "op_selection": result.op_selection}
