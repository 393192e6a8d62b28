#!/usr/bin/env python3
"""At the sizes people deploy: the whole pipeline on classifiers at 224 px, and OpenVINO's own
INT8 flow beside it; the numbers behind docs/results.md "At the sizes people deploy".

For each model (ResNet-50, MobileNetV3-Large, EfficientNet-B0), in a clone of this repository
at its committed HEAD (its own DVC cache):

1. the README's recipe as a new user runs it on a folder of 360 RGB textures (6 classes,
   256 px JPEGs, made here: quantpipe.studies.texture_folder, the deploy-size check's images):
   prepare.resize 256, crop 224, mean imagenet, train.model <model>, train.epochs 5, every
   other key at its default; `dvc repro`: green or the line it stopped on, its wall time, and
   each stage's seconds and peak RSS (its metrics' `resources`);
2. every variant (FP32, BF16, dynamic, static, QAT) on both runtimes at batch 1 and 64, one
   thread and all cores: p50 and the speedup over the best FP32 timed in the same rounds (the
   faster of ONNX Runtime's and OpenVINO's), test accuracy; a model whose FP32 test accuracy is
   not above chance (criterion.above_chance) is marked so; what `recommended` ships;
3. OpenVINO's own flow on the same FP32 file: `nncf.quantize` of the OpenVINO model (its
   performance preset, quantpipe's calibration images) saved as an OpenVINO IR, scored on the
   test split and timed in the same interleaved rounds as quantpipe's static on both runtimes,
   FP32 on both and BF16 (quantpipe.bench.latency_grid).

    python scripts/deploy_sizes.py                     # -> metrics/deploy_sizes.json; make docs
    python scripts/deploy_sizes.py --models resnet50 --workdir /tmp/deploy-sizes

About 35 minutes for ResNet-50 on 2 cores, 15 to 20 for each of the others.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from quantpipe import bench, criterion, data
from quantpipe.io import write_json
from quantpipe.runtimes.registry import select
from quantpipe.schemas.bench import BenchParams
from quantpipe.studies import clone, dvc, set_params, texture_folder
from quantpipe.sweep import error_line

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0")
RECIPE = {"prepare": {"source": "imagefolder", "path": "inputs/textures", "resize": 256,
                      "crop": 224, "mean": "imagenet"}, "train": {"epochs": 5}}
VARIANTS = ("fp32", "bf16", "dynamic", "static", "qat")
# The peer's timing: every variant's configurations (bench.batch_sizes, one thread and all cores).
PEER_BATCHES = (1, 64)


def stage_resources(repo: Path) -> dict[str, dict]:
    """{stage: {"seconds", "peak_rss_mb"}} from each stage's metrics (`resources`), as DVC
    names the stages."""
    found = {}
    for path in sorted((repo / "metrics").rglob("*.json")):
        rel = path.relative_to(repo / "metrics")
        if rel.parts[0] in ("machines", "plots"):
            continue
        try:
            r = json.loads(path.read_text()).get("resources")
        except (json.JSONDecodeError, AttributeError):
            continue
        if not isinstance(r, dict):
            continue
        name = {"eval": f"evaluate@{path.stem}", "bench": f"bench@{path.stem}"}.get(
            rel.parts[0], path.stem) if len(rel.parts) > 1 else path.stem
        found["bench_torch" if name == "bench@torch" else name] = {
            "seconds": r["seconds"], "peak_rss_mb": r["peak_rss_mb"]}
    return found


def variant_rows(repo: Path) -> dict[str, dict]:
    """Per variant: test accuracy, size and, per runtime, thread count and batch size, p50 and
    the speedup over the best FP32 timed in the same rounds (FP32 on either runtime)."""
    rows = {}
    for v in VARIANTS:
        path = repo / f"metrics/bench/{v}.json"
        b = json.loads(path.read_text()) if path.exists() else {"skipped": "not run"}
        if "skipped" in b:
            continue
        ev = json.loads((repo / f"metrics/eval/{v}.json").read_text())
        cells: dict = {}
        for name, entry in b["runtimes"].items():
            own = b["latency"] if name == b["runtime"] else entry.get("latency")
            for threads, by_bs in (own or {}).items():
                for bs, r in by_bs.items():
                    best = min(fp32_same_rounds(b, threads, bs))
                    cells.setdefault(name, {}).setdefault(threads, {})[bs] = {
                        "p50_ms": r["p50_ms"], "speedup": round(best / r["p50_ms"], 3),
                        **({"speedup_range": r["speedup_range"]} if "speedup_range" in r else {})}
        failed = {name: e["failed"] for name, e in b["runtimes"].items() if "failed" in e}
        rows[v] = {"accuracy": ev["accuracy"], "size_bytes": ev["size_bytes"], "latency": cells,
                   **({"untrusted": failed} if failed else {})}
    return rows


def fp32_same_rounds(b: dict, threads: str, bs: str) -> list[float]:
    """FP32's p50 on every runtime a variant's bench timed it on, in the variant's rounds."""
    if b["variant"] == "fp32":
        return [b["latency"][threads][bs]["p50_ms"]] + [
            e["latency"][threads][bs]["p50_ms"] for name, e in b["runtimes"].items()
            if name != b["runtime"] and threads in e.get("latency", {})]
    return [b["latency"][threads][bs]["baseline_p50_ms"]] + [
        e["baseline"]["latency"][threads][bs]["p50_ms"] for e in b["runtimes"].values()
        if threads in e.get("baseline", {}).get("latency", {})]


def openvino_flow(repo: Path, cores: int) -> dict:
    """nncf.quantize of the OpenVINO model of models/fp32.onnx on the calibration set, saved as
    an IR; its test accuracy and agreement with FP32, and the same rounds' latency of it,
    quantpipe's static on both runtimes, FP32 on both and BF16."""
    import nncf
    import openvino as ov

    info = data.load_info(repo / "data/prepared")
    calib = data.load_split(repo / "data/calibration", "calib")
    model = ov.Core().read_model(str(repo / "models/fp32.onnx"))
    dataset = nncf.Dataset(range(len(calib.x)), lambda i: data.normalize(calib.x[i:i + 1], info))
    start = time.perf_counter()
    quantized = nncf.quantize(model, dataset, preset=nncf.QuantizationPreset.PERFORMANCE,
                              subset_size=len(calib.x))
    seconds = time.perf_counter() - start
    ir = repo / "models" / "openvino_nncf.xml"
    ov.save_model(quantized, str(ir))
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    rt = {**select(["onnxruntime", "openvino"], level=level),
          "openvino_bf16": select(["onnxruntime", "openvino"], level=level,
                                  precision="bf16")["openvino"]}
    test = data.load_split(repo / "data/prepared", "test")
    x = data.Normalized(test.x, info)
    scored = {name: np.concatenate([run(x[i:i + 64]) for i in range(0, len(x), 64)])
              for name, run in (("fp32", rt["onnxruntime"].runner(repo / "models/fp32.onnx", cores)),
                                ("flow", rt["openvino"].runner(ir, cores)))}
    runners = {("fp32", "onnxruntime"): ("onnxruntime", "models/fp32.onnx"),
               ("fp32", "openvino"): ("openvino", "models/fp32.onnx"),
               ("bf16", "openvino"): ("openvino_bf16", "models/fp32.onnx"),
               ("static", "onnxruntime"): ("onnxruntime", "models/static.onnx"),
               ("static", "openvino"): ("openvino", "models/static.onnx"),
               ("openvino_nncf", "openvino"): ("openvino", ir)}
    p = BenchParams(batch_sizes=PEER_BATCHES, threads=(cores, 1), seconds=120.0)
    grid = bench.latency_grid(lambda t: {k: rt[r].runner(repo / path, t)
                                         for k, (r, path) in runners.items()},
                              x, tuple(dict.fromkeys((cores, 1))), p, desc="openvino flow")
    latency = {}
    for threads, by_bs in grid.items():
        for bs, lat in by_bs.items():
            best = min(lat[("fp32", "onnxruntime")].p50_ms, lat[("fp32", "openvino")].p50_ms)
            for (model_name, runtime), row in lat.items():
                latency.setdefault(f"{model_name}@{runtime}", {}).setdefault(threads, {})[bs] = {
                    "p50_ms": row.p50_ms, "speedup": round(best / row.p50_ms, 3)}
    flow = scored["flow"].argmax(1)
    return {"nncf": nncf.__version__, "preset": "performance", "calib_samples": len(calib.x),
            "quantize_seconds": round(seconds, 1),
            "accuracy": round(float((flow == test.y).mean()), 6),
            "agreement_with_fp32": round(float((flow == scored["fp32"].argmax(1)).mean()), 6),
            "latency": latency}


def run_model(name: str, workdir: Path) -> dict:
    repo, log = clone(ROOT, workdir / name)
    texture_folder(repo / "inputs" / "textures")
    set_params(repo, {**RECIPE, "train": {**RECIPE["train"], "model": name}})
    start = time.perf_counter()
    try:
        dvc(repo, log, "repro")
        error = None
    except SystemExit:
        error = error_line(log.read_text(errors="replace"))
    record = {"model": name, "image_size": 224, "repro_seconds": round(time.perf_counter() - start),
              "green": error is None, **({"error": error} if error else {}),
              "git_revision": subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"],
                                             capture_output=True, text=True).stdout.strip(),
              "stages": stage_resources(repo)}
    summary_path = repo / "metrics/summary.json"
    if not summary_path.exists() or not (repo / "metrics/bench/static.json").exists():
        return record
    summary = json.loads(summary_path.read_text())
    info = data.load_info(repo / "data/prepared")
    fp32 = json.loads((repo / "metrics/eval/fp32.json").read_text())
    record.update({
        "machine": summary["machine"], "classes": info.num_classes, "test_samples": fp32["samples"],
        "above_chance": criterion.above_chance(round(fp32["accuracy"] * fp32["samples"]),
                                               fp32["samples"], info.num_classes),
        "variants": variant_rows(repo),
        "recommended": {bs: {k: r[k] for k in ("variant", "runtime", "threads", "p50_ms")
                             if k in r} | ({"speedup": r["speedup"]} if "speedup" in r else {})
                        for bs, r in summary.get("recommended", {}).items()},
        "openvino_flow": openvino_flow(repo, int(summary["machine"]["cores"]))})
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-deploy-sizes"))
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "metrics" / "deploy_sizes.json")
    args = ap.parse_args()
    # --models re-measures those and keeps the others' rows.
    kept = json.loads(args.out.read_text())["models"] if args.out.exists() else {}
    record = {"recipe": RECIPE, "models": kept}
    for name in args.models:
        print(f"{name}: running the recipe in {args.workdir / name}", file=sys.stderr, flush=True)
        record["models"][name] = run_model(name, args.workdir)
        write_json(args.out, record)
    print(json.dumps(record, indent=2)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
