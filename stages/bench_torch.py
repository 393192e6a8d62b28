"""bench_torch: the PyTorch eager baseline — test accuracy (a detector: mAP) and latency of
models/model.pt (a detector's: the model to its raw output, as the variants' model-only rows),
timed in the same interleaved rounds as models/fp32.onnx (the practitioner's table starts here)."""

import time

import torch

from quantpipe import bench, budget, data, models, onnxutil, params
from quantpipe.tasks import bind
from quantpipe import machine as machines
from quantpipe.io import resources, run_stage, stage_args, write_json
from quantpipe.schemas.bench import BenchParams
from quantpipe.schemas.runtime import RuntimeParams
from quantpipe.schemas.train import TrainParams


def main(argv: list[str]) -> None:
    args = stage_args("bench_torch", argv, "model", "fp32", "data", "machine", "metrics")
    p, train_p, start = params.load(BenchParams), params.load(TrainParams), time.perf_counter()
    level = params.load(RuntimeParams).graph_optimization_level
    info = data.load_info(args.data)
    name = train_p.for_task(info.task).model
    if models.onnx_source(name):
        write_json(args.metrics, {
            "variant": "torch", "skipped": f"no PyTorch model: train.model is {name}"})
        print("bench torch: skipped, the model was brought as ONNX")
        return
    machine = machines.load(args.machine)
    threads = bench.resolve_threads(p.threads, machine["cores"])
    test = data.load_split(args.data, "test")
    x = data.Normalized(test.x, info)  # read a batch at a time
    model = models.build_model(name, info.channels, info.image_size, info.num_classes)
    models.load_weights(model, args.model)
    memory = budget.load()  # the test split's scores in batches that fit it
    out = models.predict_torch(model, x, models.eval_batch(memory, model, info.input_shape,
                                                           what="bench_torch"))
    # The task's score (a detector's: mAP of its detections, decoded as every variant's are).
    task = bind.for_data(info)
    scores = task.test_scores(out, test)
    score = {k: scores[k] for k in task.torch_score_keys}

    # A bad FP32 model fails in one line, before the progress bar.
    onnxutil.check_input_matches(onnxutil.make_session(args.fp32, level=level), info.input_shape,
                                 str(args.fp32))

    def runners_for(count: int) -> dict[str, bench.Runner]:
        torch.set_num_threads(count)
        session = onnxutil.make_session(args.fp32, level=level, threads=count, stop_spinning=True)
        return {"torch": lambda b: model(torch.from_numpy(b)), "fp32": onnxutil.session_runner(session)}

    # "speedup" has the same meaning as for the INT8 variants: FP32 ONNX time / torch time.
    with torch.inference_mode():  # within bench.seconds, as every variant's bench
        results = bench.latency_table(runners_for, "torch", x, threads, p, desc="bench torch")
    write_json(args.metrics, {
        "variant": "torch", **score, "size_bytes": args.model.stat().st_size,
        "torch": torch.__version__, "machine": machine, "threads": list(threads),
        "latency": results, "resources": {
            **resources(len(x), time.perf_counter() - start, memory.total_mb),
            "seconds_budget": p.seconds}})
    for count, rows in results.items():
        for bs, r in rows.items():
            print(f"bench torch: {bs}, {count}: p50 {r['p50_ms']:.3f} ms "
                  f"(fp32 onnx is x{1 / r['speedup']:.2f} faster)")


if __name__ == "__main__":
    run_stage(main)
