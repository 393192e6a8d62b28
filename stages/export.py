"""export: models/model.pt -> models/exported.onnx (dynamic batch), parity-checked vs PyTorch."""

import time

import torch

from quantpipe import budget, data, models, onnxutil, params
from quantpipe.tasks import bind
from quantpipe.errors import UserError
from quantpipe.io import resources, run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.export import ExportParams
from quantpipe.schemas.runtime import RuntimeParams
from quantpipe.schemas.train import TrainParams

# Parity is checked on this many real test images (and the batch axis on two batch sizes).
PARITY_SAMPLES = 256


def main(argv: list[str]) -> None:
    args = stage_args("export", argv, "data", "model", "out", "metrics")
    p, train_p, start = params.load(ExportParams), params.load(TrainParams), time.perf_counter()
    level = params.load(RuntimeParams).graph_optimization_level
    info = data.load_info(args.data)
    task = bind.for_data(info)
    model_name = train_p.for_task(info.task).model
    test = data.load_split(args.data, "test")
    x = data.normalize(test.x[:PARITY_SAMPLES], info)
    source = models.onnx_source(model_name)
    if source:  # bring your own ONNX: validate it against the data instead of exporting
        proto, facts = onnxutil.import_onnx(source, info.input_shape, info.num_classes, x, level,
                                            lambda out: task.check_output(out, str(source)))
        write_bytes(args.out, proto.SerializeToString())
        write_json(args.metrics, {**facts,
                                  "resources": resources(len(x), time.perf_counter() - start)})
        print(f"export: {source} checked against the data ({info.input_shape}, "
              f"{info.num_classes} classes) -> {args.out}")
        return
    model = models.build_model(model_name, info.channels, info.image_size, info.num_classes)
    models.load_weights(model, args.model)
    proto = onnxutil.export_onnx(model, info.input_shape, p.opset)
    blob = onnxutil.check_and_serialize(proto, str(args.out))

    memory = budget.load()  # both passes in batches that fit it
    with torch.no_grad():
        expected = models.predict_torch(model, x, models.eval_batch(memory, model, info.input_shape,
                                                                    what="export"))
    session = onnxutil.make_session(blob, level=level)
    # Batch 1 and a larger batch: the dynamic batch axis must work for both.
    got_one = onnxutil.run_batched(session, x[:8], batch_size=1)
    got = onnxutil.run_batched(session, x, batch_size=budget.inference_batch(
        memory, proto, info.input_shape, cap=len(x), what="export's parity"))
    diff = max(onnxutil.max_abs_diff(got, expected), onnxutil.max_abs_diff(got_one, expected[:8]))
    limit = onnxutil.parity_limit(expected, p.max_abs_diff)
    if diff > limit:
        raise UserError(f"{args.out}: ONNX logits differ from PyTorch by {diff:.3g} > {limit:.3g} "
                        f"(export.max_abs_diff = {p.max_abs_diff:g} x the largest "
                        f"logit, {abs(expected).max():.3g}); the export is wrong (try another "
                        "export.opset) or the tolerance too tight")
    # What the task's users see (a detector's decoded detections) must match too.
    parity = task.parity_record(got, expected, str(args.out), "PyTorch")
    write_bytes(args.out, blob)
    write_json(args.metrics, {
        "opset": p.opset, "max_abs_diff": diff, "limit": limit, "parity_samples": len(x),
        "size_bytes": len(blob), "nodes": len(proto.graph.node), **parity,
        "resources": resources(len(x), time.perf_counter() - start, memory.total_mb)})
    print(f"export: max |onnx - torch| = {diff:.2e} on {len(x)} test images -> {args.out}")


if __name__ == "__main__":
    run_stage(main)
