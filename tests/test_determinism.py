"""`dvc repro` then `dvc repro -f` of the whole pipeline gives the same data and models, byte
for byte: the hashes DVC records in dvc.lock and the files themselves."""

from __future__ import annotations

import pytest

from conftest import copy_project, reproduce
from helpers import content_md5s, lock_md5s
from quantpipe.io import VARIANTS

# A forced re-run of the whole pipeline (~80 s): with the slow tests.
pytestmark = pytest.mark.slow

# Every cached data/model output the pipeline writes (metrics carry timings and are not compared).
OUTPUTS = ("data/prepared", "data/calibration", "models/model.pt", "models/exported.onnx",
           "models/fp32.onnx", "models/dynamic.onnx", "models/static.onnx", "models/qat.onnx",
           *(f"data/predictions/{v}.json" for v in VARIANTS))


@pytest.fixture(scope="module")
def twice(tiny_run, tmp_path_factory):
    """(lock md5s, file md5s) after a first repro (the session's) and after a forced full re-run."""
    run, first = tiny_run
    repo = copy_project(run, tmp_path_factory.mktemp("determinism") / "repo")
    runs = []
    for force in (False, True):
        ran = reproduce(repo, force=True) if force else first
        assert {"prepare", "train", "quantize_static"} <= ran  # each run really ran
        files = {}
        for out in OUTPUTS:
            files.update(content_md5s(repo, out))
        runs.append((lock_md5s(repo), files))
    return runs


def test_lock_records_every_data_and_model_output(twice):
    (lock, _), _ = twice
    assert set(lock) == set(OUTPUTS)


def test_forced_rerun_records_identical_hashes_in_dvc_lock(twice):
    (first, _), (second, _) = twice
    changed = {path: (first[path], second.get(path)) for path in first if second.get(path) != first[path]}
    assert changed == {}


def test_forced_rerun_writes_identical_files(twice):
    (_, first), (_, second) = twice
    assert any(name.startswith("data/prepared/") for name in first)  # directories are walked
    assert set(first) == set(second)
    changed = sorted(name for name in first if first[name] != second[name])
    assert changed == []
