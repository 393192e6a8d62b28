"""Is the exported QAT model the fake-quant model it was trained as? quantize_qat's export hop:
the QDQ graph as written against the fake-quant PyTorch model with ONNX's rounding, end to end
(the task's comparison) and, when that is beyond the limits, node by node."""

from __future__ import annotations

import contextlib

import numpy as np
import onnx
import torch
from onnxruntime import GraphOptimizationLevel

from quantpipe import models, onnxutil
from quantpipe.engines.qat import constants, fold_batch_norms
from quantpipe.onnxutil import INPUT_NAME, OUTPUT_NAME, make_session

NODE_SAMPLES = 256  # test images for the node-by-node check (node_parity)


def as_trained_and_exported(qmodel: torch.nn.Module, body: torch.fx.GraphModule,
                            x: np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """The fake-quant model's outputs on x as trained, then as exported: its BatchNorm folded
    (`body`, the fake-quantized graph inside `qmodel`, is folded in place) and x / scale rounded
    as ONNX does (onnx_rounding); batch_size samples per pass."""
    trained = models.predict_torch(qmodel, x, batch_size)
    fold_batch_norms(body)
    with onnx_rounding(body):
        return trained, models.predict_torch(qmodel, x, batch_size)


def export_parity(blob: bytes, proto: onnx.ModelProto, x: np.ndarray, expected: np.ndarray,
                  trained: np.ndarray, compare, level: GraphOptimizationLevel,
                  batch_size: int = 256) -> tuple[dict, np.ndarray]:
    """(the parity record, the deployed model's outputs): the written graph (`blob`, `proto`)
    on test images x against the fake-quant model's
    outputs as exported (`expected`: BN folded, ONNX rounding) by the task's `compare`.
    ORT_DISABLE_ALL runs its QuantizeLinear, DequantizeLinear and float ops one by one, the
    fake-quant model's arithmetic. At the deployed `level` ORT fuses the pairs into integer
    kernels whose requantization rounds differently, one step here and there in every layer:
    that is recorded too, as `deployed` (evaluate@qat judges it against FP32 like static).
    batch_size: samples per run."""
    got = onnxutil.run_batched(onnxutil.make_session(
        blob, level=GraphOptimizationLevel.ORT_DISABLE_ALL), x, batch_size)
    deployed = onnxutil.make_session(blob, level=level)
    fused = onnxutil.run_batched(deployed, x, batch_size)
    got_one = onnxutil.run_batched(deployed, x[:8], batch_size=1)  # the batch axis is dynamic
    return {**compare(got, expected), "output_step": output_step(proto),
            "deployed": {**compare(fused, expected), "level": level.name},
            "batch_one_max_abs_diff": round(onnxutil.max_abs_diff(got_one, fused[:8]), 6),
            # Folding BatchNorm and rounding x / scale change float rounding only.
            "fold_agreement": compare(expected, trained)["agreement"]}, fused


def export_verdict(limits: str | None, parity: dict, body: torch.fx.GraphModule,
                   proto: onnx.ModelProto, x: np.ndarray, scope: str) -> tuple[str | None, str | None]:
    """(why the export is wrong, or None; a note for the log, or None) given the task's
    `limits` verdict on `parity` (which gains `nodes`). A deep network (EfficientNet) carries
    float rounding's one-step flips on to whole logits: node by node, each fake-quant computed
    from the graph's own inputs, tells a faithful export (the limits are then waived) from a
    node written wrong (named)."""
    if not limits:
        return None, None
    nodes = parity["nodes"] = node_parity(body, proto, x[:NODE_SAMPLES], scope=scope)
    where = "" if nodes is None else (
        f"; node by node, {nodes['worst']['node']} differs on "
        f"{nodes['worst']['mismatched']:.2%} of its values, by up to {nodes['max_steps']:g} steps")
    if nodes is not None and nodes["faithful"]:
        return None, (f"outputs beyond the limits ({limits}), but each of {nodes['nodes']} "
                      "fake-quants matches its QDQ node from the same inputs up to float "
                      f"rounding{where}: the fake-quant model's own sensitivity, not the export")
    return (f"the exported QDQ graph differs from the fake-quant PyTorch model on {len(x)} test "
            f"images ({limits}{where})"), None


def output_step(model: onnx.ModelProto) -> float | None:
    """The quantization step of the model's output: the scale of the DequantizeLinear that
    produces it, or None when the output is not quantized."""
    values = constants(model.graph)
    producer = next((n for n in model.graph.node if OUTPUT_NAME in n.output), None)
    if producer is None or producer.op_type != "DequantizeLinear" or producer.input[1] not in values:
        return None
    return float(values[producer.input[1]].max())


@contextlib.contextmanager
def onnx_rounding(qmodel: torch.fx.GraphModule):
    """Within: the activation fake-quants of `qmodel` (per tensor, ranges frozen) round
    x / scale, as ONNX's QuantizeLinear is defined and ONNX Runtime computes it, where torch
    rounds x * (1 / scale). The two land on opposite sides of a rounding boundary now and then,
    and a deep network carries each such flip on to its logits; the reference the exported
    graph is compared with computes what the graph computes (EfficientNet-V2-S at 32 px: max
    logit difference 2.12 -> 1.67, agreement 98.9% -> 99.0%). Weight fake-quants keep torch's
    rounding: the exported int8 weights are computed that way (`_store_weights_int8`)."""
    from torch.ao.quantization import FakeQuantizeBase

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observer_enabled[0] or not self.fake_quant_enabled[0]:
            return type(self).forward(self, x)
        q = torch.clamp(torch.round(x / self.scale) + self.zero_point, self.quant_min, self.quant_max)
        return (q - self.zero_point) * self.scale

    patched = {id(m): m for n in qmodel.graph.nodes if n.op == "call_module"
               for m in [qmodel.get_submodule(n.target)]
               if isinstance(m, FakeQuantizeBase) and m.scale.numel() == 1}
    for module in patched.values():
        module.forward = forward.__get__(module)
    try:
        yield qmodel
    finally:
        for module in patched.values():
            del module.forward


# A graph written faithfully differs from the fake-quant model, given the same inputs, only
# where float rounding (another conv summation order, x / scale against x * (1 / scale)) lands
# on the other side of a rounding boundary: one step, on a few values in 1e5 here (a few in
# 1e4 after a 256-term average). Requantizing 2x2 averages onto their input's grid flipped 2-8%.
NODE_MAX_MISMATCH = 0.01


@torch.no_grad()
def node_parity(qmodel: torch.fx.GraphModule, model: onnx.ModelProto, x: np.ndarray,
                memory_mb: int = 512, scope: str = "") -> dict | None:
    """Each activation fake-quant of `qmodel` against its DequantizeLinear in the exported
    graph (ORT_DISABLE_ALL), computed in torch from the graph's own values of the fake-quants
    before it (teacher forcing): a difference is that node's own, not one carried from
    upstream. A deep network carries a single one-step flip on to whole logits: EfficientNet at
    32 px differs from itself by 1.7-3.9 in its logits when every conv output is perturbed by a
    relative 1e-7, so end-to-end logits cannot tell a faithful export from a wrong node.

    Returns the node count, the worst node (largest share of values off by more than half a
    step, and its largest difference in steps) and `faithful` (every node within one step and
    NODE_MAX_MISMATCH); None when some fake-quant has no DequantizeLinear of its name (the
    exporter names the k-th call of a shared module `<name>_k`). `scope`: where qmodel sits in
    the exported module, e.g. "body/" for a FloatDecode detector's body."""
    from torch.ao.quantization import FakeQuantizeBase

    first_name = {}
    for name, module in qmodel.named_modules():
        first_name.setdefault(id(module), name)
    dequantized = {n.name: n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    calls, tensor_of = {}, {}
    for node in qmodel.graph.nodes:
        if node.op != "call_module":
            continue
        module = qmodel.get_submodule(node.target)
        if not isinstance(module, FakeQuantizeBase):
            continue
        k = calls[id(module)] = calls.get(id(module), -1) + 1
        name = first_name[id(module)] + (f"_{k}" if k else "")
        tensor = dequantized.get(f"/{scope}{name}/DequantizeLinear")
        if tensor is None or module.scale.numel() != 1:
            return None
        tensor_of[node.name] = (tensor, module)
    if not tensor_of:
        return None
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    names = list(dict.fromkeys(t for t, _ in tensor_of.values()))
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(t) for t in names
                              if t not in {o.name for o in model.graph.output})
    session = make_session(probe.SerializeToString(), level=GraphOptimizationLevel.ORT_DISABLE_ALL)
    stats = {node: [0, 0, 0.0] for node in tensor_of}  # values, off by > 1/2 step, max steps

    class Forced(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            out = super().run_node(n)
            if n.name not in tensor_of:
                return out
            tensor, module = tensor_of[n.name]
            got = torch.from_numpy(graph_values[tensor])
            steps = ((out - got).abs() / module.scale.reshape(())).flatten()
            s = stats[n.name]
            s[0] += steps.numel()
            s[1] += int((steps > 0.5).sum())
            s[2] = max(s[2], float(steps.max()) if steps.numel() else 0.0)
            return got.clone()  # the graph's value goes on (in place ops must not touch it)

    was_training = qmodel.training
    qmodel.eval()
    try:
        i, batch_size = 0, 1  # the first image sizes the batches (every tensor is kept)
        while i < len(x):
            graph_values = dict(zip(names, session.run(names, {INPUT_NAME: x[i:i + batch_size]})))
            Forced(qmodel).run(torch.from_numpy(x[i:i + batch_size]))
            if i == 0:
                per_image = sum(v.nbytes for v in graph_values.values())
                batch_size, i = max(1, min(64, (memory_mb << 20) // max(per_image, 1))), 1
            else:
                i += batch_size
    finally:
        qmodel.train(was_training)
    node, (count, off, worst) = max(stats.items(),
                                    key=lambda kv: (kv[1][1] / max(kv[1][0], 1), kv[1][2]))
    faithful = all(s[2] < 1.5 and s[1] <= NODE_MAX_MISMATCH * s[0] for s in stats.values())
    return {"nodes": len(stats), "samples": len(x), "faithful": faithful,
            "worst": {"node": node, "mismatched": round(off / max(count, 1), 6),
                      "max_steps": round(worst, 3)},
            "max_steps": round(max(s[2] for s in stats.values()), 3)}
