"""bench <variant>: latency, throughput, memory and kernel profile of models/<variant>.onnx on
the machine recorded in metrics/machine.json.

- Latency per batch size and thread count (bench.threads; "all" = every physical core), timed
  in the same interleaved rounds as FP32: the speedup is the ratio of the two medians from
  those rounds, so machine drift cancels out of it.
- Throughput at the largest batch: every way to fill all cores with sessions (streams) of
  fewer threads, interleaved with FP32 the same way; the best configuration of each side.
- Runtimes (bench.runtimes): the same ONNX files on OpenVINO too, first checked against ONNX
  Runtime on the test split (parity), then timed in the same rounds; `best` is the fastest
  trusted runtime and configuration, against the best FP32 one. The top-level latency and
  throughput stay ONNX Runtime's (the reference).
- Memory: peak RSS and session-creation time of a fresh process per batch size.
- One ORT profile at the largest batch: where the time goes (per node and op).
"""

from quantpipe import bench, data, onnxutil, params, profiling
from quantpipe.tasks import bind
from quantpipe import machine as machines
from quantpipe.errors import UserError
from quantpipe.io import run_stage, skipped_model, stage_args, write_json
from quantpipe.runtimes import base, registry, timing
from quantpipe.runtimes.base import kernel_table
from quantpipe.schemas.bench import BenchParams
from quantpipe.schemas.runtime import RuntimeParams

PROFILE_RUNS = 20  # profiled runs at the largest batch: enough for a stable per-node median


def main(argv: list[str]) -> None:
    args = stage_args("bench", argv, "model", "fp32", "data", "machine", "metrics", variant=True)
    variant = args.variant
    p = params.load(BenchParams)
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

    for path in models.values():  # a bad model fails in one line, before the progress bar
        onnxutil.check_input_matches(onnxutil.make_session(path, level=level), info.input_shape,
                                     str(path))
    reference = fp32_runtimes[registry.REFERENCE]
    # Runtimes agree when the task's predictions do (top-1; a detector's detections pair up).
    checks = {model: base.check(runtimes[model], reference, path, x, task.labels(test),
                                threads=threads[0], batch_size=max(p.batch_sizes),
                                min_agreement=p.min_runtime_agreement, agree=task.agree)
              for model, path in models.items()}

    if not any(c.runs for c in checks[variant].values()):  # the bf16 row: no runtime reads it
        return skip(args, "; ".join(c.failed for c in checks[variant].values()))
    print(f"bench {variant}: on {machines.describe(machine)}; runtimes: "
          + ", ".join(f"{name} {runtime.version()}" for name, runtime in runtimes[variant].items()))
    timings = timing.time_runtimes(runtimes, registry.REFERENCE, models, checks, variant, x, threads,
                                  machine["cores"], p)
    if variant == "bf16":
        timings["unsupported"] = registry.unsupported(p.runtimes, "bf16")
    if task.postprocess is not None:  # the model, then the task's post-processing
        timings["end_to_end"] = timing.end_to_end(
            task.postprocess, runtimes[variant][timings["runtime"]], reference, models, variant, x,
            threads, p)
    largest = bench.batch_of(x, max(p.batch_sizes))
    kernels = {name: kernel_table(runtime.kernels(models[variant], largest, threads[0], machine["cpu_flags"]))
               for name, runtime in runtimes[variant].items()
               if checks[variant][name].runs and hasattr(runtime, "kernels")}
    out = {"variant": variant, "graph_optimization_level": level.name, "machine": machine,
           "threads": list(threads), **timings, "kernels": kernels}
    if variant != "bf16":  # the bf16 row runs on another runtime than ORT: these are ORT's
        out["memory"] = bench.memory_profile(models[variant], info.input_shape, p.batch_sizes,
                                             threads=threads[0], level=level)
        out["kernel_profile"] = profiling.profile_model(models[variant], largest, level=level,
                                                        threads=threads[0], runs=PROFILE_RUNS)
    write_json(args.metrics, out)
    for line in timing.describe_bench(out):
        print(f"bench {variant}: {line}")

def skip(args, reason: str) -> None:
    write_json(args.metrics, {"variant": args.variant, "skipped": reason})
    print(f"bench {args.variant}: skipped, {reason}")


if __name__ == "__main__":
    run_stage(main)
