#!/usr/bin/env python3
"""What detections look like before and after INT8: the data behind docs/img/detection_example.svg.

In a clone of this repository it runs the default detection pipeline (`prepare.task:
detection`: the embedded digit canvases, tiny_detector) up to quantize_static, then runs
models/fp32.onnx and models/static.onnx on the first test canvases that hold at least two
objects and decodes both as a user of the model would (detect.score_threshold,
iou_threshold, max_detections). It records, per canvas, the pixels (PNG), the ground truth and
both models' detections; `make docs` draws them (quantpipe.pictures.detection_example).

    python scripts/detection_example.py                 # -> metrics/detection_example.json
    python scripts/detection_example.py --images 6 --workdir /tmp/det-example

About 4 minutes on 2 cores (training the detector is most of it).
"""

from __future__ import annotations

import argparse
import base64
import io
from pathlib import Path

import numpy as np

from quantpipe import machine
from quantpipe.io import write_json
from quantpipe.studies import clone, dvc, set_params

ROOT = Path(__file__).resolve().parents[1]


def png(image: np.ndarray) -> str:
    """A (C, H, W) uint8 canvas as base64 PNG (lossless: the picture shows the model's input)."""
    from PIL import Image

    buffer = io.BytesIO()
    pixels = image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)
    Image.fromarray(pixels).save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def boxes(dets) -> list[list[float]]:
    """x1, y1, x2, y2, label, score per detection, rounded to what a picture can show."""
    return [[*(round(float(v), 1) for v in box), int(label), round(float(score), 3)]
            for box, label, score in zip(dets.boxes, dets.labels, dets.scores)]


def detections(repo: Path, count: int) -> dict:
    from quantpipe import data, onnxutil, params
    from quantpipe.detection import post
    from quantpipe.schemas.detect import DetectParams
    from quantpipe.schemas.runtime import RuntimeParams

    prepared = repo / "data/prepared"
    info = data.load_info(prepared)
    test = data.load_split(prepared, "test")
    picked = [i for i, objs in enumerate(test.objects) if len(objs) >= 2][:count]
    pixels = np.asarray(data.rows(test.x, np.asarray(picked)))
    inputs = data.normalize(pixels, info)
    decode = params.load(DetectParams, repo / "params.yaml").for_model(info.model_family).decode_args()
    # The session evaluate runs each model with (runtime.graph_optimization_level).
    level = params.load(RuntimeParams, repo / "params.yaml").graph_optimization_level
    found = {}
    for variant in ("fp32", "static"):
        run = onnxutil.session_runner(onnxutil.make_session(repo / f"models/{variant}.onnx", level=level))
        found[variant] = [boxes(d) for d in post.decode(run(inputs), **decode)]
    return {
        "class_names": list(info.class_names),
        "decode": decode,
        "images": [{"index": int(i), "png": png(np.asarray(pixels[k])),
                    "truth": [[*(round(float(v), 1) for v in o[:4]), int(o[4])] for o in test.objects[i]],
                    "fp32": found["fp32"][k], "static": found["static"][k]}
                   for k, i in enumerate(picked)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4, help="test canvases to show")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-detection-example"))
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "metrics" / "detection_example.json")
    args = parser.parse_args()
    repo, log = clone(ROOT, args.workdir)
    set_params(repo, {"prepare": {"task": "detection"}})
    print(f"dvc repro quantize_static in {repo} (log: {log})")
    dvc(repo, log, "repro", "quantize_static")
    record = {"machine": machine.describe(machine.probe()),
              "pipeline": "prepare.task: detection, every other param as committed",
              **detections(repo, args.images)}
    write_json(args.out, record)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
