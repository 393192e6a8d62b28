"""bench <variant>: latency, throughput, memory and kernel profile of models/<variant>.onnx on
the machine of metrics/machine.json, within bench.seconds (quantpipe.bench.TimeBudget).

Latency per batch size and thread count ("all" = every physical core), timed in the same
interleaved rounds as FP32: the speedup is the ratio of the two medians, its spread over the
rounds beside it. Throughput at the largest batch for every way to fill the cores with streams.
Every runtime of bench.runtimes on the same files, checked against ONNX Runtime first (parity);
`best` is the fastest trusted runtime and configuration against the best FP32 one. Peak RSS of
a fresh process per batch size; one ORT profile at the largest batch.
"""
import time

import numpy as np

from quantpipe import bench, budget, data, onnxutil, params
from quantpipe.tasks import bind
from quantpipe import machine as machines
from quantpipe.errors import UserError
from quantpipe.io import resources, run_stage, skipped_model, stage_args, write_json
from quantpipe.runtimes import base, registry, timing
from quantpipe.schemas.bench import BenchParams
from quantpipe.schemas.runtime import RuntimeParams

PARITY_SAMPLES = 1000  # test samples a runtime is checked on: 5 may disagree at 99.5%


def main(argv: list[str]) -> None:
    args = stage_args("bench", argv, "model", "fp32", "data", "machine", "metrics", variant=True)
    variant, start = args.variant, time.perf_counter()
    p, memory = params.load(BenchParams), budget.load()
    level = params.load(RuntimeParams).graph_optimization_level
    try:
        fp32_runtimes = registry.select(p.runtimes, level=level)
    except UserError as e:
        raise UserError(f"{params.PARAMS_FILE}: {e}") from None
    bf16_runtimes = registry.select(p.runtimes, level=level, precision="bf16")
    machine = machines.load(args.machine)
    threads = bench.resolve_threads(p.threads, machine["cores"])
    info = data.load_info(args.data)
    task = bind.for_data(info)
    test = data.load_split(args.data, "test")
    x = data.Normalized(test.x, info)  # read a batch at a time
    models = {variant: args.model, "fp32": args.fp32}
    skipped = skipped_model(models[variant]) or (
        variant == "bf16" and registry.bf16_skip(machine, p.runtimes))
    if skipped:
        return skip(args, skipped)
    # The FP32 file in BF16 beside every INT8 variant, timed in the same rounds: on a CPU with
    # native BF16 it is the baseline INT8 has to beat (speedup_vs_bf16).
    if variant not in ("fp32", "bf16") and bf16_runtimes and not machines.bf16_missing(machine):
        models["bf16"] = args.fp32
    runtimes = {m: bf16_runtimes if m == "bf16" else fp32_runtimes for m in models}
    # Sessions of every model and runtime at the largest batch, before any is made.
    streams = bench.check_memory(memory, models, runtimes, info.input_shape, p, machine["cores"])
    for path in models.values():  # a bad model fails in one line, before the progress bar
        onnxutil.check_input_matches(onnxutil.make_session(path, level=level), info.input_shape,
                                     str(path))
    reference = fp32_runtimes[registry.REFERENCE]
    # Runtimes agree when the task's predictions do (top-1; a detector's detections pair up).
    sample = test.take(np.arange(min(len(test), PARITY_SAMPLES)))
    checks = {model: base.check(runtimes[model], reference, path, data.Normalized(sample.x, info),
                                task.labels(sample), threads=threads[0],
                                batch_size=max(p.batch_sizes), agree=task.agree,
                                min_agreement=p.min_runtime_agreement, fp32_path=args.fp32)
              for model, path in models.items()}
    if not any(c.runs for c in checks[variant].values()):  # the bf16 row: no runtime reads it
        return skip(args, "; ".join(c.failed for c in checks[variant].values()))
    print(f"bench {variant}: on {machines.describe(machine)}; runtimes: "
          + ", ".join(f"{name} {runtime.version()}" for name, runtime in runtimes[variant].items()))
    clock = bench.TimeBudget(p.seconds, bench.measurements(
        threads, p, machine["cores"], end_to_end=task.postprocess is not None,
        profiled=variant != "bf16"))
    timings = timing.time_runtimes(runtimes, registry.REFERENCE, models, checks, variant, x, threads,
                                  machine["cores"], p, clock, streams)
    if variant == "bf16":
        timings["unsupported"] = registry.unsupported(p.runtimes, "bf16")
    if task.postprocess is not None:  # the model, then the task's post-processing
        timings["end_to_end"] = timing.end_to_end(
            task.postprocess, runtimes[variant][timings["runtime"]], reference, models, variant, x,
            threads, p, clock)
    out = {"variant": variant, "graph_optimization_level": level.name, "machine": machine,
           # The kernels each runtime ran; ORT's memory and time per op (not for the bf16 row).
           "threads": list(threads), **timings,
           **timing.profile(runtimes[variant], models[variant], checks[variant], x, threads, machine,
                            info.input_shape, p, level, clock, timings, ort=variant != "bf16")}
    out["resources"] = {**resources(len(sample) * len(models), time.perf_counter() - start,
                                    memory.total_mb),
                        "seconds_budget": p.seconds, "seconds_over": round(clock.over(), 1)}
    write_json(args.metrics, out)
    for line in timing.describe_bench(out):
        print(f"bench {variant}: {line}")


def skip(args, reason: str) -> None:
    write_json(args.metrics, {"variant": args.variant, "skipped": reason})
    print(f"bench {args.variant}: skipped, {reason}")


if __name__ == "__main__":
    run_stage(main)
