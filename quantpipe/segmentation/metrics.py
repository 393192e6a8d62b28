"""Scores of per-pixel class logits (N, K, H, W) against masks (N, H, W): mIoU, per-class IoU and
pixel accuracy by torchmetrics (no hand-written IoU), pixel agreement between two models, and the
predicted masks as COCO stuff results (pycocotools' RLE)."""

from __future__ import annotations

import numpy as np

from quantpipe.segmentation.data import IGNORE

ROWS = 64  # images per torchmetrics update: bounded memory on large splits


def scores(logits: np.ndarray, masks, num_classes: int) -> dict:
    """mIoU (over the classes present in the masks or the predictions), per-class IoU of those
    classes, pixel accuracy; pixels marked IGNORE count for nothing."""
    import torch
    from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

    miou = MulticlassJaccardIndex(num_classes, average="macro", ignore_index=IGNORE)
    per_class = MulticlassJaccardIndex(num_classes, average="none", ignore_index=IGNORE)
    accuracy = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE)
    seen = np.zeros(num_classes, bool)
    for start in range(0, len(logits), ROWS):
        pred = torch.from_numpy(logits[start:start + ROWS].argmax(1))
        target = torch.from_numpy(np.asarray(masks[start:start + ROWS]).astype(np.int64))
        for metric in (miou, per_class, accuracy):
            metric.update(pred, target)
        kept = target != IGNORE
        seen |= np.bincount(pred[kept].numpy(), minlength=num_classes).astype(bool)
        seen |= np.bincount(target[kept].numpy(), minlength=num_classes).astype(bool)
    ious = per_class.compute().numpy()
    return {"miou": round(float(miou.compute()), 6),
            "pixel_accuracy": round(float(accuracy.compute()), 6),
            "per_class_iou": {str(c): round(float(ious[c]), 6) for c in np.flatnonzero(seen)}}


def pixel_agreement(out: np.ndarray, ref: np.ndarray) -> float:
    """The share of pixels whose predicted class is the same in two models' logits."""
    same = sum(int((out[i:i + ROWS].argmax(1) == ref[i:i + ROWS].argmax(1)).sum())
               for i in range(0, len(out), ROWS))
    return same / max(1, out.shape[0] * out.shape[2] * out.shape[3])


def results(logits: np.ndarray, category_ids: list[int]) -> list[dict]:
    """The predicted masks in COCO's stuff-segmentation results format: per image and predicted
    class an RLE mask (image ids are the split's indices)."""
    from pycocotools import mask as rle

    out = []
    for image_id in range(len(logits)):
        pred = logits[image_id].argmax(0)
        for c in np.unique(pred):
            encoded = rle.encode(np.asfortranarray((pred == c).astype(np.uint8)))
            out.append({"image_id": image_id, "category_id": int(category_ids[c]),
                        "segmentation": {"size": list(encoded["size"]),
                                         "counts": encoded["counts"].decode()}})
    return out
