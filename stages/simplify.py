"""simplify: onnxsim on models/exported.onnx -> models/fp32.onnx, parity re-checked on test images."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe import data, onnxutil  # noqa: E402
from quantpipe.errors import UserError  # noqa: E402
from quantpipe.io import run_stage, write_bytes, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

PREPARED = Path("data/prepared")
EXPORTED = Path("models/exported.onnx")
FP32 = Path("models/fp32.onnx")
PARITY_SAMPLES = 256


def main() -> None:
    params = load_params()
    info = data.load_info(PREPARED)
    original = onnxutil.load_model(EXPORTED)
    simplified = onnxutil.simplify(original, str(EXPORTED))
    blob = onnxutil.check_and_serialize(simplified, str(FP32))

    x = data.normalize(data.load_split(PREPARED, "test").x[:PARITY_SAMPLES], info)
    level = params.runtime.graph_optimization_level
    expected = onnxutil.run_batched(onnxutil.make_session(EXPORTED, level=level), x)
    got = onnxutil.run_batched(onnxutil.make_session(blob, level=level), x)
    diff = onnxutil.max_abs_diff(got, expected)
    limit = onnxutil.parity_limit(expected, params.simplify.max_abs_diff)
    if diff > limit:
        raise UserError(f"{FP32}: simplified logits differ from {EXPORTED} by {diff:.3g} > "
                        f"{limit:.3g} (simplify.max_abs_diff = {params.simplify.max_abs_diff:g} x "
                        f"the largest logit, {abs(expected).max():.3g})")
    write_bytes(FP32, blob)
    write_json("metrics/simplify.json", {
        "max_abs_diff": diff, "limit": limit, "parity_samples": len(x),
        "size_bytes_before": EXPORTED.stat().st_size, "size_bytes_after": len(blob),
        "ops_before": onnxutil.op_counts(original), "ops_after": onnxutil.op_counts(simplified),
        "nodes_before": len(original.graph.node), "nodes_after": len(simplified.graph.node)})
    print(f"simplify: {len(original.graph.node)} -> {len(simplified.graph.node)} nodes, "
          f"max |diff| = {diff:.2e} -> {FP32}")


if __name__ == "__main__":
    run_stage(main)
