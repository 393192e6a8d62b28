"""ONNX Runtime, the reference runtime: CPU sessions at runtime.graph_optimization_level."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import onnx
import onnxruntime as ort
from onnx import numpy_helper

from quantpipe import onnxutil
from quantpipe.runtimes.base import Runner

# ONNX Runtime's CPU provider has no BF16 arithmetic on x86: no BF16 Conv or MatMul kernel (a
# model in BF16 types does not load), and its one BF16 GEMM option
# (mlas.enable_gemm_fastmath_arm64_bfloat16) exists only in ARM64 builds. docs/precision.md.
NO_BF16 = ("ONNX Runtime's CPU provider has no BF16 arithmetic on x86 (no BF16 Conv or MatMul "
           "kernel; its BF16 GEMM option exists only in ARM64 builds)")


class OnnxRuntime:
    name = "onnxruntime"
    title = "ONNX Runtime"
    precisions = ("fp32",)
    lacks = {"bf16": NO_BF16}

    def __init__(self, level: ort.GraphOptimizationLevel) -> None:
        self.level = level

    def version(self) -> str:
        return ort.__version__

    def settings(self, path, cores: int) -> dict:
        return {"graph_optimization_level": self.level.name, "inter_op_num_threads": 1,
                "session.force_spinning_stop": 1,
                **{k: int(v) for k, v in onnxutil.exact_int8_config_of(path, self.level).items()}}

    def kernels(self, path, batch, threads: int, cpu_flags: dict) -> list[dict]:
        """The MLAS routine (and instruction set) behind each compute node of the graph ONNX
        Runtime runs for model `path` (base.Runtime.kernels). Its profile names op kernels
        (QLinearConv, QGemm) but not the routine MLAS dispatches to on this CPU; that follows
        from the node (weight type and zero points) and the CPU flags (mlas_routine). The graph
        is the one ORT runs on a CPU with those flags: on x86 without VNNI, the exact U8U8 one
        (onnxutil.exact_int8_config)."""
        on = [flag for flag, has in cpu_flags.items() if has]
        exact = {onnxutil.EXACT_INT8_KEY: onnxutil.exact_int8_config(on).get(onnxutil.EXACT_INT8_KEY, "0")}
        with tempfile.TemporaryDirectory() as tmp:
            optimized = Path(tmp) / "optimized.onnx"
            onnxutil.make_session(path, level=self.level, threads=threads,
                                  optimized_path=optimized, config=exact)
            model = onnx.load(str(optimized))
        initializers = {i.name: i for i in model.graph.initializer}
        found: Counter = Counter()
        for node in model.graph.node:
            routine = mlas_routine(node, initializers, cpu_flags)
            if routine:
                found[(node.op_type, *routine)] += 1
        return [{"layer": op, "kernel": kernel, "precision": precision, "isa": isa, "count": count}
                for (op, kernel, precision, isa), count in sorted(found.items())]

    def runner(self, path, threads: int) -> Runner:
        # Spinning stopped: sessions of several models take turns in the benchmark's rounds,
        # and one's spinning workers would steal the cores the next one runs on.
        return onnxutil.session_runner(
            onnxutil.make_session(path, level=self.level, threads=threads, stop_spinning=True))

    def pool(self, path, streams: int, threads: int) -> list[Runner]:
        # ORT releases the GIL inside run(): one session per stream, each in its own thread.
        return [self.runner(path, threads) for _ in range(streams)]


# Float op types (after ONNX Runtime's graph optimizations) that multiply.
FLOAT_OPS = ("Conv", "FusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm", "ConvTranspose")


def int8_gemm_isa(flags: dict) -> str:
    """MLAS's u8s8 GEMM on this CPU (platform.cpp): AMX tiles where AMX-INT8 is (small products
    still go to its AVX-512 VNNI kernel), else the widest VNNI, else AVX2's multiply-adds."""
    if flags.get("amx_int8"):
        return "AMX-INT8"
    return _vnni(flags)


def u8u8_gemm_isa(flags: dict) -> str:
    """MLAS's u8u8 GEMM (U8 weights) on this CPU: AVX-512BW or AVX2 multiply-adds on 16-bit
    products, exact, with no VNNI or AMX kernel (platform.cpp since ONNX Runtime 1.25; only
    AVX-VNNI-INT8, which quantpipe does not detect, has one)."""
    return "AVX-512BW" if flags.get("avx512bw") else "AVX2"


def _vnni(flags: dict) -> str:
    if flags.get("avx512_vnni"):
        return "AVX-512 VNNI"
    if flags.get("avx_vnni"):
        return "AVX-VNNI"
    return u8u8_gemm_isa(flags)  # no VNNI: the same plain multiply-adds


# The weight input of each integer op (ONNX and ORT contrib signatures).
WEIGHT_INPUT = {"QLinearConv": 3, "QGemm": 3, "QLinearMatMul": 3, "MatMulInteger": 1,
                "DynamicQuantizeMatMul": 1, "MatMulIntegerToFloat": 1, "ConvInteger": 1,
                "DynamicQuantizeLSTM": 1}


def mlas_routine(node: onnx.NodeProto, initializers: dict, flags: dict) -> tuple[str, str, str] | None:
    """(routine, precision, ISA) for a compute node, None for the rest. QLinearConv with signed
    weights whose zero points are all 0 (quantpipe's S8 symmetric scheme) runs MLAS's symmetric
    convolution, which has VNNI kernels but no AMX one; any other QLinearConv runs im2col and
    an integer GEMM (qlinearconv.cc: TryConvSymPrepack). The GEMM is u8s8, or u8u8 where the
    weights are unsigned (the exact rewrite of session.x64quantprecision on x86 without VNNI)."""
    if node.op_type in WEIGHT_INPUT:
        index = WEIGHT_INPUT[node.op_type]
        weight = initializers.get(node.input[index]) if len(node.input) > index else None
        unsigned = weight is not None and weight.data_type == onnx.TensorProto.UINT8
        gemm, isa = ("u8u8", u8u8_gemm_isa(flags)) if unsigned else ("u8s8", int8_gemm_isa(flags))
        if node.op_type != "QLinearConv":
            return f"MLAS {gemm} GEMM", gemm, isa
        zero_point = initializers.get(node.input[5]) if len(node.input) > 5 else None
        symmetric = (weight is not None and weight.data_type == onnx.TensorProto.INT8
                     and zero_point is not None and not numpy_helper.to_array(zero_point).any())
        if symmetric:
            return "MLAS symmetric conv", "u8s8", _vnni(flags)
        return f"MLAS im2col + {gemm} GEMM", gemm, isa
    if node.op_type in FLOAT_OPS:
        # NCHWc convolutions and SGEMM: FMA kernels on the widest vectors.
        nchwc = node.domain.endswith("nchwc")
        return ("MLAS NCHWc conv" if nchwc else "MLAS SGEMM", "f32",
                "AVX-512" if flags.get("avx512f") else "AVX2")
    return None
