"""params.yaml `simplify`: the parity tolerance of the onnxsim step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check


@dataclass(frozen=True)
class SimplifyParams:
    SECTION: ClassVar[str] = "simplify"

    max_abs_diff: float = 1e-4

    def __post_init__(self) -> None:
        check(self.max_abs_diff > 0, "simplify.max_abs_diff", self.max_abs_diff, "a number > 0")
