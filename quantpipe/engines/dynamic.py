"""Dynamic quantization (the quantize_dynamic stage): ONNX Runtime's quantize_dynamic, INT8
weights and activations quantized at run time, of MatMul/Gemm by default (ConvInteger runs slower
than FP32 Conv on x86)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
from onnxruntime.quantization import quantize_dynamic

from quantpipe import isa
from quantpipe.engines.graph import preprocess_checked
from quantpipe.schemas.quantize_dynamic import QuantizeDynamicParams


def quantize_dynamic_model(model_path: Path, out_path: Path, p: QuantizeDynamicParams) -> dict:
    """Pre-process then dynamically quantize (weights only) the ops in p.op_types."""
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "preprocessed.onnx"
        symbolic, pre_model = preprocess_checked(model_path, pre, p.nodes_to_exclude,
                                                 "quantize_dynamic.nodes_to_exclude")
        op_types, include, exclude = dynamic_selection(pre_model, p.op_types, p.nodes_to_exclude)
        quantize_dynamic(
            str(pre), str(out_path), op_types_to_quantize=op_types, nodes_to_quantize=include,
            per_channel=p.per_channel, reduce_range=isa.reduce_range_for(p.reduce_range),
            weight_type=p.weight_type,
            nodes_to_exclude=exclude or None)
    return {"symbolic_shape_inference": symbolic}


def dynamic_selection(model: onnx.ModelProto, op_types: tuple[str, ...],
                      exclude: tuple[str, ...]) -> tuple[list[str], list[str] | None, list[str]]:
    """(op types, nodes to quantize or None for all, nodes to exclude) as ORT's dynamic mode
    needs them. It rewrites every Gemm into `<name>_MatMul` + `<name>_Add` before selecting
    nodes, so "Gemm" and Gemm node names must be spelled as those MatMuls."""
    gemms = {n.name for n in model.graph.node if n.op_type == "Gemm"}
    exclude_out = [f"{n}_MatMul" if n in gemms else n for n in exclude]
    if "Gemm" not in op_types or "MatMul" in op_types:
        return sorted({*op_types, "MatMul"} if "Gemm" in op_types else set(op_types)), None, exclude_out
    # Gemm without MatMul: quantize the rewritten Gemms and nodes of the other listed types only.
    others = [t for t in op_types if t != "Gemm"]
    include = [n.name for n in model.graph.node if n.op_type in others]
    include += [f"{g}_MatMul" for g in sorted(gemms)]
    return sorted({*others, "MatMul"}), include, exclude_out
