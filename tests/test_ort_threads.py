"""scripts/ort_threads.py: its NHWC-flatten rewrite is the same function, and ONNX Runtime's
optimizer cancels the Transpose it adds with its own (the point of the rewrite); its first-layer
file leaves only that layer in float; its batch split is the same function, a logic stream per
slice."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from quantpipe import onnxutil
from quantpipe.docs import batch_split_table
from quantpipe.schemas.bench import BenchParams

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ort_threads", ROOT / "scripts/ort_threads.py")
ort_threads = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ort_threads)


def _optimized_ops(path: Path, tmp: Path) -> list[str]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp / f"opt_{path.name}")
    so.log_severity_level = 3
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]


def test_flatten_nhwc_keeps_the_outputs_and_drops_the_transpose_before_the_classifier(tiny_run, tmp_path):
    repo, _ = tiny_run
    fp32 = onnx.shape_inference.infer_shapes(onnx.load(str(repo / "models/fp32.onnx")))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in fp32.graph.value_info}
    rewritten = ort_threads.flatten_nhwc(onnx.load(str(repo / "models/static.onnx")), shapes)
    assert rewritten is not None
    path = tmp_path / "static_nhwc_flatten.onnx"
    onnx.save(rewritten, str(path))
    x = np.random.default_rng(0).normal(size=(5, 1, 28, 28)).astype(np.float32)
    outputs = []
    for p in (repo / "models/static.onnx", path):
        s = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        outputs.append(s.run(None, {s.get_inputs()[0].name: x})[0])
    np.testing.assert_array_equal(outputs[0], outputs[1])
    before = _optimized_ops(repo / "models/static.onnx", tmp_path)
    after = _optimized_ops(path, tmp_path)
    # ORT's NHWC INT8 convolutions: a Transpose in (the input) and one back before the Reshape;
    # with the rewrite only the first is left.
    assert before.count("Transpose") == 2 and after.count("Transpose") == 1
    assert after.index("Reshape") > after.index("NhwcMaxPool")


def test_first_layer_float_leaves_only_the_first_convolution_in_float(tiny_run, tmp_path):
    repo, _ = tiny_run
    info = ort_threads.data.load_info(repo / "data/prepared")
    split = ort_threads.data.load_split(repo / "data/prepared", "train")
    files = ort_threads.int8_files(repo / "models/fp32.onnx", repo / "models/static.onnx",
                                   split.x[:64], info, tmp_path)
    model = onnx.load(str(files["first_layer_float"]))
    producers = ort_threads.graph.producers(model)
    layers = [n for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    weights_from = [producers[n.input[1]].op_type if n.input[1] in producers else "initializer"
                    for n in layers]
    assert layers[0].op_type == "Conv" and weights_from[0] == "initializer"
    assert len(layers) >= 2 and set(weights_from[1:]) == {"DequantizeLinear"}
    # The same calibration otherwise: on the test split it classifies as static.onnx does.
    x = ort_threads.data.Normalized(ort_threads.data.load_split(repo / "data/prepared", "test").x, info)
    batch = ort_threads.bench.batch_of(x, 64)
    labels = []
    for p in (repo / "models/static.onnx", files["first_layer_float"]):
        s = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        labels.append(s.run(None, {s.get_inputs()[0].name: batch})[0].argmax(1))
    assert (labels[0] == labels[1]).mean() >= 0.95


def test_batch_split_is_the_same_function_with_a_logic_stream_per_slice(tiny_run, tmp_path):
    repo, _ = tiny_run
    static = repo / "models/static.onnx"
    x = np.random.default_rng(1).normal(size=(8, 1, 28, 28)).astype(np.float32)
    path, streams = tmp_path / "split.onnx", tmp_path / "streams.json"
    onnx.save(ort_threads.split_batch(onnx.load(str(static)), 4, 8), str(path))
    s = ort.InferenceSession(str(static), providers=["CPUExecutionProvider"])
    want = s.run(None, {s.get_inputs()[0].name: x})[0]
    ort_threads.parallel_session(path, 4, 1, streams)  # ORT writes its default partition
    default = json.loads(streams.read_text())
    split = ort_threads.slice_streams(default, 4)
    # Every node in exactly one stream; a stream holds the nodes of one slice (and unnamed ones).
    assert sorted(n for s in split["streams"] for n in s) == sorted(default["streams"][0])
    for i, stream in enumerate(split["streams"]):
        assert {int(m) for n in stream for m in re.findall(r"__b(\d+)", n)} == {i}
    assert len(split["devices"]) == 4
    streams.write_text(json.dumps(split))
    got = onnxutil.session_runner(ort_threads.parallel_session(path, 4, 1, streams))(x)
    # Exact where INT8 is; on x86 without VNNI ORT's exact U8U8 kernels may round a step apart.
    if onnxutil.EXACT_INT8:
        np.testing.assert_array_equal(got.argmax(1), want.argmax(1))
    else:
        np.testing.assert_allclose(got, want, atol=1e-6)
    # The measurement and its table, at a few runs.
    p = BenchParams(batch_sizes=(8,), threads=(2,), warmup=1, runs=4, rounds=2, seconds=None)
    record = ort_threads.batch_split(repo / "models/fp32.onnx", static, x, 2, p, tmp_path)
    assert record["parts"] == 2 and record["node_threads"] >= 1
    assert set(record["latency"]) == {"fp32", "static", "static_batch_split"}
    assert "| static_batch_split |" in "\n".join(batch_split_table(record, 2, 8))
