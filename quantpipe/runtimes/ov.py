"""OpenVINO's CPU plugin on the same ONNX files (its ONNX frontend reads QDQ INT8 models and
runs them on its own INT8 kernels), in FP32 or, from the same FP32 file, in BF16."""

from __future__ import annotations

from collections import Counter

from quantpipe.errors import UserError
from quantpipe.runtimes.base import Runner, RuntimeUnavailable

try:
    import openvino as ov
except ImportError:  # optional: a machine that benches with ONNX Runtime alone need not have it
    ov = None

# quantpipe's precision -> OpenVINO's inference precision. OpenVINO runs an FP32 model in BF16
# on CPUs with native BF16 (AMX-BF16, AVX-512 BF16) unless told otherwise: faster, but a
# different, lossier model than the FP32 baseline, so fp32 pins f32 and bf16 is its own row.
INFERENCE_PRECISION = {"fp32": "f32", "bf16": "bf16"}
# Layers whose executed kernel decides the speed: OpenVINO's executed graph names the kernel of
# each (primitiveType, e.g. brgconv_avx512_amx_I8, brgemm_avx512_amx, jit_avx512_core_vnni).
COMPUTE_LAYERS = ("Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul",
                  "Gemm", "RNNSeq", "ScaledDotProductAttention")


class OpenVino:
    name = "openvino"
    title = "OpenVINO"
    precisions = tuple(INFERENCE_PRECISION)

    def __init__(self, level=None, precision: str = "fp32") -> None:
        # level (ONNX Runtime's graph optimization level) does not apply: OpenVINO compiles
        # the graph its own way.
        if ov is None:
            raise UserError("bench.runtimes names openvino, which is not installed here: "
                            "pip install openvino, or leave it out of bench.runtimes")
        self.core = ov.Core()
        self.precision = precision
        self.hint = {"INFERENCE_PRECISION_HINT": INFERENCE_PRECISION[precision]}

    def version(self) -> str:
        return ov.get_version()

    def settings(self, path, cores: int) -> dict:
        # What the THROUGHPUT hint picks by itself: the bench times every stream count anyway.
        hinted = self._compile(path, {"PERFORMANCE_HINT": "THROUGHPUT",
                                      "INFERENCE_NUM_THREADS": cores, **self.hint})
        return {"device": "CPU", "latency": self._latency_config("<threads>"),
                "throughput": self._throughput_config("<streams>", "<streams x threads>"),
                "throughput_hint_streams": int(hinted.get_property("NUM_STREAMS")),
                # What the plugin runs: on a CPU without native BF16 it keeps f32 whatever the hint.
                "inference_precision": hinted.get_property("INFERENCE_PRECISION_HINT").get_type_name()}

    def kernels(self, path, batch, threads: int, cpu_flags: dict) -> list[dict]:
        """The kernels OpenVINO executes for model `path`'s compute layers on `batch` in the
        latency configuration (base.Runtime.kernels). Read after a run: a layer with a dynamic
        batch picks its kernel at the first run's shape."""
        request = self._compile(path, self._latency_config(threads)).create_infer_request()
        request.infer({0: batch})
        found: Counter = Counter()
        for op in request.get_compiled_model().get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            layer = info["layerType"].astype(str)
            if layer in COMPUTE_LAYERS:
                found[(layer, info["primitiveType"].astype(str),
                       info["runtimePrecision"].astype(str))] += 1
        return [{"layer": layer, "kernel": kernel, "precision": precision,
                 "isa": isa(kernel, precision), "count": count}
                for (layer, kernel, precision), count in sorted(found.items())]

    def _latency_config(self, threads) -> dict:
        return {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, **self.hint}

    def _throughput_config(self, streams, threads) -> dict:
        # INFERENCE_NUM_THREADS is the total over all streams in OpenVINO.
        return {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": streams,
                "INFERENCE_NUM_THREADS": threads, **self.hint}

    def runner(self, path, threads: int) -> Runner:
        return _request_runner(self._compile(path, self._latency_config(threads)), path)

    def pool(self, path, streams: int, threads: int) -> list[Runner]:
        # One compiled model with `streams` streams; one infer request per stream, each driven
        # from its own thread (InferRequest.infer releases the GIL).
        compiled = self._compile(path, self._throughput_config(streams, streams * threads))
        return [_request_runner(compiled, path) for _ in range(streams)]

    def _compile(self, path, config: dict) -> ov.CompiledModel:
        try:
            return self.core.compile_model(self.core.read_model(str(path)), "CPU", config)
        except RuntimeError as e:
            raise RuntimeUnavailable(f"{path}: OpenVINO cannot read or compile it "
                                     f"({reason(str(e))})") from None


def _request_runner(compiled: ov.CompiledModel, path) -> Runner:
    request = compiled.create_infer_request()

    def run(batch):
        try:
            # share_inputs: read the batch in place, as ONNX Runtime does, not a copy each run.
            return request.infer({0: batch}, share_inputs=True)[0]
        except RuntimeError as e:
            raise RuntimeUnavailable(f"{path}: OpenVINO failed to run it ({reason(str(e))})") from None
    return run


def isa(kernel: str, precision: str) -> str:
    """The instruction set an OpenVINO (oneDNN) kernel name says it uses:
    brgconv_avx512_amx_I8 -> AMX-INT8, brgemm_avx512_amx_bf16 -> AMX-BF16, ..._vnni -> VNNI."""
    name = kernel.lower()
    if "amx" in name:
        return "AMX-BF16" if precision == "bf16" else "AMX-INT8" if precision in ("u8", "i8") else "AMX"
    if "vnni" in name:
        return "AVX-512 VNNI" if "avx512" in name else "AVX-VNNI"
    for tag, title in (("avx512", "AVX-512"), ("avx2", "AVX2"), ("sse41", "SSE4.1")):
        if tag in name:
            return f"{title} BF16" if precision == "bf16" else title
    if "mlas" in name:  # OpenVINO's FullyConnected may call ONNX Runtime's MLAS SGEMM
        return "MLAS"
    return "oneDNN reference (no SIMD)" if name.startswith("ref") else kernel


def reason(message: str) -> str:
    """The part of an OpenVINO exception that says what is wrong: its messages start with
    source locations and 'Check ... failed' lines; a conversion failure ends with a summary of
    the ops it could not convert."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if "Summary:" in lines:
        ops = [line.removeprefix("-- ") for line in lines[lines.index("Summary:") + 1:]
               if line.startswith("-- ")]
        if ops:
            return "; ".join(ops)[:300]
    useful = [line for line in lines if not line.startswith(("Exception from", "Check "))]
    return (useful or lines or ["no message"])[-1][:300]
