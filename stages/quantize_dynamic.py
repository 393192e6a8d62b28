"""quantize_dynamic: models/fp32.onnx -> models/dynamic.onnx (INT8 weights, activations at run time)."""

import logging
import time

from quantpipe import isa, onnxutil, params
from quantpipe.engines import dynamic
from quantpipe.io import atomic_path, resources, run_stage, stage_args, write_json
from quantpipe.schemas.quantize_dynamic import QuantizeDynamicParams


def main(argv: list[str]) -> None:
    args = stage_args("quantize_dynamic", argv, "fp32", "int8", "out", "metrics")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    start = time.perf_counter()
    p = params.load(QuantizeDynamicParams).on_machine(isa.load_int8(args.int8))
    onnxutil.load_model(args.fp32)  # a clear error for a missing or corrupt file
    if "Conv" in p.op_types:
        logging.warning("quantize_dynamic: Conv in op_types makes ConvInteger nodes, which run "
                        "slower than FP32 Conv on x86; use static quantization for CNNs")
    with atomic_path(args.out) as tmp:
        facts = dynamic.quantize_dynamic_model(args.fp32, tmp, p)
        written = onnxutil.load_model(tmp)
    write_json(args.metrics, {
        "weight_type": p.weight_type.name, "per_channel": p.per_channel,
        "reduce_range": p.reduce_range, "op_types": list(p.op_types),
        "nodes_excluded": list(p.nodes_to_exclude), "size_bytes": args.out.stat().st_size,
        "ops": onnxutil.op_counts(written), **facts,
        "resources": resources(0, time.perf_counter() - start)})
    print(f"quantize_dynamic: {', '.join(p.op_types)} weights -> {p.weight_type.name} -> {args.out}")


if __name__ == "__main__":
    run_stage(main)
