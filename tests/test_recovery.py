"""A genuinely PTQ-hard model, and the two fallbacks that recover it: ORT's recovery ladder
(quantpipe.engines.ort_static) and NNCF's quantize_with_accuracy_control
(quantpipe.engines.nncf_ptq).

The hard model is a trained tiny CNN with one outlier activation channel (with_outlier_channel:
same FP32 function, one channel 1000x the others), judged by the real criterion
(quantpipe.criterion) on a labelled validation set and an unlabelled pool.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from helpers import TwoConvNet, export_to, info_for, structured_images, trained_on
from quantpipe import criterion, data, onnxutil
from quantpipe.engines import base, graph, nncf_ptq, ort_static
from quantpipe.errors import UserError
from quantpipe.schemas.quantize_static import NNCFParams, QuantizeStaticParams

LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
SHAPE = (1, 12, 12)
SCALE, CHANNEL = 1000.0, 3


@pytest.fixture(scope="module")
def sets():
    train = structured_images(600, size=12, seed=0)
    info = info_for(train)
    return train, structured_images(300, size=12, seed=1), structured_images(600, size=12, seed=2), info


@pytest.fixture(scope="module")
def fp32_path(tmp_path_factory, sets) -> Path:
    train, _, _, info = sets
    torch.manual_seed(0)
    model = trained_on(TwoConvNet(*SHAPE[:2], num_classes=4), data.normalize(train.x, info),
                       train.y, steps=30)
    return export_to(model, SHAPE, tmp_path_factory.mktemp("recovery") / "fp32.onnx")


@pytest.fixture(scope="module")
def hard_path(fp32_path) -> Path:
    path = fp32_path.with_name("hard.onnx")
    onnx.save(onnxutil.with_outlier_channel(onnx.load(str(fp32_path)), SCALE, CHANNEL), str(path))
    return path


def _predict(model: Path | bytes, x: np.ndarray) -> np.ndarray:
    return onnxutil.run_batched(onnxutil.make_session(model, level=LEVEL), x).argmax(1)


@pytest.fixture(scope="module")
def judge(hard_path, sets):
    """check() as the quantize_static stage builds it: val with labels, pool without."""
    _, val, pool, info = sets
    val_x, pool_x = data.normalize(val.x, info), data.normalize(pool.x, info)
    ref_val, ref_pool = _predict(hard_path, val_x), _predict(hard_path, pool_x)
    p = QuantizeStaticParams().for_task("classification")

    def check(path: Path) -> criterion.Judged:
        return criterion.assess(_predict(path, val_x), _predict(path, pool_x), ref_val, ref_pool,
                                val.y, max_drop_pp=p.max_drop_pts,
                                significance=p.significance, min_pool_agreement=p.min_pool_agreement,
                                agreement_floor=p.agreement_floor)
    check.pool = (pool_x, ref_pool)
    return check


def test_outlier_channel_keeps_the_fp32_function(fp32_path, hard_path, sets):
    x = data.normalize(sets[1].x, sets[3])
    plain, hard = (onnxutil.run_batched(onnxutil.make_session(p, level=LEVEL), x)
                   for p in (fp32_path, hard_path))
    np.testing.assert_allclose(hard, plain, atol=1e-3)
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(hard_path)).graph.initializer}
    first = next(w for w in weights.values() if w.ndim == 4)
    assert abs(first[CHANNEL]).max() > 100 * abs(np.delete(first, CHANNEL, axis=0)).max()


def test_outlier_channel_needs_conv_relu_conv(tmp_path):
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])])
    with pytest.raises(UserError, match="Conv -> Relu -> Conv"):
        onnxutil.with_outlier_channel(onnx.helper.make_model(graph), 10.0)


def test_plain_ptq_fails_the_criterion_and_the_ladder_recovers(hard_path, sets, judge, tmp_path):
    train, _, _, info = sets
    out = tmp_path / "static.onnx"
    plain = ort_static.quantize_static_with_fallback(hard_path, out, train.x[:64], info,
                                                QuantizeStaticParams(max_fallback_steps=0), judge)
    assert plain.final["real_drop"] and plain.drop_pts > 10

    result = ort_static.quantize_static_with_fallback(hard_path, out, train.x[:64], info,
                                                 QuantizeStaticParams(), judge)
    assert not result.final["real_drop"], result.tried()
    assert result.drop_pts <= 0.5 and result.final["pool"]["agreement"] >= 0.995
    assert result.steps[0]["drop_pts"] == plain.drop_pts
    assert 1 <= len(result.nodes_in_float) < 3  # not simply everything in float
    # What was written is what the last kept step judged.
    assert judge(out).record["pool"] == result.final["pool"]
    assert graph.float_compute_nodes(onnx.load(str(out))) == result.nodes_in_float


def test_nncf_plain_fails_and_accuracy_control_recovers(hard_path, sets, judge, tmp_path):
    train, _, _, info = sets
    pool_x, ref_pool = judge.pool
    out = tmp_path / "static.onnx"

    def run(**overrides) -> base.StaticResult:
        return nncf_ptq.quantize_static_nncf(
            hard_path, out, train.x[:64], info, QuantizeStaticParams(**overrides), judge,
            pool_x, ref_pool, lambda model, x: _predict(model.SerializeToString(), x))

    plain = run(max_fallback_steps=0)
    assert plain.engine == "nncf" and plain.final["real_drop"]
    result = run()
    assert [s["rung"] for s in result.steps] == ["plain", "accuracy_control"]
    assert not result.final["real_drop"] and result.final["pool"]["agreement"] >= 0.995
    assert 1 <= len(result.nodes_in_float) < 3
    model = onnxutil.load_model(out)
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # QDQ, like ORT's
    assert judge(out).record["pool"] == result.final["pool"]


def _biases(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    return {n.input[2]: inits[n.input[2]] for n in model.graph.node
            if n.op_type == "Conv" and len(n.input) > 2}


def test_nncf_options_reach_nncf(fp32_path, sets, tmp_path):
    """Ignored scope keeps a node in float; bias correction 'none' leaves every bias as FP32's,
    'fast' and 'full' shift the quantized layers' biases."""
    train, _, _, info = sets
    fp32 = onnx.load(str(fp32_path))
    conv = [n.name for n in fp32.graph.node if n.op_type == "Conv"][1]
    never = lambda path: criterion.Judged({"drop_pts": 0.0, "real_drop": False,  # noqa: E731
                                           "verdict": "ok", "pool": {}}, np.zeros(1))
    for bias in ("none", "fast", "full"):
        p = QuantizeStaticParams(nodes_to_exclude=(conv,),
                                 nncf=NNCFParams(bias_correction=nncf_ptq.BiasCorrection(bias),
                                                 subset_size=16))
        result = nncf_ptq.quantize_static_nncf(fp32_path, tmp_path / "s.onnx", train.x[:64], info,
                                                  p, never, np.zeros((0, *SHAPE), np.float32),
                                                  np.zeros(0), _predict)
        assert result.nodes_in_float == [conv] and result.calib_samples_used == 16
        before, after = _biases(fp32), _biases(onnx.load(str(tmp_path / "s.onnx")))
        same = [np.array_equal(before[k], after[k]) for k in before]
        assert all(same) if bias == "none" else not all(same), (bias, same)
    with pytest.raises(UserError, match="nodes_to_exclude.*conv9"):
        nncf_ptq.quantize_static_nncf(fp32_path, tmp_path / "s.onnx", train.x[:64], info,
                                         QuantizeStaticParams(nodes_to_exclude=("conv9",)), never,
                                         np.zeros((0, *SHAPE), np.float32), np.zeros(0), _predict)
