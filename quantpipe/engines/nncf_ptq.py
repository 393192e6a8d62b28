"""The `nncf` static engine: NNCF's ONNX post-training quantization.

NNCF (OpenVINO's compression library) quantizes the same FP32 ONNX file to a QDQ model that
ONNX Runtime runs like ORT's own. What it adds: bias correction (each quantized layer's output
mean shifted back to FP32's), and quantize_with_accuracy_control as this engine's fallback,
which reverts the quantizers that cost most until the metric is back within max_drop.

nncf is imported here only: it takes ~2 s, and only this engine needs it.
"""

from __future__ import annotations

import dataclasses

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from quantpipe import isa
from quantpipe.criterion import Judged
from quantpipe.data import DataInfo, normalize
from quantpipe.engines.base import StaticJob, StaticResult
from quantpipe.engines.graph import (check_nodes_exist, consumers, float_compute_nodes, graph_input,
                                    output_tail)
from quantpipe.schemas.quantize_static import BiasCorrection, QuantizeStaticParams

log = logging.getLogger(__name__)
# nncf imports torch, whose C++-extension helper warns "No CUDA runtime is found" on every CPU
# machine: noise in a stage's output.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def quantize_options(p: QuantizeStaticParams, n_calib: int) -> dict:
    """Keyword arguments shared by nncf.quantize and quantize_with_accuracy_control."""
    import nncf
    from nncf.quantization.advanced_parameters import (AdvancedQuantizationParameters,
                                                       AdvancedSmoothQuantParameters, OverflowFix)

    q = p.nncf
    advanced = AdvancedQuantizationParameters(
        disable_bias_correction=q.bias_correction == BiasCorrection.none)
    if isa.reduce_range_for(p.reduce_range):
        # NNCF's reduce_range: weights of every layer in [-64, 64] (its default: the first's).
        advanced.overflow_fix = OverflowFix.ENABLE
    if q.smooth_quant_alpha is not None:
        advanced.smooth_quant_alphas = AdvancedSmoothQuantParameters(matmul=q.smooth_quant_alpha)
    return {
        "preset": nncf.QuantizationPreset(q.preset.value),
        # CPU, not NNCF's default ANY: the x86 kernels are what the model is deployed on.
        "target_device": nncf.TargetDevice.CPU,
        "subset_size": min(q.subset_size or n_calib, n_calib),
        "fast_bias_correction": q.bias_correction != BiasCorrection.full,
        "model_type": nncf.ModelType(q.model_type.value) if q.model_type else None,
        "ignored_scope": nncf.IgnoredScope(names=list(p.nodes_to_exclude))
        if p.nodes_to_exclude else None,
        # bias_correction none and smooth_quant_alpha live here: without it they do nothing.
        "advanced_parameters": advanced,
    }


def calibration_dataset(model: onnx.ModelProto, calib_x: np.ndarray, info: DataInfo):
    """nncf.Dataset of the calibration images, normalized, one image per item: NNCF batches
    nothing itself, and bias correction wants single samples."""
    import nncf

    input_name = graph_input(model).name
    return nncf.Dataset(range(len(calib_x)), lambda i: {input_name: normalize(calib_x[i:i + 1], info)})


def unsigned_activations(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every activation quantizer NNCF's ONNX backend wrote as int8 with a
    non-zero zero point (an asymmetric range, preset mixed) as uint8: the same grid, its levels
    and zero point shifted by 128, so every dequantized value is unchanged. Why: OpenVINO's CPU
    plugin takes asymmetric INT8 activations only as uint8; a convolution fed by the int8 form
    runs in FP32 there. Returns how many quantizers were rewritten."""
    initializers = {init.name: init for init in model.graph.initializer}
    readers_of = consumers(model)
    rewritten: list[str] = []
    replaced: set[str] = set()
    for q in [n for n in model.graph.node if n.op_type == "QuantizeLinear"]:
        zero = initializers.get(q.input[2]) if len(q.input) > 2 else None
        readers = readers_of.get(q.output[0], [])
        if (q.input[0] in initializers or zero is None or not readers
                or any(r.op_type != "DequantizeLinear" for r in readers)):
            continue  # a weight, a symmetric default, or a Q whose output is not only dequantized
        z = numpy_helper.to_array(zero)
        if z.dtype != np.int8 or not z.any():
            continue  # uint8 already, or symmetric int8 (which OpenVINO runs as is)
        unsigned = f"{zero.name}_uint8"
        if zero.name not in replaced:  # one initializer may serve several quantizers
            model.graph.initializer.append(numpy_helper.from_array(
                (z.astype(np.int16) + 128).astype(np.uint8), unsigned))
            replaced.add(zero.name)
        for node in (q, *readers):
            node.input[2] = unsigned
        rewritten.append(q.output[0])
    for info in model.graph.value_info:  # the quantized tensors' declared type follows
        if info.name in rewritten:
            info.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    used = {name for node in model.graph.node for name in node.input}
    for init in [i for i in model.graph.initializer if i.name in replaced - used]:
        model.graph.initializer.remove(init)
    return len(rewritten)


def quantize(model: onnx.ModelProto, calib_x: np.ndarray, info: DataInfo,
             p: QuantizeStaticParams) -> onnx.ModelProto:
    """nncf.quantize with p's options on the calibration images, its activations as uint8."""
    import nncf

    quantized = nncf.quantize(model, calibration_dataset(model, calib_x, info),
                              **quantize_options(p, len(calib_x)))
    unsigned_activations(quantized)
    return quantized


def agreement_fn(pool_x: np.ndarray, pool_ref: np.ndarray,
                 predict: Callable[[onnx.ModelProto, np.ndarray], np.ndarray]):
    """NNCF validation_fn: top-1 agreement with FP32 on the pool images named by the items,
    and per item (1.0 or 0.0), which NNCF's ranking of quantizers uses."""
    def validate(model: onnx.ModelProto, items: Iterable[int]) -> tuple[float, list[float]]:
        idx = np.fromiter(items, dtype=np.int64)
        same = (predict(model, pool_x[idx]) == pool_ref[idx]).astype(np.float64)
        return float(same.mean()), same.tolist()
    return validate


def quantize_static_nncf(fp32_path: Path, out_path: Path, calib_x: np.ndarray, info: DataInfo,
                         p: QuantizeStaticParams, check: Callable[[Path], Judged],
                         pool_x: np.ndarray, pool_ref: np.ndarray,
                         predict: Callable[[onnx.ModelProto, np.ndarray], np.ndarray], *,
                         float_tail: bool = False) -> StaticResult:
    """nncf.quantize; when check() says the drop is real and max_fallback_steps > 0,
    nncf.quantize_with_accuracy_control with the pool criterion as its metric: agreement with
    FP32 (pool_ref, FP32's top-1 on the normalized pool_x) of at least min_pool_agreement,
    reverting at most max_fallback_steps quantizer groups. Writes the last model to out_path."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    model = onnx.load(str(fp32_path))
    check_nodes_exist(model, p.nodes_to_exclude, "quantize_static.nodes_to_exclude", fp32_path)
    tail = [n for n in output_tail(model) if n not in p.nodes_to_exclude] if float_tail else []
    p = dataclasses.replace(p, nodes_to_exclude=tuple(p.nodes_to_exclude) + tuple(tail))
    options = quantize_options(p, len(calib_x))
    steps: list[dict] = []

    def judge(rung: str, quantized: onnx.ModelProto, path: Path, seconds: float) -> Judged:
        onnx.save(quantized, str(path))
        judged = check(path)
        steps.append({"rung": rung, "engine": "nncf",
                      "nodes_in_float": float_compute_nodes(quantized),
                      "seconds": round(seconds, 2), **judged.record, "kept": True})
        return judged

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "quantized.onnx"
        start = time.perf_counter()
        judged = judge("plain", quantize(model, calib_x, info, p), path,
                       time.perf_counter() - start)
        if judged.real and p.max_fallback_steps > 0:
            log.warning("quantize_static: %s; running nncf.quantize_with_accuracy_control",
                        judged.record["verdict"])
            start = time.perf_counter()
            controlled = nncf.quantize_with_accuracy_control(
                model, calibration_dataset(model, calib_x, info), nncf.Dataset(range(len(pool_x))),
                agreement_fn(pool_x, pool_ref, predict),
                max_drop=1.0 - p.min_pool_agreement, drop_type=nncf.DropType.ABSOLUTE,
                preset=options["preset"], target_device=options["target_device"],
                subset_size=options["subset_size"],
                fast_bias_correction=options["fast_bias_correction"],
                model_type=options["model_type"], ignored_scope=options["ignored_scope"],
                advanced_quantization_parameters=options["advanced_parameters"],
                advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(
                    max_num_iterations=p.max_fallback_steps))
            steps[-1]["kept"] = False
            unsigned_activations(controlled)
            judge("accuracy_control", controlled, path, time.perf_counter() - start)
        os.replace(path, out_path)
    in_float = steps[-1]["nodes_in_float"]
    return StaticResult(engine="nncf", steps=steps,
                        fallback_nodes=[n for n in in_float if n not in steps[0]["nodes_in_float"]],
                        nodes_in_float=in_float, calibrate_method="nncf", sensitivity=[],
                        calib_samples_used=options["subset_size"], symbolic_shape_inference=None,
                        tail_in_float=tail)


class NNCFStatic:
    """quantize_static.engine: nncf."""
    name = "nncf"

    def warnings(self, p: QuantizeStaticParams) -> list[str]:
        return []  # NNCF picks its own types for the x86 kernels: the ORT settings do not apply

    def quantize(self, job: StaticJob) -> StaticResult:
        return quantize_static_nncf(job.fp32, job.out, job.calib_x, job.info, job.params, job.check,
                                    job.pool_x, job.pool_ref, job.predict,
                                    float_tail=job.float_tail)

    def settings(self, p: QuantizeStaticParams, result: StaticResult) -> dict:
        return {"preset": p.nncf.preset.value, "bias_correction": p.nncf.bias_correction.value,
                "subset_size": result.calib_samples_used,
                "model_type": p.nncf.model_type.value if p.nncf.model_type else None,
                "smooth_quant_alpha": p.nncf.smooth_quant_alpha,
                "overflow_fix": "enable" if isa.reduce_range_for(p.reduce_range) else "nncf default"}
