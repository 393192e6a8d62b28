"""quantize_qat: models/model.pt fine-tuned with fake quantization -> models/qat.onnx (QDQ INT8).

For when post-training quantization loses too much: U8/S8 fake quantization (ranges from
data/calibration), BatchNorm folded, QDQ export (quantpipe.engines.qat); an export unlike the
fake-quant model is written and recorded `failed`. Skipped (an empty file and the reason) when
disabled, for a brought ONNX, or for a model torch.fx or the exporter cannot handle.
"""

import sys
import time

import torch

from quantpipe import budget, data, isa, models, onnxutil, params
from quantpipe.tasks import bind
from quantpipe.engines import qat, qat_parity
from quantpipe.io import resources, run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.export import ExportParams
from quantpipe.schemas.quantize_qat import QuantizeQATParams
from quantpipe.schemas.runtime import RuntimeParams
from quantpipe.schemas.train import TrainParams


def main(argv: list[str]) -> None:
    args = stage_args("quantize_qat", argv, "model", "data", "calibration", "int8", "out", "metrics")
    try:
        quantize(args)
    except qat.Unsupported as e:  # no QAT variant: an empty file and the reason
        write_bytes(args.out, b"")
        write_json(args.metrics, {"skipped": str(e)})
        print(f"quantize_qat: skipped, {e}")


def quantize(args) -> None:
    info = data.load_info(args.data)
    p, train_p = params.load(QuantizeQATParams), params.load(TrainParams).for_task(info.task)
    level = params.load(RuntimeParams).graph_optimization_level
    seed, opset, name = params.seed(), params.load(ExportParams).opset, train_p.model
    task = bind.for_data(info)  # how the model trains, how two models' outputs compare
    if not p.enabled:
        raise qat.Unsupported("quantize_qat.enabled is false")
    p = p.on_machine(isa.load_int8(args.int8))  # reduce_range decided for this CPU
    if models.onnx_source(name):
        raise qat.Unsupported(f"train.model is {name}: there is no PyTorch model to fine-tune")
    train, val, test = (data.load_split(args.data, s) for s in ("train", "val", "test"))
    calib = data.load_split(args.calibration, "calib")
    x_train, x_val, x_test = (data.Normalized(s.x, info) for s in (train, val, test))
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = models.load_weights(
        models.build_model(name, info.channels, info.image_size, info.num_classes), args.model)
    removed = qat.without_train_only_modules(model)  # (a detector's decode stays float)
    qmodel = qat.prepare_model(model, info.input_shape, p.per_channel, name, p.reduce_range)
    body = qat.body_of(qmodel)  # the fake-quantized graph
    # Fake quantization saves more for backward than train did: micro-batches of its own.
    plan = models.training_plan(memory := budget.load(), qmodel, info.input_shape, p.batch_size,
                                what=f"quantize_qat ({name})", key="quantize_qat.batch_size")
    qat.calibrate(body, data.Normalized(calib.x, info), min(p.calib_batch_size, plan.eval_batch))
    before = task.torch_scores(qmodel, x_val, val, plan.eval_batch)[task.validation_key]  # PTQ
    history, steps = qat.fit_with_fake_quant(body, lambda on_step: task.fit(
        qmodel, x_train, train, x_val, val, epochs=p.epochs, batch_size=p.batch_size, lr=p.lr,
        max_shift=train_p.max_shift, seed=seed, on_step=on_step, plan=plan),
        freeze_bn_after=p.freeze_bn_after, freeze_observers_after=p.freeze_observers_after)
    after = getattr(history[-1], task.history_key)
    trained, expected = qat_parity.as_trained_and_exported(qmodel, body, x_test, plan.eval_batch)
    proto = qat.export_qdq(qmodel, info.input_shape, opset, name)
    blob = onnxutil.check_and_serialize(proto, str(args.out))
    seconds = round(time.perf_counter() - start, 2)  # then the export hop's parity:
    parity, fused = qat_parity.export_parity(blob, proto, x_test, expected, trained, task.compare,
                                             level, plan.eval_batch)
    metrics = {
        "model": name, "epochs": p.epochs, "lr": p.lr, "per_channel": p.per_channel, "steps": steps,
        "freeze_bn_after": p.freeze_bn_after, "freeze_observers_after": p.freeze_observers_after,
        "train_only_modules_removed": removed, "calib_samples": len(calib.y), **plan.record,
        "reduce_range": p.reduce_range,
        f"{task.history_key}_calibrated": round(before, 6), task.history_key: after,
        f"test_{task.score.key}": task.test_scores(fused, test)[task.score.key],
        "epoch_seconds": [h.seconds for h in history], "seconds": seconds,
        "parity": parity, "size_bytes": len(blob), "ops": onnxutil.op_counts(proto),
        # Images through the model: calibration, every epoch's training set, the parity passes.
        "resources": resources(len(calib.y) + p.epochs * len(train) + 3 * len(test),
                               time.perf_counter() - start, memory.total_mb)}
    failed, note = qat_parity.export_verdict(task.qat_limits(parity, p), parity, body, proto,
                                             x_test, scope=qat.scope_of(qmodel))
    if note:
        print(f"quantize_qat: {note}")
    if failed:
        # Still written: evaluate and bench measure it like any variant; the report leaves it
        # out of `recommended` and fails the gates after report.md is written.
        metrics["failed"] = f"{failed}; see {args.metrics}"
        print(f"quantize_qat: FAILED: {metrics['failed']}", file=sys.stderr)
    write_bytes(args.out, blob)
    write_json(args.metrics, metrics)
    print(f"quantize_qat: {name}, {p.epochs} epoch(s) at lr {p.lr:g}: {task.history_label} "
          f"{before:.4f} calibrated -> {after:.4f} fine-tuned; exported parity max |diff| "
          f"{parity['max_abs_diff']:.3g}, agreement {parity['agreement']:.2%} ({seconds:.1f}s)")


if __name__ == "__main__":
    run_stage(main)
