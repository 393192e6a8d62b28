"""What the model does (prepare.task), by name: the registry of tasks.

The task is a fact of the prepared data (data/prepared/meta.json): every stage after prepare
reads it from there (quantpipe.tasks.bind.for_data), so `dvc exp run -S prepare.task=detection`
switches the whole pipeline and only prepare declares the key. Each task is a package here: its
TaskSpec in __init__.py (what the params schemas, prepare and the report need, light to import)
and its Task in task.py (quantpipe.tasks.base). Adding one = that package, its name in TASKS
and its classes in spec() and quantpipe.tasks.bind.get.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantpipe.errors import UserError

if TYPE_CHECKING:
    from quantpipe.tasks.base import TaskSpec

# The tasks by name; the first is the default (prepare.task's, and an unnamed summary's).
TASKS = ("classification", "detection", "segmentation")
DEFAULT = TASKS[0]


def check_name(name: str) -> None:
    if name not in TASKS:
        raise UserError(f"prepare.task: {name!r} is not allowed; use one of {list(TASKS)}")


def spec(name: str) -> type[TaskSpec]:
    """What task `name` is: defaults, sources, score, report columns."""
    from quantpipe.tasks.classification import ClassificationSpec
    from quantpipe.tasks.detection import DetectionSpec
    from quantpipe.tasks.segmentation import SegmentationSpec

    check_name(name)
    return {cls.name: cls for cls in (ClassificationSpec, DetectionSpec, SegmentationSpec)}[name]


def default(task: str, key: str):
    """The value params.yaml `key` takes for `task` when it is null."""
    return spec(task).defaults[key]


def for_summary(summary: dict) -> type[TaskSpec]:
    """The task of a summary.json (its `task` key; the default task's summaries carry none)."""
    return spec(summary.get("task", DEFAULT))


def of_evaluation(record: dict) -> type[TaskSpec]:
    """The task whose score an evaluate record (or summary row) carries."""
    for name in TASKS:
        if spec(name).score.key in record:
            return spec(name)
    raise UserError(f"no task's score ({[spec(n).score.key for n in TASKS]}) in the evaluate "
                    "metrics: re-run `dvc repro`")
