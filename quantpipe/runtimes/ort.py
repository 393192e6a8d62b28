"""ONNX Runtime, the reference engine: CPU sessions at runtime.graph_optimization_level."""

from __future__ import annotations

import onnxruntime as ort

from quantpipe import onnxutil
from quantpipe.runtimes.base import Runner


class OnnxRuntime:
    name = "onnxruntime"
    title = "ONNX Runtime"

    def __init__(self, level: ort.GraphOptimizationLevel) -> None:
        self.level = level

    def version(self) -> str:
        return ort.__version__

    def settings(self, path, cores: int) -> dict:
        return {"graph_optimization_level": self.level.name, "inter_op_num_threads": 1,
                "session.force_spinning_stop": 1}

    def runner(self, path, threads: int) -> Runner:
        # Spinning stopped: sessions of several models take turns in the benchmark's rounds,
        # and one's spinning workers would steal the cores the next one runs on.
        return onnxutil.session_runner(
            onnxutil.make_session(path, level=self.level, threads=threads, stop_spinning=True))

    def pool(self, path, streams: int, threads: int) -> list[Runner]:
        # ORT releases the GIL inside run(): one session per stream, each in its own thread.
        return [self.runner(path, threads) for _ in range(streams)]
