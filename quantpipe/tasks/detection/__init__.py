"""Object detection (prepare.task: detection): boxes and labels per image, raw outputs in
Ultralytics' YOLOv8/YOLO11 layout (N, 4 + classes, anchors), COCO mAP. What it is (here) and
what it does after prepare (task.py)."""

from __future__ import annotations

import json
from pathlib import Path

from quantpipe import data, imagefolder
from quantpipe.data import DataInfo, Split
from quantpipe.detection import data as detection_data
from quantpipe.detection import listing as detection_listing
from quantpipe.tasks.base import Listing, Score, TaskSpec

# The test split's ground truth in COCO instances format, beside the arrays, so the COCO
# results each variant's evaluation writes can be re-scored with any COCO tool.
TEST_ANNOTATIONS = "test_annotations.json"

# The guides' order of investigation when a detector loses more than the tolerance.
INVESTIGATION = (
    "investigate in this order: calibration data that does not match the test distribution "
    "(prepare.calib_size, the calibration warning in metrics/quantize_static.json), "
    "quantize_static.per_channel, the first/last layers in float "
    "(quantize_static.nodes_to_exclude), then QAT")


def ground_truth(split: Split, info: DataInfo) -> dict:
    """A split's boxes as COCO instances."""
    return detection_data.coco_ground_truth(split.objects, info.image_size, info.category_ids,
                                            info.class_names)


class DetectionSpec(TaskSpec):
    name = "detection"
    # 15 epochs of the embedded canvases: ~2 minutes on 2 cores, mAP@.5 ~0.95.
    defaults = {"prepare.source": "digits_detection", "prepare.image_size": 64,
                "train.model": "tiny_detector", "train.epochs": 15, "train.batch_size": 32,
                "train.lr": 3e-3,
                # One point of mAP@[.5:.95]: the tolerance table's "excellent" (see its schema).
                "quantize_static.max_drop_pts": 1.0}
    # digits_detection ships inside installed wheels; COCO instances or Ultralytics' YOLO layout.
    sources = ("digits_detection", "coco", "yolo")
    letterbox = True
    score = Score("map_50_95", "map_drop_pts", "points", "max_map_drop_pts", "mAP",
                  advice=INVESTIGATION)
    score_keys = ("map_50_95", "map_50", "map_75", "per_class_ap")
    torch_score_keys = ("map_50_95", "map_50")
    headline = (("mAP@[.5:.95]", "map_50_95", ".4f"), ("mAP@.5", "map_50", ".4f"),
                ("drop (points)", "map_drop_pts", ".2f"),
                ("detection agreement", "agreement", ".4f"))

    @classmethod
    def load(cls, p) -> Listing:
        if p.source == "digits_detection":
            x, objects, class_names, category_ids = detection_data.load_digits_detection(
                p.channels, p.image_size)
            y = detection_data.strata(objects, len(class_names))
            return Listing(class_names, y, len(class_names),
                           full=data.Split(x=x, y=y, objects=tuple(objects)),
                           category_ids=category_ids)
        # Listed first (boxes, declared splits), decoded after the split, in parallel, straight
        # into the split files, like an image folder.
        listing = detection_listing.list_source(p.source, p.path, p.channels, p.image_size)
        n = len(listing.class_names)
        return Listing(listing.class_names, detection_data.strata(listing.objects, n), n,
                       folder=listing.files, objects=listing.objects,
                       transform=imagefolder.Transform(listing.channels, p.image_size,
                                                       pad_value=p.pad_value),
                       category_ids=listing.category_ids, declared=listing.declared)

    @classmethod
    def write_extras(cls, directory: Path, splits: dict[str, Split], info: DataInfo) -> None:
        (directory / TEST_ANNOTATIONS).write_text(json.dumps(ground_truth(splits["test"], info))
                                                  + "\n")

    @classmethod
    def summary_drop(cls, ev, fp32) -> dict:
        return {"map_drop_pts": ev["map_drop_pts"]}

    @classmethod
    def tolerance_notes(cls, summary, gates, quantized) -> list[str]:
        """The tolerance table: a drop between gates.warn_map_drop_pts and the gate passes with
        a warning."""
        return [f"{v} loses {summary[v]['map_drop_pts']:.2f} points of mAP@[.5:.95]: acceptable "
                f"(between {gates.warn_map_drop_pts} and {gates.max_map_drop_pts}), but check it; "
                f"{INVESTIGATION}" for v in quantized
                if gates.warn_map_drop_pts < summary[v]["map_drop_pts"] <= gates.max_map_drop_pts]
