"""params.yaml `gates`: what the report stage fails on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check


@dataclass(frozen=True)
class GatesParams:
    SECTION: ClassVar[str] = "gates"

    max_accuracy_drop_pp: float = 1.0
    min_static_speedup: float = 1.0
    # Peak RSS (MiB) of a fresh process running any variant at any benchmarked batch size: the
    # device's memory limit. null: no limit.
    max_peak_rss_mb: float | None = None
    # false: a missed gate is a warning in report, not a failure.
    enforce: bool = True

    def __post_init__(self) -> None:
        check(self.max_accuracy_drop_pp >= 0, "gates.max_accuracy_drop_pp",
              self.max_accuracy_drop_pp, "a number >= 0")
        check(self.min_static_speedup >= 0, "gates.min_static_speedup",
              self.min_static_speedup, "a number >= 0")
        check(self.max_peak_rss_mb is None or self.max_peak_rss_mb > 0, "gates.max_peak_rss_mb",
              self.max_peak_rss_mb, "a number > 0 (MiB) or null")
