"""Semantic segmentation after prepare: per-pixel class logits -> masks (argmax) -> mIoU,
per-class IoU and pixel accuracy (torchmetrics), pixel agreement with FP32, and quantize_static's
criterion on mIoU points."""

from __future__ import annotations

import numpy as np

# quantpipe.models (PyTorch: seconds to import) is imported by the methods that train or score
# in PyTorch only: the stages after export run without it.
from quantpipe import representative
from quantpipe.errors import UserError
from quantpipe.segmentation import data as seg_data
from quantpipe.segmentation import metrics
from quantpipe.tasks.base import Evaluation, StaticJudge, Task
from quantpipe.tasks.segmentation import SegmentationSpec

# Export and simplify must leave the masks as they were: the share of pixels whose class may
# differ (ties between two classes' logits, one float rounding apart), not a Resize computed
# another way (bilinear upsampling is where engines differ).
MASK_PARITY = 0.999


class Segmentation(SegmentationSpec, Task):
    """The stages' side: masks from logits, mIoU, pixel agreement, the mIoU criterion."""
    validation_key, history_key, history_label = "miou", "val_miou", "val mIoU"

    @classmethod
    def zoo(cls) -> tuple[str, ...]:
        from quantpipe import models
        return models.SEGMENTERS

    def fit(self, model, x_train, train, x_val, val, *, epochs, batch_size, lr, max_shift, seed,
            on_step=None, plan=None):
        from quantpipe.segmentation.model import train_segmenter

        return train_segmenter(model, x_train, train.masks, x_val, val.masks,
                               num_classes=self.info.num_classes, epochs=epochs,
                               batch_size=batch_size, lr=lr, seed=seed, on_step=on_step,
                               micro_batch=plan and plan.micro_batch,
                               score_miou=lambda m: self.torch_scores(m, x_val, val)["miou"])

    def torch_scores(self, model, x, split, batch_size=256) -> dict:
        import torch

        from quantpipe import models

        with torch.no_grad():
            return self.test_scores(models.predict_torch(model, x, batch_size), split)

    def check_output(self, out, where) -> None:
        k, s = self.info.num_classes, self.info.image_size
        if out.ndim != 4 or out.shape[1:] != (k, s, s):
            raise UserError(f"{where}: output has shape {list(out.shape)}; a segmenter must give "
                            f"(batch, {k} classes, {s}, {s}) per-pixel logits")

    def compare(self, got, expected) -> dict:
        diff = np.abs(got.astype(np.float64) - expected)
        return {"samples": len(got), "max_abs_diff": round(float(diff.max()), 6),
                "mean_abs_diff": round(float(diff.mean()), 6),
                "agreement": round(metrics.pixel_agreement(got, expected), 6)}

    def agree(self, ref, out) -> float:
        return metrics.pixel_agreement(out, ref)

    def parity_record(self, got, expected, where, reference) -> dict:
        agreement = metrics.pixel_agreement(got, expected)
        if agreement < MASK_PARITY:
            raise UserError(f"{where}: its masks agree with {reference}'s on {agreement:.3%} of "
                            f"the pixels of {len(got)} test images (< {MASK_PARITY:.1%}): an "
                            "operator (upsampling?) computes differently; try another "
                            "export.opset")
        return {"mask_parity": {"samples": len(got), "pixel_agreement": round(agreement, 6)}}

    def evaluate(self, out, ref, pool_out, pool_ref, test, where) -> Evaluation:
        self.check_output(out, where)
        scores = self.test_scores(out, test)
        fp32 = scores if ref is out else self.test_scores(ref, test)
        quality = {**scores, "samples": len(test), "fp32_miou": fp32["miou"],
                   "miou_drop_pts": round((fp32["miou"] - scores["miou"]) * 100, 4),
                   "agreement": round(metrics.pixel_agreement(out, ref), 6),
                   "max_abs_output_error": round(float(np.abs(out - ref).max()), 6)}
        pool = {"samples": len(pool_out),
                "agreement": round(metrics.pixel_agreement(pool_out, pool_ref), 6)}
        line = (f"mIoU {quality['miou']:.4f} (drop {quality['miou_drop_pts']:.2f} points), pixel "
                f"accuracy {quality['pixel_accuracy']:.4f}, pixel agreement with fp32 "
                f"{quality['agreement']:.4f} (pool of {pool['samples']}: {pool['agreement']:.4f})")
        # The predicted masks, per image and class as COCO RLE.
        return Evaluation(quality, pool, metrics.results(out, list(range(self.info.num_classes))),
                          [], line)

    def test_scores(self, out, test) -> dict:
        return metrics.scores(out, test.masks, self.info.num_classes)

    def static_judge(self, ref_val_out, ref_pool_out, val, p) -> StaticJudge:
        fp32 = self.test_scores(ref_val_out, val)["miou"]

        def check(val_out: np.ndarray, pool_out: np.ndarray):
            """One candidate against FP32: validation mIoU drop in points, pixel agreement on
            the pool. As for a detector, agreement does not excuse a drop (a mask can agree on
            nearly every pixel and still lose a small class) and there is no McNemar test of
            pixels, which are not independent."""
            from quantpipe.criterion import Judged

            scores = self.test_scores(val_out, val)
            drop = round((fp32 - scores["miou"]) * 100, 4)
            a = metrics.pixel_agreement(pool_out, ref_pool_out)
            where = f"pixel agreement with FP32 on {len(pool_out)} pool images {a:.2%}"
            if a < p.agreement_floor:
                real, rule, why = True, "agreement_floor", (
                    f"{where} < agreement_floor {p.agreement_floor:.2%} (validation mIoU drop "
                    f"{drop:.2f} points)")
            elif drop <= p.max_drop_pts:
                real, rule, why = False, "within_drop", (
                    f"validation mIoU drop {drop:.2f} points <= {p.max_drop_pts} ({where})")
            else:
                real, rule, why = True, "real_drop", (
                    f"validation mIoU drop {drop:.2f} points > {p.max_drop_pts} ({where}, "
                    f"min_pool_agreement {p.min_pool_agreement:.2%})")
            record = {"val_score": scores["miou"], "drop_pts": drop,
                      "val": {"samples": len(val), "miou": scores["miou"],
                              "pixel_accuracy": scores["pixel_accuracy"]},
                      "pool": {"samples": len(pool_out), "agreement": round(a, 6)},
                      "real_drop": real, "verdict": why, "rule": rule}
            masks = [o.argmax(1).astype(np.uint8).ravel() for o in (val_out, pool_out)]
            return Judged(record, np.concatenate(masks))

        return StaticJudge(fp32, self.image_labels(ref_pool_out), check, self.image_labels)

    def image_labels(self, out: np.ndarray) -> np.ndarray:
        """(N,) each image's most frequent predicted class other than 0: a per-image label
        (NNCF's accuracy control compares these with FP32's)."""
        return seg_data.strata(out.argmax(1), self.info.num_classes)

    def static_metrics(self, judge, result, val) -> dict:
        return {"task": self.name, "fp32_val_miou": round(judge.fp32_score, 6)}

    def output_statistics(self, out):
        # A classifier's per-image statistic, per pixel here (softmax over axis 1 either way).
        top1 = representative.classifier_outputs(out)["top-1 probability"]
        return {"mean top-1 probability": top1.mean(axis=(1, 2)),
                "share of pixels not class 0": (out.argmax(1) != 0).mean(axis=(1, 2))}

    def qat_limits(self, parity, p) -> str | None:
        if parity["agreement"] >= p.min_agreement:
            return None
        return (f"pixel agreement {parity['agreement']:.2%}; quantize_qat.min_agreement = "
                f"{p.min_agreement}")
