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

import numpy as np

import torch
from onnxruntime import GraphOptimizationLevel

from quantpipe import data, models, onnxutil, params
from quantpipe.engines import qat
from quantpipe.io import resources, run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.detect import DetectParams
from quantpipe.schemas.export import ExportParams
from quantpipe.schemas.quantize_qat import QuantizeQATParams
from quantpipe.schemas.runtime import RuntimeParams
from quantpipe.schemas.train import TrainParams

NODE_SAMPLES = 256  # test images for the node-by-node check (quantpipe.engines.qat.node_parity)


def compare(got: np.ndarray, expected: np.ndarray, detect: DetectParams | None) -> dict:
    """Outputs against a reference: the largest differences, and top-1 agreement of (N, K)
    logits or, for a detector (detect given), agreement of the decoded detections (the share
    matched at IoU >= 0.5 with the same label, the lower of both ways) and how far matched
    boxes and scores are apart."""
    diff = np.abs(got.astype(np.float64) - expected)
    record = {"samples": len(got), "max_abs_diff": round(float(diff.max()), 6),
              "mean_abs_diff": round(float(diff.mean()), 6)}
    if detect is None:
        return {**record, "agreement": round(float((got.argmax(1) == expected.argmax(1)).mean()), 6)}
    from quantpipe.detection import post

    ref, dets = (post.decode(o, **detect.decode_args()) for o in (expected, got))
    return {**record, "agreement": round(post.agreement(ref, dets).agreement, 6),
            **post.parity(ref, dets)}


def main(argv: list[str]) -> None:
    args = stage_args("quantize_qat", argv, "model", "data", "calibration", "out", "metrics")
    p, train_p = params.load(QuantizeQATParams), params.load(TrainParams)
    level = params.load(RuntimeParams).graph_optimization_level
    seed, opset = params.seed(), params.load(ExportParams).opset
    info = data.load_info(args.data)
    train_p = train_p.for_task(info.task)
    name = train_p.model
    # A detector trains its convolutions with fake quantization and keeps its decode in float
    # (quantpipe.engines.qat.FloatDecode); it is judged on detections, not logits.
    detect = params.load(DetectParams) if info.task == "detection" else None

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
        qmodel = (qat.prepare_detector if detect else qat.prepare)(
            model, info.input_shape, p.per_channel, name)
    except qat.Unsupported as e:
        return skip(str(e))
    body = qmodel.body if detect else qmodel  # the fake-quantized graph
    qat.calibrate(body, data.Normalized(calib.x, info), p.calib_batch_size)
    freeze = {"freeze_bn_after": p.freeze_bn_after,
              "freeze_observers_after": p.freeze_observers_after}
    if detect:
        from quantpipe.detection import task
        from quantpipe.detection.model import train_detector

        quality, measure = "val_map_50", "val mAP@.5"

        def val_quality(m: torch.nn.Module) -> float:
            return task.scored(models.predict_torch(m, x_val), val, info, detect)[0]["map_50"]

        # What fake quantization with calibrated ranges alone gives (PTQ in PyTorch): the
        # baseline the fine-tune has to improve on.
        before = val_quality(qmodel)
        history, steps = qat.fit_with_fake_quant(body, lambda on_step: train_detector(
            qmodel, x_train, train.objects, x_val, val.objects, epochs=p.epochs,
            batch_size=p.batch_size, lr=p.lr, seed=seed, score_map_50=val_quality,
            on_step=on_step), **freeze)
        after = history[-1].val_map_50
    else:
        quality, measure = "val_accuracy", "val accuracy"
        before = float((models.predict_torch(qmodel, x_val).argmax(1) == val.y).mean())
        history, steps = qat.finetune(
            qmodel, x_train, train.y, x_val, val.y, epochs=p.epochs, batch_size=p.batch_size,
            lr=p.lr, max_shift=train_p.max_shift, seed=seed, **freeze)
        after = history[-1].val_accuracy
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
    parity = {**compare(got, expected, detect), "output_step": qat.output_step(proto),
              "deployed": {**compare(fused, expected, detect), "level": level.name},
              "batch_one_max_abs_diff": round(onnxutil.max_abs_diff(got_one, fused[:8]), 6),
              # Folding BatchNorm and rounding x / scale change float rounding only.
              "fold_agreement": compare(expected, trained, detect)["agreement"]}
    metrics = {
        "model": name, "epochs": p.epochs, "lr": p.lr, "per_channel": p.per_channel,
        "steps": steps,
        "freeze_bn_after": p.freeze_bn_after, "freeze_observers_after": p.freeze_observers_after,
        "train_only_modules_removed": removed, "calib_samples": len(calib.y),
        f"{quality}_calibrated": round(before, 6), quality: after,
        **({"test_map_50_95": task.scored(fused, test, info, detect)[0]["map_50_95"]} if detect
           else {"test_accuracy": round(float((fused.argmax(1) == test.y).mean()), 6)}),
        "epoch_seconds": [h.seconds for h in history], "seconds": seconds,
        "parity": parity, "size_bytes": len(blob), "ops": onnxutil.op_counts(proto),
        # Images through the model: calibration, every epoch's training set, the parity passes.
        "resources": resources(len(calib.y) + p.epochs * len(train) + 3 * len(test),
                               time.perf_counter() - start)}
    # A detector's outputs are boxes in pixels beside scores: its limit is on the detections.
    if parity["agreement"] < p.min_agreement or (
            not detect and parity["max_abs_diff"] > p.max_abs_diff):
        # A deep network (EfficientNet) carries float rounding's one-step flips on to whole
        # logits: node by node, each fake-quant computed from the graph's own inputs, tells a
        # faithful export (the limits are then waived) from a node written wrong (named).
        nodes = parity["nodes"] = qat.node_parity(body, proto, x_test[:NODE_SAMPLES],
                                                  scope="body/" if detect else "")
        limits = (f"detection agreement {parity['agreement']:.2%}, {parity['unmatched']} "
                  f"detections unmatched; quantize_qat.min_agreement = {p.min_agreement}"
                  if detect else
                  f"max |logit diff| {parity['max_abs_diff']:.3g}, agreement "
                  f"{parity['agreement']:.2%}; quantize_qat.max_abs_diff = {p.max_abs_diff}, "
                  f"min_agreement = {p.min_agreement}")
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
    print(f"quantize_qat: {name}, {p.epochs} epoch(s) at lr {p.lr:g}: {measure} "
          f"{before:.4f} calibrated -> {after:.4f} fine-tuned; exported parity "
          f"max |diff| {parity['max_abs_diff']:.3g}, agreement {parity['agreement']:.2%} "
          f"({seconds:.1f}s) -> {args.out}")


if __name__ == "__main__":
    run_stage(main)
