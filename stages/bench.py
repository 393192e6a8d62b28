"""bench <variant>: latency, throughput, memory and kernel profile of models/<variant>.onnx on
the machine recorded in metrics/machine.json.

- Latency per batch size and thread count (bench.threads; "all" = every physical core), timed
  in the same interleaved rounds as FP32: the speedup is the ratio of the two medians from
  those rounds, so machine drift cancels out of it.
- Throughput at the largest batch: every way to fill all cores with sessions (streams) of
  fewer threads, interleaved with FP32 the same way; the best configuration of each side.
- Memory: peak RSS and session-creation time of a fresh process per batch size.
- One ORT profile at the largest batch: where the time goes (per node and op).
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe import bench, data, onnxutil  # noqa: E402
from quantpipe import machine as machines  # noqa: E402
from quantpipe.io import run_stage, skipped_model, variant_argument, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

PREPARED = Path("data/prepared")
PROFILE_RUNS = 20  # profiled runs at the largest batch: enough for a stable per-node median


def main() -> None:
    variant = variant_argument(sys.argv)
    params = load_params()
    p, level = params.bench, params.runtime.graph_optimization_level
    machine = machines.load()
    threads = bench.resolve_threads(p.threads, machine["cores"])
    info = data.load_info(PREPARED)
    x = data.normalize(data.load_split(PREPARED, "test").x, info)
    models = {name: Path(f"models/{name}.onnx") for name in dict.fromkeys((variant, "fp32"))}
    skipped = skipped_model(models[variant])
    if skipped:
        write_json(f"metrics/bench/{variant}.json", {"variant": variant, "skipped": skipped})
        print(f"bench {variant}: skipped, {skipped}")
        return

    for path in models.values():  # a bad model fails in one line, before the progress bar
        onnxutil.check_input_matches(onnxutil.make_session(path, level=level), info.input_shape,
                                     str(path))

    def session(path: Path, count: int) -> bench.Runner:
        return bench.session_runner(onnxutil.make_session(path, level=level, threads=count,
                                                          stop_spinning=True))

    print(f"bench {variant}: on {machines.describe(machine)}")
    latency = bench.latency_table(
        lambda count: {name: session(path, count) for name, path in models.items()},
        variant, x, threads, p, desc=f"bench {variant} latency")
    throughput = bench.throughput_table(
        lambda config: {name: [session(path, config.threads) for _ in range(config.streams)]
                        for name, path in models.items()},
        variant, x, machine["cores"], p, desc=f"bench {variant} throughput")
    memory = bench.memory_profile(models[variant], info.input_shape, p.batch_sizes,
                                  threads=threads[0], level_name=level.name)
    # Profiling slows every run a little, so it is a separate session after the timed rounds.
    with tempfile.TemporaryDirectory() as tmp:
        profiled = onnxutil.make_session(models[variant], level=level, threads=threads[0],
                                         profile_prefix=f"{tmp}/ort")
        profile = bench.kernel_profile(profiled, bench.batch_of(x, max(p.batch_sizes)),
                                       runs=PROFILE_RUNS)
    write_json(f"metrics/bench/{variant}.json", {
        "variant": variant, "graph_optimization_level": level.name, "machine": machine,
        "threads": list(threads), "latency": latency, "throughput": throughput, "memory": memory,
        "kernel_profile": {"threads": threads[0], **profile}})

    for count, rows in latency.items():
        for bs, r in rows.items():
            extra = f", x{r['speedup']:.2f} vs fp32" if "speedup" in r else ""
            print(f"bench {variant}: {bs}, {count}: p50 {r['p50_ms']:.3f} ms{extra}")
    best = throughput["best"]
    extra = f", x{throughput['speedup']:.2f} vs fp32's best" if "speedup" in throughput else ""
    print(f"bench {variant}: throughput at bs{throughput['batch_size']}: {best['ips']:.0f} img/s "
          f"with {best['streams']} stream(s) x {best['threads']} thread(s){extra}")
    print(f"bench {variant}: fresh process: load {memory['load_ms']:.1f} ms, peak RSS "
          + ", ".join(f"{bs} {mb:.0f} MB" for bs, mb in memory["peak_rss_mb"].items()))
    print(f"bench {variant}: kernel time at bs{profile['batch_size']}: {bench.describe_profile(profile)}")


if __name__ == "__main__":
    run_stage(main)
