"""params.yaml `prepare`: where the data comes from, image size, normalization, splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check
from quantpipe.tasks import TASKS, default


# mnist5k, digits and digits_detection ship inside installed wheels; the others read
# prepare.path. Detection sources carry boxes (COCO instances or Ultralytics' YOLO layout).
SOURCES = ("mnist5k", "digits", "imagefolder", "npz", "torchvision:<Name>")
DETECTION_SOURCES = ("digits_detection", "coco", "yolo")


@dataclass(frozen=True)
class PrepareParams:
    SECTION: ClassVar[str] = "prepare"

    # classification (a label per image) or detection (boxes and labels per image).
    task: str = "classification"
    # null: the task's own embedded data (mnist5k; digits_detection).
    source: str | None = None
    path: str | None = None
    # Side of the square images fed to the model (pixels); null: 28 for classification (mnist5k
    # is natively 28), 64 for detection (detection images are letterboxed to it).
    image_size: int | None = None
    # 1 or 3 converts every image (grey <-> RGB); null keeps the dataset's own channels.
    channels: int | None = None
    # Per-channel normalization of pixel/255; null computes it on the train split. Set it to
    # what a model brought as ONNX was trained with (e.g. ImageNet's 0.485, 0.456, 0.406).
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # Shares of the whole dataset; the rest is train. Stratified, so each class keeps its share.
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    # Calibration samples drawn from the train split (never test): a few hundred cover the
    # activation ranges of a small CNN; more only slows Entropy/Percentile calibration.
    calib_size: int = 256

    def __post_init__(self) -> None:
        check(self.task in TASKS, "prepare.task", self.task, " or ".join(TASKS))
        # Resolved once here, so every reader sees the value in use.
        for key in ("source", "image_size"):
            if getattr(self, key) is None:
                object.__setattr__(self, key, default(self.task, f"prepare.{key}"))
        if self.task == "detection":
            check(self.source in DETECTION_SOURCES, "prepare.source", self.source,
                  f"a detection source: one of {list(DETECTION_SOURCES)} (prepare.task: detection)")
        else:
            known = self.source in SOURCES or (self.source.startswith("torchvision:")
                                               and len(self.source) > len("torchvision:"))
            hint = " (set prepare.task: detection for a detection source)" \
                if self.source in DETECTION_SOURCES else ""
            check(known, "prepare.source", self.source, f"one of {list(SOURCES)}{hint}")
        check(self.channels in (None, 1, 3), "prepare.channels", self.channels, "1, 3 or null")
        check((self.mean is None) == (self.std is None), "prepare.mean", self.mean,
              "null together with prepare.std, or a list beside it")
        check(self.std is None or all(v > 0 for v in self.std), "prepare.std", self.std,
              "a list of numbers > 0")
        check(8 <= self.image_size <= 1024, "prepare.image_size", self.image_size, "8..1024")
        for key in ("val_fraction", "test_fraction"):
            value = getattr(self, key)
            check(0 < value < 0.5, f"prepare.{key}", value, "a number in (0, 0.5)")
        check(self.calib_size >= 1, "prepare.calib_size", self.calib_size, "an integer >= 1")
