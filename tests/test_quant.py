"""quantpipe.engines (ort_static, dynamic, graph) on a tiny two-conv + Linear CNN: calibration
reader, static/dynamic INT8 graphs, exclusion, accuracy vs FP32, and the boundary checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

from helpers import TinyViT, TwoConvNet, export_to, info_for, structured_images, trained_on
from quantpipe import budget, criterion, data, isa, onnxutil
from quantpipe.engines import base, dynamic, graph, nncf_ptq, ort_static
from quantpipe.errors import UserError
from quantpipe.schemas.quantize_dynamic import QuantizeDynamicParams
from quantpipe.schemas.quantize_static import QuantizeStaticParams

SHAPE = (1, 12, 12)
LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
CALIB_BATCH = 16


@pytest.fixture(scope="module")
def calib() -> data.Split:
    return structured_images(40, size=12, seed=0)  # 40 = 16 + 16 + 8: a ragged last batch


@pytest.fixture(scope="module")
def info(calib) -> data.DataInfo:
    return info_for(calib)


@pytest.fixture(scope="module")
def fp32_path(tmp_path_factory, calib, info) -> Path:
    torch.manual_seed(0)
    # A few training steps give the logits real margins, so the top-1 check below means something.
    model = trained_on(TwoConvNet(*SHAPE[:2], num_classes=4), data.normalize(calib.x, info), calib.y)
    return export_to(model, SHAPE, tmp_path_factory.mktemp("quant") / "fp32.onnx")


@pytest.fixture(scope="module")
def fp32(fp32_path) -> onnx.ModelProto:
    return onnx.load(str(fp32_path))


@pytest.fixture(scope="module")
def conv_names(fp32) -> list[str]:
    names = [n.name for n in fp32.graph.node if n.op_type == "Conv"]
    assert len(names) == 2 and all(names)
    return names


def _reader(calib, info, batch_size: int = CALIB_BATCH) -> ort_static.CalibrationReader:
    return ort_static.CalibrationReader(calib.x, info, onnxutil.INPUT_NAME, batch_size)


def _val_accuracy(calib: data.Split, info: data.DataInfo):
    """ORT top-1 accuracy on the (tiny) calibration set."""
    x = data.normalize(calib.x, info)

    def accuracy(path: Path) -> float:
        return float((_logits(path, x).argmax(1) == calib.y).mean())
    return accuracy


def _threshold_check(val_accuracy, max_drop_pp: float, fp32_accuracy: float = 1.0):
    """A fallback check() whose drop is "real" whenever it exceeds max_drop_pp: the fallback
    mechanics without the statistics of quantpipe.criterion (tested in test_criterion.py).
    Its "predictions" are the accuracy itself, so every change of accuracy is a change."""
    def check(path: Path) -> criterion.Judged:
        accuracy = val_accuracy(path)
        drop = round((fp32_accuracy - accuracy) * 100, 4)
        return criterion.Judged({"val_score": accuracy, "drop_pts": drop,
                                 "real_drop": drop > max_drop_pp, "verdict": f"drop {drop} pp"},
                                np.array([accuracy]))
    return check


def _static_result(fp32_path, tmp_path, calib, info, val_accuracy=None, memory=budget.UNLIMITED,
                   **overrides) -> tuple[onnx.ModelProto, base.StaticResult]:
    # No accuracy fallback unless a test asks for it: these tests look at plain quantization.
    overrides.setdefault("max_fallback_steps", 0)
    out = tmp_path / "static.onnx"
    p = QuantizeStaticParams(**overrides).for_task("classification")
    result = ort_static.quantize_static_with_fallback(
        fp32_path, out, calib.x, info, p,
        _threshold_check(val_accuracy or _val_accuracy(calib, info), p.max_drop_pts),
        memory=memory)
    assert result.symbolic_shape_inference is True
    return onnxutil.load_model(out), result  # load_model also runs onnx.checker


def _static(fp32_path, tmp_path, calib, info, **overrides) -> onnx.ModelProto:
    return _static_result(fp32_path, tmp_path, calib, info, **overrides)[0]


def _dynamic(fp32_path, tmp_path, **overrides) -> onnx.ModelProto:
    out = tmp_path / "dynamic.onnx"
    dynamic.quantize_dynamic_model(fp32_path, out, QuantizeDynamicParams(**overrides))
    return onnxutil.load_model(out)


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output}


def _initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    (init,) = [i for i in model.graph.initializer if i.name == name]
    return numpy_helper.to_array(init)


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.name == name]
    return node


def _logits(model: onnx.ModelProto | Path, x: np.ndarray) -> np.ndarray:
    source = model if isinstance(model, Path) else model.SerializeToString()
    return onnxutil.run_batched(onnxutil.make_session(source, level=LEVEL), x)


# --- CalibrationReader ------------------------------------------------------------------------

def test_reader_yields_normalized_batches_then_none(calib, info):
    reader = _reader(calib, info)
    assert len(reader) == 3
    batches = []
    while (batch := reader.get_next()) is not None:
        batches.append(batch)
    assert [list(b) for b in batches] == [[onnxutil.INPUT_NAME]] * 3
    assert [b[onnxutil.INPUT_NAME].shape for b in batches] == [(16, *SHAPE), (16, *SHAPE), (8, *SHAPE)]
    assert all(b[onnxutil.INPUT_NAME].dtype == np.float32 for b in batches)
    got = np.concatenate([b[onnxutil.INPUT_NAME] for b in batches])
    assert np.array_equal(got, data.normalize(calib.x, info))
    assert reader.get_next() is None  # stays exhausted


def test_reader_rewind_restarts(calib, info):
    reader = _reader(calib, info, batch_size=32)
    first = reader.get_next()[onnxutil.INPUT_NAME]
    reader.get_next()
    assert reader.get_next() is None
    reader.rewind()
    assert np.array_equal(reader.get_next()[onnxutil.INPUT_NAME], first)


def test_reader_uses_the_given_input_name(calib, info):
    reader = ort_static.CalibrationReader(calib.x, info, "pixels", 100)
    assert list(reader.get_next()) == ["pixels"]
    assert reader.get_next() is None


def test_graph_input_is_the_real_input(fp32):
    assert graph.graph_input(fp32).name == onnxutil.INPUT_NAME


# --- static quantization ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def static_default(fp32_path, tmp_path_factory, calib, info) -> onnx.ModelProto:
    return _static(fp32_path, tmp_path_factory.mktemp("static"), calib, info)


def test_static_default_is_qdq(static_default):
    ops = onnxutil.op_counts(static_default)
    assert ops.get("QuantizeLinear", 0) >= 3 and ops.get("DequantizeLinear", 0) >= 3
    assert "QLinearConv" not in ops
    assert ops.get("Conv") == 2


def test_static_default_activations_u8_weights_s8(static_default):
    producers = _producers(static_default)
    for conv in (n for n in static_default.graph.node if n.op_type == "Conv"):
        act_dq, weight_dq = producers[conv.input[0]], producers[conv.input[1]]
        assert act_dq.op_type == weight_dq.op_type == "DequantizeLinear"
        assert _initializer(static_default, act_dq.input[2]).dtype == np.uint8
        assert _initializer(static_default, weight_dq.input[0]).dtype == np.int8


def test_static_default_has_per_channel_weight_scales(static_default):
    producers = _producers(static_default)
    convs = [n for n in static_default.graph.node if n.op_type == "Conv"]
    for conv, out_channels in zip(convs, (4, 8)):
        dq = producers[conv.input[1]]
        assert dq.op_type == "DequantizeLinear"
        axis = [a for a in dq.attribute if a.name == "axis"]
        assert axis and axis[0].i == 0  # output-channel axis of an OIHW weight
        scale = _initializer(static_default, dq.input[1])
        assert scale.size == out_channels > 1
        assert len(np.unique(scale)) > 1  # really one scale per channel


def _int8_weights(model: onnx.ModelProto) -> list[np.ndarray]:
    return [numpy_helper.to_array(i).astype(np.int64) for i in model.graph.initializer
            if i.data_type == onnx.TensorProto.INT8]


def _exact_and_default(path: Path, x: np.ndarray) -> list[np.ndarray]:
    """Outputs with ORT's exact INT8 kernels forced on, then with its default ones."""
    return [onnxutil.make_session(path, level=LEVEL, config={onnxutil.EXACT_INT8_KEY: on})
            .run(None, {onnxutil.INPUT_NAME: x})[0] for on in ("1", "0")]


def test_reduced_range_weights_run_exactly_on_the_default_kernels(fp32_path, tmp_path, calib, info):
    # reduce_range (what `auto` picks on x86 without VNNI): weights within [-64, 64], which the
    # U8S8 kernels' 16-bit pair sums cannot overflow (2 x 255 x 64 < 2**15). ORT leaves such
    # weights as they are under session.x64quantprecision, so the fast kernels give the exact
    # result on every CPU.
    model = _static(fp32_path, tmp_path, calib, info, reduce_range=True)
    assert max(int(np.abs(w).max()) for w in _int8_weights(model)) <= 64
    x = data.normalize(calib.x, info)
    exact, default = _exact_and_default(tmp_path / "static.onnx", x)
    assert np.array_equal(exact, default)
    (tmp_path / "full").mkdir()
    full = _static(fp32_path, tmp_path / "full", calib, info, reduce_range=False)
    assert max(int(np.abs(w).max()) for w in _int8_weights(full)) == 127
    exact, default = _exact_and_default(tmp_path / "full" / "static.onnx", x)
    # 8-bit weights: where the kernels saturate they differ from the exact ones.
    assert np.array_equal(exact, default) is not isa.int8_saturates(isa.cpu_flags())


def test_reduce_range_auto_follows_this_cpu(fp32_path, tmp_path, calib, info):
    model = _static(fp32_path, tmp_path, calib, info, reduce_range=isa.AUTO)
    widest = max(int(np.abs(w).max()) for w in _int8_weights(model))
    assert widest == (64 if isa.int8_saturates(isa.cpu_flags()) else 127)


@pytest.mark.parametrize("reduce_range, fix", [(True, "ENABLE"), (False, None)])
def test_nncf_reduce_range_is_its_overflow_fix(reduce_range, fix):
    from nncf.quantization.advanced_parameters import OverflowFix
    options = nncf_ptq.quantize_options(QuantizeStaticParams(engine="nncf", reduce_range=reduce_range), 8)
    assert options["advanced_parameters"].overflow_fix == (fix and OverflowFix[fix])


def test_static_per_tensor_has_scalar_weight_scales(fp32_path, tmp_path, calib, info):
    model = _static(fp32_path, tmp_path, calib, info, per_channel=False)
    producers = _producers(model)
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2
    for conv in convs:
        dq = producers[conv.input[1]]
        assert dq.op_type == "DequantizeLinear"
        assert _initializer(model, dq.input[1]).size == 1


def test_static_qoperator_gives_qlinearconv(fp32_path, tmp_path, calib, info):
    model = _static(fp32_path, tmp_path, calib, info, quant_format=QuantFormat.QOperator)
    ops = onnxutil.op_counts(model)
    assert ops.get("QLinearConv") == 2
    assert "Conv" not in ops


def test_static_excluded_conv_stays_float(fp32_path, tmp_path, calib, info, conv_names):
    first, second = conv_names
    model = _static(fp32_path, tmp_path, calib, info, nodes_to_exclude=(first,))
    producers = _producers(model)
    kept = _node(model, first)
    assert kept.op_type == "Conv"
    for name in kept.input:  # input, weight, bias: all float, none via DequantizeLinear
        assert name not in producers or producers[name].op_type != "DequantizeLinear", name
    assert _initializer(model, kept.input[1]).dtype == np.float32
    # The other conv is still quantized: the exclusion is by name, not global.
    assert producers[_node(model, second).input[1]].op_type == "DequantizeLinear"


def test_static_excluded_inner_conv_keeps_float_weights(fp32_path, tmp_path, calib, info,
                                                        conv_names):
    # In QDQ format the tensor *between* conv1 and conv2 keeps its Q/DQ pair, because conv1's
    # output is quantized; what exclusion guarantees is float weight and bias for conv2.
    first, second = conv_names
    model = _static(fp32_path, tmp_path, calib, info, nodes_to_exclude=(second,))
    producers = _producers(model)
    kept = _node(model, second)
    assert kept.op_type == "Conv"
    for name in kept.input[1:]:
        assert name not in producers, name
        assert _initializer(model, name).dtype == np.float32
    assert producers[_node(model, first).input[1]].op_type == "DequantizeLinear"


def test_static_output_keeps_a_dynamic_batch(static_default, calib, info):
    dim0 = graph.graph_input(static_default).type.tensor_type.shape.dim[0]
    assert dim0.dim_param
    x = data.normalize(calib.x[:7], info)
    whole = _logits(static_default, x)
    one_by_one = np.concatenate([_logits(static_default, x[i:i + 1]) for i in range(7)])
    assert np.allclose(whole, one_by_one, atol=1e-4)


def test_static_unknown_excluded_node_is_a_user_error(fp32_path, tmp_path, calib, info):
    with pytest.raises(UserError) as e:
        _static(fp32_path, tmp_path, calib, info, nodes_to_exclude=("conv9",))
    assert "quantize_static.nodes_to_exclude" in str(e.value) and "conv9" in str(e.value)
    assert not (tmp_path / "static.onnx").exists()


# --- which op types: the transformer default ---------------------------------------------------

@pytest.fixture(scope="module")
def vit_path(tmp_path_factory, calib, info) -> Path:
    torch.manual_seed(0)
    model = trained_on(TinyViT(), data.normalize(calib.x, info), calib.y)
    return export_to(model, SHAPE, tmp_path_factory.mktemp("vit") / "fp32.onnx")


def _weight_is_int8(model: onnx.ModelProto, op_type: str) -> bool:
    """Whether the (single) node of op_type reads its weight through DequantizeLinear."""
    (node,) = [n for n in model.graph.node if n.op_type == op_type]
    producer = _producers(model).get(node.input[1])
    return producer is not None and producer.op_type == "DequantizeLinear"


def test_a_graph_with_attention_gets_gemm_and_matmul_only(vit_path, tmp_path, calib, info):
    fp32 = onnx.load(str(vit_path))
    attention = ort_static.attention_matmuls(fp32)
    assert len(attention) == 2  # Q by K, and the attention weights by V
    (tmp_path / "default").mkdir()
    (tmp_path / "named").mkdir()
    model, result = _static_result(vit_path, tmp_path / "default", calib, info)
    assert result.op_types_to_quantize == ["Gemm", "MatMul"]
    assert result.op_selection.startswith("attention (2 MatMul(s) of two activations")
    # The same model as asking for Gemm/MatMul by name; the patch Conv stays in float.
    named, _ = _static_result(vit_path, tmp_path / "named", calib, info,
                              op_types_to_quantize=("Gemm", "MatMul"))
    assert onnxutil.op_counts(model) == onnxutil.op_counts(named)
    assert not _weight_is_int8(model, "Conv")
    producers = _producers(model)
    for name in attention:  # both operands quantized: they run as integer MatMuls
        node = _node(model, name)
        assert all(producers[i].op_type == "DequantizeLinear" for i in node.input[:2])
    x = data.normalize(calib.x, info)
    assert (_logits(model, x).argmax(1) == _logits(vit_path, x).argmax(1)).mean() >= 0.95


def test_op_types_to_quantize_overrides_the_transformer_default(vit_path, tmp_path, calib, info):
    model, result = _static_result(vit_path, tmp_path, calib, info,
                                   op_types_to_quantize=("Conv", "MatMul", "Gemm", "Add"))
    assert result.op_types_to_quantize == ["Conv", "MatMul", "Gemm", "Add"]
    assert result.op_selection == "quantize_static.op_types_to_quantize"
    assert _weight_is_int8(model, "Conv")


def test_a_graph_without_attention_gets_every_op_type(fp32_path, fp32, tmp_path, calib, info):
    assert ort_static.attention_matmuls(fp32) == []
    _, result = _static_result(fp32_path, tmp_path, calib, info)
    assert result.op_types_to_quantize == [] and "no attention" in result.op_selection


# --- accuracy-aware fallback ------------------------------------------------------------------

def _quantized_compute_nodes(model: onnx.ModelProto) -> list[str]:
    """Conv/Gemm nodes whose weight comes through DequantizeLinear (i.e. run in INT8)."""
    producers = _producers(model)
    return [n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm")
            and n.input[1] in producers and producers[n.input[1]].op_type == "DequantizeLinear"]


def _one_point_per_int8_node(path: Path) -> float:
    """A validation accuracy that loses exactly 1 pp per Conv/Gemm left in INT8, so each
    fallback step that really leaves a compute node in float wins back exactly 1 pp."""
    return 1.0 - 0.01 * len(_quantized_compute_nodes(onnx.load(str(path))))


def test_ladder_climbs_its_rungs_until_within_the_drop(fp32_path, fp32, tmp_path, calib, info):
    """Other calibrations regain nothing here (the check counts INT8 nodes), the first and last
    layers regain 2 pp, the middle conv the last one; then the first and last go back to INT8
    only if the drop stays within the limit, and here it does not."""
    model, result = _static_result(fp32_path, tmp_path, calib, info,
                                   val_accuracy=_one_point_per_int8_node,
                                   max_drop_pts=0.5, max_fallback_steps=3)
    compute = [n.name for n in fp32.graph.node if n.op_type in ("Conv", "Gemm")]
    ends = [compute[0], compute[-1]]
    assert [(s["rung"], s["drop_pts"], s["kept"]) for s in result.steps] == [
        ("plain", 3.0, True), ("calibration", 3.0, False), ("calibration", 3.0, False),
        ("first_last", 1.0, True), ("node", 0.0, True), ("prune", 2.0, False)]
    assert {s["calibrate_method"] for s in result.steps[1:3]} == {"Entropy", "Percentile"}
    assert result.steps[3]["nodes_in_float"] == ends
    assert result.steps[4]["candidate"] == [compute[1]]
    assert result.drop_pts == 0.0 and result.final is result.steps[4]
    assert set(result.fallback_nodes) == set(compute) == set(result.nodes_in_float)
    assert _quantized_compute_nodes(model) == []  # the written model is the kept one
    assert result.calib_samples_used == len(calib)  # MinMax uses every sample
    assert "first/last layers" in result.tried() and "calibrate_method Entropy" in result.tried()


def test_ladder_keeps_only_what_regains(fp32_path, fp32, tmp_path,
                                                                      calib, info):
    """Only the middle conv matters: the first and last layers regain nothing, so they stay
    INT8 and the node rung finds the middle conv among its candidates."""
    compute = [n.name for n in fp32.graph.node if n.op_type in ("Conv", "Gemm")]

    def middle_matters(path: Path) -> float:
        return 0.99 if compute[1] in _quantized_compute_nodes(onnx.load(str(path))) else 1.0

    model, result = _static_result(fp32_path, tmp_path, calib, info, val_accuracy=middle_matters,
                                   max_drop_pts=0.5, max_fallback_steps=3)
    assert [(s["rung"], s["kept"]) for s in result.steps if s["rung"] != "node"] == [
        ("plain", True), ("calibration", False), ("calibration", False), ("first_last", False)]
    assert [s["rung"] for s in result.steps if s["kept"]] == ["plain", "node"]
    assert result.fallback_nodes == [compute[1]] == result.nodes_in_float
    assert _quantized_compute_nodes(model) == [compute[0], compute[2]]


def test_ladder_undoes_the_first_and_last_layers_when_they_no_longer_help(fp32_path, fp32,
                                                                          tmp_path, calib, info):
    """The first layer in float helps a little only while the middle conv is INT8: once the
    node rung puts the middle conv in float, the first and last go back to INT8 (prune)."""
    compute = [n.name for n in fp32.graph.node if n.op_type in ("Conv", "Gemm")]

    def accuracy(path: Path) -> float:
        int8 = _quantized_compute_nodes(onnx.load(str(path)))
        return 1.0 - (0.01 + 0.002 * (compute[0] in int8) if compute[1] in int8 else 0.0)

    model, result = _static_result(fp32_path, tmp_path, calib, info, val_accuracy=accuracy,
                                   max_drop_pts=0.5, max_fallback_steps=3)
    kept = [(s["rung"], s["drop_pts"]) for s in result.steps if s["kept"]]
    assert kept == [("plain", 1.2), ("first_last", 1.0), ("node", 0.0), ("prune", 0.0)]
    assert result.nodes_in_float == [compute[1]] == result.fallback_nodes
    assert f"MinMax with {[compute[1]]} in float: drop 0.00 points" in result.tried()


def test_ladder_stops_when_no_candidate_changes_a_prediction(fp32_path, tmp_path, calib, info):
    """A drop no fallback can touch: after the calibration and first/last rungs, one node step
    tries its candidates, sees no prediction move and stops; the plain model is kept."""
    model, result = _static_result(fp32_path, tmp_path, calib, info,
                                   val_accuracy=lambda path: 0.9, max_drop_pts=0.5,
                                   max_fallback_steps=3)
    rungs = [s["rung"] for s in result.steps]
    assert rungs[:4] == ["plain", "calibration", "calibration", "first_last"]
    candidates = [s["candidate"] for s in result.steps[4:]]
    assert set(rungs[4:]) == {"node"} and len(set(map(tuple, candidates))) == len(candidates)
    # One round: the 3 (fallback_candidates) nodes alone, then with their readers.
    assert [len(c) for c in candidates[:3]] == [1, 1, 1]
    assert all(len(c) > 1 and [c[0]] in candidates[:3] for c in candidates[3:])
    assert not any(s["kept"] for s in result.steps[1:])
    assert result.fallback_nodes == [] and len(_quantized_compute_nodes(model)) == 3


def test_no_fallback_when_max_steps_is_zero(fp32_path, tmp_path, calib, info):
    model, result = _static_result(fp32_path, tmp_path, calib, info,
                                   val_accuracy=_one_point_per_int8_node,
                                   max_drop_pts=0.5, max_fallback_steps=0)
    assert len(result.steps) == 1 and result.drop_pts == 3.0
    assert result.tried() == "nothing (max_fallback_steps = 0)"


def test_no_fallback_when_within_the_drop(fp32_path, tmp_path, calib, info):
    model, result = _static_result(fp32_path, tmp_path, calib, info,
                                   val_accuracy=_one_point_per_int8_node,
                                   max_drop_pts=3.0, max_fallback_steps=3)
    assert result.fallback_nodes == [] and len(result.steps) == 1
    assert len(_quantized_compute_nodes(model)) == 3


def test_float_compute_nodes_names_what_runs_in_float(fp32_path, fp32, tmp_path, calib, info,
                                                      conv_names):
    model = _static(fp32_path, tmp_path, calib, info, nodes_to_exclude=(conv_names[1],))
    assert graph.float_compute_nodes(model) == [conv_names[1]]
    assert graph.float_compute_nodes(fp32) == [n.name for n in fp32.graph.node
                                               if n.op_type in ("Conv", "Gemm")]


def test_cached_ranges_match_ort_calibration(fp32_path, tmp_path, calib, info):
    """Ranges computed from the one-pass activations equal ORT's own calibrators' ranges."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import load_tensors_data

    pre = tmp_path / "pre.onnx"
    graph.preprocess(fp32_path, pre)
    calib = calib.take(np.arange(32))  # histograms need equal batches (calibration_plan)
    reader = _reader(calib, info)
    outputs = ort_static.collect_outputs(pre, reader, QuantizeStaticParams(), tmp_path)
    for method in CalibrationMethod.MinMax, CalibrationMethod.Entropy, CalibrationMethod.Percentile:
        p = QuantizeStaticParams(calibrate_method=method,
                                 calib_batch_size=CALIB_BATCH)
        theirs, ours = tmp_path / f"{method.name}_ort.json", tmp_path / f"{method.name}.json"
        ort_static.calibrate(pre, _reader(calib, info), p, {}, theirs)
        ort_static.cached_ranges(outputs, method, p, ours)
        a, b = load_tensors_data(theirs), load_tensors_data(ours)
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            np.testing.assert_allclose(np.asarray(a[name].range_value, dtype=np.float64).ravel(),
                                       np.asarray(b[name].range_value, dtype=np.float64).ravel(),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{method.name} {name}")


def _model_with_activation(shape: list, elem_type=onnx.TensorProto.FLOAT) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["a"]), onnx.helper.make_node("Relu", ["a"], ["y"])],
        "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shape)])
    graph.value_info.append(onnx.helper.make_tensor_value_info("a", elem_type, shape))
    return onnx.helper.make_model(graph)


def test_activations_per_sample():
    """Two Relus of 1 MiB a sample: 2 MiB of intermediate tensors, 2 MiB alive at once (a node's
    input and output), none fixed; at the size the data is prepared to, whatever the graph
    declares."""
    acts = budget.activations(_model_with_activation(["n", 256, 32, 32]), (256, 32, 32))
    assert (acts.every, acts.live, acts.fixed, acts.weights) == (2**21, 2**21, 0, 0)
    acts = budget.activations(_model_with_activation(["n", 8, "h", "w"]), (8, 128, 256))
    assert (acts.every, acts.live) == (2**21, 2**21)


def test_activations_fixed_part_does_not_grow_with_the_batch():
    """A dequantized weight (a QDQ model's) costs the same at every batch size."""
    weight = onnx.numpy_helper.from_array(np.zeros((16, 16), np.int8), "w")
    scale = onnx.numpy_helper.from_array(np.array(0.1, np.float32), "s")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("DequantizeLinear", ["w", "s"], ["wf"]),
         onnx.helper.make_node("MatMul", ["x", "wf"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 16])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 16])],
        initializer=[weight, scale])
    acts = budget.activations(onnx.helper.make_model(graph), (16,))
    assert (acts.every, acts.fixed, acts.weights) == (64, 1024, 256 + 4)


def test_calibration_plan_bounds_memory():
    acts = budget.Activations(every=2**20, live=2**18, weights=0)  # 1 MiB kept, 512 KiB a run
    entropy = QuantizeStaticParams(calibrate_method=ort_static.CalibrationMethod.Entropy,
                                   calib_batch_size=4)
    plan = ort_static.calibration_plan
    # 16 MiB: a batch of 4 runs in 2 MiB, 14 MiB keep 7 samples' activations twice over: the
    # first whole batch of them.
    assert plan(acts, 0, entropy, 100, 16 * 2**20) == ort_static.CalibrationPlan(4, 4)
    assert plan(acts, 0, entropy, 3, 16 * 2**20) == ort_static.CalibrationPlan(3, 3)
    assert plan(acts, 0, entropy, 6, 64 * 2**20) == ort_static.CalibrationPlan(4, 4)  # whole batches
    minmax = QuantizeStaticParams(calib_batch_size=32)
    # MinMax reduces every batch in the graph: every sample, in batches that fit.
    assert plan(acts, 0, minmax, 100, 64 * 2**20) == ort_static.CalibrationPlan(100, 32)
    assert plan(acts, 0, minmax, 100, 4 * 2**20) == ort_static.CalibrationPlan(100, 8)
    with pytest.raises(UserError, match="raise resources.memory_mb"):
        plan(acts, 0, minmax, 100, 2**18)
    with pytest.raises(UserError, match="calibrate_method: MinMax"):
        plan(acts, 0, entropy, 100, 2**20)


def test_minmax_ranges_do_not_depend_on_the_memory_budget(fp32_path, tmp_path, calib, info,
                                                          monkeypatch):
    """Activations so large that a budget fits one calibration sample a run (a big model): the
    ranges are those of all samples in batches of four."""
    whole = _activation_scales(_static(fp32_path, tmp_path, calib, info, calib_batch_size=4))
    real = budget.activations
    monkeypatch.setattr(budget, "activations",
                        lambda model, shape: dataclasses.replace(real(model, shape), live=2**27))
    squeezed, result = _static_result(fp32_path, tmp_path, calib, info, calib_batch_size=4,
                                      memory=budget.Budget(budget.rss_bytes() / 2**20 + 400, "test"))
    assert result.calib_batch_size == 1 and result.calib_samples_used == len(calib.x)
    assert _activation_scales(squeezed) == pytest.approx(whole, rel=1e-6)


# --- dynamic quantization ---------------------------------------------------------------------

def test_dynamic_default_leaves_conv_alone_and_quantizes_linear(fp32_path, tmp_path):
    ops = onnxutil.op_counts(_dynamic(fp32_path, tmp_path))
    assert "ConvInteger" not in ops
    assert ops.get("Conv") == 2
    assert "MatMulInteger" in ops or "DynamicQuantizeLinear" in ops
    assert "Gemm" not in ops and "MatMul" not in ops  # the Linear did not stay float


def test_dynamic_with_conv_gives_convinteger(fp32_path, tmp_path):
    ops = onnxutil.op_counts(_dynamic(fp32_path, tmp_path, op_types=("Conv", "MatMul", "Gemm")))
    assert ops.get("ConvInteger") == 2
    assert "Conv" not in ops


def test_dynamic_weights_are_int8(fp32_path, tmp_path):
    model = _dynamic(fp32_path, tmp_path)
    int8 = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8]
    assert any(int(np.prod(i.dims)) == 8 * 8 * 8 * 4 for i in int8)  # the Linear's weight


def test_dynamic_excluded_linear_stays_float(fp32_path, fp32, tmp_path):
    (gemm,) = [n.name for n in fp32.graph.node if n.op_type == "Gemm"]
    assert graph.unknown_nodes(fp32, (gemm,)) == []  # the stage's own check accepts the name
    ops = onnxutil.op_counts(_dynamic(fp32_path, tmp_path, nodes_to_exclude=(gemm,)))
    assert "MatMulInteger" not in ops


def test_dynamic_gemm_op_type_quantizes_the_linear(fp32_path, fp32, tmp_path):
    assert "Gemm" in onnxutil.op_counts(fp32)  # the exported Linear is a Gemm
    ops = onnxutil.op_counts(_dynamic(fp32_path, tmp_path, op_types=("Gemm",)))
    assert "MatMulInteger" in ops


# --- accuracy vs FP32 -------------------------------------------------------------------------

# Each 8-bit MinMax-calibrated tensor is rounded to 1/255 of its range (~0.4%); three
# requantized activations plus the weights stay within a few steps, so 2% of the FP32 logit
# range is a loose bound (measured here: ~0.3%). A wrong scale, axis or zero point blows it.
REL_TOLERANCE = 0.02


@pytest.mark.parametrize("variant", ["static", "static_per_tensor", "static_qoperator",
                                     "dynamic", "dynamic_conv"])
def test_quantized_stays_close_to_fp32(variant, fp32_path, tmp_path, calib, info):
    x = data.normalize(calib.x, info)
    ref = _logits(fp32_path, x)
    assert (ref.argmax(1) == calib.y).mean() == 1.0  # the tiny model has learned the task
    model = {
        "static": lambda: _static(fp32_path, tmp_path, calib, info),
        "static_per_tensor": lambda: _static(fp32_path, tmp_path, calib, info, per_channel=False),
        "static_qoperator": lambda: _static(fp32_path, tmp_path, calib, info,
                                            quant_format=QuantFormat.QOperator),
        "dynamic": lambda: _dynamic(fp32_path, tmp_path),
        "dynamic_conv": lambda: _dynamic(fp32_path, tmp_path, op_types=("Conv", "MatMul", "Gemm")),
    }[variant]()
    got = _logits(model, x)
    assert got.shape == ref.shape
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9
    assert np.abs(got - ref).max() <= REL_TOLERANCE * (ref.max() - ref.min())
    assert not np.array_equal(got, ref)  # it really is a different (quantized) computation


# --- settings warnings and boundary checks ----------------------------------------------------

def test_slow_combination_warnings_empty_for_defaults():
    assert ort_static.slow_combination_warnings(QuantizeStaticParams()) == []


def test_slow_combination_warns_for_s8_activations():
    found = ort_static.slow_combination_warnings(QuantizeStaticParams(activation_type=QuantType.QInt8))
    assert len(found) == 1
    assert "QInt8" in found[0] and "QUInt8" in found[0]


def test_slow_combination_names_qoperator():
    found = ort_static.slow_combination_warnings(QuantizeStaticParams(
        activation_type=QuantType.QInt8, quant_format=QuantFormat.QOperator))
    assert len(found) == 1 and "QOperator" in found[0]


def test_slow_combination_warns_for_u8_weights():
    found = ort_static.slow_combination_warnings(QuantizeStaticParams(weight_type=QuantType.QUInt8))
    assert len(found) == 1
    assert "weight_type: QInt8" in found[0]


def test_check_calibration_accepts_matching_data(calib, info, fp32):
    assert graph.check_calibration(calib.x, info.input_shape, fp32) is None


def test_check_calibration_refuses_an_empty_set(info, fp32):
    with pytest.raises(UserError, match="empty") as e:
        graph.check_calibration(np.zeros((0, *SHAPE), np.uint8), info.input_shape, fp32)
    assert "prepare.calib_size" in str(e.value)


@pytest.mark.parametrize("shape", [(4, 1, 8, 8), (4, 3, 12, 12)])
def test_check_calibration_refuses_a_wrong_shape(shape, info, fp32):
    with pytest.raises(UserError) as e:
        graph.check_calibration(np.zeros(shape, np.uint8), info.input_shape, fp32)
    assert str(tuple(shape[1:])) in str(e.value)


def test_check_calibration_refuses_a_wrong_rank(info, fp32):
    with pytest.raises(UserError):
        graph.check_calibration(np.zeros((4, *SHAPE, 1), np.uint8), info.input_shape, fp32)


def test_unknown_nodes(fp32, conv_names):
    assert graph.unknown_nodes(fp32, tuple(conv_names)) == []
    assert graph.unknown_nodes(fp32, (conv_names[0], "conv9", "Conv_0")) == ["conv9", "Conv_0"]
    assert graph.unknown_nodes(fp32, ()) == []


def _activation_scales(model: onnx.ModelProto) -> dict[str, float]:
    """Scalar scales of activation QuantizeLinear nodes, by tensor name."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    return {n.input[0]: float(inits[n.input[1]]) for n in model.graph.node
            if n.op_type == "QuantizeLinear" and inits[n.input[1]].size == 1}


def test_entropy_calibration_reaches_the_histogram_bins(fp32_path, tmp_path, calib, info):
    from onnxruntime.quantization import CalibrationMethod

    minmax = _activation_scales(_static(fp32_path, tmp_path, calib, info))
    entropy = _activation_scales(_static(fp32_path, tmp_path, calib, info,
                                         calibrate_method=CalibrationMethod.Entropy))
    # ORT's own 128/128 default would reproduce MinMax exactly; 2048 bins searched for a
    # 128-bin range clip at least one activation range.
    assert minmax.keys() == entropy.keys()
    assert any(entropy[k] < 0.99 * minmax[k] for k in minmax)
    same = _activation_scales(_static(fp32_path, tmp_path, calib, info,
                                      calibrate_method=CalibrationMethod.Entropy,
                                      calib_num_bins=129, calib_num_quantized_bins=128))
    assert same == pytest.approx(minmax, rel=0.02)


@pytest.mark.parametrize("num_bins, num_quantized_bins", [(2048, 128), (512, 128), (257, 64)])
def test_entropy_thresholds_are_ort_s_own(num_bins, num_quantized_bins):
    """quantpipe's Entropy collector chooses, tensor by tensor, the very thresholds ORT's
    HistogramCollector chooses, on histograms ORT collected: dense, sparse (ReLU zeros), heavy
    tailed, grown by merging a wider batch, one that is all zeros but its last bin."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    from quantpipe.engines.entropy import EntropyCollector

    rng = np.random.default_rng(0)
    batches = [{"normal": rng.normal(0, 1, 4000).astype(np.float32),
                "relu": np.maximum(rng.normal(0, 1, 4000), 0).astype(np.float32),
                "tailed": rng.standard_t(2, 4000).astype(np.float32),
                "spike": np.r_[np.zeros(3999), 7.0].astype(np.float32)},
               {"normal": rng.normal(0, 3, 4000).astype(np.float32),  # a wider range: merged
                "relu": np.maximum(rng.normal(0, 1, 4000), 0).astype(np.float32),
                "tailed": rng.standard_t(2, 4000).astype(np.float32),
                "spike": np.zeros(4000, np.float32)}]
    results = []
    for kind in HistogramCollector, EntropyCollector:
        collector = kind(method="entropy", symmetric=False, num_bins=num_bins,
                         num_quantized_bins=num_quantized_bins, percentile=99.999,
                         scenario="same")
        for batch in batches:
            collector.collect({name: [value] for name, value in batch.items()})
        results.append(collector.compute_collection_result())
    theirs, ours = results
    assert theirs.keys() == ours.keys()
    for name in theirs:
        assert [np.asarray(v).tolist() for v in ours[name]] == \
            [np.asarray(v).tolist() for v in theirs[name]], name
    # not all the full range: the search chose something
    assert any(theirs[n][1] < theirs[n][3][-1] for n in theirs)


def test_strided_calibration_reads_every_slice(fp32_path, tmp_path, calib, info):
    reader = _reader(calib, info)
    reader.set_range(4, 9)
    assert sum(len(b[onnxutil.INPUT_NAME]) for b in iter(reader.get_next, None)) == 5
    whole = _activation_scales(_static(fp32_path, tmp_path, calib, info))
    strided = _activation_scales(_static(fp32_path, tmp_path, calib, info,
                                         extra_options={"CalibStridedMinMax": len(calib.x) // 2}))
    assert strided == pytest.approx(whole, rel=1e-6)  # min/max of slices merge to the same range


def test_a_tensor_without_a_finite_range_ends_calibration_in_one_line(fp32_path, fp32, tmp_path,
                                                                       calib, info):
    """A log of 0 inside the model: MinMax would make an infinite scale of it and ORT's
    histograms fail in numpy; both ways of calibrating name the tensor instead."""
    model = onnx.ModelProto()
    model.CopyFrom(fp32)
    logits = model.graph.output[0].name
    model.graph.node.extend([onnx.helper.make_node("Sub", [logits, logits], ["zero"]),
                             onnx.helper.make_node("Log", ["zero"], ["log_zero"]),
                             onnx.helper.make_node("Add", [logits, "log_zero"], ["scores"])])
    model.graph.output[0].name = "scores"
    pre = tmp_path / "pre.onnx"
    onnx.save(model, tmp_path / "log.onnx")
    graph.preprocess(tmp_path / "log.onnx", pre)
    calib = calib.take(np.arange(32))
    for method in CalibrationMethod.MinMax, CalibrationMethod.Entropy:
        p = QuantizeStaticParams(calibrate_method=method, calib_batch_size=CALIB_BATCH)
        with pytest.raises(UserError, match="tensor (log_zero|scores) of the FP32 model.* "
                                            "non-finite values on the calibration data"):
            ort_static.calibrate(pre, _reader(calib, info), p, {}, tmp_path / "ranges.json")
    with pytest.raises(UserError, match="non-finite values on the calibration data"):
        ort_static.collect_outputs(pre, _reader(calib, info), QuantizeStaticParams(), tmp_path)
