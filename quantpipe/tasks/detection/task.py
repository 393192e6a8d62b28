"""Object detection after prepare: raw outputs -> detections (quantpipe.detection.post, the
same decode for every variant and engine) -> COCO metrics (pycocotools) and agreement with
FP32 on one split; the Detection class answers the stages with the functions below."""

from __future__ import annotations

import numpy as np

# quantpipe.models (PyTorch: seconds to import) is imported by the methods that train or score
# in PyTorch only: the stages after export run without it.
from quantpipe.data import DataInfo, Split
from quantpipe.detection import coco, post
from quantpipe.errors import UserError
from quantpipe.schemas.detect import DetectParams
from quantpipe.tasks.base import Evaluation, StaticJudge, Task
from quantpipe.tasks.detection import DetectionSpec, ground_truth

def scored(out: np.ndarray, split: Split, info: DataInfo, p: DetectParams) -> tuple[dict, list[dict]]:
    """COCO metrics of raw outputs (N, 4 + K, A) on a split with objects, and the COCO results
    they were scored from (exactly what a results file holds)."""
    p = p.for_model(info.model_family)
    dets = coco.results(post.decode(out, **p.decode_args(for_map=True)), info.category_ids)
    return coco.score(ground_truth(split, info), dets), dets


def agreement(out: np.ndarray, ref_out: np.ndarray, p: DetectParams) -> post.Agreement:
    """Detections (at detect.score_threshold) of a variant against FP32's on the same images."""
    return post.agreement(post.decode(ref_out, **p.decode_args()), post.decode(out, **p.decode_args()))


def evaluation(out: np.ndarray, ref: np.ndarray, pool_out: np.ndarray, pool_ref: np.ndarray,
               test: Split, info: DataInfo, p: DetectParams) -> tuple[dict, dict, list[dict]]:
    """evaluate's numbers for a detector: COCO metrics on the test split, the drop against
    FP32 (ref: FP32's outputs; the same array for fp32 itself), detection agreement on test
    and on the pool, the largest raw output error; and the COCO results they were scored from."""
    scores, results = scored(out, test, info, p)
    fp32 = scores if ref is out else scored(ref, test, info, p)[0]
    quality = {**scores, "samples": len(test), "fp32_map_50_95": fp32["map_50_95"],
               "map_drop_pts": round((fp32["map_50_95"] - scores["map_50_95"]) * 100, 4),
               **agreement(out, ref, p).as_dict(),
               "max_abs_output_error": round(float(np.abs(out - ref).max()), 6)}
    pool = {"samples": len(pool_out), **agreement(pool_out, pool_ref, p).as_dict()}
    return quality, pool, results


def check_output(out: np.ndarray, info: DataInfo, where: str) -> None:
    """A detector's output must be (N, 4 + classes, anchors)."""
    if out.ndim != 3 or out.shape[1] != 4 + info.num_classes:
        raise UserError(f"{where}: output has shape {tuple(out.shape)}; a detector must give "
                        f"(batch, 4 + {info.num_classes} classes, anchors), the layout "
                        "Ultralytics exports for YOLOv8/YOLO11")


def signature(out: np.ndarray, p: DetectParams) -> np.ndarray:
    """Every detection (label, box to 0.1 px) of raw outputs, flattened: equal arrays mean the
    same predictions (the recovery ladder stops when a change moves none)."""
    dets = post.decode(out, **p.decode_args())
    return np.concatenate([np.c_[d.labels, np.round(d.boxes, 1)].ravel() for d in dets] or
                          [np.zeros(0)])


def top_labels(out: np.ndarray, p: DetectParams) -> np.ndarray:
    """(N,) the label of each image's highest-scoring detection, -1 without one: a label-free,
    per-image prediction (NNCF's accuracy control compares these with FP32's)."""
    return np.asarray([int(d.labels[0]) if len(d) else -1
                       for d in post.decode(out, **p.decode_args())], np.int64)


def judge(val_out: np.ndarray, pool_out: np.ndarray, ref_val_map: float, ref_pool: np.ndarray,
          val: Split, info: DataInfo, p: DetectParams, *, max_drop_pts: float,
          min_pool_agreement: float, agreement_floor: float):
    """A quantized candidate against FP32: the drop of validation mAP@[.5:.95] in points and
    detection agreement on the pool; real when agreement is under agreement_floor, or the drop
    exceeds max_drop_pts.

    Unlike a classifier's (quantpipe.criterion), high agreement on the pool does not excuse a
    drop: agreement counts detections that match at IoU >= 0.5, while mAP@[.5:.95] also scores
    how tight the boxes are (a quantized decode kept 99.7% agreement and lost 4.3 points). And
    mAP is not a count of flipped images, so there is no McNemar test to tell noise from loss:
    on a few hundred images it moves by tenths of a point between equally good candidates,
    which is why a detector's max_drop_pts is one point by default (its TaskSpec).
    min_pool_agreement is recorded beside the verdict."""
    from quantpipe.criterion import Judged

    metrics, _ = scored(val_out, val, info, p)
    drop = round((ref_val_map - metrics["map_50_95"]) * 100, 4)
    pool = agreement(pool_out, ref_pool, p)
    a = pool.agreement
    if a < agreement_floor:
        real, rule, why = True, "agreement_floor", (
            f"detection agreement with FP32 on {len(pool_out)} pool images {a:.2%} < "
            f"agreement_floor {agreement_floor:.2%} (validation mAP drop {drop:.2f} points)")
    elif drop <= max_drop_pts:
        real, rule, why = False, "within_drop", (
            f"validation mAP@[.5:.95] drop {drop:.2f} points <= {max_drop_pts} (detection "
            f"agreement with FP32 on {len(pool_out)} pool images {a:.2%})")
    else:
        real, rule, why = True, "real_drop", (
            f"validation mAP@[.5:.95] drop {drop:.2f} points > {max_drop_pts} (detection "
            f"agreement with FP32 on {len(pool_out)} pool images {a:.2%}, min_pool_agreement "
            f"{min_pool_agreement:.2%})")
    record = {"val_score": metrics["map_50_95"], "drop_pts": drop,
              "val": {"samples": len(val), "map_50_95": metrics["map_50_95"],
                      "map_50": metrics["map_50"]},
              "pool": {"samples": len(pool_out), **pool.as_dict()},
              "real_drop": real, "verdict": why, "rule": rule}
    return Judged(record, np.concatenate([signature(val_out, p), signature(pool_out, p)]))


def output_statistics(out: np.ndarray, p: DetectParams) -> dict[str, np.ndarray]:
    """Per image: the top detection score (0 without one) and the number of detections, at
    detect.score_threshold (quantpipe.representative compares them across sets)."""
    dets = post.decode(out, **p.decode_args())
    return {"top detection score": np.asarray([d.scores.max() if len(d) else 0.0 for d in dets]),
            "detections per image": np.asarray([len(d) for d in dets], np.float64)}


class Detection(DetectionSpec, Task):
    """The stages' side: decode (the same for every variant and engine), COCO scoring,
    detection agreement, the mAP criterion, QAT with the decode in float."""
    validation_key, history_key, history_label = "map_50", "val_map_50", "val mAP@.5"

    def __init__(self, info: DataInfo, detect: DetectParams) -> None:
        super().__init__(info)
        self.detect = detect
        decode = detect.decode_args()
        self.postprocess = lambda out: post.decode(out, **decode)
        # Batches agree when their detections pair up (same label, IoU >= 0.5), both ways.
        self.batch_agreement = lambda a, b: agreement(a, b, detect).agreement
        # A detector's decode stays in float by default (detect.float_decode; docs/detection.md).
        self.float_tail = detect.float_decode

    @classmethod
    def from_params(cls, info: DataInfo) -> "Detection":
        from quantpipe import params

        return cls(info, params.load(DetectParams))

    @classmethod
    def zoo(cls) -> tuple[str, ...]:
        from quantpipe import models
        return models.DETECTORS

    def fit(self, model, x_train, train, x_val, val, *, epochs, batch_size, lr, max_shift, seed,
            on_step=None, plan=None):
        from quantpipe.detection.model import train_detector

        return train_detector(model, x_train, train.objects, x_val, val.objects, epochs=epochs,
                              batch_size=batch_size, lr=lr, seed=seed,
                              score_map_50=lambda m: self.torch_scores(m, x_val, val)["map_50"],
                              on_step=on_step, micro_batch=plan and plan.micro_batch)

    def torch_scores(self, model, x, split, batch_size=256) -> dict:
        import torch

        from quantpipe import models

        with torch.no_grad():
            out = models.predict_torch(model, x, batch_size)
        return {"map_50": scored(out, split, self.info, self.detect)[0]["map_50"]}

    def check_output(self, out, where) -> None:
        check_output(out, self.info, where)

    def compare(self, got, expected) -> dict:
        """Raw differences, and agreement of the decoded detections (the share matched at
        IoU >= 0.5 with the same label, the lower of both ways) and how far matched boxes and
        scores are apart."""
        diff = np.abs(got.astype(np.float64) - expected)
        ref, dets = (self.postprocess(o) for o in (expected, got))
        return {"samples": len(got), "max_abs_diff": round(float(diff.max()), 6),
                "mean_abs_diff": round(float(diff.mean()), 6),
                "agreement": round(post.agreement(ref, dets).agreement, 6), **post.parity(ref, dets)}

    def agree(self, ref, out) -> float:
        return agreement(out, ref, self.detect).agreement

    def parity_record(self, got, expected, where, reference) -> dict:
        """What a detector's user sees: the decoded detections (boxes, scores, labels at
        detect.score_threshold) of the two must pair up one to one."""
        result = post.parity(self.postprocess(expected), self.postprocess(got))
        if result["unmatched"]:
            raise UserError(f"{where}: {result['unmatched']} of {result['detections']} "
                            f"detections of {reference} have no counterpart here (same label, "
                            "IoU >= 0.5); the decode or NMS inputs changed (try another "
                            "export.opset)")
        return {"detection_parity": result}

    def evaluate(self, out, ref, pool_out, pool_ref, test, where) -> Evaluation:
        check_output(out, self.info, where)
        quality, pool, results = evaluation(out, ref, pool_out, pool_ref, test, self.info,
                                            self.detect)
        line = (f"mAP@[.5:.95] {quality['map_50_95']:.4f} (drop {quality['map_drop_pts']:.2f} "
                f"points), mAP@.5 {quality['map_50']:.4f}, detection agreement with fp32 "
                f"{quality['agreement']:.4f} (pool of {pool['samples']}: {pool['agreement']:.4f})")
        # The COCO results the mAP was scored from, to re-score against
        # data/prepared/test_annotations.json with any COCO tool.
        return Evaluation(quality, pool, results, [], line)

    def test_scores(self, out, test) -> dict:
        return scored(out, test, self.info, self.detect)[0]

    def static_judge(self, ref_val_out, ref_pool_out, val, p) -> StaticJudge:
        fp32 = scored(ref_val_out, val, self.info, self.detect)[0]["map_50_95"]

        def check(val_out: np.ndarray, pool_out: np.ndarray):
            """One candidate against FP32: validation mAP drop, detection agreement on the pool."""
            return judge(val_out, pool_out, fp32, ref_pool_out, val, self.info, self.detect,
                         max_drop_pts=p.max_drop_pts,
                         min_pool_agreement=p.min_pool_agreement, agreement_floor=p.agreement_floor)

        return StaticJudge(fp32, top_labels(ref_pool_out, self.detect), check,
                           lambda out: top_labels(out, self.detect))

    def static_metrics(self, judge, result, val) -> dict:
        return {"task": self.name, "decode_in_float": result.tail_in_float,
                "fp32_val_map_50_95": round(judge.fp32_score, 6)}

    def output_statistics(self, out):
        return output_statistics(out, self.detect)

    def qat_limits(self, parity, p) -> str | None:
        # Outputs are boxes in pixels beside scores: the limit is on the detections.
        if parity["agreement"] >= p.min_agreement:
            return None
        return (f"detection agreement {parity['agreement']:.2%}, {parity['unmatched']} "
                f"detections unmatched; quantize_qat.min_agreement = {p.min_agreement}")
