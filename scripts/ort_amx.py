#!/usr/bin/env python3
"""ONNX Runtime on an AMX CPU: why its INT8 gains stay near its VNNI figures while OpenVINO's
reach several times more on the same files. The numbers behind docs/precision.md.

For torchvision models at real sizes (random weights: speed only, nothing is downloaded) this
exports FP32 ONNX as the pipeline does (export, onnxsim) and quantizes it with ONNX Runtime's
static QDQ three ways: quantpipe's scheme (U8 activations, S8 symmetric per-channel weights),
S8 weights with zero points (per tensor, WeightSymmetric false) and U8 weights; then times, in
the same interleaved rounds (quantpipe's bench), FP32 / each INT8 file on ONNX Runtime,
FP32 / BF16 / quantpipe's INT8 file on OpenVINO, at every thread count, and records the kernel
each runtime ran (quantpipe.runtimes' kernels()).

    python scripts/ort_amx.py                   # -> metrics/ort_amx.json + table
    python scripts/ort_amx.py --models resnet18:64:32 -o /tmp/ort_amx.json

About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
import torchvision
from onnx import numpy_helper
from onnxruntime import GraphOptimizationLevel
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                      quantize_static)

from quantpipe import bench, machine, onnxutil
from quantpipe.docs import ort_amx_table
from quantpipe.io import write_json
from quantpipe.runtimes.base import kernel_table
from quantpipe.runtimes.ort import OnnxRuntime
from quantpipe.runtimes.ov import OpenVino
from quantpipe.schemas.bench import BenchParams
from quantpipe.schemas.export import ExportParams

ROOT = Path(__file__).resolve().parents[1]
# name:image size:batch, as in the issue that asked (ResNet-18 small, the others at ImageNet size).
MODELS = ("resnet18:64:32", "mobilenet_v2:224:8", "resnet50:224:8")
# ONNX Runtime's static QDQ three ways: quantpipe's scheme first. ORT makes per-channel weights
# symmetric whatever WeightSymmetric says (qdq_quantizer.py: QLinear ops need one zero point per
# tensor), so weights with zero points are per-tensor.
SCHEMES = {"s8_symmetric": {"weight_type": QuantType.QInt8, "per_channel": True,
                            "extra_options": {}},
           "s8_zero_points": {"weight_type": QuantType.QInt8, "per_channel": False,
                              "extra_options": {"WeightSymmetric": False}},
           "u8_weights": {"weight_type": QuantType.QUInt8, "per_channel": True,
                          "extra_options": {}}}
TIMING = BenchParams(batch_sizes=(1,), threads=("all", 1), warmup=3, runs=42, rounds=7,
                     seconds=40.0)  # 20 s for each of the 2 measurements


class Random(CalibrationDataReader):
    """Calibration batches of normal noise: speed only, the ranges do not matter here."""

    def __init__(self, shape: tuple[int, ...], batches: int = 4) -> None:
        rng = np.random.default_rng(0)
        self.batches = iter([{"input": rng.standard_normal(shape, dtype=np.float32)}
                             for _ in range(batches)])

    def get_next(self):
        return next(self.batches, None)


def skewed(model: torch.nn.Module) -> torch.nn.Module:
    """Every convolution's most negative weights clipped to half its largest magnitude. Random
    initial weights are symmetric about 0, so WeightSymmetric false would still give zero
    points of 0 and the s8_zero_points file would run the same kernels as s8_symmetric;
    trained weights are not that symmetric. Clipping only the tail keeps the activations'
    scale (a shift of every weight compounds through ResNet-50 to infinities)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                m.weight.clamp_(min=-m.weight.abs().max().item() / 2)
    return model


def weight_zero_points(path: Path) -> int:
    """How many weight DequantizeLinear nodes of a QDQ file have a non-zero zero point."""
    graph = onnx.load(str(path)).graph
    initializers = {i.name: i for i in graph.initializer}
    return sum(1 for n in graph.node if n.op_type == "DequantizeLinear" and len(n.input) > 2
               and n.input[0] in initializers and n.input[2] in initializers
               and numpy_helper.to_array(initializers[n.input[2]]).any()
               and initializers[n.input[0]].data_type == onnx.TensorProto.INT8)


def measure(spec: str, tmp: Path, cores: int, flags: dict) -> dict:
    name, size, batch = spec.split(":")
    size, batch = int(size), int(batch)
    torch.manual_seed(0)
    model = skewed(getattr(torchvision.models, name)(weights=None).eval())
    fp32 = tmp / f"{name}.onnx"
    # quantpipe's own export and simplify stages: without onnxsim the exporter's Identity
    # nodes feed the convolutions' biases, which quantize_static then leaves in float.
    exported = onnxutil.export_onnx(model, (3, size, size), ExportParams().opset)
    onnx.save(onnxutil.simplify(exported, name), fp32)
    files = {"fp32": fp32}
    for scheme, options in SCHEMES.items():
        files[scheme] = tmp / f"{name}_{scheme}.onnx"
        quantize_static(str(fp32), str(files[scheme]), Random((4, 3, size, size)),
                        quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                        **options)
    # The scheme is what its row claims: zero points where asked for, none where not.
    assert bool(weight_zero_points(files["s8_zero_points"])) and not weight_zero_points(files["s8_symmetric"])
    ort = OnnxRuntime(GraphOptimizationLevel.ORT_ENABLE_ALL)
    ov, ov_bf16 = OpenVino(), OpenVino(precision="bf16")
    runs = {("onnxruntime", "fp32"): (ort, files["fp32"]),
            **{("onnxruntime", s): (ort, files[s]) for s in SCHEMES},
            ("openvino", "fp32"): (ov, files["fp32"]),
            ("openvino", "s8_symmetric"): (ov, files["s8_symmetric"])}
    if machine.bf16_missing({"cpu_flags": flags}) is None:
        runs[("openvino", "bf16")] = (ov_bf16, files["fp32"])
    x = np.random.default_rng(1).standard_normal((batch, 3, size, size), dtype=np.float32)
    params = BenchParams(**{**TIMING.__dict__, "batch_sizes": (batch,)})
    threads = bench.resolve_threads(params.threads, cores)
    grid = bench.latency_grid(lambda count: {key: rt.runner(path, count)
                                             for key, (rt, path) in runs.items()},
                              x, threads, params, desc=f"{name} {size}px bs{batch}")
    fp32_ort = ("onnxruntime", "fp32")
    rows = []
    for (runtime, scheme), (rt, path) in runs.items():
        row = {"runtime": runtime, "file": scheme,
               "kernels": kernel_table(rt.kernels(path, x, threads[0], flags))}
        for count in threads:
            lat = grid[f"threads{count}"][f"bs{batch}"]
            row[f"threads{count}"] = {"p50_ms": lat[(runtime, scheme)].p50_ms,
                                      "speedup": round(lat[fp32_ort].p50_ms / lat[(runtime, scheme)].p50_ms, 4)}
        rows.append(row)
    return {"model": name, "image_size": size, "batch_size": batch, "threads": list(threads),
            "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help="name:image size:batch,... (torchvision classifiers)")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "metrics/ort_amx.json")
    args = parser.parse_args()
    here = machine.probe()
    with tempfile.TemporaryDirectory() as tmp:
        record = {"machine": here,
                  "models": [measure(spec, Path(tmp), here["cores"], here["cpu_flags"])
                             for spec in args.models.split(",")]}
    write_json(args.out, record)
    print(ort_amx_table(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
