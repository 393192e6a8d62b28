"""The Task interface: every registered task answers every question the stages ask, and no code
outside quantpipe/tasks/ branches on a task's name."""

import inspect
import re
from pathlib import Path

import pytest

from quantpipe import tasks
from quantpipe.tasks import base, bind
from quantpipe.schemas.prepare import PrepareParams

ROOT = Path(__file__).resolve().parent.parent
# A comparison with a task's name, or a flag named after one: what a plug-in point replaces.
BRANCH = re.compile(r"(==|!=) ?['\"](%s)['\"]|['\"](%s)['\"] ?(==|!=)|\bis_(%s)\b|if (not )?(%s)\b"
                    % (("|".join(tasks.TASKS),) * 4))


def _unimplemented(cls: type, interface: type) -> list[str]:
    """Methods of `interface` that `cls` leaves raising NotImplementedError."""
    missing = []
    for name, member in inspect.getmembers(interface):
        if name.startswith("_") or not callable(member):
            continue
        impl = inspect.getattr_static(cls, name)
        func = getattr(impl, "__func__", impl)
        if callable(func) and "raise NotImplementedError" in inspect.getsource(func):
            missing.append(name)
    return missing


@pytest.mark.parametrize("name", tasks.TASKS)
def test_every_task_implements_the_interface(name):
    spec, task = tasks.spec(name), bind.get(name)
    assert spec.name == task.name == name and issubclass(task, spec)
    assert _unimplemented(spec, base.TaskSpec) == []
    assert _unimplemented(task, base.Task) == []
    for key in ("prepare.source", "prepare.image_size", "train.model", "train.epochs"):
        assert key in spec.defaults
    assert spec.accepts_source(spec.defaults["prepare.source"])
    assert spec.score.key in spec.score_keys and set(spec.torch_score_keys) <= set(spec.score_keys)
    assert PrepareParams(task=name).source == spec.defaults["prepare.source"]
    assert bind.get(name).has_model(spec.defaults["train.model"])


def test_a_summary_names_its_task_and_an_evaluation_shows_it():
    for name in tasks.TASKS:
        spec = tasks.spec(name)
        assert tasks.of_evaluation({spec.score.key: 0.5}) is spec
        named = {} if name == tasks.DEFAULT else {"task": name}  # the default task is unnamed
        assert tasks.for_summary(named) is spec


def test_a_source_of_another_task_says_which():
    for name in tasks.TASKS:
        for other in tasks.TASKS:
            if other == name:
                continue
            source = next(s for s in tasks.spec(other).sources if not s.endswith(":"))
            with pytest.raises(Exception, match=f"set prepare.task: {other}"):
                PrepareParams(task=name, source=source)


def test_no_code_outside_the_tasks_branches_on_a_task_name():
    found = []
    for path in [*(ROOT / "stages").rglob("*.py"), *(ROOT / "quantpipe").rglob("*.py")]:
        if (ROOT / "quantpipe" / "tasks") in path.parents:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if BRANCH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "ask the task instead:\n" + "\n".join(found)
