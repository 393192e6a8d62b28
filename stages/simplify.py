"""simplify: onnxsim on models/exported.onnx -> models/fp32.onnx, parity re-checked on test images."""

import time

from quantpipe import budget, data, onnxutil, params
from quantpipe.errors import UserError
from quantpipe.io import resources, run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.runtime import RuntimeParams
from quantpipe.schemas.simplify import SimplifyParams
from quantpipe.tasks import bind

PARITY_SAMPLES = 256


def main(argv: list[str]) -> None:
    args = stage_args("simplify", argv, "data", "exported", "out", "metrics")
    p, memory, start = params.load(SimplifyParams), budget.load(), time.perf_counter()
    level = params.load(RuntimeParams).graph_optimization_level
    info = data.load_info(args.data)
    original = onnxutil.load_model(args.exported)
    simplified = onnxutil.simplify(original, str(args.exported))
    blob = onnxutil.check_and_serialize(simplified, str(args.out))

    x = data.normalize(data.load_split(args.data, "test").x[:PARITY_SAMPLES], info)
    batch = budget.inference_batch(memory, original, info.input_shape, cap=256, sessions=2,
                                   what="simplify's parity")
    expected = onnxutil.run_batched(onnxutil.make_session(args.exported, level=level), x, batch)
    got = onnxutil.run_batched(onnxutil.make_session(blob, level=level), x, batch)
    diff = onnxutil.max_abs_diff(got, expected)
    limit = onnxutil.parity_limit(expected, p.max_abs_diff)
    if diff > limit:
        raise UserError(f"{args.out}: simplified logits differ from {args.exported} by {diff:.3g} > "
                        f"{limit:.3g} (simplify.max_abs_diff = {p.max_abs_diff:g} x "
                        f"the largest logit, {abs(expected).max():.3g})")
    # What the task's users see (a detector's detections, a segmenter's masks) must match too.
    parity = bind.for_data(info).parity_record(got, expected, str(args.out), str(args.exported))
    write_bytes(args.out, blob)
    write_json(args.metrics, {**parity,
        "max_abs_diff": diff, "limit": limit, "parity_samples": len(x),
        "size_bytes_before": args.exported.stat().st_size, "size_bytes_after": len(blob),
        "ops_before": onnxutil.op_counts(original), "ops_after": onnxutil.op_counts(simplified),
        "nodes_before": len(original.graph.node), "nodes_after": len(simplified.graph.node),
        "resources": resources(2 * len(x), time.perf_counter() - start, memory.total_mb)})
    print(f"simplify: {len(original.graph.node)} -> {len(simplified.graph.node)} nodes, "
          f"max |diff| = {diff:.2e} -> {args.out}")


if __name__ == "__main__":
    run_stage(main)
