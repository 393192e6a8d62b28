"""Post-processing shared by every variant, engine and runtime: a detector's raw output in the
layout Ultralytics exports for YOLOv8/YOLO11 -> boxes, scores and labels; and how two sets of
detections agree.

The layout: (batch, 4 + classes, anchors), per anchor a box as centre x, centre y, width,
height in input pixels, then one score in [0, 1] per class. quantpipe's own detector writes the
same layout, so one decode serves it, a YOLO ONNX and every quantized variant of either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Detections:
    boxes: np.ndarray   # (n, 4) float32 x1, y1, x2, y2 in input pixels
    scores: np.ndarray  # (n,) float32
    labels: np.ndarray  # (n,) int64 class index

    def __len__(self) -> int:
        return len(self.scores)


def decode(out: np.ndarray, *, score_threshold: float, iou_threshold: float,
           max_detections: int, multi_label: bool = False) -> list[Detections]:
    """(B, 4 + K, A) -> per image: the best class per anchor (multi_label: every class) scoring
    above score_threshold, class-aware NMS at iou_threshold, at most max_detections by score."""
    if out.ndim != 3 or out.shape[1] < 5:
        raise ValueError(f"detector output has shape {out.shape}; expected (batch, 4 + classes, "
                         "anchors)")
    result = []
    for image in out:
        scores_all = image[4:]                        # (K, A)
        if multi_label:  # Ultralytics' validator: one candidate per (anchor, class) above it
            labels, keep = np.nonzero(scores_all > score_threshold)
            scores = scores_all[labels, keep]
        else:
            labels = scores_all.argmax(0)
            scores = scores_all[labels, np.arange(scores_all.shape[1])]
            keep = np.flatnonzero(scores > score_threshold)
            scores, labels = scores[keep], labels[keep]
        cx, cy, w, h = image[:4, keep]
        boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1).astype(np.float32)
        scores, labels = scores.astype(np.float32), labels.astype(np.int64)
        if len(keep):
            kept = batched_nms(boxes, scores, labels, iou_threshold)[:max_detections]
            boxes, scores, labels = boxes[kept], scores[kept], labels[kept]
        result.append(Detections(boxes.reshape(-1, 4), scores, labels))
    return result


def batched_nms(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray,
                iou_threshold: float) -> np.ndarray:
    """Class-aware greedy NMS: the indices kept, by decreasing score. What
    torchvision.ops.batched_nms computes (tests/test_detection.py checks it), done by ONNX Runtime's
    NonMaxSuppression, which runs one NMS per class: a deployment of an ONNX detector needs no
    PyTorch for it, and the stages that decode (evaluate, bench, quantize_static) start without it
    (torch and torchvision take 5-6 s to import on a 2-core EPYC, most of a small model's stage)."""
    classes, member = np.unique(labels, return_inverse=True)
    # one row of scores per class present; -inf (below the threshold input) outside the class
    by_class = np.full((len(classes), len(scores)), -np.inf, np.float32)
    by_class[member, np.arange(len(scores))] = scores
    selected = _nms_session().run(None, {
        "boxes": boxes[None], "scores": by_class[None],
        "max_per_class": np.array([len(scores)], np.int64),
        "iou_threshold": np.array([iou_threshold], np.float32),
        "score_threshold": np.array([np.finfo(np.float32).min], np.float32)})[0]
    kept = selected[:, 2]
    return kept[np.lexsort((kept, -scores[kept]))]  # ties: the lower index first, as torchvision


@functools.cache
def _nms_session():
    """An ONNX Runtime session of one NonMaxSuppression node (boxes as x1, y1, x2, y2: the op
    reads any diagonal pair), one thread: it runs beside the model's own sessions."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from quantpipe.onnxutil import make_session

    inputs = [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, None, 4]),
              helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, None, None]),
              helper.make_tensor_value_info("max_per_class", TensorProto.INT64, [1]),
              helper.make_tensor_value_info("iou_threshold", TensorProto.FLOAT, [1]),
              helper.make_tensor_value_info("score_threshold", TensorProto.FLOAT, [1])]
    node = helper.make_node("NonMaxSuppression", [i.name for i in inputs], ["selected"])
    graph = helper.make_graph([node], "nms", inputs, [
        helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7  # what every ONNX Runtime since 1.6 reads
    return make_session(model.SerializeToString(), level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                        threads=1)


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(n, 4) x (m, 4) xyxy boxes -> (n, m) IoU."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area = lambda z: np.clip(z[:, 2] - z[:, 0], 0, None) * np.clip(z[:, 3] - z[:, 1], 0, None)
    return inter / np.maximum(area(a)[:, None] + area(b)[None] - inter, 1e-9)


def match(ref: Detections, got: Detections, iou: float = 0.5) -> list[tuple[int, int]]:
    """One-to-one pairs (i in ref, j in got) with the same label and IoU >= iou, greedily in
    the order of ref's scores (as COCO matches detections to ground truth)."""
    if not len(ref) or not len(got):
        return []
    overlap = iou_matrix(ref.boxes, got.boxes)
    overlap[ref.labels[:, None] != got.labels[None, :]] = 0
    pairs, taken = [], np.zeros(len(got), bool)
    for i in np.argsort(-ref.scores, kind="stable"):
        candidates = np.where(taken, -1.0, overlap[i])
        j = int(np.argmax(candidates))
        if candidates[j] >= iou:
            pairs.append((int(i), j))
            taken[j] = True
    return pairs


@dataclass(frozen=True)
class Agreement:
    """How a variant's detections agree with FP32's on the same images."""
    fp32_detections: int
    detections: int
    matched: int

    @property
    def recall(self) -> float:  # share of FP32's detections the variant matches
        return round(self.matched / self.fp32_detections, 6) if self.fp32_detections else 1.0

    @property
    def precision(self) -> float:  # share of the variant's detections FP32 matches
        return round(self.matched / self.detections, 6) if self.detections else 1.0

    @property
    def agreement(self) -> float:  # the lower of the two: one number that misses neither way
        return min(self.recall, self.precision)

    def as_dict(self) -> dict:
        return {"fp32_detections": self.fp32_detections, "detections": self.detections,
                "matched": self.matched, "fp32_matched": self.recall,
                "matched_by_fp32": self.precision, "agreement": self.agreement}


def agreement(ref: list[Detections], got: list[Detections], iou: float = 0.5) -> Agreement:
    return Agreement(fp32_detections=sum(len(r) for r in ref),
                     detections=sum(len(g) for g in got),
                     matched=sum(len(match(r, g, iou)) for r, g in zip(ref, got)))


def parity(ref: list[Detections], got: list[Detections]) -> dict:
    """Matched detections of two runs of one model (ONNX vs PyTorch): how many are unmatched
    and the largest box (pixels) and score differences between matched ones."""
    box, score, unmatched = 0.0, 0.0, 0
    for r, g in zip(ref, got):
        pairs = match(r, g, iou=0.5)
        unmatched += len(r) + len(g) - 2 * len(pairs)
        for i, j in pairs:
            box = max(box, float(np.abs(r.boxes[i] - g.boxes[j]).max()))
            score = max(score, float(abs(r.scores[i] - g.scores[j])))
    return {"detections": sum(len(r) for r in ref), "unmatched": unmatched,
            "max_box_diff_px": round(box, 6), "max_score_diff": round(score, 8)}
