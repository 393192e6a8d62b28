"""quantize_qat: models/model.pt fine-tuned with fake quantization -> models/qat.onnx (QDQ INT8).

The fourth variant, for when post-training quantization loses too much: the trained model is
fine-tuned for quantize_qat.epochs with U8/S8 fake quantization whose ranges start from
data/calibration, its BatchNorm folded, and exported as QDQ (quantpipe.engines.qat). A detector
fine-tunes on its own loss with its decode in float, as static keeps it. The exported model
must agree with the fake-quant PyTorch model on the test split (top-1 and logits for a
classifier, matched detections for a detector); when it does not, it is written
all the same and recorded as `failed` (the report leaves it out of `recommended`). A model
brought as ONNX has no PyTorch weights to fine-tune: then, with quantize_qat.enabled: false, or
when torch.fx or the exporter cannot handle the model, models/qat.onnx is written empty and
the metrics say why (evaluate@qat, bench@qat and report follow suit).
"""

import sys
import time

import torch
from onnxruntime import GraphOptimizationLevel

from quantpipe import data, models, onnxutil, params
from quantpipe.tasks import bind
from quantpipe.engines import qat
from quantpipe.io import resources, run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.export import ExportParams
from quantpipe.schemas.quantize_qat import QuantizeQATParams
from quantpipe.schemas.runtime import RuntimeParams
from quantpipe.schemas.train import TrainParams

NODE_SAMPLES = 256  # test images for the node-by-node check (quantpipe.engines.qat.node_parity)


def main(argv: list[str]) -> None:
    args = stage_args("quantize_qat", argv, "model", "data", "calibration", "out", "metrics")
    p, train_p = params.load(QuantizeQATParams), params.load(TrainParams)
    level = params.load(RuntimeParams).graph_optimization_level
    seed, opset = params.seed(), params.load(ExportParams).opset
    info = data.load_info(args.data)
    train_p = train_p.for_task(info.task)
    name = train_p.model
    # The task says how the model trains and how the exported outputs compare (a detector's:
    # on detections, not raw outputs).
    task = bind.for_data(info)

    def skip(reason: str) -> None:
        write_bytes(args.out, b"")
        write_json(args.metrics, {"skipped": reason})
        print(f"quantize_qat: skipped, {reason}")

    if not p.enabled:
        return skip("quantize_qat.enabled is false")
    if models.onnx_source(name):
        return skip(f"train.model is {name}: there is no PyTorch model to fine-tune")
    train, val, test = (data.load_split(args.data, s) for s in ("train", "val", "test"))
    calib = data.load_split(args.calibration, "calib")
    x_train, x_val, x_test = (data.Normalized(s.x, info) for s in (train, val, test))

    start = time.perf_counter()
    torch.manual_seed(seed)
    model = models.load_weights(
        models.build_model(name, info.channels, info.image_size, info.num_classes), args.model)
    removed = qat.without_train_only_modules(model)
    try:
        # A detector fake-quantizes its convolutions and keeps its decode in float.
        qmodel = qat.prepare_model(model, info.input_shape, p.per_channel, name)
    except qat.Unsupported as e:
        return skip(str(e))
    body = qat.body_of(qmodel)  # the fake-quantized graph
    qat.calibrate(body, data.Normalized(calib.x, info), p.calib_batch_size)
    freeze = {"freeze_bn_after": p.freeze_bn_after,
              "freeze_observers_after": p.freeze_observers_after}
    # What fake quantization with calibrated ranges alone gives (PTQ in PyTorch): the baseline
    # the fine-tune has to improve on.
    before = task.torch_scores(qmodel, x_val, val)[task.validation_key]
    history, steps = qat.fit_with_fake_quant(body, lambda on_step: task.fit(
        qmodel, x_train, train, x_val, val, epochs=p.epochs, batch_size=p.batch_size, lr=p.lr,
        max_shift=train_p.max_shift, seed=seed, on_step=on_step), **freeze)
    after = getattr(history[-1], task.history_key)
    trained = models.predict_torch(qmodel, x_test)  # the fake-quant model as trained
    qat.fold_batch_norms(body)
    with qat.onnx_rounding(body):  # ... and as exported: BN folded, x / scale rounded
        expected = models.predict_torch(qmodel, x_test)
    try:
        proto = qat.export_qdq(qmodel, info.input_shape, opset, name)
    except qat.Unsupported as e:
        return skip(str(e))
    blob = onnxutil.check_and_serialize(proto, str(args.out))
    seconds = round(time.perf_counter() - start, 2)

    # The export hop: the QDQ graph as written (ORT_DISABLE_ALL runs its QuantizeLinear,
    # DequantizeLinear and float ops one by one, the fake-quant model's arithmetic) against
    # the fake-quant model. At the deployed level ORT fuses the pairs into integer kernels
    # whose requantization rounds differently, one step here and there in every layer: that
    # is recorded too, as `deployed`, and judged by evaluate@qat against FP32 like static.
    exact = onnxutil.make_session(blob, level=GraphOptimizationLevel.ORT_DISABLE_ALL)
    got = onnxutil.run_batched(exact, x_test)
    deployed = onnxutil.make_session(blob, level=level)
    fused = onnxutil.run_batched(deployed, x_test)
    got_one = onnxutil.run_batched(deployed, x_test[:8], batch_size=1)  # the batch axis is dynamic
    parity = {**task.compare(got, expected), "output_step": qat.output_step(proto),
              "deployed": {**task.compare(fused, expected), "level": level.name},
              "batch_one_max_abs_diff": round(onnxutil.max_abs_diff(got_one, fused[:8]), 6),
              # Folding BatchNorm and rounding x / scale change float rounding only.
              "fold_agreement": task.compare(expected, trained)["agreement"]}
    metrics = {
        "model": name, "epochs": p.epochs, "lr": p.lr, "per_channel": p.per_channel,
        "steps": steps,
        "freeze_bn_after": p.freeze_bn_after, "freeze_observers_after": p.freeze_observers_after,
        "train_only_modules_removed": removed, "calib_samples": len(calib.y),
        f"{task.history_key}_calibrated": round(before, 6), task.history_key: after,
        f"test_{task.score.key}": task.test_scores(fused, test)[task.score.key],
        "epoch_seconds": [h.seconds for h in history], "seconds": seconds,
        "parity": parity, "size_bytes": len(blob), "ops": onnxutil.op_counts(proto),
        # Images through the model: calibration, every epoch's training set, the parity passes.
        "resources": resources(len(calib.y) + p.epochs * len(train) + 3 * len(test),
                               time.perf_counter() - start)}
    limits = task.qat_limits(parity, p)
    if limits:
        # A deep network (EfficientNet) carries float rounding's one-step flips on to whole
        # logits: node by node, each fake-quant computed from the graph's own inputs, tells a
        # faithful export (the limits are then waived) from a node written wrong (named).
        nodes = parity["nodes"] = qat.node_parity(body, proto, x_test[:NODE_SAMPLES],
                                                  scope=qat.scope_of(qmodel))
        where = "" if nodes is None else (
            f"; node by node, {nodes['worst']['node']} differs on "
            f"{nodes['worst']['mismatched']:.2%} of its values, by up to {nodes['max_steps']:g} steps")
        if nodes is not None and nodes["faithful"]:
            print(f"quantize_qat: outputs beyond the limits ({limits}), but each of "
                  f"{nodes['nodes']} fake-quants matches its QDQ node from the same inputs up to "
                  f"float rounding{where}: the fake-quant model's own sensitivity, not the export")
        else:
            # Still written: evaluate and bench measure it against FP32 like any variant, and
            # the report shows it failed, leaves it out of `recommended` and fails the gates
            # after report.md is written; the other variants go on.
            metrics["failed"] = (
                f"the exported QDQ graph differs from the fake-quant PyTorch model on "
                f"{len(x_test)} test images ({limits}{where}); see {args.metrics}")
            print(f"quantize_qat: FAILED: {metrics['failed']}", file=sys.stderr)
    write_bytes(args.out, blob)
    write_json(args.metrics, metrics)
    print(f"quantize_qat: {name}, {p.epochs} epoch(s) at lr {p.lr:g}: "
          f"{task.history_label} {before:.4f} calibrated -> {after:.4f} fine-tuned; exported parity "
          f"max |diff| {parity['max_abs_diff']:.3g}, agreement {parity['agreement']:.2%} "
          f"({seconds:.1f}s) -> {args.out}")


if __name__ == "__main__":
    run_stage(main)
