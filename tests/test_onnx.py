"""quantpipe.onnxutil: export (dynamic batch, parity, determinism), onnxsim, loading, checks."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from helpers import OPSET, ROOT, torch_logits
from quantpipe import isa, machine, models, onnxutil
from quantpipe.errors import UserError

SHAPE = (1, 12, 12)  # (C, S, S)
LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_ALL


@pytest.fixture(scope="module")
def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build_model("simple_cnn", 1, 12, 4).eval()


@pytest.fixture(scope="module")
def exported(cnn) -> onnx.ModelProto:
    return onnxutil.export_onnx(cnn, SHAPE, OPSET)


@pytest.fixture(scope="module")
def x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((5, *SHAPE)).astype(np.float32)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return onnxutil.make_session(model.SerializeToString(), level=LEVEL)


# --- export -----------------------------------------------------------------------------------

def test_export_passes_the_checker_with_named_io(exported):
    onnx.checker.check_model(exported, full_check=True)
    assert [i.name for i in exported.graph.input] == [onnxutil.INPUT_NAME]
    assert [o.name for o in exported.graph.output] == [onnxutil.OUTPUT_NAME]
    assert any(op.domain in ("", "ai.onnx") and op.version == OPSET for op in exported.opset_import)


def test_export_has_a_symbolic_batch_dim(exported):
    dims = exported.graph.input[0].type.tensor_type.shape.dim
    assert len(dims) == 4
    assert dims[0].dim_param and not dims[0].HasField("dim_value")
    assert [d.dim_value for d in dims[1:]] == list(SHAPE)


def test_export_keeps_weights_inline(exported):
    assert all(init.data_location != TensorProto.EXTERNAL for init in exported.graph.initializer)
    assert sum(int(np.prod(init.dims)) for init in exported.graph.initializer) >= 8 * 9


@pytest.mark.parametrize("batch", [1, 5])
def test_export_matches_torch(exported, cnn, x, batch):
    got = _session(exported).run(None, {onnxutil.INPUT_NAME: x[:batch]})[0]
    assert got.shape == (batch, 4)
    assert onnxutil.max_abs_diff(got, torch_logits(cnn, x[:batch])) <= 1e-4


def test_export_is_byte_deterministic(exported, cnn):
    again = onnxutil.export_onnx(cnn, SHAPE, OPSET)
    assert again.SerializeToString() == exported.SerializeToString()


def test_export_does_not_depend_on_where_the_code_lives(exported):
    """The exporter's per-node stack traces name absolute paths (of the checkout and the
    environment); they are dropped, so another clone exports the same bytes."""
    keys = {p.key for n in exported.graph.node for p in n.metadata_props}
    assert onnxutil.STACK_TRACE not in keys and "pkg.torch.onnx.name_scopes" in keys
    text = "".join(p.value for n in exported.graph.node for p in n.metadata_props)
    assert str(ROOT) not in text and "site-packages" not in text


def test_export_switches_the_model_to_eval():
    torch.manual_seed(0)
    model = models.build_model("mnist_net", 1, 12, 4).train()  # dropout would make it random
    proto = onnxutil.export_onnx(model, SHAPE, OPSET)
    assert not model.training
    assert "Dropout" not in onnxutil.op_counts(proto)
    xs = np.random.default_rng(1).standard_normal((3, *SHAPE)).astype(np.float32)
    got = _session(proto).run(None, {onnxutil.INPUT_NAME: xs})[0]
    assert onnxutil.max_abs_diff(got, torch_logits(model, xs)) <= 1e-4


# --- simplify ---------------------------------------------------------------------------------

def test_simplify_keeps_parity_and_does_not_grow(exported, x):
    simplified = onnxutil.simplify(exported, "exported.onnx")
    onnx.checker.check_model(simplified)
    assert len(simplified.graph.node) <= len(exported.graph.node)
    before = _session(exported).run(None, {onnxutil.INPUT_NAME: x})[0]
    after = _session(simplified).run(None, {onnxutil.INPUT_NAME: x})[0]
    assert np.allclose(after, before, atol=1e-5)
    # The batch axis stays dynamic after simplification.
    one = _session(simplified).run(None, {onnxutil.INPUT_NAME: x[:1]})[0]
    assert np.allclose(one, before[:1], atol=1e-5)


def test_simplify_folds_constant_subgraphs():
    # y = x + (c1 * c2): the Mul of two constants must be folded away.
    c1 = helper.make_tensor("c1", TensorProto.FLOAT, [2], [1.0, 2.0])
    c2 = helper.make_tensor("c2", TensorProto.FLOAT, [2], [3.0, 4.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["c1", "c2"], ["c"], name="mul"),
         helper.make_node("Add", ["x", "c"], ["y"], name="add")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])], [c1, c2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    simplified = onnxutil.simplify(model, "tiny")
    assert onnxutil.op_counts(simplified) == {"Add": 1}
    xs = np.ones((3, 2), np.float32)
    out = _session(simplified).run(None, {"x": xs})[0]
    assert np.allclose(out, xs + np.array([3.0, 8.0], np.float32))


# --- load_model / check_and_serialize ---------------------------------------------------------

def test_load_model_round_trip(exported, tmp_path):
    path = tmp_path / "ok.onnx"
    path.write_bytes(exported.SerializeToString())
    assert onnxutil.load_model(path).SerializeToString() == exported.SerializeToString()


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty_graph_text"])
def test_load_model_bad_file_names_the_file(exported, tmp_path, kind):
    path = tmp_path / f"{kind}.onnx"
    blob = exported.SerializeToString()
    content = {"truncated": blob[: len(blob) // 2],
               "garbage": b"\x00\xffthis is not a protobuf\x13\x37" * 20,
               "empty_graph_text": b"hello"}[kind]
    path.write_bytes(content)
    with pytest.raises(UserError) as info:
        onnxutil.load_model(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_load_model_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        onnxutil.load_model(tmp_path / "missing.onnx")


def test_check_and_serialize_refuses_an_invalid_model():
    # A node whose input nobody produces fails onnx.checker.
    graph = helper.make_graph(
        [helper.make_node("Relu", ["nowhere"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    with pytest.raises(UserError, match="bad.onnx"):
        onnxutil.check_and_serialize(model, "bad.onnx")


def test_check_and_serialize_returns_the_bytes(exported):
    assert onnxutil.check_and_serialize(exported, "x.onnx") == exported.SerializeToString()


# --- sessions and input checks ----------------------------------------------------------------

def test_check_input_matches_accepts_the_right_shape(exported):
    assert onnxutil.check_input_matches(_session(exported), SHAPE, "m.onnx") == onnxutil.INPUT_NAME


@pytest.mark.parametrize("data_shape", [(1, 8, 8), (3, 12, 12), (12, 12), (1, 12, 12, 1)])
def test_check_input_matches_rejects_other_shapes(exported, data_shape):
    with pytest.raises(UserError) as info:
        onnxutil.check_input_matches(_session(exported), data_shape, "m.onnx")
    assert "m.onnx" in str(info.value)
    assert ", ".join(map(str, data_shape)) in str(info.value)


def test_run_batched_equals_one_big_run(exported, x):
    session = _session(exported)
    whole = session.run(None, {onnxutil.INPUT_NAME: x})[0]
    for batch_size in (1, 2, 3, 5, 64):
        assert np.allclose(onnxutil.run_batched(session, x, batch_size), whole, atol=1e-5)


def test_make_session_from_path_and_threads(exported, tmp_path, x):
    path = tmp_path / "m.onnx"
    path.write_bytes(exported.SerializeToString())
    session = onnxutil.make_session(path, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                    threads=1)
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert np.allclose(session.run(None, {"input": x})[0],
                       _session(exported).run(None, {"input": x})[0], atol=1e-5)



@pytest.mark.parametrize("flags, exact", [
    ({"avx2"}, True),                                   # AVX2 only: U8S8 sums saturate
    ({"avx2", "avx512f", "avx512bw"}, True),            # AVX-512 without VNNI: the same
    ({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, False),
    ({"avx2", "avx_vnni"}, False),
    ({"avx2", "avx512_vnni", "amx_int8", "amx_tile"}, False),
    (set(), False),                                     # not x86 (or flags unknown)
])
def test_exact_int8_config_only_where_int8_sums_saturate(flags, exact):
    assert onnxutil.exact_int8_config(flags) == ({onnxutil.EXACT_INT8_KEY: "1"} if exact else {})
    # This process's sessions follow this CPU's /proc/cpuinfo.
    assert onnxutil.EXACT_INT8 == onnxutil.exact_int8_config()
    # reduce_range: auto gives 7-bit weights on the same CPUs (by metrics/int8.json, which the
    # machine stage derives from its record of the flags); true and false are kept as set.
    recorded = isa.int8_record(
        {"cpu_flags": {**dict.fromkeys(machine.CPU_FLAGS, False), **dict.fromkeys(flags, True)}})
    assert recorded == {"int8_saturates": exact}
    assert isa.reduce_range_for(isa.AUTO, recorded) is exact
    assert isa.reduce_range_for(True, recorded) is True
    assert isa.reduce_range_for(False, recorded) is False
    assert isa.reduce_range_for(isa.AUTO) is bool(onnxutil.EXACT_INT8)


def _matmul_integer(tmp_path, nodes: int):
    """`nodes` MatMulInteger nodes on one U8 input and one S8 weight (shared when nodes > 1),
    with values whose pairs of u8*s8 products overflow 16 bits, and the exact result."""
    weight = np.arange(-128, 128, 16, dtype=np.int8).reshape(4, 4)
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array(0, np.int8), "wz"),
             numpy_helper.from_array(np.array(128, np.uint8), "az")]
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "az", "wz"], [f"c{i}"]) for i in range(nodes)],
        "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 4])],
        [helper.make_tensor_value_info(f"c{i}", TensorProto.INT32, [2, 4]) for i in range(nodes)], inits)
    path = tmp_path / f"matmul{nodes}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), path)
    a = np.array([[255, 0, 255, 255], [0, 255, 0, 1]], np.uint8)
    return path, a, (a.astype(np.int64) - 128) @ weight.astype(np.int64)


def test_int8_products_are_exact_on_this_cpu(tmp_path):
    path, a, exact = _matmul_integer(tmp_path, 1)
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = onnxutil.make_session(path, level=level)
    assert np.array_equal(session.run(None, {"a": a})[0], exact)
    assert onnxutil.exact_int8_config_of(path, level) == onnxutil.EXACT_INT8


def test_a_shared_weight_falls_back_to_the_default_kernels_with_a_warning(tmp_path):
    # ORT's U8U8 rewrite fails on a weight two nodes share: the session still loads, warns, and
    # what a deployed session must set says the option is off.
    path, a, exact = _matmul_integer(tmp_path, 2)
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # The option forced on (a kernel table for another CPU's flags) loads on every CPU: where ORT
    # rewrites here (no VNNI, or AMX) it falls back, elsewhere the option does nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forced = onnxutil.make_session(path, level=level, config={onnxutil.EXACT_INT8_KEY: "1"})
    assert len(forced.run(None, {"a": a})) == 2
    if not onnxutil.EXACT_INT8:  # VNNI, AMX or not x86: nothing to rewrite, exact as it is
        assert all(np.array_equal(c, exact) for c in onnxutil.make_session(path, level=level).run(None, {"a": a}))
        assert onnxutil.exact_int8_config_of(path, level) == {}
        return
    with pytest.warns(UserWarning, match="a shared weight"):
        session = onnxutil.make_session(path, level=level)
    assert len(session.run(None, {"a": a})) == 2
    with pytest.warns(UserWarning, match="a shared weight"):
        assert onnxutil.exact_int8_config_of(path, level) == {onnxutil.EXACT_INT8_KEY: "0"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked once per version of the file: no second session
        assert onnxutil.exact_int8_config_of(path, level) == {onnxutil.EXACT_INT8_KEY: "0"}

# --- op_counts / max_abs_diff -----------------------------------------------------------------

def test_op_counts_counts_and_sorts():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
         helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    counts = onnxutil.op_counts(helper.make_model(graph))
    assert counts == {"Add": 1, "Relu": 3}
    assert list(counts) == ["Add", "Relu"]


def test_op_counts_of_the_export(exported):
    counts = onnxutil.op_counts(exported)
    assert counts.get("Conv") == 1 and counts.get("MaxPool") == 1
    assert sum(counts.values()) == len(exported.graph.node)


def test_max_abs_diff():
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    b = np.array([[1.5, 2.0], [3.0, 1.0]], np.float32)
    assert onnxutil.max_abs_diff(a, b) == pytest.approx(3.0)
    assert onnxutil.max_abs_diff(a, a) == 0.0


def test_parity_limit_scales_with_the_largest_logit():
    # Logits within 1: the tolerance as given; larger logits: per unit of the largest (sign
    # ignored), so an EfficientNet's rounding in the tens passes and a wrong export does not.
    small = np.array([[0.2, -0.9]], np.float32)
    assert onnxutil.parity_limit(small, 1e-4) == pytest.approx(1e-4)
    large = np.array([[3.0, -27.0]], np.float32)
    assert onnxutil.parity_limit(large, 1e-4) == pytest.approx(27e-4)
    assert 2.8e-4 < onnxutil.parity_limit(large, 1e-4) < 0.1


def test_bench_sessions_stop_spinning_after_each_run(exported):
    """The benchmark's sessions take turns in one process: their thread pools must not keep
    spinning after a run (see onnxutil.make_session)."""
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    bench_session = onnxutil.make_session(exported.SerializeToString(), level=level, threads=2,
                                          stop_spinning=True)
    plain = onnxutil.make_session(exported.SerializeToString(), level=level, threads=2)
    key = "session.force_spinning_stop"
    assert bench_session.get_session_options().get_session_config_entry(key) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):
        plain.get_session_options().get_session_config_entry(key)  # ORT's default: spin
