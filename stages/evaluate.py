"""evaluate <variant>: the task's scores of models/<variant>.onnx on the test split, agreement
and output error vs FP32, per class, graph facts, edge-input checks and the predictions, in
batches that fit resources.memory_mb. bf16 is models/fp32.onnx in BF16 on the first runtime of
bench.runtimes that can (OpenVINO), on a CPU with native BF16; elsewhere skipped, with why."""

import time

from quantpipe import budget, criterion, data, evaluate, onnxutil, params
from quantpipe.tasks import bind
from quantpipe import machine as machines
from quantpipe.errors import UserError
from quantpipe.io import resources, run_stage, skipped_model, stage_args, write_json
from quantpipe.runtimes import registry
from quantpipe.runtimes.base import RuntimeUnavailable
from quantpipe.schemas.bench import BenchParams
from quantpipe.schemas.evaluate import EvaluateParams
from quantpipe.schemas.runtime import RuntimeParams

ODD_BATCH = 7


def main(argv: list[str]) -> None:
    args = stage_args("evaluate", argv, "model", "fp32", "data", "machine", "metrics", "confusion",
                      "predictions", variant=True)
    variant, path, fp32_path = args.variant, args.model, args.fp32
    p = params.load(EvaluateParams)
    level = params.load(RuntimeParams).graph_optimization_level
    runtimes = params.load(BenchParams).runtimes  # the runtimes that may run the bf16 row
    machine = machines.load(args.machine)
    skipped = skipped_model(path) or (variant == "bf16" and registry.bf16_skip(machine, runtimes))
    if skipped:
        return skip(args, skipped)
    model, memory = onnxutil.load_model(path), budget.load()
    info = data.load_info(args.data)
    task = bind.for_data(info)
    test = data.load_split(args.data, "test")
    x = data.Normalized(test.x, info)  # (N, C, S, S) float32, read a batch at a time
    session = onnxutil.make_session(path, level=level)
    onnxutil.check_input_matches(session, info.input_shape, str(path))
    fp32_session = session if variant == "fp32" else onnxutil.make_session(fp32_path, level=level)
    # Concurrent requests: twice as many callers as cores, so requests queue for the cores.
    callers, concurrent, ran_on = 2 * machine["cores"], None, {}
    if variant == "bf16":
        # The FP32 file computed in BF16 by the first runtime of bench.runtimes that can (ONNX
        # Runtime cannot on x86): everything below is that runtime's.
        bf16 = next(iter(registry.select(runtimes, level=level, precision="bf16").values()))
        try:
            session = bf16.runner(path, machine["cores"])
            concurrent = bf16.pool(path, streams=callers, threads=1)
        except RuntimeUnavailable as e:  # a file the runtime cannot read: no row, not a stop
            return skip(args, str(e))
        ran_on = {"runtime": bf16.name,
                  "inference_precision": bf16.settings(path, machine["cores"])["inference_precision"]}
    start = time.perf_counter()
    batch = budget.inference_batch(memory, onnxutil.load_model(fp32_path), info.input_shape,
                                   cap=p.batch_size, sessions=2, what=f"evaluate {variant}")
    logits = onnxutil.run_batched(session, x, batch, progress=f"evaluate {variant}")
    ref = logits if variant == "fp32" else onnxutil.run_batched(fp32_session, x, batch,
                                                                progress="evaluate fp32")
    seconds = time.perf_counter() - start  # the variant's and FP32's pass over the test split
    atol = getattr(p.batch_consistency_atol, variant)
    # fp32, static and bf16 must match their sequential outputs bit for bit; dynamic is held to
    # its batch tolerance (its activation scales are computed at run time).
    checks = evaluate.edge_checks(session, info, x, odd_batch=ODD_BATCH, large_batch=batch,
                                  atol=atol, callers=callers, concurrent=concurrent,
                                  concurrency_atol=atol if variant == "dynamic" else 0.0,
                                  same=task.batch_agreement)
    # Fail before writing: metrics of a model that fails a check (NaN logits, say) must not
    # replace the last good ones.
    failed = [c for c in checks if not c.ok]
    if failed:
        others = f" (also failed: {', '.join(c.name for c in failed[1:])})" if failed[1:] else ""
        raise UserError(f"{path}: edge check {failed[0].name} failed: {failed[0].detail}{others}")
    # Agreement on a larger pool that needs no labels: train images, evenly spaced.
    pool_x = criterion.pool(data.load_split(args.data, "train").x, info)
    pool_out = onnxutil.run_batched(session, pool_x, batch)
    pool_ref = pool_out if variant == "fp32" else onnxutil.run_batched(fp32_session, pool_x, batch)
    result = task.evaluate(logits, ref, pool_out, pool_ref, test, str(path))
    metrics = {
        "variant": variant, **ran_on, **result.quality, "pool": result.pool,
        "size_bytes": path.stat().st_size, "ops": onnxutil.op_counts(model),
        "graph_optimization_level": level.name, "batch_size": batch,
        "edge_checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in checks},
        "resources": resources(len(x) * (2 - (variant == "fp32")), seconds, memory.total_mb)}
    write_json(args.metrics, metrics)
    write_json(args.predictions, result.results)  # the task's, in COCO results format, if any
    write_json(args.confusion, result.confusion)
    print(f"evaluate {variant}: {result.line}, {len(checks)} edge checks passed")


def skip(args, reason: str) -> None:
    """No row for this variant: empty outputs and the reason."""
    write_json(args.metrics, {"variant": args.variant, "skipped": reason})
    write_json(args.confusion, [])
    write_json(args.predictions, [])
    print(f"evaluate {args.variant}: skipped, {reason}")


if __name__ == "__main__":
    run_stage(main)
