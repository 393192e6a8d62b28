"""params.yaml `gates`: what the report stage fails on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check


@dataclass(frozen=True)
class GatesParams:
    SECTION: ClassVar[str] = "gates"

    max_accuracy_drop_pp: float = 1.0
    # A classifier's test drop over max_accuracy_drop_pp fails only when McNemar's one-sided
    # test of its flips (FP32-right -> INT8-wrong against the reverse) is below this p, as
    # quantize_static judges the validation split: on 72 test images one image is 1.4 pp, and
    # two lost against none won (p = 0.25) is what a faithful model does on near-ties. Above
    # it the drop passes, with a note in report.md.
    significance: float = 0.1
    # Detection (mAP@[.5:.95] points, as practitioners read a drop after INT8): a drop under
    # warn_map_drop_pts is excellent, up to max_map_drop_pts acceptable with a warning in
    # report.md, beyond it a failure with the order to investigate in.
    warn_map_drop_pts: float = 1.0
    max_map_drop_pts: float = 3.0
    # Segmentation: the largest mIoU drop in points.
    max_miou_drop_pts: float = 1.0
    min_static_speedup: float = 1.0
    # Peak RSS (MiB) of a fresh process running any variant at any benchmarked batch size: the
    # device's memory limit. null: no limit.
    max_peak_rss_mb: float | None = None
    # false: a missed gate is a warning in report, not a failure.
    enforce: bool = True

    def __post_init__(self) -> None:
        check(self.max_accuracy_drop_pp >= 0, "gates.max_accuracy_drop_pp",
              self.max_accuracy_drop_pp, "a number >= 0")
        check(0 < self.significance < 1, "gates.significance", self.significance,
              "a probability in (0, 1), e.g. 0.05")
        check(self.max_miou_drop_pts >= 0, "gates.max_miou_drop_pts", self.max_miou_drop_pts,
              "a number >= 0")
        check(0 <= self.warn_map_drop_pts <= self.max_map_drop_pts, "gates.warn_map_drop_pts",
              self.warn_map_drop_pts, f"a number in [0, gates.max_map_drop_pts = {self.max_map_drop_pts}]")
        check(self.min_static_speedup >= 0, "gates.min_static_speedup",
              self.min_static_speedup, "a number >= 0")
        check(self.max_peak_rss_mb is None or self.max_peak_rss_mb > 0, "gates.max_peak_rss_mb",
              self.max_peak_rss_mb, "a number > 0 (MiB) or null")
