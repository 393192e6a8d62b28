"""How much of a difference in mAP between two models scored on the same few hundred images is
the luck of which images were drawn: a paired bootstrap over the images, each resample scored by
pycocotools (quantpipe.detection.coco.score) for every model."""

from __future__ import annotations

import numpy as np

from quantpipe.detection import coco


def _by_image(records: list[dict]) -> dict[int, list[dict]]:
    grouped: dict[int, list[dict]] = {}
    for r in records:
        grouped.setdefault(r["image_id"], []).append(r)
    return grouped


def map_differences(ground_truth: dict, dets: dict, reference, *, resamples: int = 200,
                    seed: int = 0, quantiles: tuple[float, float] = (0.05, 0.95)) -> dict:
    """How far each model's mAP@[.5:.95] lies from the reference model's, beyond the luck of
    which images were drawn: a paired bootstrap over the images (each resample scores every
    model on the same images drawn with replacement). `dets`: COCO results per model (any
    hashable key); per model: [low, high] of (model - reference) in points of mAP at
    `quantiles` (default: a 90% interval)."""
    images = ground_truth["images"]
    truth, found = _by_image(ground_truth["annotations"]), {k: _by_image(v) for k, v in dets.items()}
    rng = np.random.default_rng(seed)
    diffs: dict[str, list[float]] = {k: [] for k in dets}
    for _ in range(resamples):
        drawn = rng.integers(0, len(images), len(images))
        # Each drawn image gets a new id, so an image drawn twice counts twice.
        annotations = [{**a, "image_id": new} for new, i in enumerate(drawn)
                       for a in truth.get(images[i]["id"], [])]
        gt = {**ground_truth, "images": [{**images[i], "id": new} for new, i in enumerate(drawn)],
              "annotations": [{**a, "id": n + 1} for n, a in enumerate(annotations)]}
        maps = {k: coco.score(gt, [{**d, "image_id": new} for new, i in enumerate(drawn)
                                   for d in found[k].get(images[i]["id"], [])])["map_50_95"]
                for k in dets}
        for k in dets:
            diffs[k].append((maps[k] - maps[reference]) * 100)
    return {k: [round(float(q), 2) for q in np.quantile(v, quantiles)] for k, v in diffs.items()}
