"""bench <variant>: latency of models/<variant>.onnx per batch size and thread count.

A quantized variant is timed in the same interleaved rounds as FP32, and its speedup is the
ratio of the two medians from those rounds, so machine drift cancels out of the ratio.
Afterwards one ORT profile at the largest batch records where the time goes (per node and op).
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe import bench, data, onnxutil  # noqa: E402
from quantpipe.io import run_stage, variant_argument, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

PREPARED = Path("data/prepared")
PROFILE_RUNS = 20  # profiled runs at the largest batch: enough for a stable per-node median


def main() -> None:
    variant = variant_argument(sys.argv)
    params = load_params()
    p, level = params.bench, params.runtime.graph_optimization_level
    info = data.load_info(PREPARED)
    x = data.normalize(data.load_split(PREPARED, "test").x, info)
    models = {name: Path(f"models/{name}.onnx") for name in dict.fromkeys((variant, "fp32"))}

    for path in models.values():  # a bad model fails in one line, before the progress bar
        onnxutil.check_input_matches(onnxutil.make_session(path, level=level), info.input_shape,
                                     str(path))

    def runners_for(threads: int) -> dict[str, bench.Runner]:
        return {name: bench.session_runner(onnxutil.make_session(path, level=level, threads=threads))
                for name, path in models.items()}

    results = bench.latency_table(runners_for, variant, x, p, desc=f"bench {variant}")
    # Profiling slows every run a little, so it is a separate session after the timed rounds.
    profile_threads = p.threads[0]
    with tempfile.TemporaryDirectory() as tmp:
        session = onnxutil.make_session(models[variant], level=level, threads=profile_threads,
                                        profile_prefix=f"{tmp}/ort")
        profile = bench.kernel_profile(session, bench.batch_of(x, max(p.batch_sizes)),
                                       runs=PROFILE_RUNS)
    write_json(f"metrics/bench/{variant}.json", {
        "variant": variant, "graph_optimization_level": level.name,
        "machine": bench.machine_info(), "latency": results,
        "kernel_profile": {"threads": profile_threads, **profile}})
    for threads, rows in results.items():
        for bs, r in rows.items():
            extra = f", x{r['speedup']:.2f} vs fp32" if "speedup" in r else ""
            print(f"bench {variant}: {bs}, {threads}: p50 {r['p50_ms']:.3f} ms{extra}")
    print(f"bench {variant}: kernel time at bs{profile['batch_size']}: {bench.describe_profile(profile)}")


if __name__ == "__main__":
    run_stage(main)
