#!/usr/bin/env python3
"""Detection end to end: the numbers behind docs/detection.md's table.

In a clone of this repository it runs the real pipeline with prepare.task: detection (the
default detector on the embedded canvases), then
- a calibration set that does not represent the data: static INT8 calibrated on the darkest
  canvases only (quantize_static and evaluate@static run by hand on that calibration set:
  the calibration check's warnings and the mAP it costs, plain and with the recovery ladder,
  asked for half a point of mAP);
- static with the decode quantized too (detect.float_decode: false; only the static branch
  re-runs): what keeping it float buys;
- the same detector brought as ONNX in the YOLOv8/YOLO11 output layout
  (train.model: onnx:inputs/detector.onnx, its fp32.onnx copied there);
- torchvision's SSDLite (train.model: ssdlite320_mobilenet_v3_large) with SSDLITE's params;
- torchvision's Faster R-CNN (fasterrcnn_mobilenet_v3_large_320_fpn) with FASTER_RCNN's, and
  what quantpipe's fixed-shape cut of it costs: torchvision's own inference (proposals after
  NMS, every class's box) on the same weights and test split.

    python scripts/detection.py                     # -> metrics/detection.json + table
    python scripts/detection.py --workdir /tmp/det -o /tmp/detection.json
    python scripts/detection.py --only ssdlite      # re-measure the SSDLite rows only
    python scripts/detection.py --only fasterrcnn   # the Faster R-CNN rows only
    python scripts/detection.py --only fasterrcnn --collect   # its rows from the run in --workdir

About an hour on 2 cores (32 minutes without Faster R-CNN).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from quantpipe import data
from quantpipe.docs import detection_table
from quantpipe.io import write_json
from quantpipe.studies import clone, dvc, repro, set_params

ROOT = Path(__file__).resolve().parents[1]
DARK_CALIBRATION = 256
# The ladder rows (dark calibration, decode quantized) ask for half a point of mAP
# (quantize_static.max_drop_pts), a detector's default being one: how far the ladder climbs when
# asked. The other rows run the defaults.
LADDER_DROP_PTS = 0.5
# SSDLite from random init (2.3M parameters on ~1,450 canvases): it overfits well before it
# matches tiny_detector (train loss 0.26, val mAP@.5 0.16 after 20 epochs at 64 px; 12 get 0.15).
SSDLITE = {"prepare": {"image_size": 64}, "train": {"model": "ssdlite320_mobilenet_v3_large",
                                                    "epochs": 12}}
# Faster R-CNN from random init learns late (val mAP@.5 0.02 after 5 epochs, 0.76 after 12 at
# lr 1e-3; a training step of 32 canvases ~1 s on 2 cores). Plain PTQ: one static attempt takes
# ~3 minutes on its 100-proposal graph, and the recovery ladder would try dozens.
FASTER_RCNN = {"prepare": {"image_size": 64},
               "train": {"model": "fasterrcnn_mobilenet_v3_large_320_fpn", "epochs": 12,
                         "lr": 0.001},
               "quantize_static": {"max_fallback_steps": 0}}
TORCHVISION = {"ssdlite": SSDLITE, "fasterrcnn": FASTER_RCNN}

VARIANTS = ("fp32", "dynamic", "static", "qat")


def read(repo: Path, rel: str) -> dict:
    return json.loads((repo / rel).read_text())


def row(repo: Path, name: str, variant: str, seconds: float | None) -> dict:
    """One variant of a finished run: mAP, drop, agreement, speedups (model only and end to
    end, at 1 thread and all cores), what stayed float."""
    summary = read(repo, "metrics/summary.json")
    s = summary[variant]
    sizes = sorted(s["latency_p50_ms"], key=lambda k: int(k[2:]))
    one = s["by_threads"].get("threads1", {})
    q = read(repo, "metrics/quantize_static.json")
    out = {"name": name, "variant": variant, "map_50_95": s["map_50_95"], "map_50": s["map_50"],
           "fp32_map_50_95": summary["fp32"]["map_50_95"],
           "map_drop_pts": s.get("map_drop_pts", 0.0), "agreement": s.get("agreement", 1.0),
           "sizes": sizes, "cpu": summary["machine"].get("cpu"),
           "pipeline_seconds": None if seconds is None else round(seconds, 1),
           # a pipeline that trained (the decode-quantized run re-ran the static branch only)
           "train_seconds": read(repo, "metrics/train.json").get("seconds")
           if seconds is not None and variant == "fp32" else None}
    if variant != "fp32":
        out.update({
            "speedup": s["speedup"], "speedup_1thread": one.get("speedup"),
            "end_to_end_speedup": s["end_to_end"]["speedup"],
            "end_to_end_speedup_1thread": s["end_to_end"]["by_threads"]
            .get("threads1", {}).get("speedup"),
            # QAT keeps the decode float always (quantpipe.engines.qat.FloatDecode).
            "decode_in_float": {"static": bool(q.get("decode_in_float")), "qat": True}.get(variant),
            "nodes_in_float": {"static": q["nodes_in_float"], "qat": []}.get(variant),
            "calibration_warnings": q["calibration_warnings"] if variant == "static" else []})
    return out


def stage_seconds(repo: Path) -> dict:
    return {"train": read(repo, "metrics/train.json").get("seconds"),
            "quantize_static": read(repo, "metrics/quantize_static.json")["seconds"],
            "quantize_qat": read(repo, "metrics/quantize_qat.json").get("seconds")}


def run_stage(repo: Path, log: Path, stage: str, variant: str | None = None) -> None:
    """A stage's command from dvc.yaml, run by hand (DVC would restore the calibration set)."""
    body = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"][stage]
    body = body.get("do", body)
    # ${key}: the variant; ${item}: the model file it runs (the variants run here run their own).
    argv = shlex.split(body["cmd"].replace("${key}", variant or "").replace("${item}", variant or ""))
    with log.open("a") as out:
        done = subprocess.run([sys.executable, *argv[1:]], cwd=repo, stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{stage} failed in {repo}; see {log}")


def dark_calibration(repo: Path, log: Path, ladder: bool) -> dict:
    """Calibrate static on the darkest train canvases only, plain PTQ or with the recovery
    ladder (quantize_static.max_fallback_steps as in params.yaml, asked for LADDER_DROP_PTS);
    its warnings and mAP."""
    steps = yaml.safe_load((ROOT / "params.yaml").read_text())["quantize_static"]["max_fallback_steps"]
    set_params(repo, {"quantize_static": {"max_fallback_steps": steps if ladder else 0,
                                          "max_drop_pts": LADDER_DROP_PTS}})
    prepared, calib_dir = repo / "data/prepared", repo / "data/calibration"
    train, info = data.load_split(prepared, "train"), data.load_info(prepared)
    brightness = train.x[:].reshape(len(train), -1).mean(1)
    index = np.sort(np.argsort(brightness, kind="stable")[:DARK_CALIBRATION])
    calib_dir.chmod(0o755)
    for f in calib_dir.iterdir():  # DVC may have linked them read-only from its cache
        f.unlink()
    data.save_splits(calib_dir, {"calib": train.take(index)}, info)
    np.save(calib_dir / data.CALIB_INDEX, index)
    run_stage(repo, log, "quantize_static")
    run_stage(repo, log, "evaluate", "static")
    q, ev = read(repo, "metrics/quantize_static.json"), read(repo, "metrics/eval/static.json")
    set_params(repo, {"quantize_static": {"max_fallback_steps": steps, "max_drop_pts": None}})
    return {"name": "static, dark calibration" + (", recovery ladder" if ladder else ", plain PTQ"),
            "variant": "static", "nodes_in_float": q["nodes_in_float"],
            "decode_in_float": bool(q.get("decode_in_float")),
            "map_50_95": ev["map_50_95"], "map_50": ev["map_50"],
            "fp32_map_50_95": ev["fp32_map_50_95"], "map_drop_pts": ev["map_drop_pts"],
            "agreement": ev["agreement"], "calibration_warnings": q["calibration_warnings"],
            "calibration_check": q["calibration_check"]}


def torchvision_rows(repo: Path, log: Path, changes: dict, run: bool = True) -> list[dict]:
    """One of torchvision's detectors through the pipeline with `changes` to the params (run
    False: the rows of the run already in repo, without its pipeline time). A variant its
    stage skipped (Faster R-CNN's QAT) has no row."""
    seconds = None
    if run:
        set_params(repo, changes)
        seconds = repro(repo, log)
    plain = changes.get("quantize_static", {}).get("max_fallback_steps") == 0
    name = (f"{changes['train']['model']} ({changes['prepare']['image_size']} px, "
            f"{changes['train']['epochs']} epochs{', plain PTQ' if plain else ''})")
    summary = read(repo, "metrics/summary.json")
    return [row(repo, name, v, seconds if v == "fp32" else None) for v in VARIANTS if v in summary]


def torchvision_inference(repo: Path) -> dict:
    """The trained Faster R-CNN's test mAP through torchvision's own inference (the RPN's
    proposals after NMS, every class's box, per-class NMS: a Python loop over the images that
    no ONNX export of any batch keeps) beside quantpipe's fixed-shape graph (evaluate@fp32)."""
    import torch

    from quantpipe import models
    from quantpipe.detection import coco, post, task

    prepared = repo / "data/prepared"
    info, test = data.load_info(prepared), data.load_split(prepared, "test")
    model = models.build_model(FASTER_RCNN["train"]["model"], info.channels, info.image_size,
                               info.num_classes)
    model.load_state_dict(torch.load(repo / "models/model.pt", weights_only=True))
    det = model.eval().det
    # quantpipe's scoring threshold and detections per image (detect.map_score_threshold, ...)
    detect = yaml.safe_load((repo / "params.yaml").read_text())["detect"]
    det.roi_heads.score_thresh = detect["map_score_threshold"]
    det.roi_heads.detections_per_img = detect["max_detections"]
    x, dets = torch.from_numpy(data.normalize(test.x, info)), []
    with torch.no_grad():
        for batch in x.split(64):
            dets += [post.Detections(o["boxes"].numpy(), o["scores"].numpy(), o["labels"].numpy() - 1)
                     for o in det(list(batch))]
    own = coco.detections_map(dets, task.ground_truth(test, info), info.category_ids)
    graph = read(repo, "metrics/eval/fp32.json")
    return {"torchvision_map_50_95": own["map_50_95"], "torchvision_map_50": own["map_50"],
            "graph_map_50_95": graph["map_50_95"], "graph_map_50": graph["map_50"]}


def run_torchvision(repo: Path, log: Path, name: str, record: dict, run: bool = True) -> None:
    """torchvision_rows of TORCHVISION[name] into record (replacing that model's rows)."""
    changes = TORCHVISION[name]
    record["rows"] = [r for r in record["rows"] if changes["train"]["model"] not in r["name"]]
    record["rows"] += torchvision_rows(repo, log, changes, run)
    if name == "fasterrcnn":
        record["faster_rcnn_cut"] = torchvision_inference(repo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-detection"))
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "metrics/detection.json")
    parser.add_argument("--only", choices=list(TORCHVISION),
                        help="run only this detector's rows and replace them in the output file")
    parser.add_argument("--collect", action="store_true",
                        help="with --only: read the rows of the run already in --workdir (no "
                             "clone, no dvc repro; its pipeline time is not known)")
    args = parser.parse_args()
    if args.collect:
        if not args.only:
            parser.error("--collect needs --only")
        record = json.loads(args.output.read_text())
        run_torchvision(args.workdir / "repo", args.workdir / "repro.log", args.only, record, run=False)
        write_json(args.output, record)
        print(detection_table(record))
        return
    repo, log = clone(ROOT, args.workdir)
    set_params(repo, {"prepare": {"task": "detection"}, "gates": {"enforce": False}})
    if args.only:
        record = json.loads(args.output.read_text())
        run_torchvision(repo, log, args.only, record)
        write_json(args.output, record)
        print(detection_table(record))
        return
    seconds = repro(repo, log)
    rows = [row(repo, "tiny_detector", v, seconds if v == "fp32" else None)
            for v in VARIANTS]
    stages = stage_seconds(repo)

    rows += [dark_calibration(repo, log, ladder=False), dark_calibration(repo, log, ladder=True)]
    dvc(repo, log, "checkout", "-f")  # the representative calibration set back

    set_params(repo, {"detect": {"float_decode": False},
                      "quantize_static": {"max_drop_pts": LADDER_DROP_PTS}})
    start = time.perf_counter()
    repro(repo, log)  # the static branch only
    rows.append({**row(repo, "tiny_detector, decode quantized", "static",
                       time.perf_counter() - start), "decode_in_float": False})
    set_params(repo, {"detect": {"float_decode": True}, "quantize_static": {"max_drop_pts": None}})

    (repo / "inputs").mkdir(exist_ok=True)
    shutil.copy(repo / "models/fp32.onnx", repo / "inputs/detector.onnx")
    set_params(repo, {"train": {"model": "onnx:inputs/detector.onnx"}})
    seconds = repro(repo, log)
    rows += [row(repo, "YOLO-layout ONNX (onnx:inputs/detector.onnx)", v,
                 seconds if v == "fp32" else None) for v in ("fp32", "static")]

    record = {"rows": rows, "stage_seconds": stages}
    for name in TORCHVISION:
        run_torchvision(repo, log, name, record)
    write_json(args.output, record)
    print(detection_table(record))


if __name__ == "__main__":
    main()
