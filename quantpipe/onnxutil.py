"""ONNX helpers: export from PyTorch, load and check, ORT sessions, batched inference, graph stats."""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
import onnxruntime as ort

from quantpipe import isa
from quantpipe.errors import UserError

INPUT_NAME = "input"
OUTPUT_NAME = "logits"


def export_onnx(model, input_shape: tuple[int, int, int], opset: int) -> onnx.ModelProto:
    """torch.onnx.export (dynamo) of an eval-mode model, batch axis dynamic, weights inline.

    Weights stay inside the ModelProto (external_data=False), so one file is one DVC output.
    """
    import torch

    model.eval()
    example = torch.zeros((2, *input_shape), dtype=torch.float32)  # (B, C, S, S); B=2 keeps it symbolic
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (example,), dynamo=True, external_data=False, opset_version=opset,
            input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch},), verbose=False)
    proto = program.model_proto
    for nodes in [proto.graph.node, *(f.node for f in proto.functions)]:
        _drop_stack_traces(nodes)
    return proto


# The dynamo exporter records each node's Python stack trace, with the absolute paths of the
# checkout and of the environment: the same model exported in another clone got other bytes,
# hence another hash in dvc.lock. A debugging aid only (onnxsim drops it anyway).
STACK_TRACE = "pkg.torch.onnx.stack_trace"


def _drop_stack_traces(nodes) -> None:
    for node in nodes:
        keep = [p for p in node.metadata_props if p.key != STACK_TRACE]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)
        for attr in node.attribute:  # If/Loop/Scan bodies
            for graph in [attr.g, *attr.graphs] if attr.HasField("g") else attr.graphs:
                _drop_stack_traces(graph.node)


def load_model(path: Path | str) -> onnx.ModelProto:
    """Load and check an ONNX file; any failure is a UserError naming the file."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: not found; run the stage that writes it (dvc repro)")
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as e:
        raise UserError(f"{path}: not a valid ONNX model ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); re-create it") from None
    return model


def check_and_serialize(model: onnx.ModelProto, name: str) -> bytes:
    """onnx.checker on every model the pipeline writes, then its bytes."""
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise UserError(f"{name}: the produced model fails onnx.checker: {str(e).splitlines()[0]}") from None
    return model.SerializeToString()


EXACT_INT8_KEY = "session.x64quantprecision"


def exact_int8_config(flags: Iterable[str] | None = None) -> dict[str, str]:
    """ONNX Runtime's session config that keeps INT8 exact on a CPU with these ISA flags (as
    /proc/cpuinfo spells them; this CPU's when None): empty, except where its U8S8 kernels
    saturate (isa.int8_saturates: x86 without VNNI), where 8-bit weights make the model
    compute something other than its QDQ math (on an AVX2 EPYC the tests' tiny models were off
    by a tenth of their output range, and the QAT and OpenVINO parity checks failed).
    `session.x64quantprecision` makes those kernels U8U8, exact, at a speed cost; ORT leaves
    weights within [-64, 64] (reduce_range) as they are, exact on the fast kernels. With VNNI
    (and off x86) nothing is added, nothing changes."""
    saturates = isa.int8_saturates(isa.cpu_flags() if flags is None else flags)
    return {EXACT_INT8_KEY: "1"} if saturates else {}


EXACT_INT8 = exact_int8_config()  # every session make_session builds


def make_session(model: Path | str | bytes, *, level: ort.GraphOptimizationLevel,
                 threads: int = 0, profile_prefix: str | None = None,
                 stop_spinning: bool = False, optimized_path: Path | None = None,
                 config: dict[str, str] | None = None) -> ort.InferenceSession:
    """A CPU session at the given optimization level; threads=0 lets ORT choose.

    With profile_prefix, ORT records every run; session.end_profiling() writes the trace to
    <profile_prefix>_<timestamp>.json (its directory must exist) and returns its path.
    stop_spinning: the intra-op threads stop spinning when a run ends. For sessions that take
    turns in one process (the benchmark's interleaved FP32 and INT8): otherwise one session's
    spinning workers steal the cores the other runs on (measured here: static at 2 threads,
    bs64, p90 5.5 ms instead of 2.4 ms, p50 unchanged). optimized_path: where ORT writes the
    graph it runs (after its optimizations). config: more session config entries, by ONNX
    Runtime's names (e.g. session.dynamic_block_base).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # ORT's warnings about unused initializers are noise here
    if stop_spinning:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    for key, value in {**EXACT_INT8, **(config or {})}.items():
        options.add_session_config_entry(key, value)
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    source = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT's pybind errors (InvalidProtobuf, Fail, ...) share no base class
        if {**EXACT_INT8, **(config or {})}.get(EXACT_INT8_KEY) == "1" \
                and "Attempt to replace the existing tensor" in str(e):
            # ORT's U8U8 rewrite (x64quantprecision) fails on a weight that several nodes
            # share: such a model runs with the saturating kernels, and says so.
            warnings.warn("ONNX Runtime cannot make this model's INT8 kernels exact on this CPU "
                          "(a shared weight); its INT8 sums may saturate", stacklevel=2)
            return make_session(model, level=level, threads=threads, profile_prefix=profile_prefix,
                                stop_spinning=stop_spinning, optimized_path=optimized_path,
                                config={**(config or {}), EXACT_INT8_KEY: "0"})
        name = "the model in memory" if isinstance(model, bytes) else str(model)
        raise UserError(f"{name}: ONNX Runtime cannot load it ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}); re-create it") from None


def exact_int8_config_of(model: Path | str, level: ort.GraphOptimizationLevel) -> dict[str, str]:
    """EXACT_INT8 as the sessions of `model` take it (what a deployed session must set): empty
    where the CPU needs nothing, the option off where ORT's rewrite fails on this model
    (make_session's fallback: a shared weight)."""
    if not EXACT_INT8:
        return {}
    stat = Path(model).stat()
    return dict(_exact_int8_config_of(str(Path(model).resolve()), stat.st_mtime_ns, stat.st_size,
                                      level))


@functools.lru_cache(maxsize=64)
def _exact_int8_config_of(path: str, mtime_ns: int, size: int,
                          level: ort.GraphOptimizationLevel) -> tuple[tuple[str, str], ...]:
    # Learning it loads a session; the bench asks once per runtime setting and once for the
    # memory probe. Keyed on the file's mtime and size so a rewritten model is asked again.
    options = make_session(path, level=level).get_session_options()
    return tuple((key, options.get_session_config_entry(key)) for key in EXACT_INT8)


def check_input_matches(session: ort.InferenceSession, input_shape: tuple[int, ...],
                        name: str) -> str:
    """The model's single float input must accept (B, *input_shape); returns its name."""
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise UserError(f"{name}: expected one input, found {[i.name for i in inputs]}")
    spec = inputs[0]
    if spec.type != "tensor(float)":
        raise UserError(f"{name}: input {spec.name!r} is {spec.type}, expected tensor(float)")
    dims = spec.shape[1:]
    if len(spec.shape) != len(input_shape) + 1 or any(
            isinstance(d, int) and d != want for d, want in zip(dims, input_shape)):
        raise UserError(f"{name}: input {spec.name!r} has shape {spec.shape}, but the data is "
                        f"(batch, {', '.join(map(str, input_shape))})")
    if spec.shape and isinstance(spec.shape[0], int):
        # Evaluation and benchmarks run batches of 1, odd and large sizes.
        raise UserError(f"{name}: input {spec.name!r} has shape {spec.shape} with a fixed batch "
                        f"size of {spec.shape[0]}; re-export it with a dynamic batch axis")
    return spec.name


def session_runner(session: ort.InferenceSession) -> Callable[[np.ndarray], np.ndarray]:
    """A function feeding a batch to the session's single input, returning its first output."""
    name = session.get_inputs()[0].name
    return lambda batch: session.run(None, {name: batch})[0]


# Passes over at least this many images show a progress bar (images/s, time left) on stderr.
PROGRESS_FROM = 5000


def run_batched(session: ort.InferenceSession | Callable[[np.ndarray], np.ndarray], x: np.ndarray,
                batch_size: int = 256, progress: str | None = None) -> np.ndarray:
    """Outputs of the first model output for (N, ...) inputs (an array, or data.Normalized: a
    split read a batch at a time), batch by batch; `session` may also be a runner (another
    runtime's: batch -> first output). progress: the bar's title, for a long pass."""
    from tqdm import tqdm

    run = session_runner(session) if isinstance(session, ort.InferenceSession) else session
    outputs = []
    with tqdm(total=len(x), unit="img", desc=progress, leave=False,
              disable=progress is None or len(x) < PROGRESS_FROM) as bar:
        for i in range(0, len(x), batch_size):
            outputs.append(run(x[i:i + batch_size]))
            bar.update(len(outputs[-1]))
    return np.concatenate(outputs)


class Outputs:
    """Models' raw outputs on sets of images, one session per call at `level`, `batch_size`
    images a run (the stage's memory budget sizes it); `images` counts the images run (a
    stage's images/s)."""

    def __init__(self, level: ort.GraphOptimizationLevel, batch_size: int = 256) -> None:
        self.level, self.batch_size, self.images = level, batch_size, 0

    def __call__(self, model: Path | bytes, *images: np.ndarray) -> list[np.ndarray]:
        session = make_session(model, level=self.level)
        self.images += sum(len(x) for x in images)
        return [run_batched(session, x, self.batch_size) for x in images]


def parity_limit(expected: np.ndarray, tolerance: float) -> float:
    """The largest logit difference a parity check allows: `tolerance` per unit of the largest
    |logit| (at least 1). Float32 rounding grows with the values, so logits in the tens (an
    EfficientNet after two epochs) differ by a few 1e-4 between two correct runtimes, while a
    wrong export differs by whole units."""
    return tolerance * max(1.0, float(np.abs(expected).max()))


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type, sorted by name for stable metrics diffs."""
    return dict(sorted(Counter(node.op_type for node in model.graph.node).items()))


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def simplify(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """onnxsim with its own random-input check off: the caller checks parity on real data."""
    import onnxsim

    try:
        simplified, ok = onnxsim.simplify(model)
    except Exception as e:  # onnxsim raises RuntimeError/ValueError from its C++ core
        raise UserError(f"{name}: onnxsim failed ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not ok:
        raise UserError(f"{name}: onnxsim could not validate the simplified model")
    return simplified


def with_dynamic_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    """Make a fixed leading (batch) dimension of the graph's inputs and outputs symbolic.

    Models exported elsewhere often have batch 1 baked into the signature; inference at other
    batch sizes then fails although the graph itself is batch-agnostic.
    """
    initializers = {i.name for i in model.graph.initializer}
    changed = False
    for value in [*[i for i in model.graph.input if i.name not in initializers], *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            dims[0].dim_param = "batch"  # clears dim_value (a oneof)
            changed = True
    if changed:
        del model.graph.value_info[:]  # inferred shapes carried the old batch size
    return model


def check_logits(out: np.ndarray, num_classes: int, where: str) -> None:
    """A classifier's outputs must be (batch, num_classes) logits."""
    if out.ndim != 2 or out.shape[1] != num_classes:
        raise UserError(f"{where}: output has shape {list(out.shape)}; expected (batch, "
                        f"{num_classes}) logits for the {num_classes} classes of the data")


def import_onnx(path: Path, input_shape: tuple[int, int, int], num_classes: int,
                x: np.ndarray, level: ort.GraphOptimizationLevel,
                check_output: Callable[[np.ndarray], None] | None = None
                ) -> tuple[onnx.ModelProto, dict]:
    """Validate an ONNX model brought from elsewhere against the data; returns it (batch axis
    made dynamic) and facts for metrics. x: normalized (N, C, S, S) test samples;
    check_output(outputs) raises UserError for outputs of the wrong layout (default: a
    classifier's (batch, num_classes) logits)."""
    model = with_dynamic_batch(load_model(path))
    blob = check_and_serialize(model, str(path))
    session = make_session(blob, level=level)
    check_input_matches(session, input_shape, str(path))
    try:
        single = run_batched(session, x[:8], batch_size=1)
        batched = run_batched(session, x, batch_size=len(x))
    except Exception as e:  # ORT's Fail/InvalidArgument: a shape baked into the graph
        raise UserError(f"{path}: fails on a batch of {len(x)} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}); re-export it with a dynamic batch axis") from None
    if check_output is not None:
        check_output(batched)
    else:
        check_logits(batched, num_classes, str(path))
    if not np.isfinite(batched).all():
        raise UserError(f"{path}: produces NaN/Inf on the test images")
    return model, {"source": str(path), "batch_max_abs_diff": max_abs_diff(batched[:8], single),
                   "samples": len(x), "size_bytes": len(blob), "nodes": len(model.graph.node)}


def with_outlier_channel(model: onnx.ModelProto, scale: float, channel: int = 0) -> onnx.ModelProto:
    """The same function with one outlier activation channel: a PTQ-hard twin of a model.

    Output channel `channel` of the first Conv (weights and bias) is multiplied by `scale` and
    the matching input channel of the Conv that reads it (through a Relu) divided by it: Relu is
    positively homogeneous, so FP32 outputs stay the same up to rounding, but one per-tensor
    activation range now spans `scale` times the others' values, which INT8 then crushes. Real
    models get such channels from training (LayerNorm/BatchNorm folding, outlier features).
    """
    if scale <= 0:
        raise ValueError("scale must be > 0 (Relu commutes only with positive factors)")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    consumers = {i: n for n in nodes for i in n.input}
    first = next((n for n in nodes if n.op_type == "Conv"), None)
    relu = consumers.get(first.output[0]) if first is not None else None
    second = consumers.get(relu.output[0]) if relu is not None and relu.op_type == "Relu" else None
    groups = {a.name: a.i for a in second.attribute} if second is not None else {}
    if second is None or second.op_type != "Conv" or groups.get("group", 1) != 1:
        raise UserError("with_outlier_channel: needs a model that starts Conv -> Relu -> Conv")
    inits = {i.name: i for i in out.graph.initializer}

    def rescale(name: str, index: tuple, factor: float) -> None:
        array = onnx.numpy_helper.to_array(inits[name]).copy()
        array[index] *= factor
        inits[name].CopyFrom(onnx.numpy_helper.from_array(array, name))

    rescale(first.input[1], (channel,), scale)
    if len(first.input) > 2 and first.input[2]:
        rescale(first.input[2], (channel,), scale)
    rescale(second.input[1], (slice(None), channel), 1.0 / scale)
    return out
