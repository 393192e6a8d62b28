#!/usr/bin/env python3
"""Datasets larger than memory: wall time and peak memory of prepare, quantize_static and
evaluate@static on generated image folders of growing size (the figures of docs/scale.md).

    python scripts/scale.py                        # 2,000, 10,000 and 50,000 images
    python scripts/scale.py --sizes 2000 10000 --workdir /tmp/scale -o /tmp/scale.json

The images are RGB JPEGs at 224 px in 10 classes (a coloured patch per class on noise), decoded by
prepare at 224 px as they are; the model is simple_cnn trained one epoch (it has to be trained
for the quantization criterion to mean something, and small so that the figures are about the
data, not the network). Each stage runs through `dvc repro -s` in a clone of this repository
(its own DVC cache, which holds a copy of every prepared split), timed from outside; peak RSS is
the stage's own (VmHWM, and prepare's decode workers') from its metrics. With memory bounded, a
stage's peak must not grow with the dataset; time grows about linearly.

Disk: ~0.17 MB per image for the prepared splits and again in the DVC cache (50,000 images:
~17 GB), plus the JPEGs. Time on 2 cores: ~40 minutes for the three sizes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np

from quantpipe.io import write_json
from quantpipe.studies import clone, dvc, set_params

ROOT = Path(__file__).resolve().parents[1]
SIZE, CLASSES = 224, 10
STAGES = {"prepare": "metrics/prepare.json", "quantize_static": "metrics/quantize_static.json",
          "evaluate@static": "metrics/eval/static.json"}


def _image(args: tuple[Path, int, int]) -> None:
    """One JPEG: class k's colour in a patch at a random place, on noise."""
    from PIL import Image

    path, k, seed = args
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 90, (SIZE, SIZE, 3), dtype=np.uint8)
    colour = np.array([(k * 70) % 256, (k * 150 + 60) % 256, (k * 230 + 120) % 256], np.uint8)
    top, left = rng.integers(0, SIZE - 64, 2)
    img[top:top + 64, left:left + 64] = colour
    Image.fromarray(img).save(path, quality=85)


def image_folder(root: Path, n: int) -> Path:
    """root/<class>/<i>.jpg, n images (kept between runs: made once)."""
    done = root / ".complete"
    if done.exists() and int(done.read_text()) == n:
        return root
    for k in range(CLASSES):
        (root / f"class_{k}").mkdir(parents=True, exist_ok=True)
    jobs = [(root / f"class_{i % CLASSES}" / f"{i:06d}.jpg", i % CLASSES, i) for i in range(n)]
    with multiprocessing.get_context("spawn").Pool(len(os.sched_getaffinity(0))) as pool:
        pool.map(_image, jobs, chunksize=256)
    done.write_text(str(n))
    return root


def subset(source: Path, root: Path, n: int) -> Path:
    """The first n images of source (hard links), class folders kept."""
    done = root / ".complete"
    if done.exists() and int(done.read_text()) == n:
        return root
    for k in range(CLASSES):
        (root / f"class_{k}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rel = Path(f"class_{i % CLASSES}") / f"{i:06d}.jpg"
        if not (root / rel).exists():
            os.link(source / rel, root / rel)
    done.write_text(str(n))
    return root


def run(workdir: Path, images: Path, n: int) -> dict:
    repo, log = clone(ROOT, workdir / f"run-{n}")
    set_params(repo, {
        "prepare": {"source": "imagefolder", "path": str(images), "image_size": SIZE,
                    "channels": 3},
        "train": {"model": "simple_cnn", "epochs": 1, "batch_size": 64},
        # Plain PTQ: the figures are about the data, not about the recovery ladder's attempts.
        "quantize_static": {"max_fallback_steps": 0, "allow_accuracy_drop": True}})
    dvc(repo, log, "repro", "-s", "machine")
    out = {"images": n}
    for stage, before in (("prepare", []), ("quantize_static", ["train", "export", "simplify"]),
                          ("evaluate@static", [])):
        for other in before:
            dvc(repo, log, "repro", "-s", other)
        start = time.perf_counter()
        dvc(repo, log, "repro", "-s", stage)
        wall = time.perf_counter() - start
        metrics = json.loads((repo / STAGES[stage]).read_text())
        out[stage] = {"wall_seconds": round(wall, 1), **metrics["resources"]}
        print(f"{n} images, {stage}: {wall:.0f} s, peak RSS "
              f"{metrics['resources']['peak_rss_mb']:.0f} MB", flush=True)
    out["static_accuracy"] = json.loads((repo / STAGES["evaluate@static"]).read_text())["accuracy"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 10000, 50000])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-scale"))
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "metrics" / "scale.json")
    args = parser.parse_args()
    largest = image_folder(args.workdir / f"images-{max(args.sizes)}", max(args.sizes))
    from quantpipe import machine

    runs = [run(args.workdir, subset(largest, args.workdir / f"images-{n}", n)
                if n != max(args.sizes) else largest, n) for n in sorted(args.sizes)]
    write_json(args.out, {"machine": machine.describe(machine.probe()), "size_px": SIZE,
                          "runs": {str(r["images"]): r for r in runs}})
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
