"""`quantpipe init` / `quantpipe upgrade` (quantpipe/cli.py): the pipeline of this repository
written into a repository of your own, and renewed after an upgrade keeping your params."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import setuptools
import yaml

from quantpipe import cli

ROOT = Path(__file__).resolve().parents[1]


def test_the_template_is_this_repositorys_own_pipeline():
    assert cli.template("dvc.yaml") == (ROOT / "dvc.yaml").read_text()
    assert cli.template("params.yaml") == (ROOT / "params.yaml").read_text()


def test_the_repository_has_one_pipeline():
    """DVC takes every file named dvc.yaml for a pipeline: the packaged template is not one."""
    tracked = subprocess.run(["git", "ls-files", "*dvc.yaml", "dvc.yaml"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked == ["dvc.yaml"]


def test_the_wheel_lists_every_package_and_maps_the_stages():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = set(setuptools.find_packages(where=str(ROOT), include=["quantpipe*"]))
    assert set(setup["packages"]) == on_disk | {"quantpipe.stages"}
    assert setup["package-dir"] == {"quantpipe.stages": "stages"}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"quantpipe": "quantpipe.cli:main"}


def test_the_rendered_pipeline_runs_from_the_package_and_depends_on_the_version():
    rendered = cli.render_dvc_yaml(cli.template("dvc.yaml"))
    mine, theirs = (yaml.safe_load(t)["stages"] for t in ((ROOT / "dvc.yaml").read_text(), rendered))
    assert list(mine) == list(theirs)
    for name, stage in theirs.items():
        body, own = stage.get("do", stage), mine[name].get("do", mine[name])
        assert body["cmd"] == own["cmd"].replace("python -m stages.", "python -m quantpipe.stages.")
        deps = body.get("deps", [])
        # The same data and model inputs, no source file (they are site-packages' there).
        assert deps == [d for d in own["deps"] if not re.match(r"(stages|quantpipe)/.*\.py$", d)]
        if "params" in own:
            assert body["params"] == [{".quantpipe/state.yaml": ["version"]}, *own["params"]]
        assert {k: v for k, v in body.items() if k not in ("cmd", "deps", "params")} == \
            {k: v for k, v in own.items() if k not in ("cmd", "deps", "params")}
    assert "deps" not in theirs["machine"]  # its only deps were code
    assert rendered.startswith("# The quantpipe pipeline, written by `quantpipe init`")


def _repository(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=path, check=True,
                   env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    return path


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_init_writes_the_pipeline_beside_the_users_files_and_dvc_reads_it(tmp_path, monkeypatch, capsys):
    repo = _repository(tmp_path / "repo")
    (repo / "notes.txt").write_text("mine\n")
    (repo / ".gitignore").write_text("/secrets")  # no trailing newline
    monkeypatch.chdir(repo)
    code, out, err = _run(["init"], capsys)
    assert code == 0, err
    assert out.startswith(f"quantpipe {cli.version()}: wrote dvc.yaml, params.yaml, "
                          ".quantpipe/state.yaml, inputs/README.md, .gitignore")
    assert (repo / "notes.txt").read_text() == "mine\n"
    assert (repo / ".gitignore").read_text() == "/secrets\n" + cli.GITIGNORE_BLOCK
    assert (repo / "dvc.yaml").read_text() == cli.render_dvc_yaml(cli.template("dvc.yaml"))
    assert (repo / "params.yaml").read_text() == (ROOT / "params.yaml").read_text()
    state = yaml.safe_load((repo / ".quantpipe/state.yaml").read_text())
    assert state == {"version": cli.version(), "defaults": yaml.safe_load(cli.template("params.yaml"))}
    # DVC reads the pipeline: every stage, each foreach variant.
    listed = subprocess.run([sys.executable, "-m", "dvc", "stage", "list"], cwd=repo,
                            capture_output=True, text=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    assert {"machine", "prepare", "train", "quantize_static", "evaluate@static", "bench@qat",
            "report"} <= names
    # Never over a file it did not write: a second init stops in one line.
    code, out, err = _run(["init"], capsys)
    assert code == 2 and err.startswith("error: dvc.yaml: exists;") and err.count("\n") == 1


def test_init_outside_a_git_and_dvc_repository_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(["init"], capsys)
    assert code == 2 and "run `git init` and `dvc init` there first" in err
    assert list(tmp_path.iterdir()) == []


def test_upgrade_keeps_the_users_params_and_names_every_changed_default(tmp_path, monkeypatch, capsys):
    repo = _repository(tmp_path / "repo")
    monkeypatch.chdir(repo)
    assert _run(["init"], capsys)[0] == 0
    # The repository as an older quantpipe left it: its version and defaults, a user's value, a
    # key under its old name, a key that version had and this one does not, one it lacked.
    state = yaml.safe_load((repo / ".quantpipe/state.yaml").read_text())
    state["version"] = "0.0.9"
    state["defaults"]["bench"]["runs"] = 7
    state["defaults"]["prepare"]["calib_size"] = 999
    state["defaults"]["quantize_static"]["max_drop_pts"] = 0.5  # a number before it was null
    (repo / ".quantpipe/state.yaml").write_text(yaml.safe_dump(state, sort_keys=False))
    mine = yaml.safe_load((repo / "params.yaml").read_text())
    mine["prepare"]["calib_size"] = 123
    del mine["quantize_static"]["max_drop_pts"]  # null: the task's
    mine["quantize_static"]["max_accuracy_drop_pp"] = 0.75
    mine["bench"]["retired_knob"] = 3
    mine["quantize_static"]["extra_options"] = {"CalibPercentile": 99.9}  # a free-form mapping
    del mine["gates"]["max_miou_drop_pts"]
    (repo / "params.yaml").write_text(yaml.safe_dump(mine, sort_keys=False))
    (repo / "dvc.yaml").write_text("stages: {}\n")  # what an older version wrote

    code, out, err = _run(["upgrade"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == (f"quantpipe 0.0.9 -> {cli.version()}: rewrote dvc.yaml, "
                        ".quantpipe/state.yaml; params.yaml keeps your values")
    defaults = yaml.safe_load(cli.template("params.yaml"))
    assert "  quantize_static.max_accuracy_drop_pp is now quantize_static.max_drop_pts (your value kept)" in lines
    assert f"  new key gates.max_miou_drop_pts: {defaults['gates']['max_miou_drop_pts']!r}" in lines
    assert "  bench.retired_knob is no longer read (removed; it was 3)" in lines
    assert f"  default of bench.runs: 7 -> {defaults['bench']['runs']!r}" in lines
    assert f"  default of prepare.calib_size: 999 -> {defaults['prepare']['calib_size']!r}" in lines
    # A null default reads as YAML spells it (the task's value: quantize_static.max_drop_pts).
    assert "  default of quantize_static.max_drop_pts: 0.5 -> null" in lines
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["prepare"]["calib_size"] == 123  # the user's value, not the new default
    assert params["quantize_static"]["max_drop_pts"] == 0.75
    assert params["gates"]["max_miou_drop_pts"] == defaults["gates"]["max_miou_drop_pts"]
    assert "retired_knob" not in params["bench"]
    assert params["quantize_static"]["extra_options"] == {"CalibPercentile": 99.9}
    assert not any("extra_options" in line for line in lines)
    assert list(params) == list(defaults)  # the new version's order
    assert (repo / "dvc.yaml").read_text() == cli.render_dvc_yaml(cli.template("dvc.yaml"))
    assert yaml.safe_load((repo / ".quantpipe/state.yaml").read_text()) == {
        "version": cli.version(), "defaults": defaults}
    # The params quantpipe reads are valid as written.
    from quantpipe.schemas.all import parse_params
    parse_params(params)


def test_upgrade_of_a_repository_init_did_not_write_stops_in_one_line(tmp_path, monkeypatch, capsys):
    repo = _repository(tmp_path / "repo")
    (repo / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(repo)
    code, out, err = _run(["upgrade"], capsys)
    assert code == 2 and err.startswith("error: .quantpipe/state.yaml: not found;")
    assert (repo / "dvc.yaml").read_text() == "stages: {}\n"


@pytest.mark.slow  # a wheel, a virtualenv and a short pipeline: ~4 min on 2 cores
def test_the_wheel_installed_elsewhere_runs_the_pipeline_in_a_new_repository(tmp_path):
    """As a user would: a wheel of this repository installed into a fresh virtualenv (its
    dependencies from this environment), `quantpipe init` in an empty git + DVC repository,
    `dvc repro` there with a shorter training; `quantpipe upgrade` of the same version then
    changes nothing DVC would re-run."""
    from conftest import set_params

    # Not this checkout on the path (conftest puts it on PYTHONPATH): pip would take its
    # quantpipe.egg-info for the wheel, already installed.
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
           "DVC_NO_ANALYTICS": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(ROOT), "-w", str(tmp_path / "dist")], check=True, env=env)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next(venv.glob("lib/python3.*/site-packages"))
    import site as this_site
    (site / "base.pth").write_text(this_site.getsitepackages()[0] + "\n")
    wheel = next((tmp_path / "dist").glob("quantpipe-*.whl"))
    pip = subprocess.run([str(venv / "bin/pip"), "install", "--no-deps", str(wheel)], env=env,
                         capture_output=True, text=True, cwd=tmp_path)
    assert (venv / "bin/quantpipe").exists(), pip.stdout[-2000:] + pip.stderr[-2000:]
    env = {**env, "PATH": f"{venv}/bin:{os.path.dirname(sys.executable)}:{env['PATH']}",
           "VIRTUAL_ENV": str(venv)}
    repo = _repository(tmp_path / "repo")
    init = subprocess.run(["quantpipe", "init"], cwd=repo, env=env, capture_output=True, text=True)
    assert init.returncode == 0, init.stderr
    # The package the stages run from is the wheel's, not this checkout.
    where = subprocess.run(["python", "-c", "import quantpipe.stages.train as t; print(t.__file__)"],
                           cwd=repo, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    set_params(repo, {"train": {"epochs": 2},
                      "bench": {"runtimes": ["onnxruntime"], "batch_sizes": [1, 8], "threads": ["all"],
                                "warmup": 2, "runs": 10, "rounds": 2, "seconds": 5.0},
                      "quantize_qat": {"epochs": 1}, "gates": {"enforce": False}})
    repro = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=1500)
    assert repro.returncode == 0, repro.stderr[-3000:]
    summary = yaml.safe_load((repo / "metrics/summary.json").read_text())
    assert summary["fp32"]["accuracy"] > 0.9 and summary["static"]["speedup"]
    upgrade = subprocess.run(["quantpipe", "upgrade"], cwd=repo, env=env, capture_output=True,
                             text=True)
    assert upgrade.returncode == 0, upgrade.stderr
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=repo, env=env,
                            capture_output=True, text=True, check=True)
    assert set(yaml.safe_load(status.stdout)) <= {"machine"}, status.stdout
