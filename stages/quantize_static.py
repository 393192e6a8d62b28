"""quantize_static: models/fp32.onnx + data/calibration -> models/static.onnx (INT8, calibrated).

quantize_static.engine picks who quantizes (quantpipe.engines.registry): ONNX Runtime or NNCF;
both write a QDQ model. While the drop is real (quantpipe.criterion, on the task's score and
outputs: the validation split and the train images that did not calibrate), the engine's
fallback runs: ORT's recovery ladder, or nncf.quantize_with_accuracy_control. A model still out
of the criterion is written all the same and recorded as `failed` (or `accepted`, with
allow_accuracy_drop): the report leaves it out of `recommended`, the gates fail after it.
"""

import logging
import time

from quantpipe import budget, criterion, data, isa, onnxutil, params, representative
from quantpipe.tasks import bind
from quantpipe.engines import record, registry
from quantpipe.engines.base import StaticJob
from quantpipe.engines.graph import check_calibration
from quantpipe.io import atomic_path, resources, run_stage, stage_args, write_json
from quantpipe.schemas.prepare import PrepareParams
from quantpipe.schemas.quantize_static import QuantizeStaticParams
from quantpipe.schemas.runtime import RuntimeParams


def main(argv: list[str]) -> None:
    args = stage_args("quantize_static", argv, "fp32", "data", "calibration", "int8", "out",
                      "metrics", "sensitivity")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    stage_start = time.perf_counter()
    p = params.load(QuantizeStaticParams)
    level = params.load(RuntimeParams).graph_optimization_level
    engine = registry.get(p.engine)
    p = p.on_machine(isa.load_int8(args.int8))  # after the params' own errors
    fp32 = onnxutil.load_model(args.fp32)
    info = data.load_info(args.calibration)
    calib = data.load_split(args.calibration, "calib")
    check_calibration(calib.x, info.input_shape, fp32)
    prepared_info = data.load_info(args.data)
    task = bind.for_data(prepared_info)
    p = p.for_task(prepared_info.task)  # max_drop_pts: null is the task's
    val = data.load_split(args.data, "val")
    # Read a batch at a time (data.Normalized): every model below runs over them in batches.
    val_x = data.Normalized(val.x, prepared_info)
    pool_x = criterion.pool(data.load_split(args.data, "train").x, prepared_info,
                            exclude=data.load_calibration_index(args.calibration))
    warnings = engine.warnings(p)  # and a validation split too small to see the drop allowed:
    for w in warnings + task.static_warnings(val, p, params.load(PrepareParams).val_fraction):
        logging.warning("quantize_static: %s", w)

    # Counts the images run, for the stage's images/s; its batches fit the memory budget.
    outputs = onnxutil.Outputs(level, budget.inference_batch(
        memory := budget.load(), fp32, info.input_shape, cap=256, what="quantize_static"))
    # The task's criterion: FP32's validation score, and each candidate's verdict against it.
    judge = task.static_judge(*outputs(args.fp32, val_x, pool_x), val, p)

    # Does the calibration set look like the data? Inputs, and FP32's outputs on both.
    test_x = data.load_split(args.data, "test").x
    calibration_check, calibration_warnings = representative.compare(
        calib.x, test_x, *outputs(args.fp32, data.Normalized(calib.x, info),
                                  data.Normalized(test_x, prepared_info)), task.output_statistics)
    for w in calibration_warnings:
        logging.warning("quantize_static: %s", w)

    start = time.perf_counter()
    with atomic_path(args.out) as tmp:
        result = engine.quantize(StaticJob(
            fp32=args.fp32, out=tmp, calib_x=calib.x, info=info, params=p,
            check=lambda model_path: judge.check(*outputs(model_path, val_x, pool_x)),
            pool_x=pool_x, pool_ref=judge.ref_pool,
            predict=lambda model, x: judge.labels(outputs(model.SerializeToString(), x)[0]),
            float_tail=task.float_tail, memory=memory))
        static = onnxutil.load_model(tmp)  # onnx.checker on what we are about to publish
        metrics = {**record.static_record(result, engine.settings(p, result), p, task.score.key,
                                          judge.fp32_score, task.static_metrics(judge, result, val),
                                          static, info.input_shape),
                   "slow_combination_warnings": warnings, "calibration_check": calibration_check,
                   "calibration_warnings": calibration_warnings,
                   "seconds": round(time.perf_counter() - start, 2), "size_bytes": tmp.stat().st_size,
                   "resources": resources(outputs.images + result.calib_samples_used,
                                          time.perf_counter() - stage_start, memory.total_mb)}
        message = record.failure(result, p, registry.ENGINES.names())
        if message:
            # Still written: evaluate and bench measure it, and the report shows it failed,
            # leaves it out of `recommended` and fails the gates after report.md is written.
            metrics["accepted" if p.allow_accuracy_drop else "failed"] = message
            logging.warning("quantize_static: %s%s", "" if p.allow_accuracy_drop else "FAILED: ",
                            message)
        write_json(args.metrics, metrics)
        write_json(args.sensitivity, result.sensitivity)
    share = metrics["mac_share_int8"]
    print(f"quantize_static: {result.engine}, {result.calibrate_method} on "
          f"{result.calib_samples_used} samples, val {task.score.label} drop "
          f"{result.drop_pts:.2f} {task.score.unit}, pool agreement "
          f"{result.final['pool']['agreement']:.2%}, {len(result.nodes_in_float)} compute node(s) "
          f"in float, {'unknown share' if share is None else f'{share:.1%}'} of MACs in INT8 "
          f"({metrics['seconds']:.1f}s) -> {args.out}")


if __name__ == "__main__":
    run_stage(main)
