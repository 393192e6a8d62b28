"""Measure on another machine: pack what `stages.bench` needs, run it there, bring the JSON back.

CI's machine has 2 cores; people deploy on 8 to 64. This runs quantpipe's own bench stage, on
the pipeline's own model files and test split, on a bigger machine, and keeps its figures beside
this machine's, named by the machine.json it records there:

    python scripts/remote_bench.py pack build/bench-bundle.tar.gz --python-version 3.12
    python scripts/remote_bench.py run build/bench-bundle.tar.gz --target ssh:HOST:/tmp/qp-bench
    python scripts/remote_bench.py run build/bench-bundle.tar.gz --target local:/tmp/qp-bench
    make docs                                     # docs/results.md: a table per machine

`pack` takes the code (quantpipe/, stages/), params.yaml (bench.runtimes narrowed to what the
target will have, and any --set bench.KEY=VALUE), models/*.onnx, the test split (data/prepared)
and wheels of this environment's versions of the packages the bench imports (--packages; pip
download for the target's Python, --with-deps for a bare one; --wheel carries a wheel file as it
is, a build of your own; openvino's, either way, without its GPU/NPU plugins and non-ONNX
frontends: 31 MB of its 59). There, a pinned package the target lacks or has in another version is
installed from them into the bundle's site/, put first on the stages' PYTHONPATH so they see the
target's own packages too (its torch, onnx, numpy), and both machines run the same ONNX Runtime.
`run` unpacks the bundle on the target, runs `remote_bench.py target` there (stages.machine, then
stages.evaluate and stages.bench for every variant, and scripts/ort_threads.py) and collects what
it wrote; `collect` does the last step for results brought back by other means (a machine
reached through a batch system: unpack the bundle there, run
`python3 remote_bench.py target --out results`, `tar czf results.tar.gz results`).

Collected into metrics/machines/<cpu>-<cores>c/: machine.json, eval/ and bench/<variant>.json
(stages.evaluate and stages.bench there: INT8 accuracy is checked where it runs, as on any new
machine), models.json (the md5 of each model file measured: `make docs` says whether they are
the files of this project's dvc.lock; a pipeline re-run on another CPU trains other files) with
the quantize stages' records of those files, and that machine's report by stages.report here
(summary.json, report.md, plots/; PyTorch eager is not benched there).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINES = Path("metrics/machines")
VARIANTS = ("fp32", "dynamic", "static", "qat", "bf16")
# What the target's stages import: import name -> distribution (pip) name; and openvino, when
# bench.runtimes names it. A classifier's or a detector's evaluate and bench need no PyTorch
# (the detectors' NMS is ONNX Runtime's), so a deployment server without it can be measured; a
# segmenter's mIoU is torchmetrics', which imports torch.
NEEDS = {"numpy": "numpy", "onnx": "onnx", "onnxruntime": "onnxruntime", "yaml": "pyyaml",
         "tqdm": "tqdm"}
TASK_NEEDS = {"segmentation": {"torch": "torch", "torchmetrics": "torchmetrics"}}
# OpenVINO's wheel holds every device plugin and model frontend (59 MB for Python 3.12, more
# than some transfers take: the device machine's 64 MiB a call, with the models beside it); the
# bench compiles ONNX files for the CPU, so the bundle's copy leaves out the GPU and NPU
# plugins, the GPU's kernel cache and the other frontends (31 MB).
OPENVINO_UNUSED = re.compile(r"openvino/libs/(libopenvino_intel_(gpu|npu)_plugin\.so|cache\.json|"
                             r"libopenvino_(tensorflow|tensorflow_lite|pytorch|paddle|gguf|jax)"
                             r"_frontend\.so[.0-9]*)")


# --- here: pack -------------------------------------------------------------------------------

def pack(project: Path, out: Path, runtimes: list[str], packages: list[str],
         python_version: str | None, with_deps: bool, wheels: list[Path] = (),
         settings: list[str] = ()) -> Path:
    """The bundle: a .tar.gz whose root holds remote_bench.py, quantpipe/, stages/,
    params.yaml, models/, data/prepared/ (the test split) and wheels/ (with requirements.txt,
    the pins the target must match)."""
    import yaml

    from quantpipe.io import atomic_path

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["bench"]["runtimes"] = runtimes
    params["bench"].update(bench_settings(params, settings))
    models = [project / f"models/{v}.onnx" for v in VARIANTS if v != "bf16"]
    # Every variant's file, or the target would bench fewer rows than the pipeline has without a
    # word (an empty qat.onnx is its stage's "skipped" and stays skipped there).
    for m in models:
        if not m.exists():
            raise SystemExit(f"{m} is missing: run `make repro` (or `dvc pull`) first; the bundle "
                             "carries every model file of the pipeline")
    with tempfile.TemporaryDirectory() as tmp:
        wheel_dir = Path(tmp) / "wheels"
        wheel_dir.mkdir()
        pins = [f"{dist}=={importlib.metadata.version(dist)}" for dist in packages]
        for wheel in wheels:  # carried as they are (a build of your own), pinned to their version
            if not wheel.is_file() or wheel.suffix != ".whl":
                raise SystemExit(f"--wheel {wheel}: not a wheel file")
            shutil.copy(wheel, wheel_dir / wheel.name)
        pins += ["==".join(_wheel_name(w)) for w in wheels]
        (wheel_dir / "requirements.txt").write_text("".join(f"{pin}\n" for pin in pins))
        if packages:
            if not python_version:
                raise SystemExit("--packages needs --python-version: the target's Python, which "
                                 "the wheels are downloaded for")
            download(wheel_dir, pins[:len(packages)], python_version, with_deps)
        slimmed = {}  # wheel: its size before and after
        for wheel in wheel_dir.glob("openvino-*.whl"):
            before = wheel.stat().st_size
            cpu_only(wheel)
            slimmed[wheel.name] = before, wheel.stat().st_size
        with atomic_path(out) as partial, tarfile.open(partial, "w:gz") as tar:
            tar.add(__file__, "remote_bench.py")
            for package in ("quantpipe", "stages"):
                tar.add(project / package, package, filter=_source_only)
            # bundle.json: what the target checks before it starts, read without yaml, and the
            # md5 of each model file (DVC's hash of a file), which the results carry back.
            carried = {m.name: _md5(m) for m in models if m.stat().st_size}
            for name, text in (("params.yaml", yaml.safe_dump(params, sort_keys=False)),
                               ("bundle.json", json.dumps({
                                   "runtimes": runtimes, "task": (params.get("prepare") or {}).get("task"),
                                   "models": carried}) + "\n")):
                info = tarfile.TarInfo(name)
                info.size = len(text.encode())
                tar.addfile(info, io.BytesIO(text.encode()))
            for m in models:
                if m.exists() and m.stat().st_size:  # qat.onnx is empty when its stage skipped
                    tar.add(m, f"models/{m.name}")
            for name in ("quantize_static.json", "quantize_qat.json"):  # what made those files
                tar.add(project / "metrics" / name, f"records/{name}")
            tar.add(project / "data/prepared", "data/prepared")
            # ONNX Runtime's INT8 against FP32 per thread count, file layout and session options.
            tar.add(Path(__file__).with_name("ort_threads.py"), "scripts/ort_threads.py")
            tar.add(wheel_dir, "wheels")
        carried = sorted(_wheel_name(w)[0] for w in wheel_dir.glob("*.whl"))
    print(f"packed {out} ({out.stat().st_size / 2**20:.1f} MiB; bench.runtimes {runtimes}; "
          f"wheels: {', '.join(carried) or 'none'})")
    for name, (before, after) in slimmed.items():
        print(f"  {name}: CPU plugin and ONNX frontend only ({before / 2**20:.1f} -> "
              f"{after / 2**20:.1f} MiB)")
    return out


def cpu_only(wheel: Path) -> int:
    """Rewrite an openvino wheel in place without the members OPENVINO_UNUSED matches, nor
    their lines of its RECORD (pip installs what RECORD lists); the bytes left out, unpacked."""
    import zipfile

    from quantpipe.io import atomic_path

    saved = 0
    with atomic_path(wheel) as partial, zipfile.ZipFile(wheel) as src, \
            zipfile.ZipFile(partial, "w") as dst:
        for info in src.infolist():
            if OPENVINO_UNUSED.fullmatch(info.filename):
                saved += info.file_size
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not OPENVINO_UNUSED.fullmatch(line.split(b",")[0].decode()))
            dst.writestr(info, data)  # its ZipInfo: the same compression and file modes
    return saved


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def bench_settings(params: dict, settings: list[str]) -> dict:
    """--set bench.KEY=VALUE (VALUE as YAML) for the target's bench only, checked as params.yaml
    is (a bigger machine measures more thread counts and stream configurations: fewer runs
    or a shorter bench.seconds bound its time)."""
    import yaml

    from quantpipe.errors import UserError
    from quantpipe.params import section
    from quantpipe.schemas.bench import BenchParams

    changed = {}
    for setting in settings:
        key, eq, value = setting.partition("=")
        name = key.removeprefix("bench.")
        if not eq or not key.startswith("bench.") or not name or name == "runtimes":
            raise SystemExit(f"--set {setting}: expected bench.KEY=VALUE, a bench param other "
                             "than runtimes (--runtimes names those)")
        changed[name] = yaml.safe_load(value)
    try:
        section(BenchParams, {"bench": {**params["bench"], **changed}}, "--set")
    except UserError as e:
        raise SystemExit(str(e)) from None
    return changed


def _source_only(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if "__pycache__" in info.name or info.name.endswith(".pyc") else info


def download(into: Path, pins: list[str], python_version: str, with_deps: bool) -> None:
    """Wheels of `pins` for the target's Python on x86-64 Linux; their dependencies too when
    with_deps (a bare Python), else the target must have them (it has torch: numpy, protobuf)."""
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
           "--only-binary=:all:", *([] if with_deps else ["--no-deps"]),
           "--python-version", python_version, "--implementation", "cp", "-d", str(into),
           *[a for tag in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
             for a in ("--platform", tag)], *pins]
    subprocess.run(cmd, check=True)


# --- there: the target's side -----------------------------------------------------------------

def target(out: Path, python: str) -> None:
    """Run in the unpacked bundle on the machine to measure: the packages it lacks from
    wheels/, then stages.machine, stages.evaluate and stages.bench of every variant and
    scripts/ort_threads.py, into `out`."""
    here = Path.cwd()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(environment(here, python))}
    out.mkdir(parents=True, exist_ok=True)
    # Which files these figures are of (`make docs` compares them with dvc.lock's), and what
    # their quantize stages recorded.
    models = json.loads((here / "bundle.json").read_text()).get("models", {})
    (out / "models.json").write_text(json.dumps(models, indent=2) + "\n")
    for record in (here / "records").glob("*.json"):
        shutil.copy(record, out / record.name)
    machine = out / "machine.json"
    subprocess.run([python, "-m", "stages.machine", "--out", str(machine),
                    "--int8", str(out / "int8.json")], check=True, env=env)
    # Accuracy too: INT8 kernels differ by instruction set, so it is checked where it runs.
    for stage in ("evaluate", "bench"):
        for variant in VARIANTS:
            model = here / f"models/{'fp32' if variant == 'bf16' else variant}.onnx"
            if not model.exists():
                model.parent.mkdir(exist_ok=True)
                model.touch()  # qat skipped on this pipeline: an empty file, as its stage leaves
            extra = (["--confusion", str(out / f"plots/confusion_{variant}.json"),
                      "--predictions", str(out / f"predictions/{variant}.json")]
                     if stage == "evaluate" else [])
            subprocess.run([python, "-m", f"stages.{stage}", variant, "--model", str(model),
                            "--fp32", str(here / "models/fp32.onnx"),
                            "--data", str(here / "data/prepared"), "--machine", str(machine),
                            "--metrics", str(out / f"{'eval' if stage == 'evaluate' else stage}/{variant}.json"),
                            *extra], check=True, env=env)
    subprocess.run([python, "scripts/ort_threads.py", "--project", str(here),
                    "-o", str(out / "ort_threads.json")], check=True, env=env)


def environment(here: Path, python: str) -> list[str]:
    """PYTHONPATH for the bundle's code on `python`: the bundle itself, after site/ where the
    wheels of every carried package it lacks or has in another version are installed (and of
    any dependency packed with --with-deps that it lacks), before the PYTHONPATH the target
    already had. A folder first on the path rather than a virtualenv: one made from a
    virtualenv's Python (the device machine's python3 is one, holding torch, numpy and onnx)
    sees the base interpreter's packages, not that virtualenv's."""
    site = here / "site"
    pins = {_normal(dist): version for dist, version in
            (pin.split("==") for pin in (here / "wheels/requirements.txt").read_text().split())}
    wheels = {_wheel_name(w)[0]: w for w in (here / "wheels").glob("*.whl")}
    wanted = [w for dist, w in wheels.items()
              if dist in pins and _installed(python, dist) != pins[dist]
              or dist not in pins and _installed(python, dist) is None]
    path = [*([str(site)] if wanted else []), str(here),
            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if wanted:
        shutil.rmtree(site, ignore_errors=True)
        subprocess.run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                        "--no-index", "--no-deps", "--target", str(site), *map(str, wanted)],
                       check=True)
        print(f"installed from the bundle's wheels: {', '.join(w.name for w in wanted)}",
              flush=True)
    imported = {dist: _installed(python, dist, env) for dist in pins}
    shadowed = [f"{dist} {imported[dist]} (carried {version})"
                for dist, version in pins.items() if imported[dist] != version]
    if shadowed:
        raise SystemExit(f"this Python ({python}) still imports {', '.join(shadowed)}: "
                         "check its site-packages and PYTHONPATH")
    bundle = json.loads((here / "bundle.json").read_text())
    needs = {**NEEDS, **TASK_NEEDS.get(bundle.get("task"), {}),
             **({"openvino": "openvino"} if "openvino" in bundle["runtimes"] else {})}
    missing = [m for m in needs if not _importable(python, m, env)]
    if missing:
        raise SystemExit(f"this Python ({python}) lacks {', '.join(missing)}: pack the bundle "
                         f"with --packages {' '.join(needs[m] for m in missing)} (--with-deps "
                         "for a Python that has nothing)")
    return path


def _wheel_name(wheel: Path) -> tuple[str, str]:
    """(distribution, version) of a wheel file, from its name (name-version[-build]-tags.whl)."""
    dist, version = wheel.name.split("-")[:2]
    return _normal(dist), version


def _normal(dist: str) -> str:
    """A distribution's name as pip compares them (PyYAML, pyyaml; typing_extensions, -)."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def _installed(python: str, dist: str, env: dict | None = None) -> str | None:
    """The version of distribution `dist` that `python` imports (under env), or None."""
    code = (f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\n"
            "except m.PackageNotFoundError: pass")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                         env=env).stdout.strip()
    return out or None


def _importable(python: str, module: str, env: dict) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                          env=env).returncode == 0


# --- here: run there, collect -----------------------------------------------------------------

def run(project: Path, bundle: Path, where: str, python: str) -> Path:
    """Unpack `bundle` on the target, run its bench there and collect the results.
    where: local:DIR (this machine, in another directory: the same commands without ssh) or
    ssh:HOST:DIR."""
    kind, _, rest = where.partition(":")
    if kind == "local":
        host, directory = None, rest
    elif kind == "ssh" and ":" in rest:
        host, directory = rest.split(":", 1)
    else:
        raise SystemExit(f"--target {where!r}: expected local:DIR or ssh:HOST:DIR")
    d = shlex.quote(directory)

    def there(command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        argv = ["sh", "-c", command] if host is None else ["ssh", host, command]
        return subprocess.run(argv, check=check, **kwargs)

    # The directory is replaced: only a new one or an earlier bundle's, never anything else.
    if there(f"test ! -e {d} || test -f {d}/remote_bench.py", check=False).returncode != 0:
        raise SystemExit(f"--target {where}: {directory} exists and holds no earlier bundle; "
                         "name a new directory")
    with bundle.open("rb") as f:
        there(f"rm -rf {d} && mkdir -p {d} && tar -xzf - -C {d}", stdin=f)
    there(f"cd {d} && {shlex.quote(python)} remote_bench.py target --out results")
    results = there(f"cd {d} && tar -czf - results", stdout=subprocess.PIPE).stdout
    with tempfile.NamedTemporaryFile(suffix=".tar.gz") as tmp:
        tmp.write(results)
        tmp.flush()
        return collect(project, Path(tmp.name))


def machine_name(machine: dict) -> str:
    """metrics/machines/<this>: the CPU model and core count, as a path segment."""
    cpu = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|@.*", "", machine.get("cpu", "cpu"), flags=re.I)
    slug = re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-") or "cpu"
    return f"{slug}-{machine['cores']}c"


def collect(project: Path, results: Path) -> Path:
    """Results of `target` (a .tar.gz holding results/) into project's
    metrics/machines/<name>/, with that machine's report (this machine's accuracy, its benches)."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(results) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:  # Python 3.11.0-3.11.3 have no extraction filters: the check by hand
                for member in tar.getmembers():
                    if not (member.isfile() or member.isdir()) or member.name.startswith("/") \
                            or ".." in Path(member.name).parts:
                        raise SystemExit(f"{results}: {member.name} is not a plain file or "
                                         "folder inside the archive; not extracting it")
                tar.extractall(tmp)
        got = Path(tmp) / "results"
        machine = json.loads((got / "machine.json").read_text())
        dest = project / MACHINES / machine_name(machine)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        shutil.copy(got / "machine.json", dest / "machine.json")
        for folder in ("eval", "bench"):
            shutil.copytree(got / folder, dest / folder)
        if (got / "ort_threads.json").exists():
            shutil.copy(got / "ort_threads.json", dest / "ort_threads.json")
        # Which files were measured (and what their quantize stages recorded: a static model
        # out of its criterion is never recommended), from the bundle; older results lack them.
        for name in ("models.json", "quantize_static.json", "quantize_qat.json"):
            if (got / name).exists():
                shutil.copy(got / name, dest / name)
    for name in ("quantize_static.json", "quantize_qat.json"):  # an older bundle's: this project's
        if not (dest / name).exists():
            shutil.copy(project / "metrics" / name, dest / name)
    (dest / "bench/torch.json").write_text(json.dumps(
        {"variant": "torch", "skipped": "PyTorch eager is benched on the pipeline's own machine only"},
        indent=2) + "\n")
    # That machine's summary and report, by the report stage itself (gates are this project's:
    # a gate that fails there is printed, the report is written first).
    proc = subprocess.run([sys.executable, "-m", "stages.report", "--metrics", str(dest)],
                          cwd=project, capture_output=True, text=True)
    if not (dest / "summary.json").exists():
        raise SystemExit(f"stages.report failed on {dest}: {proc.stderr.strip().splitlines()[-1:]}")
    for line in proc.stderr.splitlines():
        if line.startswith("gate:"):
            print(f"{dest.name}: {line}")
    print(f"collected {dest.relative_to(project)} ({json.loads((dest / 'summary.json').read_text())['machine']['cpu']}); "
          "`make docs` renders its tables")
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, default=ROOT,
                        help="the pipeline whose models, data and metrics/ it uses (default: this one)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="the bundle for another machine")
    p.add_argument("out", type=Path)
    p.add_argument("--runtimes", nargs="+", default=["onnxruntime", "openvino"],
                   help="bench.runtimes there (openvino's wheel, CPU-only in the bundle, is 31 MB)")
    p.add_argument("--packages", nargs="*", default=[],
                   help="distributions to carry as wheels of this environment's versions "
                        "(e.g. onnxruntime pyyaml tqdm openvino)")
    p.add_argument("--wheel", type=Path, action="append", default=[], dest="wheels",
                   help="a wheel file to carry as it is (a build of your own, for the target's "
                        "Python and platform; openvino's CPU-only); repeatable")
    p.add_argument("--set", action="append", default=[], dest="settings", metavar="bench.KEY=VALUE",
                   help="a bench param for the target (VALUE as YAML, e.g. bench.seconds=20); "
                        "repeatable")
    p.add_argument("--python-version", help="the target's Python (3.12): the wheels are for it")
    p.add_argument("--with-deps", action="store_true", help="their dependencies too (a bare Python)")
    r = sub.add_parser("run", help="unpack the bundle on a target, bench there, collect")
    r.add_argument("bundle", type=Path)
    r.add_argument("--target", required=True, help="local:DIR or ssh:HOST:DIR")
    r.add_argument("--python", default="python3", help="the target's Python")
    t = sub.add_parser("target", help="(on the target, in the unpacked bundle) bench this machine")
    t.add_argument("--out", type=Path, default=Path("results"))
    c = sub.add_parser("collect", help="results.tar.gz from a target into metrics/machines/")
    c.add_argument("results", type=Path)
    args = parser.parse_args()
    project = args.project.resolve()
    if args.command == "pack":
        pack(project, args.out, args.runtimes, args.packages, args.python_version, args.with_deps,
             args.wheels, args.settings)
    elif args.command == "run":
        run(project, args.bundle, args.target, args.python)
    elif args.command == "target":
        target(args.out, sys.executable)
    else:
        collect(project, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
