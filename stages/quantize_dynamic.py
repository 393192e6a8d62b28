"""quantize_dynamic: models/fp32.onnx -> models/dynamic.onnx (INT8 weights, activations at run time)."""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe import onnxutil, quant  # noqa: E402
from quantpipe.io import atomic_path, run_stage, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

FP32 = Path("models/fp32.onnx")
DYNAMIC = Path("models/dynamic.onnx")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    p = load_params().quantize_dynamic
    onnxutil.load_model(FP32)  # a clear error for a missing or corrupt file
    if "Conv" in p.op_types:
        logging.warning("quantize_dynamic: Conv in op_types makes ConvInteger nodes, which run "
                        "slower than FP32 Conv on x86; use static quantization for CNNs")
    with atomic_path(DYNAMIC) as tmp:
        facts = quant.quantize_dynamic_model(FP32, tmp, p)
        dynamic = onnxutil.load_model(tmp)
    write_json("metrics/quantize_dynamic.json", {
        "weight_type": p.weight_type.name, "per_channel": p.per_channel,
        "reduce_range": p.reduce_range, "op_types": list(p.op_types),
        "nodes_excluded": list(p.nodes_to_exclude), "size_bytes": DYNAMIC.stat().st_size,
        "ops": onnxutil.op_counts(dynamic), **facts})
    print(f"quantize_dynamic: {', '.join(p.op_types)} weights -> {p.weight_type.name} -> {DYNAMIC}")


if __name__ == "__main__":
    run_stage(main)
