#!/usr/bin/env python3
"""quantpipe against Ultralytics' own INT8, side by side in one run: the numbers behind the peer
table of docs/detection.md.

For each YOLO of the study (scripts/ultralytics_fixtures.py --study: full-width YOLO11n and
YOLOv8n trained by Ultralytics on the 128 px digit canvases, exported to ONNX and to OpenVINO
FP32 and INT8 by Ultralytics' own exporter, its NNCF path calibrated on the val split by
default and on train), in a clone of this repository:

1. the README's YOLO recipe as written (`dvc repro` with prepare.source yolo, the dataset,
   train.model onnx:inputs/<model>.onnx): whether the report is green, its mAP and speed;
2. every model on the same test images scored by quantpipe's own decode and COCO evaluation:
   quantpipe's FP32 and static (ONNX Runtime and OpenVINO), Ultralytics' OpenVINO FP32 and INT8;
3. the same models timed in the same interleaved rounds (quantpipe.bench): 1 thread at batch 1
   and all cores at batch 16, OpenVINO models compiled for each batch's static shape;
4. Ultralytics' validator on the same ONNX file and test split (its own venv, as a tool:
   Ultralytics is never a dependency of quantpipe), at imgsz (rect=False) and by default;
5. quantpipe's `nncf` engine with Ultralytics' preset (mixed) on the same FP32 file: NNCF's
   placement (no quantizer between a conv and its SiLU) on both runtimes, and on OpenVINO
   without its bias correction (`quantize_static.nncf.bias_correction: none`);
6. ONNX Runtime's kernel time per op type at 1 thread, batch 1, FP32 and static: where the
   INT8 model's time goes when it is not faster;
7. each row's mAP against Ultralytics' INT8 (calibrated on train) as a 90% interval of a paired
   bootstrap over the test images (quantpipe.detection.bootstrap).

    python scripts/yolo_peer.py                    # -> metrics/yolo_peer.json, then make docs
    python scripts/yolo_peer.py --families yolo11n --workdir /tmp/peer

About 20 minutes a model on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from quantpipe import bench, data, onnxutil, profiling
from quantpipe.detection import bootstrap, task
from quantpipe.docs import PEER_REFERENCE
from quantpipe.io import write_json
from quantpipe.schemas.bench import BenchParams
from quantpipe.schemas.detect import DetectParams
from quantpipe.studies import clone, repro, set_params

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("QP_ULTRALYTICS_CACHE", Path.home() / ".cache" / "quantpipe-ultralytics"))
# The peer's configurations (the issue's): 1 thread at batch 1, all cores at batch 16.
BATCHES = (1, 16)
# Ultralytics' exports of the study, by their key in study.json.
ULTRALYTICS = {"ultralytics_openvino_int8": "openvino_int8_calib_train",
               "ultralytics_openvino_int8_calib_val": "openvino_int8_calib_val",
               "ultralytics_openvino_fp32": "openvino_fp32"}

VALIDATE = """
import json, sys
from ultralytics import YOLO
path, data, imgsz = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
for rect in (False, True):
    r = YOLO(path, task="detect").val(data=data, imgsz=imgsz, batch=16, split="test", rect=rect,
                                      plots=False, device="cpu", verbose=False)
    out[f"rect_{str(rect).lower()}"] = {"map_50_95": round(float(r.box.map), 4),
                                        "map_50": round(float(r.box.map50), 4)}
print("RESULT " + json.dumps(out))
"""


def ultralytics_scores(python: Path, model: Path, data_yaml: Path, imgsz: int) -> dict:
    """Ultralytics' validator on the test split, run by its own venv's python."""
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_AUTOINSTALL": "0",
           "YOLO_CONFIG_DIR": str(CACHE / "config")}
    done = subprocess.run([str(python), "-c", VALIDATE, str(model), str(data_yaml), str(imgsz)],
                          capture_output=True, text=True, env=env)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(line[len("RESULT "):])


class StaticShapes:
    """An OpenVINO model (an IR .xml or an ONNX file) compiled once per batch size at that
    batch's static shape, with the latency hint and `threads` threads."""

    def __init__(self, path: Path, threads: int) -> None:
        import openvino as ov

        self.core, self.path, self.threads, self.compiled = ov.Core(), path, threads, {}

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        n = len(batch)
        if n not in self.compiled:
            model = self.core.read_model(str(self.path))
            model.reshape({model.inputs[0].get_any_name(): list(batch.shape)})
            self.compiled[n] = self.core.compile_model(model, "CPU", {
                "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": self.threads,
                "INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
        return self.compiled[n].infer({0: batch}, share_inputs=True)[0]


def ort_runner(path: Path, threads: int):
    from onnxruntime import GraphOptimizationLevel

    from quantpipe.runtimes.ort import OnnxRuntime

    return OnnxRuntime(GraphOptimizationLevel.ORT_ENABLE_ALL).runner(path, threads)


def scored(run, x, test: data.Split, info: data.DataInfo, p: DetectParams) -> tuple[dict, list]:
    """mAP of a runner on the test split, by the pipeline's own decode and COCO evaluation, and
    the COCO results it was scored from."""
    out = np.concatenate([run(x[i:i + 16]) for i in range(0, len(x), 16)])
    s, dets = task.scored(out, test, info, p)
    return {"map_50_95": s["map_50_95"], "map_50": s["map_50"]}, dets


def nncf_mixed(repo: Path, out: Path, bias_correction: str = "fast") -> Path:
    """The nncf engine's nncf.quantize (activations as uint8, which OpenVINO runs INT8) with its
    calibration dataset, Ultralytics' preset (mixed), `bias_correction` and the decode in float
    as the onnxruntime engine keeps it (graph.float_decode), on the pipeline's FP32 file and
    calibration set. The engine's accuracy control is not run."""
    import dataclasses

    import onnx

    from quantpipe import params
    from quantpipe.engines.graph import float_decode
    from quantpipe.engines.nncf_ptq import quantize
    from quantpipe.schemas.quantize_static import BiasCorrection, NNCFPreset, QuantizeStaticParams

    model = onnx.load(str(repo / "models/fp32.onnx"))
    info = data.load_info(repo / "data/calibration")
    calib = data.load_split(repo / "data/calibration", "calib").x[:]
    p = params.load(QuantizeStaticParams, repo / "params.yaml")
    p = dataclasses.replace(p, nodes_to_exclude=tuple(float_decode(model)),
                            nncf=dataclasses.replace(p.nncf, preset=NNCFPreset.mixed,
                                                     bias_correction=BiasCorrection(bias_correction)))
    onnx.save(quantize(model, calib, info, p), str(out))
    return out


def kernel_profiles(models: dict[str, Path], x: np.ndarray, workdir: Path) -> dict:
    """ONNX Runtime's kernel time per op type, 1 thread, batch 1 (quantpipe.profiling)."""
    from onnxruntime import GraphOptimizationLevel

    workdir.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, path in models.items():
        session = onnxutil.make_session(path, level=GraphOptimizationLevel.ORT_ENABLE_ALL,
                                        threads=1, profile_prefix=str(workdir / key))
        out[key] = profiling.kernel_profile(session, x[:1], runs=200, top=3)
    return out


def peer(family: str, rec: dict, dataset: Path, args) -> dict:
    repo, log = clone(ROOT, args.workdir / family)
    shutil.copytree(dataset, repo / "inputs" / "data", ignore=shutil.ignore_patterns("*.cache"))
    onnx_file = repo / "inputs" / f"{family}.onnx"
    shutil.copy(rec["val"]["onnx"]["path"], onnx_file)
    set_params(repo, {"prepare": {"task": "detection", "source": "yolo", "path": "inputs/data"},
                      "train": {"model": f"onnx:inputs/{family}.onnx"}})
    if args.smoke:  # a check of this script, not a measurement
        set_params(repo, {"bench": {"runs": 10, "rounds": 2, "seconds": 5.0}})
    try:  # the recipe as written: the gates decide whether dvc repro ends green
        seconds, green = repro(repo, log), True
    except SystemExit:
        seconds, green = None, False
    read = lambda rel: json.loads((repo / rel).read_text())  # noqa: E731
    summary, q = read("metrics/summary.json"), read("metrics/quantize_static.json")
    info, test = data.load_info(repo / "data/prepared"), data.load_split(repo / "data/prepared", "test")
    x = data.normalize(test.x[:], info)  # a few hundred 128 px images
    detect = DetectParams()
    cores = int(summary["machine"]["cores"])
    mixed = nncf_mixed(repo, repo / "models" / "nncf_mixed.onnx")
    unbiased = nncf_mixed(repo, repo / "models" / "nncf_mixed_no_bc.onnx", "none")
    models = {("fp32", "onnxruntime"): (ort_runner, repo / "models/fp32.onnx"),
              ("static", "onnxruntime"): (ort_runner, repo / "models/static.onnx"),
              ("static", "openvino"): (StaticShapes, repo / "models/static.onnx"),
              ("nncf_mixed", "onnxruntime"): (ort_runner, mixed),
              ("nncf_mixed", "openvino"): (StaticShapes, mixed),
              ("nncf_mixed_no_bc", "openvino"): (StaticShapes, unbiased),
              **{(name, "openvino"): (StaticShapes, _xml(Path(rec["val"][key]["path"])))
                 for name, key in ULTRALYTICS.items() if "path" in rec["val"].get(key, {})}}
    results = {k: scored(make(path, cores), x, test, info, detect) for k, (make, path) in models.items()}
    scores = {k: v[0] for k, v in results.items()}
    # mAP differences of a few tenths on ~100 images: how much of one is the luck of the draw.
    reference = (PEER_REFERENCE, "openvino")
    interval = {} if reference not in models else bootstrap.map_differences(
        task.ground_truth(test, info), {k: v[1] for k, v in results.items()}, reference)
    p = BenchParams(batch_sizes=BATCHES, threads=(1, cores), runs=args.runs, rounds=args.rounds,
                    seconds=args.max_seconds * 2 * len(BATCHES))  # --max-seconds per measurement
    grid = bench.latency_grid(lambda t: {k: make(path, t) for k, (make, path) in models.items()},
                              x, (1, cores), p, desc=f"peer {family}")
    base = ("fp32", "onnxruntime")
    rows = []
    for key in models:
        lat = bench.rows_against(grid, key, base)
        one, many = lat["threads1"]["bs1"], lat[f"threads{cores}"][f"bs{BATCHES[-1]}"]
        rows.append({"model": family, "variant": key[0], "runtime": key[1], **scores[key],
                     "map_drop_pts": round((scores[base]["map_50_95"] - scores[key]["map_50_95"]) * 100, 2),
                     "p50_ms_1thread_bs1": one["p50_ms"], "speedup_1thread_bs1": one.get("speedup", 1.0),
                     f"p50_ms_all_bs{BATCHES[-1]}": many["p50_ms"],
                     f"speedup_all_bs{BATCHES[-1]}": many.get("speedup", 1.0),
                     **({"vs_ultralytics_int8_pts_90": interval[key]} if interval else {})})
    data_yaml = repo / "inputs/data/data.yaml"
    return {"model": family, "green_report": green, "pipeline_seconds": seconds and round(seconds, 1),
            "recipe": {v: {k: summary[v].get(k) for k in ("map_50_95", "map_drop_pts", "speedup")}
                       for v in ("fp32", "static") if v in summary},
            "recommended": summary.get("recommended"),
            "mac_share_int8": q.get("mac_share_int8"), "nodes_in_float": q.get("nodes_in_float"),
            "ultralytics_validator": {
                "onnx": ultralytics_scores(args.ultralytics_python, onnx_file, data_yaml, info.image_size),
                **{name: ultralytics_scores(args.ultralytics_python, Path(rec["val"][key]["path"]),
                                            data_yaml, info.image_size)
                   for name, key in ULTRALYTICS.items() if "path" in rec["val"].get(key, {})}},
            "ort_kernels_1thread_bs1": kernel_profiles(
                {"fp32": repo / "models/fp32.onnx", "static": repo / "models/static.onnx"}, x,
                args.workdir / f"{family}-profiles"),
            "cores": cores, "cpu": summary["machine"].get("cpu"), "rows": rows}


def _xml(path: Path) -> Path:
    """An Ultralytics OpenVINO export folder's .xml (the path itself for a file)."""
    if path.is_file():
        return path
    folder = path.parent if path.suffix == ".xml" else path
    found = sorted(folder.glob("*.xml"))
    if not found:
        raise SystemExit(f"{folder}: no OpenVINO .xml; re-run the study's export")
    return found[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", type=Path, default=CACHE / "study",
                    help="scripts/ultralytics_fixtures.py --study's folder (study.json)")
    ap.add_argument("--ultralytics-python", type=Path, default=CACHE / "venv" / "bin" / "python")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-yolo-peer"))
    ap.add_argument("--families", nargs="+", default=None)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-seconds", type=float, default=5.0)
    ap.add_argument("--smoke", action="store_true",
                    help="the pipeline's bench shortened too: checks the script, measures nothing")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "metrics" / "yolo_peer.json")
    args = ap.parse_args()
    study = json.loads((args.study / "study.json").read_text())
    dataset = Path(study["dataset"]["path"])
    # --families re-measures those models and keeps the others' rows.
    kept = json.loads(args.out.read_text())["models"] if args.families and args.out.exists() else {}
    record = {"ultralytics": study["ultralytics"], "imgsz": study["imgsz"],
              "dataset": study["dataset"]["command"], "models": kept}
    for family, rec in study["models"].items():
        if args.families and family not in args.families:
            continue
        if "onnx" not in rec.get("val", {}):
            print(f"{family}: the study has no ONNX export yet; skipped", file=sys.stderr)
            continue
        record["models"][family] = {**peer(family, rec, dataset, args),
                                    "epochs": rec["epochs"], "params": rec["params"],
                                    "validator_val_split": {k: v for k, v in rec["val"].items()}}
        write_json(args.out, record)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
