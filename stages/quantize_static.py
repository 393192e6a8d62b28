"""quantize_static: models/fp32.onnx + data/calibration -> models/static.onnx (INT8, calibrated).

With the accuracy-aware fallback: nodes are left in float, most sensitive first, until the
validation accuracy is within quantize_static.max_accuracy_drop_pp of FP32.
"""

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe import data, onnxutil, quant  # noqa: E402
from quantpipe.errors import UserError  # noqa: E402
from quantpipe.io import atomic_path, run_stage, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

PREPARED = Path("data/prepared")
CALIBRATION = Path("data/calibration")
FP32 = Path("models/fp32.onnx")
STATIC = Path("models/static.onnx")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    params = load_params()
    p, level = params.quantize_static, params.runtime.graph_optimization_level
    fp32 = onnxutil.load_model(FP32)
    info = data.load_info(CALIBRATION)
    calib = data.load_split(CALIBRATION, "calib")
    quant.check_calibration(calib.x, info.input_shape, fp32)
    val = data.load_split(PREPARED, "val")
    val_x = data.normalize(val.x, data.load_info(PREPARED))
    warnings = quant.slow_combination_warnings(p)
    for w in warnings:
        logging.warning("quantize_static: %s", w)

    def val_accuracy(model_path: Path) -> float:
        session = onnxutil.make_session(model_path, level=level)
        return float((onnxutil.run_batched(session, val_x).argmax(1) == val.y).mean())

    start = time.perf_counter()
    with atomic_path(STATIC) as tmp:
        result = quant.quantize_static_with_fallback(FP32, tmp, calib.x, info, p, val_accuracy)
        static = onnxutil.load_model(tmp)  # onnx.checker on what we are about to publish
        metrics = {
            "quant_format": p.quant_format.name, "activation_type": p.activation_type.name,
            "weight_type": p.weight_type.name, "per_channel": p.per_channel,
            "reduce_range": p.reduce_range, "calibrate_method": p.calibrate_method.name,
            "calib_samples": result.calib_samples_used, "nodes_excluded": list(p.nodes_to_exclude),
            "fallback_nodes": result.fallback_nodes, "fallback_steps": result.steps,
            "fp32_val_accuracy": round(result.fp32_val_accuracy, 6),
            "val_accuracy": result.steps[-1]["val_accuracy"],
            "val_accuracy_drop_pp": result.accuracy_drop_pp,
            "slow_combination_warnings": warnings,
            "symbolic_shape_inference": result.symbolic_shape_inference,
            "seconds": round(time.perf_counter() - start, 2),
            "size_bytes": tmp.stat().st_size, "ops": onnxutil.op_counts(static)}
        # Written before the accuracy check on purpose: when it fails, the fallback steps and
        # the SQNR table are what the user reads to decide what to change. The model itself is
        # published only if the check passes (the exception skips atomic_path's rename).
        write_json("metrics/quantize_static.json", metrics)
        write_json("metrics/plots/sensitivity.json", result.sensitivity)
        if result.accuracy_drop_pp > p.max_accuracy_drop_pp:
            message = (f"{STATIC}: validation accuracy drops {result.accuracy_drop_pp:.2f} pp "
                       f"> quantize_static.max_accuracy_drop_pp = {p.max_accuracy_drop_pp} even with "
                       f"{result.fallback_nodes or 'no'} nodes in float; raise max_fallback_steps, "
                       "try calibrate_method Entropy/Percentile, or set allow_accuracy_drop: true")
            if not p.allow_accuracy_drop:
                raise UserError(message)
            logging.warning("quantize_static: %s", message)
    print(f"quantize_static: {p.quant_format.name} {p.activation_type.name}/{p.weight_type.name}, "
          f"{p.calibrate_method.name} on {result.calib_samples_used} samples, val drop "
          f"{result.accuracy_drop_pp:.2f} pp, {len(result.fallback_nodes)} node(s) left in float "
          f"({metrics['seconds']:.1f}s) -> {STATIC}")


if __name__ == "__main__":
    run_stage(main)
