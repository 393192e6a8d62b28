#!/usr/bin/env python3
"""Segmentation end to end: the numbers behind docs/segmentation.md's table.

In a clone of this repository it runs the real pipeline with prepare.task: segmentation and
the defaults (tiny_segmenter on the embedded digit canvases with masks), then the same with
prepare.source: masks on those canvases written as a folder of PNG images and masks (the path
a user's own data takes), and records per variant mIoU, the drop in points, pixel agreement
with FP32 and the speedups at 1 thread and all cores.

    python scripts/segmentation.py                  # -> metrics/segmentation.json + table
    python scripts/segmentation.py --only embedded  # the embedded run only
    python scripts/segmentation.py --workdir /tmp/seg -o /tmp/segmentation.json

About 25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quantpipe.docs import segmentation_table
from quantpipe.io import write_json
from quantpipe.studies import clone, repro, set_params

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("fp32", "dynamic", "static", "qat")
FOLDER = "inputs/digit_masks"
RUNS = {"embedded": {"prepare": {"task": "segmentation"}},
        "masks folder": {"prepare": {"task": "segmentation", "source": "masks", "path": FOLDER}}}


def write_folder(root: Path) -> None:
    """The embedded canvases as a `masks` folder: images/, masks/ (8-bit PNG), classes.txt."""
    from PIL import Image

    from quantpipe.segmentation.data import load_digit_masks

    x, masks, names = load_digit_masks(None, 64)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(exist_ok=True)
    (root / "classes.txt").write_text("".join(f"{n}\n" for n in names))
    for i in range(len(x)):
        Image.fromarray(x[i, 0]).save(root / "images" / f"{i:05d}.png")
        Image.fromarray(masks[i]).save(root / "masks" / f"{i:05d}.png")


def rows(repo: Path, run: str, seconds: float) -> list[dict]:
    summary = json.loads((repo / "metrics/summary.json").read_text())
    train = json.loads((repo / "metrics/train.json").read_text())
    out = []
    for variant in VARIANTS:
        if variant not in summary:
            continue
        s = summary[variant]
        one = s["by_threads"].get("threads1", {})
        out.append({"run": run, "variant": variant, "model": train["model"],
                    "miou": s["miou"], "pixel_accuracy": s["pixel_accuracy"],
                    "miou_drop_pts": s.get("miou_drop_pts", 0.0),
                    "agreement": s.get("agreement", 1.0), "size_bytes": s["size_bytes"],
                    "latency_p50_ms": s["latency_p50_ms"], "speedup": s.get("speedup"),
                    "speedup_1thread": one.get("speedup"), "cpu": summary["machine"].get("cpu"),
                    "cores": summary["machine"].get("cores"),
                    "train_seconds": train.get("seconds") if variant == "fp32" else None,
                    "pipeline_seconds": round(seconds, 1) if variant == "fp32" else None})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-segmentation"))
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "metrics/segmentation.json")
    parser.add_argument("--only", choices=sorted(RUNS), action="append")
    args = parser.parse_args()
    found = json.loads(args.output.read_text()) if args.output.exists() else {"rows": []}
    kept = [r for r in found["rows"] if args.only and r["run"] not in args.only]
    for run, params in RUNS.items():
        if args.only and run not in args.only:
            continue
        repo, log = clone(ROOT, args.workdir / run.replace(" ", "_"))
        set_params(repo, params)
        if run == "masks folder":
            write_folder(repo / FOLDER)
        seconds = repro(repo, log)
        kept += rows(repo, run, seconds)
        print(f"segmentation: {run} done in {seconds / 60:.1f} min", file=sys.stderr)
    result = {"rows": sorted(kept, key=lambda r: (list(RUNS).index(r["run"]),
                                                 VARIANTS.index(r["variant"])))}
    write_json(args.output, result)
    print(segmentation_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
