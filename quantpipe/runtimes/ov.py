"""OpenVINO's CPU plugin on the same ONNX files (its ONNX frontend reads QDQ INT8 models and
runs them on its own INT8 kernels)."""

from __future__ import annotations

import openvino as ov

from quantpipe.runtimes.base import Runner, RuntimeUnavailable

# OpenVINO runs an FP32 model in bf16 on CPUs that have bf16 (this EPYC's AVX-512 BF16 does) unless
# told otherwise: faster, but a different, lossier model than the FP32 baseline it is compared to.
PRECISION = {"INFERENCE_PRECISION_HINT": "f32"}


class OpenVino:
    name = "openvino"
    title = "OpenVINO"

    def __init__(self, level=None) -> None:
        # level (ONNX Runtime's graph optimization level) does not apply: OpenVINO compiles
        # the graph its own way.
        self.core = ov.Core()

    def version(self) -> str:
        return ov.get_version()

    def settings(self, path, cores: int) -> dict:
        # What the THROUGHPUT hint picks by itself: the bench times every stream count anyway.
        hinted = self._compile(path, {"PERFORMANCE_HINT": "THROUGHPUT",
                                      "INFERENCE_NUM_THREADS": cores, **PRECISION})
        return {"device": "CPU", "latency": self._latency_config("<threads>"),
                "throughput": self._throughput_config("<streams>", "<streams x threads>"),
                "throughput_hint_streams": int(hinted.get_property("NUM_STREAMS"))}

    @staticmethod
    def _latency_config(threads) -> dict:
        return {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, **PRECISION}

    @staticmethod
    def _throughput_config(streams, threads) -> dict:
        # INFERENCE_NUM_THREADS is the total over all streams in OpenVINO.
        return {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": streams,
                "INFERENCE_NUM_THREADS": threads, **PRECISION}

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
