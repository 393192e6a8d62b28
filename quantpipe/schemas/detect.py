"""params.yaml `detect`: post-processing of a detector's output (prepare.task: detection), the
same code and values for every variant, engine and runtime."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check

MAP_PROTOCOLS = ("quantpipe", "ultralytics")
# Ultralytics' validator (ultralytics/cfg/default.yaml iou and max_det; DetectionValidator's
# non_max_suppression(..., multi_label=True)).
ULTRALYTICS_VAL = {"iou_threshold": 0.7, "max_detections": 300, "multi_label": True}


@dataclass(frozen=True)
class DetectParams:
    SECTION: ClassVar[str] = "detect"

    # mAP is scored on every detection above this (COCO practice: a low threshold, so the
    # precision-recall curve is complete).
    map_score_threshold: float = 0.001
    # A deployed detector's threshold: what agreement with FP32, parity and the end-to-end
    # latency count as a detection.
    score_threshold: float = 0.25
    # Class-aware NMS: a box overlapping a higher-scoring box of its class by more is dropped.
    iou_threshold: float = 0.6
    max_detections: int = 100
    # The decode after the last conv (box distances -> pixels, sigmoid, concat) stays float in
    # the static and QAT models: quantized, its single scale over pixels and probabilities cost
    # the default detector 5.3 points of mAP@[.5:.95]; in float, 0.01 (docs/detection.md).
    float_decode: bool = True
    # How mAP is scored (every other decode uses the thresholds above): `quantpipe`, the best
    # class per anchor, iou_threshold and max_detections; `ultralytics`, as Ultralytics'
    # validator scores (every class above map_score_threshold per anchor, NMS at IoU 0.7, 300
    # detections), so FP32 mAP compares with `yolo val` on the same images. null: ultralytics
    # for an Ultralytics export (prepare read its metadata), quantpipe otherwise.
    map_protocol: str | None = None

    def __post_init__(self) -> None:
        for key in ("map_score_threshold", "score_threshold", "iou_threshold"):
            value = getattr(self, key)
            check(0 <= value < 1, f"detect.{key}", value, "a number in [0, 1)")
        check(self.max_detections >= 1, "detect.max_detections", self.max_detections,
              "an integer >= 1")
        check(self.map_protocol in (None, *MAP_PROTOCOLS), "detect.map_protocol",
              self.map_protocol, f"one of {list(MAP_PROTOCOLS)} or null")

    def for_model(self, family: str | None) -> "DetectParams":
        """map_protocol resolved for the prepared data's model family (DataInfo.model_family)."""
        if self.map_protocol is not None:
            return self
        return dataclasses.replace(self, map_protocol="ultralytics" if family == "ultralytics"
                                   else "quantpipe")

    def decode_args(self, for_map: bool = False) -> dict:
        """quantpipe.detection.post.decode's keyword arguments (for_map: mAP's, by
        map_protocol, resolved with for_model first)."""
        if for_map and self.map_protocol == "ultralytics":
            return {"score_threshold": self.map_score_threshold, **ULTRALYTICS_VAL}
        return {"score_threshold": self.map_score_threshold if for_map else self.score_threshold,
                "iou_threshold": self.iou_threshold, "max_detections": self.max_detections}
