#!/usr/bin/env python3
"""Why ONNX Runtime's INT8 gains less with every thread than its FP32, and what of it quantpipe
controls: the numbers behind docs/runtimes.md ("Many cores").

On the pipeline's own files (models/fp32.onnx, models/static.onnx, data/prepared's test split),
at every thread count 1, 2, 4, ... and all cores, each INT8 file against FP32 in the same
interleaved rounds (quantpipe.bench), under three sets of session options:

- INT8 files: quantpipe's static.onnx (QDQ; S8 symmetric per-channel weights: MLAS's symmetric
  convolution); the same file flattening in NHWC before its classifier (ONNX Runtime runs INT8
  convolutions in NHWC and transposes back to NCHW before a Flatten; with a Transpose of our
  own and the classifier's weight rows permuted, its transpose optimizer cancels the pair); the
  same calibration written as QOperator; S8 weights with zero points (per tensor: im2col and
  MLAS's u8s8 GEMM, AMX where the CPU has it); the first layer left in float (ORT's INT8
  convolution splits each image into blocks of at least 64K multiply-adds and runs the images
  of a batch one after another: a first convolution on one channel has few blocks per image).
- Session options: quantpipe bench's (workers stop spinning after each run), ONNX Runtime's
  defaults (they spin), and a dynamic block base of 4 (ORT's finer split of parallel loops).
- At all cores, batch 64: ONNX Runtime's profile of each file, time per op type; and each
  node's kernel time at 1 thread and at all cores (bench's options): which layers scale.
- Where OpenVINO is installed: the static file and its NHWC-flatten rewrite on OpenVINO too (one
  file serves both runtimes: a rewrite that helps one must not cost the other).
- Whether one session can run the images of a batch on several cores at once (what its INT8
  convolution does not do): static.onnx with the batch cut into slices, a copy of the graph per
  slice, each slice a logic stream of ONNX Runtime's parallel executor (inter-op threads), timed
  against static and FP32 at all cores; ORT's profile says how many threads ran the nodes.

Standalone beside the pipeline (onnx, onnxruntime, numpy and quantpipe): run it where you
deploy, or on a bigger machine with scripts/remote_bench.py (its target runs this too).

    python scripts/ort_threads.py                 # -> metrics/ort_threads.json + table
    python scripts/ort_threads.py -o /tmp/t.json --runs 60
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

from quantpipe import bench, data, onnxutil, profiling
from quantpipe import machine as machines
from quantpipe.engines import graph
from quantpipe.engines.ort_static import CalibrationReader, first_and_last
from quantpipe.io import write_json
from quantpipe.schemas.bench import BenchParams

ROOT = Path(__file__).resolve().parents[1]

# Session config entries per option set (ONNX Runtime's names).
OPTIONS = {"bench": {"session.force_spinning_stop": "1"},
           "spinning": {},
           "block_base_4": {"session.force_spinning_stop": "1", "session.dynamic_block_base": "4"}}
PROFILE_RUNS = 20
PER_MEASUREMENT = 3.0  # seconds each latency measurement may take
SCALING_NODES = 12  # the nodes each profile keeps (by time): the per-node scaling reads them


def session(path: Path, threads: int, config: dict, profile_prefix: str | None = None):
    """A session as the pipeline builds them (ORT_ENABLE_ALL), with `config`'s entries."""
    return onnxutil.make_session(path, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                 threads=threads, profile_prefix=profile_prefix, config=config)


def flatten_nhwc(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto | None:
    """The same function with each Reshape of a 4-D (N, C, H, W) tensor to (N, C*H*W) that
    feeds a Gemm flattening in H, W, C order: a Transpose(0, 2, 3, 1) before it and the
    Gemm's weight columns (quantized, transB) permuted to match. None when no such Reshape."""
    producers, readers = graph.producers(model), graph.consumers(model)
    inits = {i.name: i for i in model.graph.initializer}
    changed = False
    for node in list(model.graph.node):
        if node.op_type not in ("Reshape", "Flatten"):
            continue
        source = node.input[0]
        origin = producers.get(source)
        while origin is not None and origin.op_type in ("DequantizeLinear", "QuantizeLinear"):
            origin = producers.get(origin.input[0])
        shape = shapes.get(origin.output[0]) if origin is not None else None
        if not shape or len(shape) != 4 or shape[2] * shape[3] == 1:
            continue
        gemm = _next_gemm(node, readers)
        if gemm is None or gemm.input[1] not in producers:
            continue
        weight = producers[gemm.input[1]]  # the weight's DequantizeLinear
        if weight.op_type != "DequantizeLinear" or weight.input[0] not in inits:
            continue
        transposed = next((a.i for a in gemm.attribute if a.name == "transB"), 0)
        w = numpy_helper.to_array(inits[weight.input[0]])
        _, c, h, wd = shape
        order = np.arange(c * h * wd).reshape(c, h, wd).transpose(1, 2, 0).reshape(-1)
        w = w[:, order] if transposed else w[order, :]
        inits[weight.input[0]].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w), weight.input[0]))
        t = helper.make_node("Transpose", [source], [source + "_nhwc"], perm=[0, 2, 3, 1],
                             name=node.name + "_nhwc")
        node.input[0] = source + "_nhwc"
        nodes = list(model.graph.node)
        nodes.insert(nodes.index(node), t)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        changed = True
    return model if changed else None


def _next_gemm(node: onnx.NodeProto, readers: dict) -> onnx.NodeProto | None:
    """The Gemm that reads node's output, through Quantize/DequantizeLinear pairs."""
    out = node.output[0]
    for _ in range(3):
        users = readers.get(out, [])
        if len(users) != 1:
            return None
        if users[0].op_type == "Gemm":
            return users[0]
        out = users[0].output[0]
    return None


def split_batch(model: onnx.ModelProto, parts: int, batch: int) -> onnx.ModelProto:
    """The same function on a batch of `batch` images cut into `parts` equal slices: a copy of
    the graph per slice (its nodes, tensors and weights named <name>__b<i>: ONNX Runtime's exact
    INT8 rewrite on CPUs without VNNI fails on shared weights), a Split before the copies and a
    Concat of each output after them. For graphs without subgraphs."""
    g = model.graph
    source = g.input[0].name
    slices = [f"{source}__b{i}" for i in range(parts)]
    sizes = numpy_helper.from_array(np.full(parts, batch // parts, np.int64), "batch_split_sizes")
    nodes = [helper.make_node("Split", [source, sizes.name], slices, axis=0, name="batch_split")]
    for i in range(parts):
        def renamed(tensor: str, i: int = i) -> str:
            return tensor if not tensor else slices[i] if tensor == source else f"{tensor}__b{i}"
        for k, node in enumerate(g.node):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = f"{node.name or node.op_type + str(k)}__b{i}"
            copy.input[:] = [renamed(t) for t in node.input]
            copy.output[:] = [renamed(t) for t in node.output]
            nodes.append(copy)
    nodes += [helper.make_node("Concat", [f"{o.name}__b{i}" for i in range(parts)], [o.name],
                               axis=0, name=f"batch_concat_{o.name}") for o in g.output]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:], out.graph.value_info[:]
    out.graph.node.extend(nodes)
    del out.graph.initializer[:]
    for i in range(parts):
        for init in g.initializer:
            copy = onnx.TensorProto()
            copy.CopyFrom(init)
            copy.name = f"{init.name}__b{i}"
            out.graph.initializer.append(copy)
    out.graph.initializer.append(sizes)
    return out


def parallel_session(path: Path, parts: int, intra: int, streams: Path,
                     profile_prefix: str | None = None) -> ort.InferenceSession:
    """ORT's parallel executor: `parts` inter-op threads, `intra` intra-op threads, the node
    partition (logic streams) read from `streams`; ORT writes its default there when missing."""
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    options.inter_op_num_threads, options.intra_op_num_threads = parts, intra
    options.log_severity_level = 3
    for key, value in {**onnxutil.EXACT_INT8, **OPTIONS["bench"],
                       "session.node_partition_config_file": str(streams)}.items():
        options.add_session_config_entry(key, value)
    if profile_prefix is not None:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def slice_streams(default: dict, parts: int) -> dict:
    """ORT's default node partition (one logic stream, the nodes after its optimizations in
    execution order) as one stream per slice: each node goes to the stream of the last node
    named after a slice before it (the layout Transposes ORT adds are named after none)."""
    (order,) = default["streams"]
    streams: list[list[str]] = [[] for _ in range(parts)]
    current = 0
    for node in order:
        found = re.search(r"__b(\d+)", node)
        current = int(found.group(1)) if found else current
        streams[current].append(node)
    return {**default, "devices": default["devices"] * parts, "streams": streams}


def batch_split(fp32: Path, static: Path, x: np.ndarray, cores: int, p: BenchParams,
                workdir: Path) -> dict | None:
    """static.onnx with the batch cut into one slice per core (as many as divide both), each
    slice a logic stream of ORT's parallel executor, against static and FP32 at all cores in
    the same rounds; node_threads: how many threads ran its nodes (ORT's profile). None when
    there is one core, or the batch and the cores share no divisor."""
    parts = math.gcd(len(x), cores)
    if parts < 2:
        return None
    path, streams = workdir / "static_batch_split.onnx", workdir / "streams.json"
    onnx.save(split_batch(onnx.load(str(static)), parts, len(x)), str(path))
    streams.unlink(missing_ok=True)
    parallel_session(path, parts, cores // parts, streams)  # writes ORT's default partition
    streams.write_text(json.dumps(slice_streams(json.loads(streams.read_text()), parts)))
    runners = {"fp32": onnxutil.session_runner(session(fp32, cores, OPTIONS["bench"])),
               "static": onnxutil.session_runner(session(static, cores, OPTIONS["bench"])),
               "static_batch_split": onnxutil.session_runner(
                   parallel_session(path, parts, cores // parts, streams))}
    # The same function, or the timing below compares different work (up to INT8 rounding: on
    # x86 without VNNI ORT's exact U8U8 kernels may round an output a step apart).
    same = (runners["static_batch_split"](x).argmax(1) == runners["static"](x).argmax(1)).mean()
    assert same >= 0.98, f"the batch split changed {1 - same:.1%} of static's top-1 answers"
    latency = bench.measure(runners, x, warmup=p.warmup, runs=p.runs, rounds=p.rounds,
                            budget=PER_MEASUREMENT)
    profiled = parallel_session(path, parts, cores // parts, streams, str(workdir / "split"))
    for _ in range(3):
        onnxutil.session_runner(profiled)(x)
    events = json.loads(Path(profiled.end_profiling()).read_text())
    return {"parts": parts, "inter_op_threads": parts, "intra_op_threads": cores // parts,
            "logic_streams": parts,
            "node_threads": len({e["tid"] for e in events if e.get("cat") == "Node"}),
            "latency": {m: bench.as_dict(lat) for m, lat in latency.items()}}


def int8_files(fp32: Path, static: Path, calib: np.ndarray, info, workdir: Path) -> dict[str, Path]:
    """The INT8 files compared: quantpipe's, and the four others (module docstring)."""
    files = {"static": static}
    fp32_model = onnx.shape_inference.infer_shapes(onnx.load(str(fp32)))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in fp32_model.graph.value_info}
    rewritten = flatten_nhwc(onnx.load(str(static)), shapes)
    if rewritten is not None:
        files["static_nhwc_flatten"] = workdir / "static_nhwc_flatten.onnx"
        onnx.save(rewritten, str(files["static_nhwc_flatten"]))
    name = fp32_model.graph.input[0].name
    pre = workdir / "preprocessed.onnx"
    graph.preprocess(fp32, pre)  # as quantpipe's engine does before quantize_static
    first_layer = first_and_last(onnx.load(str(pre)), ())[:1]
    for label, kwargs in (("qoperator", {"quant_format": QuantFormat.QOperator, "per_channel": True}),
                          ("zero_points", {"quant_format": QuantFormat.QDQ, "per_channel": False,
                                           "extra_options": {"WeightSymmetric": False}}),
                          ("first_layer_float", {"quant_format": QuantFormat.QDQ, "per_channel": True,
                                                 "nodes_to_exclude": first_layer})):
        out = workdir / f"{label}.onnx"
        quantize_static(str(pre), str(out), CalibrationReader(calib, info, name, 32),
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, **kwargs)
        files[label] = out
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, default=ROOT)
    parser.add_argument("-o", "--out", type=Path, default=None,
                        help="default: <project>/metrics/ort_threads.json")
    parser.add_argument("--runs", type=int, default=120)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    project = args.project
    probe = machines.probe()
    cores = probe["cores"]
    threads = bench.resolve_threads(("powers", "all"), cores)
    p = BenchParams(batch_sizes=tuple(args.batch_sizes), threads=threads, warmup=5, runs=args.runs,
                    rounds=4, seconds=PER_MEASUREMENT * len(threads) * len(args.batch_sizes))
    info = data.load_info(project / "data/prepared")
    x = data.Normalized(data.load_split(project / "data/prepared", "test").x, info)
    fp32 = project / "models/fp32.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        calib = data.load_split(project / "data/prepared", "train").x[:256]
        files = int8_files(fp32, project / "models/static.onnx", calib, info, Path(tmp))
        models = {"fp32": fp32, **files}
        largest = bench.batch_of(x, max(p.batch_sizes))
        latency, profiles = {}, {}
        for option, config in OPTIONS.items():
            grid = bench.latency_grid(
                lambda count: {m: onnxutil.session_runner(session(path, count, config))
                               for m, path in models.items()},
                x, threads, p, desc=f"ort_threads {option}")
            latency[option] = {m: bench.rows_against(grid, m, "fp32") for m in models}
            profiles[option] = {
                m: profiling.kernel_profile(session(path, cores, config, f"{tmp}/{option}_{m}"),
                                            largest, runs=PROFILE_RUNS, top=SCALING_NODES)
                for m, path in models.items()}
        # Which layers scale: each node at 1 thread beside its all-cores profile above (bench's
        # options; on one core that profile is the 1-thread one).
        all_cores = profiles["bench"]
        scaling = {m: {"threads1": all_cores[m] if cores == 1 else profiling.kernel_profile(
                           session(path, 1, OPTIONS["bench"], f"{tmp}/scaling_{m}"), largest,
                           runs=PROFILE_RUNS, top=SCALING_NODES),
                       f"threads{cores}": all_cores[m]}
                   for m, path in models.items()}
        openvino = _openvino(files, x, threads, p)
        split = batch_split(fp32, files["static"], largest, cores, p, Path(tmp))
    record = {"machine": probe, "threads": list(threads), "batch_sizes": list(p.batch_sizes),
              "options": OPTIONS, "latency": latency, "profile": profiles, "node_scaling": scaling,
              **({"openvino": openvino} if openvino else {}),
              **({"batch_split": split} if split else {})}
    out = args.out or project / "metrics/ort_threads.json"
    write_json(out, record)
    from quantpipe.docs import ort_threads_table

    print(ort_threads_table(record))
    return 0


def _openvino(files: dict[str, Path], x, threads: tuple[int, ...], p: BenchParams) -> dict | None:
    """static.onnx and its NHWC-flatten rewrite on OpenVINO (quantpipe's latency settings),
    the rewrite's rows against static's from the same rounds; None without OpenVINO."""
    from quantpipe.runtimes import ov

    if ov.ov is None or "static_nhwc_flatten" not in files:
        return None
    openvino = ov.OpenVino()
    pair = {m: files[m] for m in ("static", "static_nhwc_flatten")}
    grid = bench.latency_grid(lambda count: {m: openvino.runner(path, count) for m, path in pair.items()},
                              x, threads, p, desc="ort_threads openvino")
    return {m: bench.rows_against(grid, m, "static") for m in pair}


if __name__ == "__main__":
    sys.exit(main())
