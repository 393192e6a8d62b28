"""params.yaml `resources`: the memory every stage plans within (quantpipe.budget)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check


@dataclass(frozen=True)
class ResourcesParams:
    SECTION: ClassVar[str] = "resources"

    # The resident memory (MiB) one stage may reach at its peak. Every stage sizes what grows
    # with the model and the data to it before allocating: calibration and debugging batches,
    # the recovery ladder's sensitivity runs, training and QAT micro-batches (gradients
    # accumulated to train.batch_size), evaluation and bench batches; one that cannot fit even
    # one sample stops in one line naming this key. null: a third of this machine's memory (its
    # cgroup limit where lower), leaving room for the page cache, DVC and a second experiment
    # of `dvc queue start -j 2`. ResNet-50 at 224 px trains and quantizes in 8 GiB.
    memory_mb: int | None = None

    def __post_init__(self) -> None:
        check(self.memory_mb is None or (isinstance(self.memory_mb, int) and self.memory_mb >= 256),
              "resources.memory_mb", self.memory_mb, "an integer >= 256 (MiB), or null (a third "
              "of this machine's memory)")
