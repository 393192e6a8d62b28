"""quantize_static: models/fp32.onnx + data/calibration -> models/static.onnx (INT8, calibrated).

quantize_static.engine picks who quantizes, by name in quantpipe.engines.registry: ONNX Runtime
(quantpipe.engines.ort_static) or NNCF (quantpipe.engines.nncf_ptq); both write a QDQ model. While the accuracy drop is real
(quantpipe.criterion: over max_accuracy_drop_pp on the validation split, lopsided flips by
McNemar's test, and below min_pool_agreement on the train images that did not calibrate; or
below agreement_floor there, whatever the drop), the engine's fallback runs: ORT's recovery
ladder, or nncf.quantize_with_accuracy_control. A model still out of the criterion after the
fallback is written all the same and recorded as `failed` (or `accepted`, with
allow_accuracy_drop): the report leaves it out of `recommended` and the gates fail after the
report is written.
"""

import logging
import time
from pathlib import Path

import numpy as np

from quantpipe import criterion, data, onnxutil, params, representative
from quantpipe.tasks import bind
from quantpipe.engines import registry
from quantpipe.engines.base import StaticJob
from quantpipe.engines.graph import check_calibration, mac_summary
from quantpipe.errors import UserError
from quantpipe.io import atomic_path, resources, run_stage, stage_args, write_json
from quantpipe.schemas.prepare import PrepareParams
from quantpipe.schemas.quantize_static import QuantizeStaticParams
from quantpipe.schemas.runtime import RuntimeParams

# The params behind each rule of quantpipe.criterion that makes a change real.
RULE_KEYS = {"agreement_floor": "quantize_static.agreement_floor",
             "real_drop": "quantize_static.max_accuracy_drop_pp, significance and min_pool_agreement"}


def main(argv: list[str]) -> None:
    args = stage_args("quantize_static", argv, "fp32", "data", "calibration", "out", "metrics",
                      "sensitivity")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    stage_start = time.perf_counter()
    p = params.load(QuantizeStaticParams)
    level = params.load(RuntimeParams).graph_optimization_level
    try:
        engine = registry.get(p.engine)
    except UserError as e:
        raise UserError(f"{params.PARAMS_FILE}: {e}") from None
    fp32 = onnxutil.load_model(args.fp32)
    info = data.load_info(args.calibration)
    calib = data.load_split(args.calibration, "calib")
    check_calibration(calib.x, info.input_shape, fp32)
    prepared_info = data.load_info(args.data)
    val = data.load_split(args.data, "val")
    # Read a batch at a time (data.Normalized): every model below runs over them in batches.
    val_x = data.Normalized(val.x, prepared_info)
    train_x = data.load_split(args.data, "train").x
    pool_x = data.Normalized(data.rows(train_x, criterion.pool_indices(
        len(train_x), data.load_calibration_index(args.calibration))), prepared_info)
    warnings = engine.warnings(p)
    for w in warnings:
        logging.warning("quantize_static: %s", w)
    task = bind.for_data(prepared_info)
    warnings_about_val = task.static_warnings(val, p, params.load(PrepareParams).val_fraction)
    for w in warnings_about_val:  # a validation split too small to see the drop allowed
        logging.warning("quantize_static: %s", w)

    scored = [0]  # images through candidate and reference models (the stage's images/s)

    def outputs(model: Path | bytes, *images: np.ndarray) -> list[np.ndarray]:
        """The model's raw outputs on each of `images`, from one session."""
        session = onnxutil.make_session(model, level=level)
        scored[0] += sum(len(x) for x in images)
        return [onnxutil.run_batched(session, x) for x in images]

    # The task's criterion: FP32's validation score, and each candidate's verdict against it.
    judge = task.static_judge(*outputs(args.fp32, val_x, pool_x), val, p)

    def check(model_path: Path) -> criterion.Judged:
        return judge.check(*outputs(model_path, val_x, pool_x))

    # Does the calibration set look like the data? Inputs, and FP32's outputs on both.
    test_x = data.load_split(args.data, "test").x
    calib_out, test_out = outputs(args.fp32, data.Normalized(calib.x, info),
                                  data.Normalized(test_x, prepared_info))
    calibration_check, calibration_warnings = representative.check(
        representative.input_measures(calib.x, test_x) + representative.output_measures(
            task.output_statistics(calib_out), task.output_statistics(test_out)))
    for w in calibration_warnings:
        logging.warning("quantize_static: %s", w)

    start = time.perf_counter()
    with atomic_path(args.out) as tmp:
        result = engine.quantize(StaticJob(
            fp32=args.fp32, out=tmp, calib_x=calib.x, info=info, params=p, check=check,
            pool_x=pool_x, pool_ref=judge.ref_pool,
            predict=lambda model, x: judge.labels(outputs(model.SerializeToString(), x)[0]),
            float_tail=task.float_tail))
        settings = engine.settings(p, result)
        static = onnxutil.load_model(tmp)  # onnx.checker on what we are about to publish
        last = result.final
        metrics = {
            "engine": result.engine, **settings,
            "nodes_excluded": list(p.nodes_to_exclude),
            "fallback_nodes": result.fallback_nodes, "nodes_in_float": result.nodes_in_float,
            # Where the arithmetic is and how much of it the written model runs in INT8: the
            # report's reason when static is not faster (mac_share_int8, macs_by_op_type).
            **mac_summary(static, info.input_shape),
            **task.static_metrics(judge, result, val),
            "fallback_steps": result.steps,
            "fp32_val_accuracy": round(judge.fp32_score, 6),
            "val_accuracy": last["val_accuracy"],
            "val_accuracy_drop_pp": result.accuracy_drop_pp,
            # What the decision rests on (the kept model): flips and agreement, val and pool.
            "val": last["val"], "pool": last["pool"], "real_drop": last["real_drop"],
            "verdict": last["verdict"], "rule": last["rule"],
            "slow_combination_warnings": warnings,
            "calibration_check": calibration_check, "calibration_warnings": calibration_warnings,
            "symbolic_shape_inference": result.symbolic_shape_inference,
            "seconds": round(time.perf_counter() - start, 2),
            "size_bytes": tmp.stat().st_size, "ops": onnxutil.op_counts(static),
            "resources": resources(scored[0] + result.calib_samples_used,
                                   time.perf_counter() - stage_start)}
        if last["real_drop"]:
            other = " or ".join(n for n in registry.ENGINES.names() if n != p.engine)
            message = (f"{last['verdict']} (rule: {RULE_KEYS[last['rule']]}); tried "
                       f"{result.tried()}; raise max_fallback_steps, try engine: {other}, or set "
                       "allow_accuracy_drop: true")
            # Still written: evaluate and bench measure it, and the report shows it failed,
            # leaves it out of `recommended` and fails the gates after report.md is written.
            metrics["accepted" if p.allow_accuracy_drop else "failed"] = message
            logging.warning("quantize_static: %s%s", "" if p.allow_accuracy_drop else "FAILED: ",
                            message)
        write_json(args.metrics, metrics)
        write_json(args.sensitivity, result.sensitivity)
    share = metrics["mac_share_int8"]
    int8 = "unknown share" if share is None else f"{share:.1%}"
    print(f"quantize_static: {result.engine}, {result.calibrate_method} on "
          f"{result.calib_samples_used} samples, val {task.score.label} drop "
          f"{result.accuracy_drop_pp:.2f} {task.score.unit}, pool agreement {last['pool']['agreement']:.2%}, "
          f"{len(result.nodes_in_float)} compute node(s) in float, {int8} of MACs in INT8 "
          f"({metrics['seconds']:.1f}s) -> {args.out}")


if __name__ == "__main__":
    run_stage(main)
