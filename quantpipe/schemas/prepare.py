"""params.yaml `prepare`: where the data comes from, image size, normalization, splits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from quantpipe.modelinfo import PRESETS, Stated
from quantpipe.params import check
from quantpipe import tasks


# Named normalizations (prepare.mean / prepare.std): torchvision's ImageNet models', and `unit`
# (pixel/255 as it is, on any channel count: Ultralytics' models).
NORMALIZATION_PRESETS = {name: {"mean": mean, "std": std} for name, (mean, std) in PRESETS.items()}


@dataclass(frozen=True)
class PrepareParams:
    SECTION: ClassVar[str] = "prepare"

    # What the model does, a name in quantpipe.tasks.TASKS: classification (a label per
    # image), detection (boxes and labels per image).
    task: str = tasks.DEFAULT
    # One of the task's sources (quantpipe.tasks.<task>.sources); null: the task's own
    # embedded data (mnist5k; digits_detection).
    source: str | None = None
    path: str | None = None
    # Side of the square images fed to the model (pixels); null: what a brought model states
    # (an Ultralytics export's imgsz), else 28 for classification (mnist5k is natively 28), 64
    # for detection (detection images are letterboxed to it), or prepare.crop. Without
    # resize/crop every image is resized to image_size x image_size.
    image_size: int | None = None
    # torchvision's evaluation transform, for a model trained with it: the shorter side resized
    # to `resize` (bilinear, antialiased, aspect kept), then the centre `crop` x `crop` (e.g.
    # 256 and 224 for ImageNet models). One of them alone: the other takes its value.
    resize: int | None = None
    crop: int | None = None
    # 1 or 3 converts every image (grey <-> RGB); null keeps the dataset's own channels (a
    # brought model's stated channels: 3 for an Ultralytics export).
    channels: int | None = None
    # Per-channel normalization of pixel/255: null takes what a brought model states (an
    # Ultralytics export: none, `unit`), else, for a model trained here, the train split's; a
    # brought ONNX that states nothing needs it set. `imagenet` is torchvision's (mean 0.485,
    # 0.456, 0.406, std 0.229, 0.224, 0.225), what its pretrained models expect; `unit` is
    # pixel/255 as it is (mean 0, std 1); or a list per channel, one value for all.
    mean: tuple[float, ...] | str | None = None
    std: tuple[float, ...] | str | None = None
    # Detection: the grey level the letterbox pads with (0..255); null: what a brought model
    # states (Ultralytics: 114), else 0 (black, what quantpipe's own detectors train with).
    pad_value: int | None = None
    # Shares of the whole dataset; the rest is train. Stratified, so each class keeps its share.
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    # Calibration samples drawn from the train split (never test): a few hundred cover the
    # activation ranges of a small CNN; more only slows Entropy/Percentile calibration.
    calib_size: int = 256

    def __post_init__(self) -> None:
        check(self.task in tasks.TASKS, "prepare.task", self.task, " or ".join(tasks.TASKS))
        task = tasks.spec(self.task)
        for key in ("resize", "crop"):
            value = getattr(self, key)
            check(value is None or 8 <= value <= 4096, f"prepare.{key}", value, "8..4096 or null")
        if self.resize or self.crop:
            key = "prepare.resize" if self.resize else "prepare.crop"
            check(not task.letterbox, key, self.resize or self.crop,
                  f"null with prepare.task: {self.task} (its images are letterboxed to "
                  "prepare.image_size)")
            resize, crop = self.resize or self.crop, self.crop or self.resize
            check(crop <= resize, "prepare.crop", crop, f"at most prepare.resize ({resize})")
            check(self.image_size in (None, crop), "prepare.image_size", self.image_size,
                  f"null or {crop}: the images are prepare.crop = {crop} px square")
            object.__setattr__(self, "resize", resize)
            object.__setattr__(self, "crop", crop)
            object.__setattr__(self, "image_size", crop)
        named = {v for v in (self.mean, self.std) if isinstance(v, str)}
        for key in ("mean", "std"):  # presets become their numbers, once (one names both)
            value = getattr(self, key)
            if value is None and len(named) == 1:
                value = next(iter(named))
            if isinstance(value, str):
                check(value in NORMALIZATION_PRESETS, f"prepare.{key}", value,
                      f"one of {list(NORMALIZATION_PRESETS)}, a list of numbers per channel, or null")
                object.__setattr__(self, key, NORMALIZATION_PRESETS[value][key])
        # Resolved once here, so every reader sees the value in use.
        if self.source is None:
            object.__setattr__(self, "source", task.defaults["prepare.source"])
        owner = next((t for t in tasks.TASKS if tasks.spec(t).accepts_source(self.source)), None)
        hint = f" (set prepare.task: {owner} for a {owner} source)" if owner else ""
        check(task.accepts_source(self.source), "prepare.source", self.source,
              f"a {self.task} source: one of "
              f"{[s + '<Name>' if s.endswith(':') else s for s in task.sources]}{hint}")
        check(self.channels in (None, 1, 3), "prepare.channels", self.channels, "1, 3 or null")
        check((self.mean is None) == (self.std is None), "prepare.mean", self.mean,
              "null together with prepare.std, or a list beside it")
        check(self.std is None or all(v > 0 for v in self.std), "prepare.std", self.std,
              "a list of numbers > 0")
        check(self.image_size is None or 8 <= self.image_size <= 1024, "prepare.image_size",
              self.image_size, "8..1024 or null")
        check(self.pad_value is None or 0 <= self.pad_value <= 255, "prepare.pad_value",
              self.pad_value, "0..255 or null")
        check(self.pad_value is None or task.letterbox, "prepare.pad_value", self.pad_value,
              f"null with prepare.task: {self.task} (its images are not letterboxed)")
        for key in ("val_fraction", "test_fraction"):
            value = getattr(self, key)
            check(0 < value < 0.5, f"prepare.{key}", value, "a number in (0, 0.5)")
        check(self.calib_size >= 1, "prepare.calib_size", self.calib_size, "an integer >= 1")

    def for_model(self, stated: Stated | None) -> "PrepareParams":
        """These params with what a brought model states where they are null (image size,
        channels, normalization, letterbox padding), then the task's defaults."""
        values = {}
        if stated is not None:
            values = {k: getattr(stated, k) for k in ("image_size", "channels", "pad_value")
                      if getattr(self, k) is None and getattr(stated, k) is not None}
            if self.mean is None and stated.mean is not None:
                values.update(mean=stated.mean, std=stated.std)
        if self.image_size is None and "image_size" not in values:
            values["image_size"] = tasks.default(self.task, "prepare.image_size")
        if tasks.spec(self.task).letterbox and self.pad_value is None and "pad_value" not in values:
            values["pad_value"] = 0
        return dataclasses.replace(self, **values)
