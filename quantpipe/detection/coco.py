"""COCO scoring with pycocotools: detections in the COCO results format, mAP@[.5:.95], mAP@.5
and AP per class. No AP is computed here; pycocotools' COCOeval does it all."""

from __future__ import annotations

import contextlib
import io

from quantpipe.detection.post import Detections


def results(detections: list[Detections], category_ids: tuple[int, ...]) -> list[dict]:
    """COCO results format: one record per detection, image_id the split index, bbox as
    [x, y, width, height] rounded to 1/100 pixel (the file is what gets scored)."""
    out = []
    for image_id, d in enumerate(detections):
        for (x1, y1, x2, y2), score, label in zip(d.boxes.tolist(), d.scores.tolist(),
                                                  d.labels.tolist()):
            out.append({"image_id": image_id, "category_id": category_ids[label],
                        "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
                        "score": round(score, 5)})
    return out


def score(ground_truth: dict, dets: list[dict]) -> dict:
    """pycocotools' bbox evaluation of `dets` (COCO results) against `ground_truth` (COCO
    instances): map_50_95, map_50, map_75 and AP@[.5:.95] per category name (None for a
    category without ground truth)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    names = {c["id"]: c["name"] for c in ground_truth["categories"]}
    if not dets:  # loadRes refuses an empty list; no detections score zero
        return {"map_50_95": 0.0, "map_50": 0.0, "map_75": 0.0,
                "per_class_ap": {n: 0.0 for n in names.values()}}
    with contextlib.redirect_stdout(io.StringIO()):  # COCO prints progress and the table
        gt = COCO()
        gt.dataset = ground_truth
        gt.createIndex()
        dt = gt.loadRes(dets)
        ev = COCOeval(gt, dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    # precision: (IoU thresholds, recall points, categories, area ranges, max dets); area
    # "all" and 100 detections, -1 where a category has no ground truth.
    precision = ev.eval["precision"][:, :, :, 0, -1]
    per_class = {}
    for k, cat in enumerate(ev.params.catIds):
        p = precision[:, :, k]
        per_class[names[cat]] = round(float(p[p > -1].mean()), 6) if (p > -1).any() else None
    return {"map_50_95": round(float(ev.stats[0]), 6), "map_50": round(float(ev.stats[1]), 6),
            "map_75": round(float(ev.stats[2]), 6), "per_class_ap": per_class}


def detections_map(detections: list[Detections], ground_truth: dict,
                   category_ids: tuple[int, ...]) -> dict:
    return score(ground_truth, results(detections, category_ids))

