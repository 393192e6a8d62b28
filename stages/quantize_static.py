"""quantize_static: models/fp32.onnx + data/calibration -> models/static.onnx (INT8, calibrated)."""

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe import data, onnxutil, quant  # noqa: E402
from quantpipe.errors import UserError  # noqa: E402
from quantpipe.io import atomic_path, run_stage, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

CALIBRATION = Path("data/calibration")
FP32 = Path("models/fp32.onnx")
STATIC = Path("models/static.onnx")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    p = load_params().quantize_static
    fp32 = onnxutil.load_model(FP32)
    missing = quant.unknown_nodes(fp32, p.nodes_to_exclude)
    if missing:
        raise UserError(f"quantize_static.nodes_to_exclude: no node named {missing} in {FP32}; "
                        f"its nodes are {[n.name for n in fp32.graph.node][:20]}")
    info = data.load_info(CALIBRATION)
    calib = data.load_split(CALIBRATION, "calib")
    quant.check_calibration(calib.x, info.input_shape, fp32)
    warnings = quant.slow_combination_warnings(p)
    for w in warnings:
        logging.warning("quantize_static: %s", w)

    reader = quant.CalibrationReader(calib.x, info, quant.graph_input(fp32).name, p.calib_batch_size)
    start = time.perf_counter()
    with atomic_path(STATIC) as tmp:
        facts = quant.quantize_static_model(FP32, tmp, reader, p)
        static = onnxutil.load_model(tmp)  # onnx.checker on what we are about to publish
    seconds = time.perf_counter() - start
    write_json("metrics/quantize_static.json", {
        "quant_format": p.quant_format.name, "activation_type": p.activation_type.name,
        "weight_type": p.weight_type.name, "per_channel": p.per_channel,
        "reduce_range": p.reduce_range, "calibrate_method": p.calibrate_method.name,
        "calib_samples": len(calib), "nodes_excluded": list(p.nodes_to_exclude),
        "slow_combination_warnings": warnings, "seconds": round(seconds, 2),
        "size_bytes": STATIC.stat().st_size, "ops": onnxutil.op_counts(static), **facts})
    print(f"quantize_static: {p.quant_format.name} {p.activation_type.name}/{p.weight_type.name}, "
          f"{p.calibrate_method.name} on {len(calib)} samples ({seconds:.1f}s) -> {STATIC}")


if __name__ == "__main__":
    run_stage(main)
