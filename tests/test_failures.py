"""Bad input and failures: one clear error line, nothing half-written, safe loading.

Every case runs the real stage script (or the real `dvc`) as a subprocess in a throw-away copy
of the project, and checks what a user sees: exit code 2 and one `error:` line naming the key
or file (a traceback only with QUANTPIPE_DEBUG=1), and an untouched workspace.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import psutil
import pytest
import torch
import yaml
from onnx import TensorProto, helper, numpy_helper

from conftest import PROBE, ROOT, TINY_PARAMS, copy_project, make_project, set_params
from helpers import lock_md5s
from quantpipe import data, machine
from quantpipe.errors import UserError

DVC = str(Path(sys.executable).parent / "dvc")
# Slow enough (~0.25 s an epoch here) to signal train mid-way; still only a few seconds.
EPOCHS = 8
MODEL_FILES = ("exported.onnx", "fp32.onnx", "dynamic.onnx", "static.onnx", "qat.onnx")


# --- helpers ----------------------------------------------------------------------------------

def stage_command(cwd: Path, stage: str, variant: str | None = None) -> list[str]:
    """The command dvc.yaml in cwd runs for `stage` (at `variant` for a foreach stage)."""
    body = yaml.safe_load((cwd / "dvc.yaml").read_text())["stages"][stage]
    body = body.get("do", body)
    variants = yaml.safe_load((cwd / "dvc.yaml").read_text())["vars"][0]["variants"]
    # ${key}: the variant; ${item}: the model file it runs (bf16 runs fp32's).
    cmd = body["cmd"].replace("${key}", variant or "${key}")
    argv = shlex.split(cmd.replace("${item}", variants[variant] if variant else "${item}"))
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]]


def run_script(cwd: Path, stage: str, variant: str | None = None, debug: bool = False,
               timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `stage` in cwd with the command in dvc.yaml, as DVC runs it."""
    env = {k: v for k, v in os.environ.items() if k != "QUANTPIPE_DEBUG"}
    if debug:
        env["QUANTPIPE_DEBUG"] = "1"
    return subprocess.run(stage_command(cwd, stage, variant), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def error_line(result: subprocess.CompletedProcess) -> str:
    """The single `error:` line of a stage that failed at a boundary (asserting that it did)."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """{path: md5} of every file under root except git/DVC internals and bytecode caches."""
    skip = {".git", ".dvc", "__pycache__"}
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not skip & set(p.relative_to(root).parts)}


def temp_leftovers(root: Path) -> list[str]:
    """atomic_path's temp dirs (`.NAME.*.tmp`) anywhere in the workspace."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp")
                  if ".git" not in p.relative_to(root).parts)


def dvc(repo: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([DVC, *args], cwd=repo, capture_output=True, text=True, timeout=timeout)


def dvc_changed(repo: Path, stage: str) -> dict:
    result = dvc(repo, "status", "--json", stage)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def md5(path: Path) -> str | None:
    return hashlib.md5(path.read_bytes()).hexdigest() if path.exists() else None


# --- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """A committed copy of the project with nothing run yet."""
    return make_project(tmp_path_factory.mktemp("fresh"), TINY_PARAMS)


@pytest.fixture
def with_params(fresh):
    """Apply params changes to `fresh` for one test; restores params.yaml afterwards."""
    original = (fresh / "params.yaml").read_text()

    def apply(changes: dict) -> Path:
        set_params(fresh, changes)
        return fresh

    yield apply
    (fresh / "params.yaml").write_text(original)


@pytest.fixture(scope="module")
def built(tiny_run, tmp_path_factory) -> Path:
    """A copy of the session's complete tiny run (its git, DVC cache and lock) to change freely.
    The tests that need a train slow enough to signal ask for EPOCHS epochs themselves."""
    return copy_project(tiny_run[0], tmp_path_factory.mktemp("built") / "repo")


@pytest.fixture
def workspace(built, tmp_path) -> Path:
    """A scratch copy of the built workspace (no git, no DVC) to corrupt files in."""
    dest = tmp_path / "ws"
    shutil.copytree(built, dest, ignore=shutil.ignore_patterns(".git", ".dvc", "__pycache__"))
    return dest


# --- params: stage-level behaviour (parse-level messages are in test_params.py) ---------------

PARAM_CASES = [
    # (stage script args, params change, what the line must name)
    (("train",), {"train": {"epoch": 3}}, ["unknown key train.epoch", "epochs"]),
    (("quantize_static",), {"quantize_static": {"calibration_method": "Entropy"}},
     ["unknown key quantize_static.calibration_method", "calibrate_method"]),
    (("quantize_static",), {"quantize_static": {"per_channel": "yes"}},
     ["quantize_static.per_channel = 'yes'", "true or false"]),
    (("train",), {"train": {"epochs": 2.5}}, ["train.epochs = 2.5", "an integer"]),
    (("quantize_static",), {"quantize_static": {"calibrate_method": "minmax"}},
     ["quantize_static.calibrate_method = 'minmax'", "'MinMax'", "'Entropy'", "'Percentile'"]),
    (("quantize_dynamic",), {"quantize_dynamic": {"weight_type": "int8"}},
     ["quantize_dynamic.weight_type = 'int8'", "'QInt8'", "'QUInt8'"]),
    (("evaluate", "static"), {"runtime": {"graph_optimization_level": "ORT_ENABLE_MAX"}},
     ["runtime.graph_optimization_level = 'ORT_ENABLE_MAX'", "'ORT_ENABLE_ALL'"]),
    (("quantize_static",), {"quantize_static": {"calibrate_method": "Percentile",
                                                "extra_options": {"CalibPercentile": 0}}},
     ["quantize_static.extra_options.CalibPercentile = 0", "(0, 100]"]),
    (("quantize_static",), {"quantize_static": {"calibrate_method": "Percentile",
                                                "extra_options": {"CalibPercentile": 100.5}}},
     ["quantize_static.extra_options.CalibPercentile = 100.5", "(0, 100]"]),
    (("train",), {"train": {"batch_size": 0}}, ["train.batch_size = 0", ">= 1"]),
    (("evaluate", "fp32"), {"evaluate": {"batch_size": -8}}, ["evaluate.batch_size = -8", ">= 1"]),
    (("quantize_static",), {"quantize_static": {"calib_batch_size": 0}},
     ["quantize_static.calib_batch_size = 0", ">= 1"]),
    (("bench", "fp32"), {"bench": {"batch_sizes": [1, 0]}}, ["bench.batch_sizes = [1, 0]", ">= 1"]),
    (("quantize_static",), {"quantize_static": {"engine": "tensorrt"}},
     ["quantize_static.engine: 'tensorrt' is not allowed", "['onnxruntime', 'nncf']"]),
    (("bench", "fp32"), {"bench": {"runtimes": ["onnxruntime", "tensorrt"]}},
     ["bench.runtimes: 'tensorrt' is not allowed", "['onnxruntime', 'openvino']"]),
]


@pytest.mark.parametrize("args, changes, expected", PARAM_CASES,
                         ids=[f"{c[0][0]}:{section}.{next(iter(inner))}"
                              for c in PARAM_CASES for section, inner in [next(iter(c[1].items()))]])
def test_bad_params_stop_the_stage_with_one_line_and_write_nothing(with_params, args, changes,
                                                                    expected):
    repo = with_params(changes)
    before = snapshot(repo)
    line = error_line(run_script(repo, *args))
    assert line.startswith("error: params.yaml: ")
    for text in expected:
        assert text in line
    assert snapshot(repo) == before  # not even a data/ or metrics/ directory
    assert temp_leftovers(repo) == []


@pytest.mark.parametrize("args, changes", [
    (("prepare",), {"prepare": {"calib_size": 0}}),
    (("quantize_static",), {"quantize_static": {"calibrate_method": "minmax"}}),
])
def test_bad_params_with_debug_show_the_traceback(with_params, args, changes):
    result = run_script(with_params(changes), *args, debug=True)
    assert result.returncode not in (0, 2)
    assert "Traceback" in result.stderr
    assert "quantpipe.errors.UserError" in result.stderr


def test_misspelt_extra_option_is_refused(workspace):
    # ORT ignores unknown keys: without the check the stage would run with the typo unseen.
    set_params(workspace, {"quantize_static": {"calibrate_method": "Percentile",
                                               "extra_options": {"CalibPercentil": 99.9}}})
    line = error_line(run_script(workspace, "quantize_static"))
    assert "quantize_static.extra_options.CalibPercentil" in line and "CalibPercentile" in line


def test_unknown_node_to_exclude_names_the_node_and_the_model(workspace):
    set_params(workspace, {"quantize_static": {"nodes_to_exclude": ["conv9"]}})
    before = snapshot(workspace)
    line = error_line(run_script(workspace, "quantize_static"))
    assert "quantize_static.nodes_to_exclude" in line and "'conv9'" in line
    assert "models/fp32.onnx" in line
    assert snapshot(workspace) == before


# --- models: corrupt, mismatched, non-finite ---------------------------------------------------

def corrupt(path: Path, kind: str) -> None:
    blob = path.read_bytes()
    path.write_bytes({"truncated": blob[:len(blob) // 2], "garbage": b"\x08\x07not an onnx model",
                      "empty": b""}[kind])


@pytest.mark.parametrize("args, broken, kind", [
    (("simplify",), "models/exported.onnx", "truncated"),
    (("quantize_dynamic",), "models/fp32.onnx", "truncated"),
    (("quantize_static",), "models/fp32.onnx", "truncated"),
    (("quantize_static",), "models/fp32.onnx", "garbage"),
    (("quantize_static",), "models/fp32.onnx", "empty"),
    (("evaluate", "fp32"), "models/fp32.onnx", "truncated"),
    (("evaluate", "static"), "models/static.onnx", "truncated"),
    (("evaluate", "static"), "models/fp32.onnx", "garbage"),  # the FP32 reference
    (("bench", "static"), "models/fp32.onnx", "truncated"),
    (("bench_torch",), "models/fp32.onnx", "truncated"),
    (("export",), "models/model.pt", "truncated"),
])
def test_corrupt_model_file_is_named_in_one_line(workspace, args, broken, kind):
    corrupt(workspace / broken, kind)
    before = snapshot(workspace)
    line = error_line(run_script(workspace, *args))
    assert line.startswith(f"error: {broken}: ")
    assert snapshot(workspace) == before  # the stage's outputs keep their last good version
    assert temp_leftovers(workspace) == []


def linear_model(path: Path, input_shape: list, *, elem_type: int = TensorProto.FLOAT,
                 bias: np.ndarray | None = None, inf_where: float | None = None) -> Path:
    """A hand-written ONNX classifier: flatten -> MatMul -> Add, 10 logits.

    elem_type: the input's dtype (cast to float inside); bias: the Add's constant (NaN here makes
    every logit NaN); inf_where: logits become -inf for samples containing this exact value.
    """
    features = int(np.prod(input_shape[1:]))
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.01, (features, 10)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(10, np.float32) if bias is None else bias, "b")]
    nodes, x = [], "input"
    if elem_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", ["input"], ["x_float"], to=TensorProto.FLOAT))
        x = "x_float"
    nodes += [helper.make_node("Flatten", [x], ["flat"], axis=1),
              helper.make_node("MatMul", ["flat", "W"], ["mm"])]
    if inf_where is None:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["logits"]))
    else:
        inits += [numpy_helper.from_array(np.array(inf_where, np.float32), "c"),
                  numpy_helper.from_array(np.array([1], np.int64), "axis1"),
                  numpy_helper.from_array(np.array(1, np.float32), "one")]
        nodes += [helper.make_node("Add", ["mm", "b"], ["finite"]),
                  helper.make_node("Equal", ["flat", "c"], ["hit"]),
                  helper.make_node("Cast", ["hit"], ["hit_float"], to=TensorProto.FLOAT),
                  helper.make_node("ReduceMax", ["hit_float", "axis1"], ["any_hit"], keepdims=1),
                  helper.make_node("Sub", ["one", "any_hit"], ["keep"]),
                  helper.make_node("Log", ["keep"], ["penalty"]),  # 0 or -inf, (N, 1)
                  helper.make_node("Add", ["finite", "penalty"], ["logits"])]
    graph = helper.make_graph(
        nodes, "crafted", [helper.make_tensor_value_info("input", elem_type, input_shape)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [input_shape[0], 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)  # valid ONNX: only the data disagrees
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("args, shape, elem_type, expected", [
    (("evaluate", "static"), ["N", 1, 14, 14], TensorProto.FLOAT,
     ["input 'input' has shape ['N', 1, 14, 14]", "the data is (batch, 1, 28, 28)"]),
    (("evaluate", "static"), ["N", 3, 28, 28], TensorProto.FLOAT,
     ["has shape ['N', 3, 28, 28]", "the data is (batch, 1, 28, 28)"]),
    (("evaluate", "static"), ["N", 1, 28, 28], TensorProto.DOUBLE,
     ["input 'input' is tensor(double), expected tensor(float)"]),
    (("evaluate", "static"), [1, 1, 28, 28], TensorProto.FLOAT,
     ["has shape [1, 1, 28, 28] with a fixed batch size of 1", "dynamic batch axis"]),
    (("bench", "static"), [1, 1, 28, 28], TensorProto.FLOAT,
     ["has shape [1, 1, 28, 28] with a fixed batch size of 1"]),
])
def test_model_input_that_does_not_fit_the_data_is_named(workspace, args, shape, elem_type,
                                                         expected):
    linear_model(workspace / "models/static.onnx", shape, elem_type=elem_type)
    before = snapshot(workspace)
    line = error_line(run_script(workspace, *args))
    assert line.startswith("error: models/static.onnx: ")
    for text in expected:
        assert text in line
    assert snapshot(workspace) == before


def test_model_with_nan_logits_fails_evaluate_naming_the_check(workspace):
    linear_model(workspace / "models/static.onnx", ["N", 1, 28, 28],
                 bias=np.full(10, np.nan, np.float32))
    before = snapshot(workspace)
    line = error_line(run_script(workspace, "evaluate", "static"))
    assert line.startswith("error: models/static.onnx: edge check finite_zeros failed")
    assert "NaN" in line
    # The last good metrics stay: no NaN written into metrics/eval/static.json.
    assert snapshot(workspace) == before


def test_model_with_inf_logits_on_real_images_only_fails_the_test_sample_check(workspace):
    info = data.load_info(workspace / "data/prepared")
    test_x = data.load_split(workspace / "data/prepared", "test").x[:TINY_PARAMS["evaluate"]["batch_size"]]
    # A grey level that occurs in the test images but is none of the constant edge inputs.
    values, counts = np.unique(test_x[(test_x > 0) & (test_x < 255)], return_counts=True)
    grey = np.array([[[[values[counts.argmax()]]]]], np.uint8)
    linear_model(workspace / "models/static.onnx", ["N", 1, 28, 28],
                 inf_where=float(data.normalize(grey, info).item()))
    line = error_line(run_script(workspace, "evaluate", "static"))
    assert line.startswith("error: models/static.onnx: edge check finite_test_samples failed")
    assert re.search(r"0 NaN and [1-9]\d* Inf of \d+ logits", line)


def test_every_onnx_file_the_pipeline_writes_passes_the_full_checker(built):
    written = sorted(p.name for p in (built / "models").glob("*.onnx"))
    assert set(MODEL_FILES) <= set(written)
    for name in written:
        onnx.checker.check_model(str(built / "models" / name), full_check=True)
    # model.pt is a plain state_dict: loadable without unpickling arbitrary objects.
    state = torch.load(built / "models/model.pt", weights_only=True)
    assert all(isinstance(t, torch.Tensor) for t in state.values())


# --- calibration ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["empty", "other_size", "other_size_and_meta"])
def test_unusable_calibration_set_fails_before_ort(workspace, case):
    calib = workspace / "data/calibration"
    x = np.load(calib / "calib_x.npy")
    if case == "empty":
        np.save(calib / "calib_x.npy", x[:0])
        np.save(calib / "calib_y.npy", np.load(calib / "calib_y.npy")[:0])
        expected = ["data/calibration: the calibration set is empty", "prepare.calib_size"]
    else:
        np.save(calib / "calib_x.npy", np.ascontiguousarray(x[:, :, ::2, ::2]))  # (N, 1, 14, 14)
        expected = ["data/calibration: samples of shape (1, 14, 14)"]
        if case == "other_size_and_meta":
            meta = json.loads((calib / "meta.json").read_text())
            (calib / "meta.json").write_text(json.dumps({**meta, "image_size": 14}))
            expected.append("do not fit the model input [None, 1, 28, 28]")
        else:
            expected.append("disagree with its meta.json ((1, 28, 28))")
    before = snapshot(workspace)
    line = error_line(run_script(workspace, "quantize_static"))
    for text in expected:
        assert text in line
    assert snapshot(workspace) == before
    # The check ran before any ORT quantization code: the traceback ends in check_calibration.
    debug = run_script(workspace, "quantize_static", debug=True)
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', debug.stderr)
    assert frames[-1][1] == "check_calibration", debug.stderr
    assert not any("onnxruntime" in f for f, _ in frames), debug.stderr


# --- atomic outputs ---------------------------------------------------------------------------

def test_stale_temps_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    from quantpipe.io import atomic_path

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    out = tmp_path / "data" / "prepared"
    stale = [out.parent / f".prepared.{dead}.abc123.tmp", out.parent / ".prepared.k2j_x9.tmp"]
    live = out.parent / f".prepared.{os.getppid()}.def456.tmp"  # a running process's
    other = out.parent / f".calibration.{dead}.ghi789.tmp"  # another output's
    for d in (*stale, live, other):
        (d / "partial").mkdir(parents=True)
    with atomic_path(out, is_dir=True) as tmp:
        (tmp / "train_x.npy").write_bytes(b"complete")
    assert (out / "train_x.npy").read_bytes() == b"complete"
    assert not any(d.exists() for d in stale)
    assert live.exists() and other.exists()


def test_dvc_ignores_stray_temp_dirs_beside_outputs(built):
    """What a SIGKILLed stage leaves (temp dirs beside data/ and models/ outputs) is never taken
    as an output: the pipeline stays up to date and the recorded hashes do not move."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    planted = [built / f"data/.prepared.{dead}.x1.tmp", built / f"data/.calibration.{dead}.x2.tmp",
               built / f"models/.model.pt.{dead}.x3.tmp", built / f"models/.static.onnx.{dead}.x4.tmp"]
    lock = lock_md5s(built)
    try:
        for d in planted:
            d.mkdir()
            (d / d.name.split(".")[1]).write_bytes(b"half written")
        result = dvc(built, "status", "--json")
        # Up to date; only the machine probe, which runs every time by design, is listed.
        assert result.returncode == 0 and json.loads(result.stdout) == {PROBE: ["always changed"]}, \
            result.stdout + result.stderr
        assert lock_md5s(built) == lock
    finally:
        for d in planted:
            shutil.rmtree(d, ignore_errors=True)


def start_dvc(repo: Path, *args: str, log: Path) -> subprocess.Popen:
    """`dvc <args>` in its own process group (so the group can be signalled), output to log."""
    with open(log, "wb") as out:
        return subprocess.Popen([DVC, *args], cwd=repo, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_until(proc: subprocess.Popen, ready, what: str, log: Path, timeout: float = 120):
    """Poll ready() until it returns something truthy, while the process runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"dvc exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def stage_process(proc: subprocess.Popen, script: str) -> psutil.Process | None:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            # The module as an argv item of its own: the python process itself, never the
            # `sh -c "python -m stages.X ..."` wrapper that DVC starts when $SHELL is dash or
            # unset (dash forks rather than execs, so signalling it would orphan the stage).
            if f"stages.{script}" in child.cmdline()[1:]:
                return child
        except psutil.NoSuchProcess:
            continue
    return None


# (stage, params change that makes it out of date with no run-cache entry, output, what is
# signalled, signal). The target "stage" signals only the stage's python (DVC sees it fail);
# "group" signals DVC and the stage together (DVC dies too).
KILL_CASES = [
    ("train", {"train": {"epochs": EPOCHS + 1}}, "models/model.pt", "stage", signal.SIGTERM),
    ("train", {"train": {"epochs": EPOCHS + 2}}, "models/model.pt", "group", signal.SIGKILL),
    ("quantize_static", {"quantize_static": {"per_channel": False}}, "models/static.onnx", "group",
     signal.SIGTERM),
    ("quantize_static", {"quantize_static": {"reduce_range": True}}, "models/static.onnx", "stage",
     signal.SIGKILL),
]
# make test kills one stage (SIGKILL of quantize_static alone); the other cases run with the
# slow tests (each is a partial pipeline run, 30-60 s: make test must stay under 15 minutes).
SLOW_KILLS = {0, 1, 2}


@pytest.mark.parametrize("stage, changes, output, target, sig", [
    pytest.param(*c, marks=[pytest.mark.slow] if i in SLOW_KILLS else [],
                 id=f"{c[0]}-{c[3]}-{c[4].name}") for i, c in enumerate(KILL_CASES)])
def test_stage_killed_midway_leaves_nothing_dvc_accepts_and_rerun_recovers(
        built, tmp_path, stage, changes, output, target, sig):
    out = built / output
    previous = lock_md5s(built)[output]
    set_params(built, changes)
    log = tmp_path / "dvc.log"
    proc = start_dvc(built, "repro", stage, log=log)
    if stage == "train":
        # The epoch lines show training is under way; the model is written only at the end.
        running = wait_until(proc, lambda: "epoch 2/" in log.read_text()
                             and stage_process(proc, stage), "epoch 2", log)
    else:
        # The temp dir exists from the start of quantization until the rename at the end.
        running = wait_until(proc, lambda: list(out.parent.glob(f".{out.name}.*.tmp"))
                             and stage_process(proc, stage), "a temp output", log)
    if target == "group":
        os.killpg(proc.pid, sig)
    else:
        running.send_signal(sig)
    proc.wait(timeout=60)
    psutil.wait_procs([running], timeout=60)
    text = log.read_text()
    assert proc.returncode != 0, text

    # No partial output: the final file is absent (DVC removes outputs before running a
    # stage) or still the last complete version.
    assert md5(out) in (None, previous)
    leftovers = temp_leftovers(built)
    if sig == signal.SIGTERM:
        assert leftovers == []  # SIGTERM unwinds: atomic_path removes its temp dir
        if target == "stage":
            assert f"failed to reproduce '{stage}'" in text and "exited with 143" in text
    if target == "stage" and sig == signal.SIGKILL:
        assert leftovers and all(f".{out.name}." in p for p in leftovers)
        # -9 when DVC runs the script directly (bash execs it), 137 through a dash wrapper.
        assert "exited with -9" in text or "exited with 137" in text
    if target == "group" and sig == signal.SIGKILL:
        # DVC died holding its rwlock: the next dvc command notices the dead pid and goes on
        # (no need to delete .dvc/tmp/rwlock or .dvc/tmp/lock by hand).
        assert f'"pid": {proc.pid}' in (built / ".dvc/tmp/rwlock").read_text()
        status = dvc(built, "status", stage)
        assert status.returncode == 0, status.stderr
        assert f"(Pid {proc.pid})" in status.stderr and "had been killed" in status.stderr
        # Its write locks are dropped; its read locks linger, harmless (reads do not block
        # reads; a later write to such a path drops them the same way).
        writers = json.loads((built / ".dvc/tmp/rwlock").read_text())["write"].values()
        assert proc.pid not in {info["pid"] for info in writers}
    # DVC does not take the stage as done.
    assert stage in dvc_changed(built, stage)

    rerun = dvc(built, "repro", stage)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"Running stage '{stage}'" in rerun.stdout  # really re-run, not restored
    assert dvc_changed(built, stage) == {}
    assert temp_leftovers(built) == []  # the re-run removed what a SIGKILL left
    assert md5(out) == lock_md5s(built)[output]
    if stage == "train":
        state = torch.load(out, weights_only=True)
        assert state and all(isinstance(t, torch.Tensor) for t in state.values())
    else:
        onnx.checker.check_model(str(out), full_check=True)


# What `make repro` runs (quantpipe.dvcrun: `dvc --wait-for-lock`, after checking no run's stage
# is going); the first argument is the DVC command.
ENTRY = (sys.executable, "-m", "quantpipe.dvcrun")

# Takes DVC's repository lock while stage process argv[1] runs and keeps it until argv[2]
# seconds after that process ends: what a second DVC command (`dvc status`, a second `dvc
# repro` collecting the pipeline) does on a loaded machine at the worst moment, made certain.
HOLD_LOCK = """
import sys, time, psutil
from dvc.lock import make_lock
lock = make_lock(".dvc/tmp/lock", tmp_dir=".dvc/tmp", wait=True)
stage = psutil.Process(int(sys.argv[1]))
lock.lock()
print("held", stage.is_running(), flush=True)
stage.wait()
time.sleep(float(sys.argv[2]))
print("released", time.time(), flush=True)
lock.unlock()
"""


def start_run(repo: Path, *args: str, log: Path, entry: bool = True) -> subprocess.Popen:
    """`dvc <args>` as quantpipe's entry points run it (or plain, entry=False), in its own
    process group, output to log."""
    argv = [*ENTRY, *args] if entry else [DVC, *args]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=repo, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.mark.parametrize("entry", [pytest.param(True, id="entry-point"),
                                   pytest.param(False, id="plain-dvc", marks=pytest.mark.slow)])
def test_a_run_keeps_its_result_when_another_command_holds_the_lock_as_its_stage_ends(
        built, tmp_path, entry):
    """DVC releases its lock while a stage runs and takes it back to record the result; plain
    `dvc repro` gives up after 3 s and loses the result, quantpipe's entry points wait."""
    original = (built / "params.yaml").read_text()
    # A result dvc.lock does not have yet (one per case); run, not restored from the run cache
    # (where an earlier run of this test left it).
    set_params(built, {"train": {"lr": 0.002 if entry else 0.003, "epochs": EPOCHS}})
    try:
        log = tmp_path / "first.log"
        first = start_run(built, "repro", "--no-run-cache", "train", log=log, entry=entry)
        stage = wait_until(first, lambda: stage_process(first, "train"), "train running", log)
        holder = subprocess.run([sys.executable, "-c", HOLD_LOCK, str(stage.pid), "6"], cwd=built,
                                capture_output=True, text=True, timeout=300)
        assert holder.returncode == 0, holder.stderr
        held, released = holder.stdout.splitlines()
        assert held == "held True"  # the lock was taken while the stage still ran
        rc = first.wait(timeout=300)
        text = log.read_text()
        if not entry:
            # DVC's own behaviour, the reason for the entry point: the work is done, its
            # result not recorded (`dvc commit train` would record it).
            assert rc != 0 and "Unable to acquire lock" in text, text[-2000:]
            assert "train" in dvc_changed(built, "train")
            return
        assert rc == 0, text[-3000:]
        assert time.time() > float(released.split()[1])  # it waited for the release
        assert dvc_changed(built, "train") == {}
        assert lock_md5s(built)["models/model.pt"] == md5(built / "models/model.pt")
    finally:
        (built / "params.yaml").write_text(original)
        assert dvc(built, "repro", "train").returncode == 0  # back as it was (run cache)


@pytest.mark.slow  # two train runs of ~35 s, one waited for
def test_a_second_command_while_one_runs_stops_at_once_and_the_first_completes(built, tmp_path):
    original = (built / "params.yaml").read_text()
    # A train long enough to run two DVC commands beside (their start-ups take seconds on a
    # loaded machine): the tiny model's epoch takes under a second on one thread, so EPOCHS'
    # 8 could end first (it did on a 2-core EPYC, 0.8 s an epoch).
    set_params(built, {"train": {"epochs": 5 * EPOCHS}})
    try:
        assert dvc(built, "repro", "train").returncode == 0
        second_command_while_one_runs(built, tmp_path)
    finally:
        (built / "params.yaml").write_text(original)
        assert dvc(built, "repro", "train").returncode == 0  # back as it was (run cache)


def second_command_while_one_runs(built: Path, tmp_path: Path) -> None:
    model = built / "models/model.pt"
    before = md5(model)
    log = tmp_path / "first.log"
    first = start_run(built, "repro", "-f", "train", log=log)
    wait_until(first, lambda: "epoch 2/" in log.read_text() and stage_process(first, "train"),
               "epoch 2", log)
    # A plain `dvc repro` typed in another terminal: DVC's path locks stop it.
    start = time.monotonic()
    second = dvc(built, "repro", timeout=120)
    plain_seconds = time.monotonic() - start
    # The entry point (`make repro`) stops before it takes DVC's lock at all, naming the run.
    start = time.monotonic()
    ours = subprocess.run([*ENTRY, "repro"], cwd=built, capture_output=True, text=True,
                          timeout=120)
    ours_seconds = time.monotonic() - start
    assert first.poll() is None, "the first run finished before the others started"
    assert second.returncode != 0
    # During a stage DVC holds per-path rwlocks (the repo lock only between stages).
    message = second.stderr
    busy = f"is busy, it is being blocked by:\n  (PID {first.pid}): " in message
    assert busy or "ERROR: Unable to acquire lock" in message, message
    assert error_line(ours).startswith(f"error: a DVC run is going in this workspace (PID "
                                       f"{first.pid}: "), ours.stderr
    assert "repro -f train" in ours.stderr
    # Seconds, not the length of the run (slack for a loaded machine's DVC start-up).
    assert plain_seconds < 60 and ours_seconds < 60
    assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert md5(model) == before  # deterministic training: the same bytes again
    assert dvc_changed(built, "train") == {}


def test_the_run_check_reads_dvcs_rwlock_and_ignores_dead_and_foreign_pids(tmp_path):
    from quantpipe import dvcrun

    (tmp_path / ".dvc/tmp").mkdir(parents=True)
    assert dvcrun.running_stages(tmp_path) == []  # no rwlock file: nothing ever ran
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "dvc"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    for proc in (alive, other):  # exec'd: its own command line, not still the forked test's
        deadline = time.monotonic() + 10
        while (b"time.sleep(60)" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
               and time.monotonic() < deadline):
            time.sleep(0.01)
    try:
        info = lambda pid, cmd: {"pid": pid, "cmd": cmd}  # noqa: E731
        (tmp_path / ".dvc/tmp/rwlock").write_text(json.dumps({
            "read": {"/r/data/prepared": [info(dead.pid, "dvc repro"), info(alive.pid, "dvc repro")]},
            "write": {"/r/models/model.pt": info(alive.pid, "dvc repro"),
                      "/r/models/fp32.onnx": info(other.pid, "dvc repro")}}))
        # A killed run's entry (DVC leaves its read locks) and a PID reused by another program
        # are no run.
        assert dvcrun.running_stages(tmp_path) == [f"PID {alive.pid}: dvc repro"]
        with pytest.raises(UserError, match=rf"a DVC run is going in this workspace \(PID {alive.pid}: "
                                            r"dvc repro; .*then run `dvc push` again"):
            dvcrun.check_idle(tmp_path, ["push"])
        dvcrun.check_idle(tmp_path, ["metrics", "diff", "main"])  # read-only: no lock, no check
        dvcrun.check_idle(tmp_path, ["exp", "show"])
    finally:
        alive.kill()
        other.kill()
    assert dvcrun.takes_lock(["repro", "-f", "train"]) and dvcrun.takes_lock(["exp", "run", "-S", "a=1"])
    assert not dvcrun.takes_lock(["params", "diff"]) and not dvcrun.takes_lock(["plots", "show"])
    assert dvcrun.command(["repro"])[-2:] == ["--wait-for-lock", "repro"]


# --- safe loading and commands ----------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal",
                  "shelve"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def unsafe_loads(source: str, filename: str) -> list[str]:
    """Calls and imports that can run code while loading a file, as 'file:line: what'."""
    found = []

    def dotted(node: ast.AST) -> str:
        if isinstance(node, ast.Attribute):
            return f"{dotted(node.value)}.{node.attr}"
        return node.id if isinstance(node, ast.Name) else "?"

    def keyword(call: ast.Call, name: str):
        for kw in call.keywords:
            if kw.arg == name:
                return kw.value
        return None

    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{where}: import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
            if isinstance(node, ast.ImportFrom) and node.module in ("torch", "yaml", "numpy"):
                found += [f"{where}: from {node.module} import {a.name}" for a in node.names
                          if a.name in ("load", "unsafe_load", "full_load")]
            continue
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        last = name.rsplit(".", 1)[-1]
        if name == "torch.load":
            flag = keyword(node, "weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                found.append(f"{where}: torch.load without weights_only=True")
        elif name in ("np.load", "numpy.load"):
            flag = keyword(node, "allow_pickle")
            if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                found.append(f"{where}: {name} with allow_pickle")
        elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
            found.append(f"{where}: {name}")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or dotted(loader).rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
                found.append(f"{where}: {name} without SafeLoader")
        elif last in ("load", "loads") and name.split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}: {name}")
    return found


def test_the_unsafe_load_finder_finds_them():
    bad = """
import pickle
import numpy as np, torch, yaml
torch.load("m.pt")
torch.load("m.pt", weights_only=False)
np.load("x.npy", allow_pickle=True)
yaml.load(text)
yaml.load(text, Loader=yaml.FullLoader)
yaml.unsafe_load(text)
pickle.loads(b"")
"""
    assert len(unsafe_loads(bad, "bad.py")) == 8
    good = """
import numpy as np, torch, yaml
torch.load("m.pt", map_location="cpu", weights_only=True)
np.load("x.npy", allow_pickle=False)
np.load("x.npy")
yaml.safe_load(text)
yaml.load(text, Loader=yaml.SafeLoader)
"""
    assert unsafe_loads(good, "good.py") == []


def test_no_source_file_loads_unsafely():
    files = sorted([*(ROOT / "quantpipe").glob("*.py"), *(ROOT / "stages").glob("*.py")])
    assert len(files) > 10
    found = [hit for f in files for hit in unsafe_loads(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == []


def test_no_stage_command_is_built_from_param_strings():
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    # `vars` defined inline (a mapping), never imported from params.yaml (a string entry).
    inline = {}
    for entry in pipeline.get("vars", []):
        assert isinstance(entry, dict), f"dvc.yaml vars imports {entry!r}: commands could use it"
        inline.update(entry)
    assert inline.get("variants") == {"fp32": "fp32", "dynamic": "dynamic", "static": "static",
                                      "qat": "qat", "bf16": "fp32"}
    for name, stage in pipeline["stages"].items():
        body = stage.get("do", stage)
        commands = body["cmd"] if isinstance(body["cmd"], list) else [body["cmd"]]
        for cmd in commands:
            interpolated = re.findall(r"\$\{[^}]*\}", cmd)
            if "foreach" in stage:
                assert stage["foreach"] == "${variants}", name
                assert set(interpolated) <= {"${key}", "${item}"}, (name, cmd)
            else:
                assert interpolated == [], (name, cmd)
            # python -m stages.<name> [${item}] --<path name> <path> ...: paths, never params.
            assert re.fullmatch(r"python -m stages\.\w+( \$\{key\})?( --\w+ [\w/.${}]+)+", cmd), \
                (name, cmd)


def test_quantize_static_says_when_one_validation_image_outweighs_the_limit(workspace):
    """500 validation images: one is worth 0.2 pp, more than a 0.1 pp limit. The stage warns with
    the fix and records what its verdict rests on."""
    set_params(workspace, {"quantize_static": {"max_drop_pts": 0.1}})
    result = run_script(workspace, "quantize_static")
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("one of the 500 validation images is worth 0.20 pp, more than quantize_static.max_drop_pts = "
            "0.1") in result.stderr and "raise prepare.val_fraction" in result.stderr
    q = json.loads((workspace / "metrics/quantize_static.json").read_text())
    assert q["val_image_pp"] == 0.2 and q["val"]["samples"] == 500
    assert q["pool"]["samples"] == min(2000, 3500 - TINY_PARAMS["prepare"]["calib_size"])
    assert isinstance(q["real_drop"], bool) and q["verdict"].startswith("validation drop")


def test_quantize_static_with_the_nncf_engine(workspace):
    """engine: nncf writes a QDQ models/static.onnx that evaluate runs like ORT's, and the
    metrics say which engine made it, with the flips the verdict rests on."""
    set_params(workspace, {"quantize_static": {"engine": "nncf", "nncf": {"subset_size": 32}}})
    result = run_script(workspace, "quantize_static")
    assert result.returncode == 0, result.stderr[-2000:]
    q = json.loads((workspace / "metrics/quantize_static.json").read_text())
    assert q["engine"] == "nncf" and q["subset_size"] == 32 and q["preset"] == "performance"
    assert {"fp32_right_int8_wrong", "int8_right_fp32_wrong", "mcnemar_p"} <= set(q["val"])
    assert q["fallback_steps"][0]["rung"] == "plain" and q["ops"]["QuantizeLinear"] > 0
    assert "quant_format" not in q  # ORT's settings are not NNCF's
    result = run_script(workspace, "evaluate", "static")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((workspace / "metrics/eval/static.json").read_text())["agreement"] > 0.9


# --- plug-in points: an engine and a runtime registered from a test alone ---------------------

class PerTensorEngine:
    """A third static engine, known to this test only: ONNX Runtime's quantize_static with
    per-tensor weights and no fallback."""
    name = "per_tensor"

    def warnings(self, p):
        return []

    def quantize(self, job):
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

        from quantpipe.engines import base, graph, ort_static

        reader = ort_static.CalibrationReader(
            job.calib_x, job.info, graph.graph_input(onnx.load(str(job.fp32))).name, 32)
        quantize_static(str(job.fp32), str(job.out), reader, quant_format=QuantFormat.QDQ,
                        per_channel=False, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8)
        judged = job.check(job.out)
        return base.StaticResult(
            engine=self.name, steps=[{"rung": "plain", **judged.record, "kept": True}],
            fallback_nodes=[], nodes_in_float=graph.float_compute_nodes(onnx.load(str(job.out))),
            calibrate_method="MinMax", sensitivity=[], calib_samples_used=len(job.calib_x),
            symbolic_shape_inference=None)

    def settings(self, p, result):
        return {"per_channel": False}


def test_an_engine_registered_by_a_test_runs_through_the_static_stage(workspace, monkeypatch):
    from quantpipe.engines import registry
    from stages import quantize_static

    monkeypatch.setitem(registry.ENGINES.classes, PerTensorEngine.name, PerTensorEngine)
    set_params(workspace, {"quantize_static": {"engine": "per_tensor"}})
    monkeypatch.chdir(workspace)
    quantize_static.main(stage_command(workspace, "quantize_static")[3:])
    q = json.loads((workspace / "metrics/quantize_static.json").read_text())
    assert q["engine"] == "per_tensor" and q["per_channel"] is False and q["verdict"]
    model = onnx.load(str(workspace / "models/static.onnx"))
    scales = [i for i in model.graph.initializer if i.name.endswith("weight_scale")]
    assert q["ops"]["QuantizeLinear"] > 0 and scales and all(len(i.dims) == 0 for i in scales)
    result = run_script(workspace, "evaluate", "static")  # the pipeline takes it like any other
    assert result.returncode == 0, result.stderr[-2000:]


class BasicLevelRuntime:
    """A third runtime, known to this test only: ONNX Runtime at ORT_ENABLE_BASIC (QDQ pairs
    left unfused), timed beside the reference and checked against it."""
    name, title = "ort_basic", "ONNX Runtime (basic)"

    def __init__(self, level) -> None:
        pass

    def version(self) -> str:
        return "basic"

    def settings(self, path, cores) -> dict:
        return {"graph_optimization_level": "ORT_ENABLE_BASIC"}

    def runner(self, path, threads):
        from onnxruntime import GraphOptimizationLevel

        from quantpipe import onnxutil

        return onnxutil.session_runner(onnxutil.make_session(
            path, level=GraphOptimizationLevel.ORT_ENABLE_BASIC, threads=threads))

    def pool(self, path, streams, threads):
        return [self.runner(path, threads) for _ in range(streams)]


def test_a_runtime_registered_by_a_test_runs_through_the_bench(workspace, monkeypatch):
    from quantpipe.runtimes import registry
    from stages import bench, report

    monkeypatch.setitem(registry.RUNTIMES.classes, BasicLevelRuntime.name, BasicLevelRuntime)
    # The built project's batch sizes and threads (report compares benches of one setup).
    set_params(workspace, {"bench": {"runtimes": ["onnxruntime", "ort_basic"], "runs": 4,
                                     "rounds": 2}})
    monkeypatch.chdir(workspace)
    bench.main(stage_command(workspace, "bench", "static")[3:])
    entry = json.loads((workspace / "metrics/bench/static.json").read_text())["runtimes"]["ort_basic"]
    assert entry["title"] == "ONNX Runtime (basic)" and entry["parity"]["passed"]
    assert entry["latency"] and entry["throughput"]["best"]["ips"] > 0
    report.main(stage_command(workspace, "report")[3:])
    summary = json.loads((workspace / "metrics/summary.json").read_text())
    assert summary["runtimes"]["ort_basic"] == "ONNX Runtime (basic)"
    assert "ONNX Runtime (basic)" in (workspace / "metrics/report.md").read_text()



def test_qat_logits_beyond_the_limits_with_every_node_faithful_pass_with_a_note(workspace):
    """End-to-end logits are a screen: beyond quantize_qat.max_abs_diff, the node-by-node
    check decides, and an export whose every fake-quant matches its QDQ node passes."""
    set_params(workspace, {"quantize_qat": {"max_abs_diff": 1e-9}})
    result = run_qat(workspace, FLOORED_SCREEN + RUN_QAT)
    assert result.returncode == 0 and "FAILED" not in result.stderr, result.stderr[-3000:]
    assert "quantize_qat: outputs beyond the limits (max |logit diff|" in result.stdout
    assert "quantize_qat.max_abs_diff = 1e-09" in result.stdout
    metrics = json.loads((workspace / "metrics/quantize_qat.json").read_text())
    assert "failed" not in metrics
    nodes = metrics["parity"]["nodes"]
    assert nodes["faithful"] and nodes["nodes"] > 0 and nodes["samples"] > 0
    assert metrics["parity"]["agreement"] >= 0.99 and metrics["parity"]["max_abs_diff"] > 1e-9
    assert temp_leftovers(workspace) == []


# Float rounding makes the exported logits differ from the fake-quant model's on most
# machines, but not on all (bit for bit on an Intel Xeon with AMX): the screen's measurement is
# floored at 1e-6 so that, with quantize_qat.max_abs_diff = 1e-9, the node check runs anywhere.
FLOORED_SCREEN = ("import stages.quantize_qat as s; "
                  "from quantpipe.tasks.classification.task import Classification as C; "
                  "c = C.compare; C.compare = lambda self, *a: {**c(self, *a), "
                  "'max_abs_diff': max(c(self, *a)['max_abs_diff'], 1e-6)}; ")
RUN_QAT = "from quantpipe.io import run_stage; run_stage(s.main)"
# ... and the node check's tolerance below zero: no node can pass it, as a node written wrong
# would not.
NO_NODE_PASSES = ("import quantpipe.engines.qat_parity as q; q.NODE_MAX_MISMATCH = -1.0; "
                  + FLOORED_SCREEN + RUN_QAT)


def run_qat(workspace: Path, program: str) -> subprocess.CompletedProcess:
    """quantize_qat with dvc.yaml's arguments, run by `program` (a patched entry point)."""
    argv = stage_command(workspace, "quantize_qat")[3:]  # its arguments
    return subprocess.run([sys.executable, "-c", program, *argv], cwd=workspace,
                          env={**os.environ, "PYTHONPATH": str(workspace)},
                          capture_output=True, text=True, timeout=300)


def test_quantize_qat_without_parity_writes_the_model_as_failed_naming_the_limits_and_node(workspace):
    written = workspace / "models/qat.onnx"
    written.unlink()
    set_params(workspace, {"quantize_qat": {"max_abs_diff": 1e-9}})
    result = run_qat(workspace, NO_NODE_PASSES)
    # Not a stop: the model is written for evaluate and bench, and the report shows it failed.
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]  # after the fine-tune's progress bars
    assert line.startswith("quantize_qat: FAILED: the exported QDQ graph differs from the "
                           "fake-quant PyTorch model"), line
    assert "quantize_qat.max_abs_diff = 1e-09" in line and "metrics/quantize_qat.json" in line
    metrics = json.loads((workspace / "metrics/quantize_qat.json").read_text())
    worst = metrics["parity"]["nodes"]["worst"]["node"]
    assert metrics["failed"] in line and f"node by node, {worst} differs" in line
    assert written.stat().st_size > 0
    assert temp_leftovers(workspace) == []


def test_disabled_qat_writes_an_empty_model_and_every_consumer_skips_it(workspace):
    set_params(workspace, {"quantize_qat": {"enabled": False}})
    result = run_script(workspace, "quantize_qat")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (workspace / "models/qat.onnx").stat().st_size == 0
    assert json.loads((workspace / "metrics/quantize_qat.json").read_text()) == {
        "skipped": "quantize_qat.enabled is false"}
    for stage, record in (("evaluate", "metrics/eval/qat.json"), ("bench", "metrics/bench/qat.json")):
        result = run_script(workspace, stage, "qat")
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads((workspace / record).read_text())["skipped"].startswith(
            "models/qat.onnx is empty")
    result = run_script(workspace, "report")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((workspace / "metrics/summary.json").read_text())
    skipped = dict(summary["skipped"])
    assert "qat" not in summary and skipped.pop("qat") == "quantize_qat.enabled is false"
    # bf16 is skipped too where the CPU has no native BF16 (with that reason), never elsewhere.
    assert set(skipped) == ({"bf16"} if machine.bf16_missing(machine.probe()) else set())
    assert ("- INT8 ONNX, quantization-aware training (QAT): quantize_qat.enabled is false."
            in (workspace / "metrics/report.md").read_text())


def _quantpipe_imports(path: Path) -> set[Path]:
    """The quantpipe source files `path` imports, directly or through each other (imports
    inside functions included: they run too), with each package's __init__.py."""
    seen: set[Path] = set()
    todo = [path]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if not name.startswith("quantpipe"):
                    continue
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # quantpipe.runtimes.timing: every package on the way
                    base = ROOT.joinpath(*parts[:i])
                    for f in (base.with_suffix(".py"), base / "__init__.py"):
                        if f.is_file() and f not in seen:
                            seen.add(f)
                            todo.append(f)
    return seen


def test_every_stage_depends_on_the_library_files_it_imports():
    """A library change must re-run the stages that run it, and only those: each stage's deps
    list exactly the quantpipe files its script imports (memprobe.py, run as a subprocess by
    bench, is listed by hand)."""
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    for name, stage in pipeline["stages"].items():
        body = stage.get("do", stage)
        script = ROOT / (body["cmd"].split()[2].replace(".", "/") + ".py")
        deps = {d for d in body["deps"] if isinstance(d, str)}
        listed = {d for d in deps if d.startswith("quantpipe/") and d.endswith(".py")}
        imported = {str(f.relative_to(ROOT)) for f in _quantpipe_imports(script)}
        imported.discard("quantpipe/__init__.py")  # empty
        assert script.relative_to(ROOT).as_posix() in deps, name
        missing = imported - listed
        assert not missing, f"dvc.yaml stage {name} imports {sorted(missing)} but does not list them"
        extra = listed - imported - {"quantpipe/memprobe.py"}
        assert not extra, f"dvc.yaml stage {name} lists {sorted(extra)} that it does not import"
