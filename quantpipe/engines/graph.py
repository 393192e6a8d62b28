"""ONNX graph facts every quantization engine needs: the model's input, its nodes, which
compute nodes still run in float, and ONNX Runtime's pre-processing (quant_pre_process)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import quant_pre_process

from quantpipe.errors import UserError

log = logging.getLogger(__name__)


def graph_input(model: onnx.ModelProto) -> onnx.ValueInfoProto:
    """The model's single real input (initializers listed as inputs are skipped)."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise UserError(f"expected a model with one input, found {[i.name for i in inputs]}")
    return inputs[0]


def check_calibration(x: np.ndarray, info_shape: tuple[int, ...], model: onnx.ModelProto) -> None:
    """Fail before ORT does, deep inside, when the calibration set cannot feed the model."""
    if len(x) == 0:
        raise UserError("data/calibration: the calibration set is empty; raise prepare.calib_size")
    dims = [d.dim_value if d.HasField("dim_value") else None
            for d in graph_input(model).type.tensor_type.shape.dim]
    if tuple(x.shape[1:]) != tuple(info_shape):
        raise UserError(f"data/calibration: samples of shape {tuple(x.shape[1:])} disagree with its "
                        f"meta.json ({tuple(info_shape)}); re-run `dvc repro -f prepare`")
    if len(dims) != x.ndim or any(d is not None and d != s for d, s in zip(dims[1:], x.shape[1:])):
        raise UserError(f"data/calibration: samples of shape {tuple(x.shape[1:])} do not fit the "
                        f"model input {dims}; re-run prepare with the model's image size/channels")


def preprocess(model_path: Path, out_path: Path) -> bool:
    """quant_pre_process (shape inference + fusions). Returns whether symbolic shape inference ran.

    Symbolic shape inference fails on some graphs; then retry without it rather than quantize
    an unprocessed model.
    """
    try:
        quant_pre_process(str(model_path), str(out_path))
        return True
    except Exception as e:  # ORT raises bare Exceptions from its shape inference
        log.warning("quant_pre_process: symbolic shape inference failed (%s); retrying without it",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        quant_pre_process(str(model_path), str(out_path), skip_symbolic_shape=True)
        return False


def preprocess_checked(model_path: Path, out_path: Path, exclude: tuple[str, ...],
                       key: str) -> tuple[bool, onnx.ModelProto]:
    """preprocess(), then check that every name in `exclude` (params key `key`) is a node of
    the pre-processed graph, the one ORT quantizes. Returns (symbolic shape inference ran, model)."""
    symbolic = preprocess(model_path, out_path)
    model = onnx.load(str(out_path))
    check_nodes_exist(model, exclude, key, model_path)
    return symbolic, model


def check_nodes_exist(model: onnx.ModelProto, names: tuple[str, ...], key: str, where: Path) -> None:
    """A UserError naming params key `key` when a name in `names` is no node of `model`."""
    missing = unknown_nodes(model, names)
    if missing:
        raise UserError(f"{key}: no node named {missing} in {where}; its nodes are "
                        f"{[n.name for n in model.graph.node][:30]}")


# Compute ops whose weights ORT and NNCF quantize: "nodes in float" counts these.
COMPUTE_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul"}


def float_compute_nodes(model: onnx.ModelProto) -> list[str]:
    """Conv/Gemm/MatMul nodes of a quantized model whose weight does not come through
    DequantizeLinear, i.e. that still run in float (either engine's QDQ output)."""
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {i.name for i in model.graph.initializer}

    def quantized(name: str) -> bool:
        node = producers.get(name)
        return node is not None and node.op_type == "DequantizeLinear"

    return [n.name for n in model.graph.node if n.op_type in COMPUTE_OPS and len(n.input) > 1
            and (n.input[1] in initializers or n.input[1] in producers) and not quantized(n.input[1])]


def output_tail(model: onnx.ModelProto) -> list[str]:
    """Nodes after the last compute nodes: those from which no Conv/Gemm/MatMul is reachable
    (a detector's decode: reshapes, softplus, grid offsets, sigmoid, concat). Empty for a
    classifier ending in its Gemm."""
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    reaches: dict[str, bool] = {}
    for node in reversed(model.graph.node):  # graph order is topological
        reaches[node.name] = node.op_type in COMPUTE_OPS or any(
            reaches.get(c.name, False) for out in node.output for c in consumers.get(out, []))
    return [n.name for n in model.graph.node if not reaches[n.name]]


def box_nodes(model: onnx.ModelProto) -> list[str]:
    """Nodes that compute the boxes a RoiAlign pools (a two-stage detector's proposals: the
    RPN's box decoding, its top-k by objectness, the clipping), up to the compute nodes whose
    outputs they read. Empty without RoiAlign. In INT8 those boxes would move by a quantization
    step of their whole range and pool from the wrong place."""
    producers = {out: node for node in model.graph.node for out in node.output}
    todo = [name for node in model.graph.node if node.op_type == "RoiAlign"
            for name in node.input[1:]]
    found: set[str] = set()
    while todo:
        node = producers.get(todo.pop())
        if node is None or node.name in found or node.op_type in COMPUTE_OPS:
            continue
        found.add(node.name)
        todo.extend(node.input)
    return [n.name for n in model.graph.node if n.name in found]


def unknown_nodes(model: onnx.ModelProto, names: tuple[str, ...]) -> list[str]:
    """Names in nodes_to_exclude that are not in the model: a typo would silently do nothing."""
    present = {node.name for node in model.graph.node}
    return [n for n in names if n not in present]
