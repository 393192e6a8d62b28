"""Semantic segmentation (prepare.task: segmentation): a class per pixel (N, H, W) masks, per-pixel
class logits (N, classes, H, W), mIoU by torchmetrics. What it is (here) and what it does after
prepare (task.py)."""

from __future__ import annotations

from quantpipe import data, sources
from quantpipe.errors import UserError
from quantpipe.segmentation import data as seg_data
from quantpipe.tasks.base import Listing, Score, TaskSpec

# What to try, in order, when static INT8 loses more mIoU than the gate allows.
INVESTIGATION = (
    "investigate in this order: calibration data that does not match the test distribution "
    "(the calibration warning in metrics/quantize_static.json), quantize_static.per_channel, "
    "the classifier head and the upsampling in float (quantize_static.nodes_to_exclude), "
    "then QAT")


class SegmentationSpec(TaskSpec):
    name = "segmentation"
    # 10 epochs of the embedded canvases: ~4 minutes on 2 cores, validation mIoU ~0.88.
    defaults = {"prepare.source": "digits_masks", "prepare.image_size": 64,
                "train.model": "tiny_segmenter", "train.epochs": 10, "train.batch_size": 16,
                "train.lr": 3e-3, "quantize_static.max_drop_pts": 0.5}
    # digits_masks: the detection canvases with per-pixel masks, inside installed wheels;
    # masks: images/, masks/ and classes.txt under prepare.path.
    sources = ("digits_masks", "masks")
    score = Score("miou", "miou_drop_pts", "points", "max_miou_drop_pts", "mIoU",
                  advice=INVESTIGATION)
    score_keys = ("miou", "pixel_accuracy", "per_class_iou")
    torch_score_keys = ("miou", "pixel_accuracy")
    headline = (("mIoU", "miou", ".4f"), ("pixel accuracy", "pixel_accuracy", ".4f"),
                ("drop (points)", "miou_drop_pts", ".2f"), ("pixel agreement", "agreement", ".4f"))

    @classmethod
    def load(cls, p) -> Listing:
        if p.resize or p.crop:
            raise UserError("prepare.resize/prepare.crop: null with prepare.task: segmentation "
                            "(images and masks are squeezed to prepare.image_size together)")
        if p.source == "digits_masks":
            x, masks, names = seg_data.load_digit_masks(p.channels, p.image_size)
        else:
            x, masks, names = seg_data.load_mask_folder(sources.source_root(p.source, p.path),
                                                        p.channels, p.image_size)
        y = seg_data.strata(masks, len(names))
        return Listing(names, y, len(names), full=data.Split(x=x, y=y, masks=masks))

    @classmethod
    def summary_drop(cls, ev, fp32) -> dict:
        return {"miou_drop_pts": ev["miou_drop_pts"]}
