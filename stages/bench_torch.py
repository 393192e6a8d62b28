"""bench_torch: the PyTorch eager baseline — test accuracy and latency of models/model.pt,
timed in the same interleaved rounds as models/fp32.onnx (the practitioner's table starts here)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantpipe import bench, data, models, onnxutil  # noqa: E402
from quantpipe import machine as machines  # noqa: E402
from quantpipe.io import run_stage, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

PREPARED = Path("data/prepared")
MODEL = Path("models/model.pt")
FP32 = Path("models/fp32.onnx")


def main() -> None:
    params = load_params()
    p, level = params.bench, params.runtime.graph_optimization_level
    if models.onnx_source(params.train.model):
        write_json("metrics/bench/torch.json", {
            "variant": "torch", "skipped": f"no PyTorch model: train.model is {params.train.model}"})
        print("bench torch: skipped, the model was brought as ONNX")
        return
    machine = machines.load()
    threads = bench.resolve_threads(p.threads, machine["cores"])
    info = data.load_info(PREPARED)
    test = data.load_split(PREPARED, "test")
    x = data.normalize(test.x, info)
    model = models.build_model(params.train.model, info.channels, info.image_size, info.num_classes)
    models.load_weights(model, MODEL)
    accuracy = float((models.predict_torch(model, x).argmax(1) == test.y).mean())

    # A bad FP32 model fails in one line, before the progress bar.
    onnxutil.check_input_matches(onnxutil.make_session(FP32, level=level), info.input_shape, str(FP32))

    def runners_for(count: int) -> dict[str, bench.Runner]:
        torch.set_num_threads(count)
        session = onnxutil.make_session(FP32, level=level, threads=count, stop_spinning=True)
        return {"torch": lambda b: model(torch.from_numpy(b)), "fp32": onnxutil.session_runner(session)}

    # "speedup" has the same meaning as for the INT8 variants: FP32 ONNX time / torch time.
    with torch.inference_mode():
        results = bench.latency_table(runners_for, "torch", x, threads, p, desc="bench torch")
    write_json("metrics/bench/torch.json", {
        "variant": "torch", "accuracy": round(accuracy, 6), "size_bytes": MODEL.stat().st_size,
        "torch": torch.__version__, "machine": machine, "threads": list(threads),
        "latency": results})
    for count, rows in results.items():
        for bs, r in rows.items():
            print(f"bench torch: {bs}, {count}: p50 {r['p50_ms']:.3f} ms "
                  f"(fp32 onnx is x{1 / r['speedup']:.2f} faster)")


if __name__ == "__main__":
    run_stage(main)
