"""The memory budget (params.yaml `resources`): what a machine has, what a model costs, how
stages size their batches to it, and what names a stage the kernel killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from conftest import copy_project, set_params
from quantpipe import budget, models, training, watch
from quantpipe.errors import UserError
from quantpipe.schemas.resources import ResourcesParams


def test_machine_memory_is_the_lower_of_memtotal_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:        1000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert budget.machine_memory_mb(meminfo, cgroup) == 24576  # no limit file
    (cgroup / "memory.max").write_text("max\n")
    assert budget.machine_memory_mb(meminfo, cgroup) == 24576  # cgroup v2 without a limit
    (cgroup / "memory.max").write_text(f"{8 * 2**30}\n")
    assert budget.machine_memory_mb(meminfo, cgroup) == 8192


def test_a_null_budget_is_a_third_of_the_machine_and_a_set_one_is_taken_as_it_is():
    assert budget.Budget.of(ResourcesParams(), machine_mb=24576).total_mb == 8192
    assert "a third of this machine's 24576 MiB" in budget.Budget.of(ResourcesParams(), 24576).source
    assert budget.Budget.of(ResourcesParams(memory_mb=4096)).total_mb == 4096
    with pytest.raises(UserError, match=r"resources.memory_mb = 100 is not allowed"):
        ResourcesParams(memory_mb=100)


def test_batch_is_the_largest_that_fits_and_one_sample_too_many_names_the_keys():
    held = budget.rss_bytes() / budget.MB
    memory = budget.Budget(held + 100, "resources.memory_mb = test")  # ~100 MiB left
    assert memory.batch(10 * budget.MB, cap=64, what="x") in range(8, 11)
    assert memory.batch(budget.MB, cap=64, what="x") == 64  # capped
    with pytest.raises(UserError, match=r"calibrating needs about .* MiB for one sample, more "
                                        r"than resources.memory_mb = test MiB allows; raise "
                                        r"resources.memory_mb or lower a.batch_size"):
        memory.batch(400 * budget.MB, cap=64, what="calibrating", fix="lower a.batch_size")


def test_training_plan_splits_the_batch_into_equal_micro_batches():
    held = budget.rss_bytes() / budget.MB
    memory = budget.Budget(held + 100, "test")
    # 1 MiB saved a sample is 1.5 MiB a training sample: ~66 fit, so 64 is one part, 100 two.
    assert budget.training_plan(memory, budget.MB, 0, 64, what="t", key="k").micro_batch == 64
    assert budget.training_plan(memory, budget.MB, 0, 100, what="t", key="k").micro_batch == 50
    plan = budget.training_plan(memory, 8 * budget.MB, 0, 64, what="t", key="k")
    assert plan.micro_batch * -(-64 // plan.micro_batch) >= 64 and plan.micro_batch <= 8
    assert training.accumulate(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert training.accumulate(10, None) == training.accumulate(10, 10) == [slice(0, 10)]


def test_accumulated_micro_batches_train_as_the_whole_batch():
    """Without BatchNorm (whose statistics do see the micro-batches), gradients accumulated over
    micro-batches are the whole batch's: the same weights after the same steps."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, 24)

    def fit(micro):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
        models.train_model(model, x, y, x[:4], y[:4], epochs=2, batch_size=12, lr=1e-2,
                           max_shift=0, seed=0, progress=False, micro_batch=micro)
        return [p.detach().clone() for p in model.parameters()]

    for whole, parts in zip(fit(None), fit(5)):
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


def test_saved_bytes_grow_with_the_activations_and_leave_the_model_untouched():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    before = model[1].running_mean.clone()
    small = models.saved_bytes(model, (3, 16, 16))
    assert small >= 8 * 16 * 16 * 4  # at least one activation of the batch norm, per sample
    assert models.saved_bytes(model, (3, 32, 32)) == pytest.approx(4 * small, rel=0.05)
    assert torch.equal(model[1].running_mean, before)  # measured on a copy


def test_a_stage_marker_lives_while_it_runs_and_a_killed_one_is_reported_once(tmp_path):
    (tmp_path / ".dvc").mkdir()
    with watch.running("train", root=tmp_path):
        (marker,) = (tmp_path / watch.RUNNING).glob("*.json")
        assert json.loads(marker.read_text())["stage"] == "train"
        assert watch.killed(tmp_path) == []  # alive: not killed
    assert not list((tmp_path / watch.RUNNING).glob("*.json"))
    # A process that dies without removing its marker: what SIGKILL leaves.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / watch.RUNNING / "quantize_static.json").write_text(json.dumps(
        {"stage": "quantize_static", "pid": dead.pid, "started": time.time(),
         "peak_rss_mb": 23000.0}))
    (record,) = watch.killed(tmp_path)
    line = watch.explain(record, machine_mb=24000)
    assert "stage 'quantize_static'" in line and "out-of-memory killer" in line
    assert "resources.memory_mb" in line
    assert "a signal from outside" in watch.explain({**record, "peak_rss_mb": 900.0}, 24000)
    assert watch.killed(tmp_path) == []  # reported once


def test_the_next_stage_names_a_stage_killed_by_sigkill(tiny_run, tmp_path):
    """A real stage killed with SIGKILL mid-run (as the kernel's OOM killer does), then the next
    stage started: it says which one died and with how much memory, in one warning line."""
    repo = copy_project(tiny_run[0], tmp_path / "repo")
    train = subprocess.Popen([sys.executable, "-m", "stages.train", "--data", "data/prepared",
                              "--model", str(tmp_path / "model.pt"), "--metrics",
                              str(tmp_path / "train.json"), "--curve", str(tmp_path / "c.json")],
                             cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    markers = repo / watch.RUNNING
    deadline = time.monotonic() + 120
    while not list(markers.glob("train.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(markers.glob("train.json")), "the train stage wrote no marker"
    os.kill(train.pid, signal.SIGKILL)
    train.wait()
    machine = subprocess.run([sys.executable, "-m", "stages.machine", "--out", "metrics/machine.json",
                              "--int8", "metrics/int8.json"], cwd=repo, capture_output=True,
                             text=True, timeout=120)
    assert machine.returncode == 0, machine.stderr
    warning = [line for line in machine.stderr.splitlines() if line.startswith("warning: stage")]
    assert len(warning) == 1 and "stage 'train'" in warning[0] and "MiB resident" in warning[0]
    assert not list(markers.glob("*.json"))


def test_a_stage_that_cannot_fit_one_sample_stops_in_one_line_naming_the_keys(tiny_run, tmp_path):
    """256 MiB is less than a Python process with PyTorch holds: train stops before it trains,
    naming the budget and the batch key, and writes nothing."""
    repo = copy_project(tiny_run[0], tmp_path / "repo")
    set_params(repo, {"resources": {"memory_mb": 256}})
    proc = subprocess.run([sys.executable, "-m", "stages.train", "--data", "data/prepared",
                           "--model", str(tmp_path / "model.pt"), "--metrics",
                           str(tmp_path / "train.json"), "--curve", str(tmp_path / "c.json")],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: train (simple_cnn at 28 px) needs about")
    assert "resources.memory_mb = 256" in line and "lower train.batch_size" in line
    assert not (tmp_path / "model.pt").exists()
