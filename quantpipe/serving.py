"""A benchmarked configuration written out as the code that serves it: the exact session or
compile options the bench ran with (each runtime's `settings` in metrics/bench/<variant>.json),
for summary.json and report.md. Pure functions over the recorded JSON: the report stage imports
no runtime."""

from __future__ import annotations


def options(runtime: str, settings: dict, streams: int, threads: int) -> dict:
    """The options of `streams` sessions (ONNX Runtime) or streams of one compiled model
    (OpenVINO) of `threads` threads each, as the bench built them."""
    if runtime == "onnxruntime":
        return {"sessions": streams, "intra_op_num_threads": threads, **settings}
    if runtime == "openvino":
        mode = "throughput" if streams > 1 else "latency"
        filled = {"<threads>": threads, "<streams>": streams, "<streams x threads>": streams * threads}
        config = {k: filled.get(v, v) for k, v in settings[mode].items()}
        return {"device": settings.get("device", "CPU"), "infer_requests": streams, "config": config}
    raise ValueError(f"no serving snippet for runtime {runtime!r}")


def snippet(runtime: str, settings: dict, model: str, streams: int, threads: int) -> str:
    """Python that builds what the bench timed: one session (or infer request) per stream, each
    driven by its own request thread (both runtimes release the GIL while they run)."""
    o = options(runtime, settings, streams, threads)
    if runtime == "onnxruntime":
        lines = ["import onnxruntime as ort", "",
                 "options = ort.SessionOptions()",
                 f"options.intra_op_num_threads = {threads}",
                 f"options.inter_op_num_threads = {o.get('inter_op_num_threads', 1)}",
                 f"options.graph_optimization_level = ort.GraphOptimizationLevel."
                 f"{o.get('graph_optimization_level', 'ORT_ENABLE_ALL')}"]
        lines += [f'options.add_session_config_entry("{k}", "{v}")'
                  for k, v in o.items() if k.startswith("session.")]
        lines += [f'sessions = [ort.InferenceSession("{model}", options, '
                  f'providers=["CPUExecutionProvider"]) for _ in range({streams})]',
                  "# one request thread per session: sessions[i].run(None, {input_name: batch})"]
        return "\n".join(lines)
    config = repr(dict(sorted(o["config"].items())))
    return "\n".join(["import openvino as ov", "",
                      f'compiled = ov.Core().compile_model("{model}", "{o["device"]}", {config})',
                      f"requests = [compiled.create_infer_request() for _ in range({streams})]",
                      "# one request thread per infer request: requests[i].infer({0: batch})"])
