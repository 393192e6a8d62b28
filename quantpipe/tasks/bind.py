"""Tasks at work: the Task of the prepared data, bound to it, for the stages after prepare."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantpipe.errors import UserError
from quantpipe.modelinfo import INPUTS_DIR, ONNX_PREFIX, onnx_source
from quantpipe.tasks import TASKS, check_name

if TYPE_CHECKING:
    from quantpipe.data import DataInfo
    from quantpipe.tasks.base import Task


def get(name: str) -> type[Task]:
    """The Task class of task `name`."""
    from quantpipe.tasks.classification.task import Classification
    from quantpipe.tasks.detection.task import Detection
    from quantpipe.tasks.segmentation.task import Segmentation

    check_name(name)
    return {cls.name: cls for cls in (Classification, Detection, Segmentation)}[name]


def for_data(info: DataInfo) -> Task:
    """The prepared data's task, bound to it and to the task's own params."""
    return get(info.task).from_params(info)


def check_model(task: str, name: str) -> None:
    """train.model must be one of the task's models or a brought ONNX file; one line naming the
    task it belongs to otherwise."""
    cls = get(task)
    if onnx_source(name) or cls.has_model(name):
        return
    owner = next((other for other in TASKS if other != task and get(other).has_model(name)), None)
    if owner is not None:
        raise UserError(f"train.model = {name!r} is a {owner} model; set prepare.task: {owner} "
                        f"or use one of {cls.describe_zoo()}")
    raise UserError(f"train.model = {name!r} is not a {task} model; with prepare.task: {task} "
                    f"use one of {cls.describe_zoo()} or {ONNX_PREFIX}{INPUTS_DIR}/<file>.onnx")
