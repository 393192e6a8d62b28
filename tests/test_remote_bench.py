"""scripts/remote_bench.py end to end against a local target: pack the tiny pipeline's models,
test split and code, unpack and run them in another directory (the commands an ssh target gets,
without ssh), bring the JSON back into metrics/machines/<name>/ with that machine's report."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import copy_project

from quantpipe.docs import locked_models, render
from quantpipe.machine import probe

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/remote_bench.py"
_spec = importlib.util.spec_from_file_location("remote_bench", SCRIPT)
remote_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(remote_bench)


def _hide(folder: Path, *modules: str) -> Path:
    """A folder that, first on PYTHONPATH, makes `modules` fail to import: a Python without them."""
    for module in modules:
        (folder / module).mkdir(parents=True, exist_ok=True)
        (folder / module / "__init__.py").write_text(f"raise ImportError('no {module} here')\n")
    return folder


def _script(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def collected(tiny_run, tmp_path_factory):
    work = tmp_path_factory.mktemp("remote")
    project = copy_project(tiny_run[0], work / "project")
    bundle = work / "bundle.tar.gz"
    _script("--project", str(project), "pack", str(bundle), "--runtimes", "onnxruntime", cwd=work)
    # A deployment server often has no PyTorch: a classifier is measured without it (an import
    # of torch fails there, and here while the results are collected: the report needs none).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(_hide(work / "no_torch", "torch")), os.environ.get("PYTHONPATH")]))}
    run = _script("--project", str(project), "run", str(bundle), "--target",
                  f"local:{work / 'target'}", "--python", sys.executable, cwd=work, env=env)
    return project, bundle, work / "target", run.stdout


def test_the_bundle_carries_code_models_data_and_narrowed_params(collected):
    _, bundle, _, _ = collected
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
        params = tar.extractfile("params.yaml").read().decode()
    assert {"remote_bench.py", "params.yaml", "stages/bench.py", "quantpipe/bench.py",
            "models/fp32.onnx", "models/static.onnx", "data/prepared/test_x.npy",
            "wheels/requirements.txt", "records/quantize_static.json"} <= names
    assert not any("__pycache__" in n for n in names)
    assert "runtimes:\n  - onnxruntime\n" in params  # what the target will have


def test_the_target_measured_and_the_results_came_back_named_by_its_machine(collected):
    project, _, target, stdout = collected
    machine = json.loads((target / "results/machine.json").read_text())
    here = probe()
    assert machine["cpu"] == here["cpu"] and machine["cores"] == here["cores"]
    dest = project / "metrics/machines" / remote_bench.machine_name(machine)
    assert f"collected metrics/machines/{dest.name}" in stdout
    assert json.loads((dest / "machine.json").read_text()) == machine
    summary = json.loads((dest / "summary.json").read_text())
    assert summary["machine"] == machine
    # Accuracy measured there too (stages.evaluate on the target), the bench there, the threads
    # curve and the tails in every recommendation; torch is not benched there.
    for variant in ("fp32", "static"):
        there = json.loads((target / f"results/eval/{variant}.json").read_text())
        assert summary[variant]["accuracy"] == there["accuracy"]
    cores = machine["cores"]
    assert set(summary["static"]["by_threads"]) == (
        {f"threads{2 ** i}" for i in range(cores.bit_length())} | {f"threads{cores}"})
    for row in summary["recommended"].values():
        assert row["p99_ms"] >= row["p50_ms"] > 0 and "snippet" in row
    assert summary["server"]["runtime"] == "onnxruntime"
    assert "torch" not in summary
    assert (dest / "report.md").read_text().startswith("# quantpipe results")
    # scripts/ort_threads.py ran there too; make docs renders it under that machine.
    threads = json.loads((dest / "ort_threads.json").read_text())
    assert threads["machine"] == machine and "static" in threads["latency"]["bench"]
    # The files measured are the project's dvc.lock's, and the machine's section says so; the
    # quantize records came with them.
    files = json.loads((dest / "models.json").read_text())
    assert files == {n: h for n, h in locked_models(project).items() if n in files}
    assert {"fp32.onnx", "static.onnx"} <= set(files)
    assert json.loads((dest / "quantize_static.json").read_text()) == \
        json.loads((target / "records/quantize_static.json").read_text())
    section = render("machines", project)
    assert f"`metrics/machines/{dest.name}/`" in section and "The model files of `dvc.lock`." in section
    # Other files than dvc.lock's (a pipeline re-run on another CPU): the section says so.
    (dest / "models.json").write_text(json.dumps({**files, "static.onnx": "0" * 32}))
    try:
        assert "Other model files than `dvc.lock`'s" in render("machines", project)
    finally:
        (dest / "models.json").write_text(json.dumps(files))

def test_machine_names_are_path_segments():
    assert remote_bench.machine_name({"cpu": "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz",
                                      "cores": 16}) == "intel-xeon-platinum-8480-16c"
    assert remote_bench.machine_name({"cpu": "AMD EPYC 9654 96-Core Processor", "cores": 64}) == \
        "amd-epyc-9654-96-core-64c"


def test_run_never_replaces_a_directory_that_holds_no_earlier_bundle(tmp_path):
    target = tmp_path / "important"
    target.mkdir()
    (target / "data.txt").write_text("keep")
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path / "bundle.tar.gz"),
                           "--target", f"local:{target}"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"--target local:{target}: {target} exists and holds no earlier bundle; name a new directory")
    assert (target / "data.txt").read_text() == "keep"


def test_pack_stops_on_a_missing_model_file_and_writes_no_bundle(tmp_path):
    """A pipeline not reproduced in full (dynamic.onnx absent) is not packed into a bundle that
    would bench fewer variants there: one line naming the file, no bundle."""
    (tmp_path / "models").mkdir()
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    for variant in ("fp32", "static", "qat"):
        (tmp_path / f"models/{variant}.onnx").write_bytes(b"")
    bundle = tmp_path / "bundle.tar.gz"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--project", str(tmp_path), "pack",
                           str(bundle), "--runtimes", "onnxruntime"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"{tmp_path / 'models/dynamic.onnx'} is missing: run `make repro` (or `dvc pull`) first; "
        "the bundle carries every model file of the pipeline"]
    assert not bundle.exists() and not list(tmp_path.glob("bundle*"))


def _wheel(folder: Path, dist: str, version: str, module: str,
           extra: dict[str, str] | None = None) -> Path:
    """A pure-Python wheel of `dist` at `version` whose `module` says its version (and holds the
    `extra` files): made here, nothing downloaded."""
    import base64
    import hashlib
    import zipfile

    info = f"{dist}-{version}.dist-info"
    files = {f"{module}/__init__.py": f"__version__ = {version!r}\n", **(extra or {}),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(text.encode())}\n" for name, text in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def test_an_openvino_wheel_travels_with_its_cpu_plugin_and_onnx_frontend_only(tmp_path):
    """OpenVINO's wheel (59 MB) is over what the device machine takes a call beside the models:
    the bundle's copy leaves out the GPU/NPU plugins, the GPU's kernel cache and the frontends
    the bench never loads, and pip installs what is left (its RECORD lists no missing file)."""
    libs = {f"openvino/libs/{name}": name * 100 for name in (
        "libopenvino_intel_cpu_plugin.so", "libopenvino_onnx_frontend.so.2641", "libopenvino.so.2641",
        "libopenvino_intel_gpu_plugin.so", "libopenvino_intel_npu_plugin.so", "cache.json",
        "libopenvino_pytorch_frontend.so.2641", "libopenvino_tensorflow_lite_frontend.so.2641")}
    wheel = _wheel(tmp_path, "openvino", "2026.4.1", "openvino", libs)
    saved = remote_bench.cpu_only(wheel)
    kept = ["libopenvino.so.2641", "libopenvino_intel_cpu_plugin.so", "libopenvino_onnx_frontend.so.2641"]
    assert saved == sum(len(text) for name, text in libs.items() if name.rsplit("/", 1)[1] not in kept)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("openvino-2026.4.1.dist-info/RECORD").decode()
    assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("openvino/libs/")) == kept
    assert sorted(line.split(",")[0] for line in record.splitlines()) == sorted(names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                    "--no-index", "--no-deps", "--target", str(site), str(wheel)], check=True)
    assert sorted(p.name for p in (site / "openvino/libs").iterdir()) == kept
    assert (site / "openvino/libs/libopenvino_intel_cpu_plugin.so").read_text() == \
        libs["openvino/libs/libopenvino_intel_cpu_plugin.so"]


def test_a_wheel_that_cannot_be_read_is_left_as_it_was(tmp_path):
    """A damaged member stops the rewrite with zipfile's error; the wheel keeps its bytes and
    no half-written copy stays beside it."""
    wheel = _wheel(tmp_path, "openvino", "2026.4.1", "openvino",
                   {"openvino/libs/libopenvino.so.2641": "x" * 1000})
    data = bytearray(wheel.read_bytes())
    at = data.index(b"x" * 1000)  # stored uncompressed: flip a byte its CRC covers
    data[at] = ord("y")
    wheel.write_bytes(bytes(data))
    with pytest.raises(zipfile.BadZipFile):
        remote_bench.cpu_only(wheel)
    assert wheel.read_bytes() == bytes(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]


def test_carried_wheels_shadow_the_targets_versions_and_keep_its_other_packages(tmp_path):
    """On the target a carried package of another version than the target's is installed where
    the stages import it first, and everything else the target's Python has stays importable:
    the device machine's python3 is itself a virtualenv (a virtualenv made from it sees the
    base interpreter's packages, not its numpy, onnx and torch). A carried dependency the target
    lacks (--with-deps) is installed too; one it has is not."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "tqdm", "0.0.1", "tqdm")  # this Python has another tqdm
    _wheel(wheels, "qp_probe_dep", "1.0", "qp_probe_dep")  # a dependency it lacks
    (wheels / "requirements.txt").write_text("tqdm==0.0.1\n")
    (tmp_path / "bundle.json").write_text('{"runtimes": ["onnxruntime"]}')
    path = remote_bench.environment(tmp_path, sys.executable)
    assert path[:2] == [str(tmp_path / "site"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    code = ("import importlib.metadata as m, tqdm, qp_probe_dep, numpy, onnx, onnxruntime, torch\n"
            "print(tqdm.__version__, m.version('tqdm'), qp_probe_dep.__version__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.split() == ["0.0.1", "0.0.1", "1.0"]
    # A bundle whose pins this Python already has installs nothing and adds no folder.
    (wheels / "requirements.txt").write_text(f"numpy=={importlib.metadata.version('numpy')}\n")
    for wheel in wheels.glob("*.whl"):
        wheel.unlink()
    assert remote_bench.environment(tmp_path, sys.executable)[0] == str(tmp_path)


def test_a_wheel_of_your_own_travels_as_it_is_and_the_target_checks_its_runtimes(collected, tmp_path):
    """pack --wheel carries a wheel file unchanged, pinned to its version; the target refuses
    to start, in one line, when a runtime of bench.runtimes cannot be imported there."""
    project = collected[0]
    wheel = _wheel(tmp_path, "tqdm", "0.0.1", "tqdm")
    bundle = tmp_path / "own.tar.gz"
    _script("--project", str(project), "pack", str(bundle), "--runtimes", "onnxruntime",
            "openvino", "--wheel", str(wheel), cwd=tmp_path)
    there = tmp_path / "there"
    with tarfile.open(bundle) as tar:
        assert tar.extractfile(f"wheels/{wheel.name}").read() == wheel.read_bytes()
        # Python 3.11.0-3.11.3 have no extraction filters (Debian's 3.11.2 among them).
        tar.extractall(there, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert (there / "wheels/requirements.txt").read_text() == "tqdm==0.0.1\n"
    carried = json.loads((there / "bundle.json").read_text())
    assert (carried["runtimes"], carried["task"]) == (["onnxruntime", "openvino"], "classification")
    path = remote_bench.environment(there, sys.executable)  # this Python has openvino
    assert path[:2] == [str(there / "site"), str(there)]
    # The target's own PYTHONPATH is kept (after the bundle's): here it hides openvino, as on a
    # Python without it.
    hide = _hide(tmp_path / "hide", "openvino")
    proc = subprocess.run([sys.executable, str(SCRIPT), "target", "--out", str(tmp_path / "out")],
                          cwd=there, env={**os.environ, "PYTHONPATH": str(hide)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "lacks openvino: pack the bundle with --packages openvino (--with-deps for a Python that "
        "has nothing)")
    # A classifier needs no PyTorch there (the collected fixture's target had none); a
    # segmenter's mIoU (torchmetrics) does.
    _hide(hide, "torch")
    (there / "bundle.json").write_text(json.dumps({**carried, "runtimes": ["onnxruntime"],
                                                   "task": "segmentation"}))
    proc = subprocess.run([sys.executable, str(SCRIPT), "target", "--out", str(tmp_path / "out")],
                          cwd=there, env={**os.environ, "PYTHONPATH": str(hide)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    assert "lacks torch, torchmetrics: pack the bundle with --packages torch torchmetrics" in \
        proc.stderr.strip().splitlines()[-1]


def test_bench_params_set_for_the_target_are_checked_as_params_yaml_is(collected, tmp_path):
    """pack --set bench.KEY=VALUE changes the target's bench only, validated like params.yaml;
    a bad one is one line and no bundle."""
    project = collected[0]
    bundle = tmp_path / "set.tar.gz"
    _script("--project", str(project), "pack", str(bundle), "--runtimes", "onnxruntime",
            "--set", "bench.seconds=20", "--set", "bench.runs=150", cwd=tmp_path)
    with tarfile.open(bundle) as tar:
        bench = yaml.safe_load(tar.extractfile("params.yaml"))["bench"]
    assert (bench["seconds"], bench["runs"], bench["runtimes"]) == (20, 150, ["onnxruntime"])
    for setting, says in [("bench.runs=0", "--set: bench.runs = 0 is not allowed"),
                          ("bench.max_second=2", "unknown key bench.max_second"),
                          ("train.epochs=1", "--set train.epochs=1: expected bench.KEY=VALUE")]:
        proc = subprocess.run([sys.executable, str(SCRIPT), "--project", str(project), "pack",
                               str(tmp_path / "bad.tar.gz"), "--set", setting], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert says in proc.stderr and not list(tmp_path.glob("bad*"))
