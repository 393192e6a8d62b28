"""Where static INT8 goes, decided from the graph: multiply-accumulates per node and op type
(graph.macs_by_node, mac_share), the op types ort_static quantizes (a CNN with one attention
block gets its convs in INT8, a transformer Gemm/MatMul only), the ladder's attention rung, a
YOLO head's decode kept float (graph.output_tail with its DFL) while its SiLUs stay
quantizable, and the report's reason when a static model computes mostly in float."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from helpers import ROOT, TinyViT, TwoConvNet, export_to, info_for, structured_images, trained_on
from quantpipe import criterion, data, report
from quantpipe.engines import graph, nncf_ptq, ort_static
from quantpipe.models import build_model
from quantpipe.schemas.quantize_static import QuantizeStaticParams

ULTRALYTICS = sorted((ROOT / "tests/fixtures/ultralytics").glob("*.onnx"))


# --- tiny models ------------------------------------------------------------------------------

class PSA(nn.Module):
    """YOLO11's position-sensitive attention at one head: Q·Kᵀ over the pixels, softmax, ·V, a
    depthwise positional conv beside it and a 1x1 projection, all on a feature map."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)
        self.pe = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.scale = c ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).view(b, 3, c, h * w).unbind(1)
        attention = ((q.transpose(-2, -1) @ k) * self.scale).softmax(-1)
        out = (v @ attention.transpose(-2, -1)).view(b, c, h, w) + self.pe(v.reshape(b, c, h, w))
        return x + self.proj(out)


class ConvAttentionNet(nn.Module):
    """A CNN with SiLU convs and one attention block at 6x6: about 90% of its MACs in Conv."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.SiLU(),
                                  nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.SiLU())
        self.psa = PSA(32)
        self.neck = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.SiLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.neck(self.psa(self.stem(x))).mean((2, 3)))


REG_MAX = 16


class TinyYolo(nn.Module):
    """An Ultralytics-like detector: SiLU convs, a box branch of 4 x REG_MAX bins and a class
    branch concatenated and split again, the DFL (softmax over the bins, then a fixed 1x1 conv
    of weight arange(REG_MAX)), anchor and stride arithmetic, class Sigmoid, final Concat."""

    def __init__(self, classes: int = 3, size: int = 32) -> None:
        super().__init__()

        def silu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.SiLU())

        self.backbone = nn.Sequential(silu(1, 8, 2), silu(8, 16, 2))
        self.box = nn.Sequential(silu(16, 16), nn.Conv2d(16, 4 * REG_MAX, 1))
        self.cls = nn.Sequential(silu(16, 16), nn.Conv2d(16, classes, 1))
        self.dfl = nn.Conv2d(REG_MAX, 1, 1, bias=False).requires_grad_(False)
        self.dfl.weight.data[:] = torch.arange(REG_MAX, dtype=torch.float32).view(1, REG_MAX, 1, 1)
        cells = size // 4
        ys, xs = torch.meshgrid(torch.arange(cells) + 0.5, torch.arange(cells) + 0.5, indexing="ij")
        self.register_buffer("anchors", torch.stack([xs.flatten(), ys.flatten()]).unsqueeze(0))
        self.stride, self.classes = 4.0, classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features, b = self.backbone(x), x.shape[0]
        y = torch.cat([self.box(features).flatten(2), self.cls(features).flatten(2)], 1)
        box, cls = y.split((4 * REG_MAX, self.classes), 1)
        a = box.shape[-1]
        bins = box.view(b, 4, REG_MAX, a).transpose(2, 1).softmax(1)
        lt, rb = self.dfl(bins).view(b, 4, a).chunk(2, 1)
        x1y1, x2y2 = self.anchors - lt, self.anchors + rb
        boxes = torch.cat([(x1y1 + x2y2) / 2, x2y2 - x1y1], 1) * self.stride
        return torch.cat([boxes, cls.sigmoid()], 1)


def _never_real(path: Path) -> criterion.Judged:
    return criterion.Judged({"drop_pts": 0.0, "real_drop": False, "verdict": "ok",
                             "pool": {"agreement": 1.0}}, np.zeros(1))


def _ops(model: onnx.ModelProto) -> dict[str, str]:
    return {n.name: n.op_type for n in model.graph.node}


def _through_dq(model: onnx.ModelProto, name: str, inputs: slice = slice(1, 2)) -> bool:
    """Whether node `name` reads its inputs[inputs] (the weight by default) from DequantizeLinear."""
    producers = {out: n.op_type for n in model.graph.node for out in n.output}
    (node,) = [n for n in model.graph.node if n.name == name]
    return all(producers.get(i) == "DequantizeLinear" for i in node.input[inputs])


def _silu_sigmoids(model: onnx.ModelProto) -> list[str]:
    """Sigmoids of SiLU activations: a Sigmoid whose output a Mul multiplies by its own input."""
    sigmoids = {n.output[0]: n for n in model.graph.node if n.op_type == "Sigmoid"}
    return [sigmoids[i].name for n in model.graph.node if n.op_type == "Mul"
            for i in n.input if i in sigmoids and sigmoids[i].input[0] in n.input]


@pytest.fixture(scope="module")
def calib12():
    split = structured_images(48, size=12, seed=0)
    return split, info_for(split)


@pytest.fixture(scope="module")
def conv_attention(tmp_path_factory, calib12) -> Path:
    split, info = calib12
    torch.manual_seed(0)
    model = trained_on(ConvAttentionNet(), data.normalize(split.x, info), split.y)
    return export_to(model, (1, 12, 12), tmp_path_factory.mktemp("psa") / "fp32.onnx")


@pytest.fixture(scope="module")
def yolo(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return export_to(TinyYolo().eval(), (1, 32, 32), tmp_path_factory.mktemp("yolo") / "fp32.onnx")


# --- MACs -------------------------------------------------------------------------------------

def test_macs_of_convs_and_a_linear_layer_are_the_hand_counted_ones(tmp_path):
    model = onnx.load(str(export_to(TwoConvNet(1, 12, 4).eval(), (1, 12, 12), tmp_path / "m.onnx")))
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    (fc,) = [n.name for n in model.graph.node if n.op_type == "Gemm"]
    macs = graph.macs_by_node(model)  # per sample, the batch axis being symbolic
    assert macs == {convs[0]: 10 * 10 * 4 * (1 * 3 * 3),   # 10x10 outputs x 4 ch, 1x3x3 each
                    convs[1]: 8 * 8 * 8 * (4 * 3 * 3),     # 8x8 x 8 ch, 4x3x3 each
                    fc: 4 * (8 * 8 * 8)}                   # 4 outputs, 512 inputs each
    total = 3600 + 18432 + 2048
    assert graph.mac_share(model) == {"Conv": round(22032 / total, 4), "Gemm": round(2048 / total, 4)}
    assert graph.describe_mac_share(graph.mac_share(model)) == "Conv 91.5% of MACs, Gemm 8.5%"


def _hand_graph(batch) -> onnx.ModelProto:
    """A grouped conv, a transposed conv, a MatMul of two activations (one reshaped by a shape
    computed from the input's) and a Gemm with transA, on input (batch, 4, 6, 6)."""
    w = lambda name, *shape: numpy_helper.from_array(np.ones(shape, np.float32), name)  # noqa: E731
    nodes = [
        helper.make_node("Conv", ["x", "wg"], ["g"], name="grouped", group=2, pads=[1] * 4),
        helper.make_node("ConvTranspose", ["g", "wt"], ["t"], name="up", strides=[2, 2]),
        helper.make_node("Shape", ["x"], ["xs"], name="shape"),
        helper.make_node("Gather", ["xs", "zero"], ["n"], name="batch", axis=0),
        helper.make_node("Concat", ["n", "rest"], ["to"], name="to", axis=0),
        helper.make_node("Reshape", ["g", "to"], ["q"], name="flat"),          # (N, 8, 36)
        helper.make_node("Transpose", ["q"], ["k"], name="kt", perm=[0, 2, 1]),  # (N, 36, 8)
        helper.make_node("MatMul", ["k", "q"], ["a"], name="qk"),              # (N, 36, 36)
        helper.make_node("ReduceMean", ["a"], ["m"], name="mean", axes=[2], keepdims=0),
        helper.make_node("Gemm", ["m", "wf"], ["y"], name="fc", transA=0),
        helper.make_node("Transpose", ["m"], ["mt"], name="mt", perm=[1, 0]),
        helper.make_node("Gemm", ["mt", "wf"], ["z"], name="fc_t", transA=1)]
    graph_ = helper.make_graph(
        nodes, "hand", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4, 6, 6])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("t", "y", "z")],
        [w("wg", 8, 2, 3, 3), w("wt", 8, 3, 2, 2), w("wf", 36, 5),
         numpy_helper.from_array(np.array([0], np.int64), "zero"),
         numpy_helper.from_array(np.array([8, 36], np.int64), "rest")])
    return helper.make_model(graph_, opset_imports=[helper.make_opsetid("", 13)])


HAND_MACS = {"grouped": 6 * 6 * 8 * (2 * 3 * 3),  # outputs x C/group x kernel
             "up": 8 * 6 * 6 * (3 * 2 * 2),       # inputs x M/group x kernel
             "qk": 36 * 36 * 8, "fc": 5 * 36, "fc_t": 5 * 36}


@pytest.mark.parametrize("batch", ["N", 3])
def test_macs_per_sample_of_every_compute_op_with_a_symbolic_or_fixed_batch(batch):
    assert graph.macs_by_node(_hand_graph(batch)) == HAND_MACS


def test_a_shape_nobody_knows_is_counted_as_unknown_and_said():
    model = _hand_graph("N")
    # The MatMul now reads a tensor of a custom op: no shape inference knows its shape.
    model.graph.node.insert(7, helper.make_node("Mystery", ["k"], ["k2"], name="mystery",
                                                domain="example.custom"))
    model.graph.node[8].input[0] = "k2"
    model.opset_import.append(helper.make_opsetid("example.custom", 1))
    unknown = ["qk", "fc", "fc_t"]  # the MatMul and the Gemms after it
    assert graph.macs_by_node(model) == {**HAND_MACS, **dict.fromkeys(unknown)}
    summary = graph.mac_summary(model)
    assert summary["macs_unknown"] == unknown and summary["macs_by_op_type"] == {
        "Conv": round(HAND_MACS["grouped"] / (HAND_MACS["grouped"] + HAND_MACS["up"]), 4),
        "ConvTranspose": round(HAND_MACS["up"] / (HAND_MACS["grouped"] + HAND_MACS["up"]), 4)}
    assert summary["macs_per_sample"] == HAND_MACS["grouped"] + HAND_MACS["up"]
    assert graph.describe_mac_share(summary["macs_by_op_type"], 3).endswith(
        "(3 compute node(s) of unknown shape not counted)")
    del model.graph.input[0].type.tensor_type.shape.dim[:]  # no input shape at all: nothing known
    model.graph.input[0].type.tensor_type.ClearField("shape")
    assert graph.mac_share(model) == {} and graph.mac_summary(model)["mac_share_int8"] is None


# --- which op types -----------------------------------------------------------------------------

def test_a_cnn_with_one_attention_block_gets_its_convs_in_int8(conv_attention, calib12, tmp_path):
    split, info = calib12
    fp32 = onnx.load(str(conv_attention))
    assert len(ort_static.attention_matmuls(fp32)) == 2  # what the old transformer rule saw
    shares = graph.mac_share(fp32)
    assert list(shares)[0] == "Conv" and shares["Conv"] > 0.8 and shares["MatMul"] > 0.05
    out = tmp_path / "static.onnx"
    result = ort_static.quantize_static_with_fallback(
        conv_attention, out, split.x, info, QuantizeStaticParams(max_fallback_steps=0), _never_real)
    assert result.op_types_to_quantize == []
    assert result.op_selection.startswith(f"Conv {shares['Conv']:.1%} of MACs, MatMul")
    assert "every op type" in result.op_selection
    model = onnx.load(str(out))
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 6 and all(_through_dq(model, c) for c in convs)
    assert result.nodes_in_float == []
    summary = graph.mac_summary(model)
    assert summary["mac_share_int8"] > 0.9 and summary["macs_by_op_type"] == shares


def test_the_ladder_puts_the_attention_back_in_float_first(conv_attention, calib12, tmp_path):
    """A drop the attention causes (this check: real while any attention MatMul reads INT8
    operands): the attention rung, right after the calibration methods, leaves the MatMuls and
    their Softmax in float, and the convs stay INT8."""
    split, info = calib12
    attention = ort_static.attention_matmuls(onnx.load(str(conv_attention)))

    def check(path: Path) -> criterion.Judged:
        model = onnx.load(str(path))
        real = any(_through_dq(model, name, slice(0, 2)) for name in attention)
        return criterion.Judged({"drop_pts": 5.0 if real else 0.0, "real_drop": real,
                                 "verdict": "drop" if real else "ok", "pool": {"agreement": 1.0}},
                                np.array([real]))

    out = tmp_path / "static.onnx"
    result = ort_static.quantize_static_with_fallback(conv_attention, out, split.x, info,
                                                      QuantizeStaticParams(), check)
    assert [s["rung"] for s in result.steps] == ["plain", "calibration", "calibration", "attention"]
    assert result.final["rung"] == "attention" and not result.final["real_drop"]
    fp32 = onnx.load(str(conv_attention))
    core, ops = ort_static.attention_core(fp32), _ops(fp32)
    # The block between its convs: reshapes, split, the scale, Softmax, transposes, the Add of
    # the positional conv; not a conv, not the SiLUs around it.
    assert {"MatMul", "Softmax", "Mul", "Transpose", "Reshape", "Add"} <= {ops[n] for n in core}
    assert not {"Conv", "Sigmoid", "Gemm"} & {ops[n] for n in core}
    assert result.fallback_nodes == core and sorted(result.nodes_in_float) == sorted(attention)
    model = onnx.load(str(out))
    assert all(_through_dq(model, n.name) for n in model.graph.node if n.op_type == "Conv")
    # Everything but the attention MatMuls' MACs in INT8.
    assert graph.mac_summary(model)["mac_share_int8"] == pytest.approx(
        1 - graph.mac_share(model)["MatMul"], abs=2e-4)
    assert f"the attention ({len(core)} nodes) in float: drop 0.00 points" in result.tried()


def test_a_transformer_keeps_gemm_and_matmul_only(tmp_path):
    torch.manual_seed(0)
    fp32 = onnx.load(str(export_to(TinyViT().eval(), (1, 12, 12), tmp_path / "vit.onnx")))
    shares = graph.mac_share(fp32)
    assert shares["MatMul"] + shares["Gemm"] > 0.5 > shares["Conv"]
    op_types, why = ort_static.static_op_types(fp32, ())
    assert op_types == ("Gemm", "MatMul")
    assert why.startswith("attention (2 MatMul(s) of two activations")
    assert f"Gemm/MatMul {shares['MatMul'] + shares['Gemm']:.1%} of MACs" in why
    assert ort_static.static_op_types(fp32, ("Conv",)) == (("Conv",), "quantize_static.op_types_to_quantize")


def test_the_default_cnn_quantizes_every_op_type_as_before(calib12, tmp_path):
    """mnist_net (2 conv + 2 fc, no attention): every op type, nothing in float, all its MACs
    in INT8; the op types ORT gets are the same as before the MAC rule (none named), so its
    static.onnx is byte for byte what it was."""
    split, info = calib12
    torch.manual_seed(0)
    path = export_to(build_model("mnist_net", 1, 12, 4).eval(), (1, 12, 12), tmp_path / "fp32.onnx")
    out = tmp_path / "static.onnx"
    result = ort_static.quantize_static_with_fallback(
        path, out, split.x, info, QuantizeStaticParams(max_fallback_steps=0), _never_real)
    assert result.op_types_to_quantize == [] and result.op_selection.endswith(
        "every op type ORT quantizes (no attention in the graph)")
    model = onnx.load(str(out))
    assert result.nodes_in_float == [] and graph.mac_summary(model)["mac_share_int8"] == 1.0


# --- a YOLO head ----------------------------------------------------------------------------

DECODE_OPS = {"Softmax", "Conv", "Sigmoid", "Concat", "Split", "Sub", "Add", "Div", "Mul"}


def test_a_yolo_decode_is_the_tail_and_its_silus_are_not(yolo):
    model = onnx.load(str(yolo))
    ops = _ops(model)
    (dfl,) = graph.dfl_convs(model)
    tail = graph.output_tail(model)
    assert dfl in tail and DECODE_OPS <= {ops[n] for n in tail}
    softmax = [n for n in ops if ops[n] == "Softmax"]
    assert softmax and set(softmax) <= set(tail)
    # The head's concat and split, the class Sigmoid and the last Concat are decode ...
    last = model.graph.node[-1]
    assert last.op_type == "Concat" and last.name in tail
    head_concat = next(n for n in model.graph.node if n.op_type == "Concat")
    assert head_concat.name in tail
    # ... every SiLU is not, and every other conv computes features.
    silus = _silu_sigmoids(model)
    assert len(silus) == 4 and not set(silus) & set(tail)
    assert [n for n in tail if ops[n] == "Conv"] == [dfl]
    # Without the Softmax before it, the same conv is a feature conv: no decode.
    plain = onnx.load(str(yolo))
    for node in plain.graph.node:
        if node.op_type == "Softmax":
            node.op_type = "Relu"
            del node.attribute[:]
    assert graph.dfl_convs(plain) == [] and dfl not in graph.output_tail(plain)


def test_a_yolo_static_model_keeps_its_decode_float_and_its_convs_int8(yolo, tmp_path):
    split = structured_images(32, size=32, seed=0)
    info = info_for(split)
    out = tmp_path / "static.onnx"
    result = ort_static.quantize_static_with_fallback(
        yolo, out, split.x, info, QuantizeStaticParams(max_fallback_steps=0), _never_real,
        float_tail=True)
    fp32 = onnx.load(str(yolo))
    (dfl,) = graph.dfl_convs(fp32)
    assert dfl in result.tail_in_float and result.nodes_in_float == [dfl]
    model = onnx.load(str(out))
    assert not _through_dq(model, dfl)
    assert all(_through_dq(model, n.name) for n in model.graph.node
               if n.op_type == "Conv" and n.name != dfl)
    # The SiLUs' Sigmoids run on quantized tensors; no QuantizeLinear reads the decode's.
    assert all(_through_dq(model, s, slice(0, 1)) for s in _silu_sigmoids(fp32))
    tail_outputs = {o for n in fp32.graph.node if n.name in result.tail_in_float for o in n.output}
    assert not [n for n in model.graph.node if n.op_type == "QuantizeLinear"
                and n.input[0] in tail_outputs]
    assert graph.mac_summary(model)["mac_share_int8"] > 0.95


def test_nncf_keeps_the_same_yolo_decode_in_float(yolo, tmp_path):
    split = structured_images(16, size=32, seed=0)
    info = info_for(split)
    out = tmp_path / "static.onnx"
    result = nncf_ptq.quantize_static_nncf(
        yolo, out, split.x, info, QuantizeStaticParams(max_fallback_steps=0), _never_real,
        np.zeros((0, 1, 32, 32), np.float32), np.zeros(0, np.int64), lambda model, x: x,
        float_tail=True)
    fp32 = onnx.load(str(yolo))
    (dfl,) = graph.dfl_convs(fp32)
    assert result.tail_in_float == graph.output_tail(fp32) and dfl in result.tail_in_float
    model = onnx.load(str(out))
    assert dfl in result.nodes_in_float and not _through_dq(model, dfl)
    assert graph.mac_summary(model)["mac_share_int8"] > 0.95


def test_nncf_mixed_gives_openvino_int8_convs_and_onnx_runtime_the_same_outputs(yolo, tmp_path):
    """Preset mixed (asymmetric activations, Ultralytics' own choice): NNCF's ONNX backend
    writes those quantizers as int8 with a zero point, whose convolutions OpenVINO runs in FP32;
    the engine writes the same grid as uint8: identical outputs, INT8 convolutions."""
    import dataclasses

    import nncf
    import onnxruntime as ort

    from quantpipe.runtimes.ov import OpenVino
    from quantpipe.schemas.quantize_static import NNCFParams, NNCFPreset

    split = structured_images(16, size=32, seed=0)
    info = info_for(split)
    p = QuantizeStaticParams(max_fallback_steps=0, nncf=NNCFParams(preset=NNCFPreset.mixed))
    fp32 = onnx.load(str(yolo))
    tail = tuple(graph.output_tail(fp32))
    signed = nncf.quantize(fp32, nncf_ptq.calibration_dataset(fp32, split.x, info),
                           **nncf_ptq.quantize_options(dataclasses.replace(p, nodes_to_exclude=tail),
                                                       len(split.x)))
    onnx.save(signed, str(tmp_path / "signed.onnx"))
    out = tmp_path / "static.onnx"
    nncf_ptq.quantize_static_nncf(
        yolo, out, split.x, info, p, _never_real, np.zeros((0, 1, 32, 32), np.float32),
        np.zeros(0, np.int64), lambda model, x: x, float_tail=True)

    def zero_points(path: Path) -> set:
        model = onnx.load(str(path))
        inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        return {(str(inits[n.input[2]].dtype), bool(inits[n.input[2]].any()))
                for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits}

    assert ("int8", True) in zero_points(tmp_path / "signed.onnx")
    assert zero_points(out) == {("uint8", True)}
    x = data.normalize(split.x, info)
    name = graph.graph_input(fp32).name
    assert np.array_equal(*(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                            .run(None, {name: x})[0] for path in (tmp_path / "signed.onnx", out)))

    def conv_precisions(path: Path) -> set[str]:
        return {k["precision"] for k in OpenVino().kernels(path, x[:1], 1, {})
                if k["layer"] == "Convolution"}

    (dfl,) = graph.dfl_convs(fp32)
    assert "f32" in conv_precisions(tmp_path / "signed.onnx")
    # Every convolution but the DFL's (the decode, kept float) runs INT8.
    kernels = [k for k in OpenVino().kernels(out, x[:1], 1, {}) if k["layer"] == "Convolution"]
    assert sum(k["count"] for k in kernels if k["precision"] in ("u8", "i8")) == \
        sum(n.op_type == "Conv" for n in fp32.graph.node) - 1, kernels


# --- real Ultralytics exports -----------------------------------------------------------------

def _fixture_shape() -> tuple[int, int, int]:
    """One sample's input dims of the fixtures (their height and width are symbolic)."""
    import json

    size = json.loads((ROOT / "tests/fixtures/ultralytics/fixtures.json").read_text())["imgsz"]
    return 3, size, size


needs_fixtures = pytest.mark.skipif(
    not ULTRALYTICS, reason="no Ultralytics exports in tests/fixtures/ultralytics "
                            "(scripts/ultralytics_fixtures.py makes them)")


@needs_fixtures
@pytest.mark.parametrize("path", ULTRALYTICS, ids=[p.stem for p in ULTRALYTICS])
def test_ultralytics_exports_get_their_convs_in_int8_and_their_decode_in_float(path):
    model = onnx.load(str(path))
    ops = _ops(model)
    assert graph.mac_share(model) == {}  # symbolic height and width: nothing to count ...
    macs = graph.macs_by_node(model, _fixture_shape())  # ... until a sample's size is given
    assert None not in macs.values()
    shares = graph.mac_share(model, macs)
    assert list(shares)[0] == "Conv" and shares["Conv"] > 0.9, shares
    op_types, why = ort_static.static_op_types(model, (), _fixture_shape())
    assert op_types == ()  # every op type, attention (YOLO11's C2PSA) or not
    if ort_static.attention_matmuls(model):
        assert "every op type, as Gemm/MatMul hold only" in why
    (dfl,) = graph.dfl_convs(model)
    tail = graph.output_tail(model)
    assert dfl in tail and {"Softmax", "Sigmoid", "Concat", "Sub", "Add", "Mul"} <= {
        ops[n] for n in tail}
    assert model.graph.node[-1].name in tail
    silus = _silu_sigmoids(model)
    assert len(silus) > 40 and not set(silus) & set(tail)
    assert [n for n in tail if ops[n] in graph.COMPUTE_OPS] == [dfl]


@needs_fixtures
@pytest.mark.parametrize("path", ULTRALYTICS, ids=[p.stem for p in ULTRALYTICS])
def test_an_ultralytics_static_model_computes_in_int8(path, tmp_path):
    channels, size, _ = _fixture_shape()
    split = structured_images(16, channels=channels, size=size, seed=0)
    out = tmp_path / "static.onnx"
    result = ort_static.quantize_static_with_fallback(
        path, out, split.x, info_for(split), QuantizeStaticParams(max_fallback_steps=0),
        _never_real, float_tail=True)
    assert result.op_types_to_quantize == []
    model = onnx.load(str(out))
    (dfl,) = graph.dfl_convs(onnx.load(str(path)))
    assert result.nodes_in_float == [dfl] and dfl in result.tail_in_float
    summary = graph.mac_summary(model, _fixture_shape())
    assert summary["mac_share_int8"] > 0.95 and summary["macs_unknown"] == []


# --- the report -------------------------------------------------------------------------------

def test_the_report_gives_float_compute_as_the_reason_static_is_not_faster():
    from test_bench_report import VNNI_MACHINE, _bench, _eval

    evals = {"fp32": _eval("fp32", 0.98, 1.0, 4_000_000),
             "static": _eval("static", 0.97, 0.985, 1_000_000)}
    benches = {"fp32": _bench("fp32", {"bs1": 0.2, "bs64": 8.0}),
               "static": _bench("static", {"bs1": 0.196, "bs64": 8.1})}
    summary = report.build_summary(evals, benches)
    stage = {"mac_share_int8": 0.0, "macs_by_op_type": {"Conv": 0.978, "MatMul": 0.022},
             "op_types_to_quantize": ["Gemm", "MatMul"], "op_selection": "attention (2 ...)",
             "nodes_in_float": [f"conv{i}" for i in range(88)]}
    (note,) = report.slowdown_notes(summary, evals, VNNI_MACHINE, stages={"static": stage})
    assert note.startswith("static keeps 100% of its MACs in float (Conv 98%, MatMul 2% of its "
                           "MACs), so INT8 can speed up at most the other 0% of its arithmetic "
                           "(x1.02 at bs1, x0.99 at bs64 against FP32)")
    assert "op_types_to_quantize is Gemm, MatMul (attention (2 ...))" in note
    assert "88 compute node(s) in float" in note
    assert "little arithmetic" not in note and "slowest kernel" not in note
    # With its MACs in INT8 the note is the usual slowdown one, with the share; without the
    # stage's record, the same without it.
    mostly_int8 = {**stage, "mac_share_int8": 0.97}
    (note,) = report.slowdown_notes(summary, evals, VNNI_MACHINE, stages={"static": mostly_int8})
    assert note.startswith("static is slower than FP32 at bs64: at bs64 INT8 kernels gain little")
    assert note.endswith("(97.0% of its MACs run in INT8).")
    (plain,) = report.slowdown_notes(summary, evals, VNNI_MACHINE)
    assert plain == note.replace(" (97.0% of its MACs run in INT8)", "")
