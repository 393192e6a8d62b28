"""The Task interface: everything that differs between what a model does (prepare.task).

Stages and the shared library hold no task's name: they ask the task for what differs. A
TaskSpec is what the params schemas, prepare and the report need: defaults, data sources and
loading (`load`), the score and the report's columns (light imports, so that a quantizer's
change does not re-run prepare). A Task adds, bound to the prepared data
(quantpipe.tasks.bind.for_data), what the stages after prepare need: its models (`zoo`,
`fit`), what its outputs mean (`check_output`, `postprocess`), its score on them and the drop
against FP32 (`evaluate`), how two models' outputs compare (`compare`, `agree`), how a
quantized candidate is judged (`static_judge`), and QAT's limits (`qat_limits`). A task is one
package in quantpipe/tasks/: its TaskSpec in __init__.py, its Task in task.py, listed in
quantpipe.tasks (docs/design.md, "Adding a task").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:  # (the params schemas and the criterion are the stages' imports, not prepare's)
    from quantpipe.data import DataInfo, Split


@dataclass(frozen=True)
class Score:
    """A task's headline score as the summary, report, gates and review name it."""
    key: str  # in evaluate's metrics and summary.json rows: "accuracy", "map_50_95"
    drop_key: str  # the drop against FP32 in summary rows
    unit: str  # of the drop: "pp", "points"
    gate: str  # the gates.* key that bounds the drop
    label: str  # for people: "accuracy", "mAP"
    # What to try, in order, when the drop is over the gate (appended to the gate's failure).
    advice: str = ""


@dataclass
class Listing:
    """A task's dataset as prepare splits it: a label (stratum) per image, and either the images
    in memory (`full`) or files decoded after the split (`folder` with its `transform`)."""
    class_names: list[str]
    y: np.ndarray  # (N,) the class (or stratum) of each image: what the split stratifies on
    num_classes: int
    full: Split | None = None
    folder: Any = None
    transform: Any = None
    objects: tuple | None = None  # per image, what the task adds to a label (boxes, masks)
    category_ids: list[int] | None = None
    declared: dict[str, np.ndarray] = field(default_factory=dict)  # the source's own splits


@dataclass(frozen=True)
class Evaluation:
    """evaluate's task figures for one variant."""
    quality: dict  # the score on the test split, the drop and agreement against FP32
    pool: dict  # agreement with FP32 on the unlabelled pool
    results: list  # per-image predictions as a DVC output (COCO results, ...); [] when none
    confusion: list  # rows for DVC's confusion plot; [] when the task has none
    line: str  # the stage's summary line


@dataclass(frozen=True)
class StaticJudge:
    """quantize_static's criterion for one task: FP32's validation score, FP32's labels on the
    pool (what NNCF's accuracy control compares), and the verdict on a candidate's outputs."""
    fp32_score: float
    ref_pool: np.ndarray
    # (val outputs, pool outputs) -> the verdict, a quantpipe.criterion.Judged
    check: Callable[[np.ndarray, np.ndarray], Any]
    labels: Callable[[np.ndarray], np.ndarray]  # outputs -> one label per image


class TaskSpec:
    """What a task is, light enough for the params schemas, prepare and the report: its
    defaults, data sources and loading, its score, and the report's columns and notes."""
    name: ClassVar[str]
    # params.yaml keys left null take these values.
    defaults: ClassVar[dict[str, Any]]
    # prepare.source values this task reads (a "name:" entry takes "name:<anything>").
    sources: ClassVar[tuple[str, ...]]
    # Images are letterboxed (prepare.pad_value applies) rather than resized/cropped.
    letterbox: ClassVar[bool] = False
    score: ClassVar[Score]
    # Keys of an evaluate record (and summary row) that carry the task's scores.
    score_keys: ClassVar[tuple[str, ...]]
    # Scores bench_torch reports of the PyTorch model (a subset of score_keys).
    torch_score_keys: ClassVar[tuple[str, ...]]
    # The report's headline columns for the score: (title, summary row key, format).
    headline: ClassVar[tuple[tuple[str, str, str], ...]]

    @classmethod
    def accepts_source(cls, source: str) -> bool:
        return any(source == s or (s.endswith(":") and source.startswith(s) and len(source) > len(s))
                   for s in cls.sources)

    @classmethod
    def load(cls, p) -> Listing:  # p: PrepareParams
        """prepare's dataset: labels (strata) for the split, the images or their files."""
        raise NotImplementedError

    @classmethod
    def write_extras(cls, directory: Path, splits: dict[str, Split], info: DataInfo) -> None:
        """Files beside the prepared arrays (a detector's COCO ground truth); none by default."""

    @classmethod
    def summary_scores(cls, ev: dict) -> dict:
        """A summary.json row's score keys from the variant's evaluate record."""
        return {k: ev[k] for k in cls.score_keys}

    @classmethod
    def summary_drop(cls, ev: dict, fp32: dict) -> dict:
        raise NotImplementedError

    @classmethod
    def drop_noise(cls, entry: dict, gates) -> str | None:
        """Why a summary row's drop over its gate is noise (then it passes, with a note), or
        None: the task has no test of it."""
        return None

    @classmethod
    def tolerance_notes(cls, summary: dict, gates, quantized: list[str]) -> list[str]:
        """report.md notes for drops within the gate that still want a look."""
        return []


class Task(TaskSpec):
    """A task at work: bound to the prepared data's DataInfo (and the task's own params), it
    answers for the stages after prepare."""
    # The validation measure: its key in torch_scores, in the training history
    # (models.EpochStats, detection's DetEpoch), and for people.
    validation_key: ClassVar[str]
    history_key: ClassVar[str]
    history_label: ClassVar[str]

    def __init__(self, info: DataInfo) -> None:
        self.info = info

    @classmethod
    def from_params(cls, info: DataInfo) -> "Task":
        """Bound to the prepared data and to the task's own params.yaml section, if any."""
        return cls(info)

    # --- models -------------------------------------------------------------------------
    @classmethod
    def zoo(cls) -> tuple[str, ...]:
        """The model names train.model may take for this task (besides onnx:<file>)."""
        raise NotImplementedError

    @classmethod
    def has_model(cls, name: str) -> bool:
        return name in cls.zoo()

    @classmethod
    def describe_zoo(cls) -> str:
        return str(list(cls.zoo()))

    # --- train --------------------------------------------------------------------------
    def fit(self, model, x_train, train: Split, x_val, val: Split, *, epochs: int,
            batch_size: int, lr: float, max_shift: int, seed: int, on_step=None,
            plan=None) -> list:
        """Train `model` on its task's loss; on_step(model, step) after each optimizer step
        (QAT freezes ranges and BatchNorm with it); `plan` (a quantpipe.budget.TrainingPlan):
        the memory budget's micro-batches (gradients accumulated to batch_size) and validation
        batch. Returns the per-epoch history."""
        raise NotImplementedError

    def torch_scores(self, model, x, split: Split, batch_size: int = 256) -> dict:
        """A PyTorch model's scores on a split (train's checkpoint scores), batch_size samples
        per pass."""
        raise NotImplementedError

    # --- outputs ------------------------------------------------------------------------
    def check_output(self, out: np.ndarray, where: str) -> None:
        """Raise UserError when outputs do not have the task's layout."""
        raise NotImplementedError

    # What an application runs after the model (decode + NMS), timed end to end by bench;
    # None when the model's output is the answer.
    postprocess: Callable[[np.ndarray], Any] | None = None

    def compare(self, got: np.ndarray, expected: np.ndarray) -> dict:
        """Two models' outputs on the same images: the largest and mean differences and the
        agreement of their predictions (and what else the task's users see)."""
        raise NotImplementedError

    def agree(self, ref: np.ndarray, out: np.ndarray) -> float:
        """The share of images on which two models' outputs predict the same."""
        raise NotImplementedError

    def parity_record(self, got: np.ndarray, expected: np.ndarray, where: str,
                      reference: str) -> dict:
        """export's and simplify's parity on what users see, beyond the raw outputs'
        difference: `got` (the model written to `where`) against `expected` (`reference`'s);
        one line naming both when the predictions do not match."""
        return {}

    def labels(self, split: Split) -> np.ndarray | None:
        """Per-image labels the engines' parity check scores accuracy on; None when it has none."""
        return None

    # --- evaluate -----------------------------------------------------------------------
    # Two batches' outputs agree (the share that matches) when exact equality is not the test.
    batch_agreement: Callable[[np.ndarray, np.ndarray], float] | None = None

    def evaluate(self, out: np.ndarray, ref: np.ndarray, pool_out: np.ndarray,
                 pool_ref: np.ndarray, test: Split, where: str) -> Evaluation:
        raise NotImplementedError

    def test_scores(self, out: np.ndarray, test: Split) -> dict:
        """Scores of raw outputs on the test split, the task's torch_score_keys first."""
        raise NotImplementedError

    # --- quantize_static ----------------------------------------------------------------
    def static_judge(self, ref_val_out: np.ndarray, ref_pool_out: np.ndarray, val: Split,
                     p) -> StaticJudge:  # p: QuantizeStaticParams
        raise NotImplementedError

    def static_warnings(self, val: Split, p,
                        val_fraction: float) -> list[str]:
        return []

    def static_metrics(self, judge: StaticJudge, result, val: Split) -> dict:
        """quantize_static.json's task keys."""
        return {}

    def output_statistics(self, out: np.ndarray) -> dict[str, np.ndarray]:
        """Per-image statistics of FP32's outputs that the calibration check compares."""
        raise NotImplementedError

    # Keep the operators after the last convolution (a detector's decode) in float.
    float_tail: bool = False

    # --- quantize_qat -------------------------------------------------------------------
    def qat_limits(self, parity: dict, p) -> str | None:  # p: QuantizeQATParams
        """Why the exported QAT model is beyond quantize_qat's limits, or None."""
        raise NotImplementedError
