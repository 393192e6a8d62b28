"""Model artifacts in remote storage, the way a team shares them: push a pipeline run, clone and
pull it elsewhere (nothing re-runs), and restore a wiped cache from the remote.

Real components only: an S3 bucket served by a local moto server (the S3 API as MinIO or AWS
speak it, through dvc-s3 and an `endpointurl`), and a plain local-directory remote. Both go
through one helper, `round_trip`; everything listens on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PROBE, ROOT, dvc, git, reproduce

MODEL_FILES = ("model.pt", "exported.onnx", "fp32.onnx", "dynamic.onnx", "static.onnx", "qat.onnx")
REVIEW = ROOT / "scripts" / "review.sh"
# Secrets a developer keeps in .dvc/config.local; moto accepts any credentials, but without
# some boto refuses to sign requests ("Unable to locate credentials").
LOCAL_KEY_ID, LOCAL_SECRET = "AKIAQUANTPIPELOCAL", "local-secret-not-for-git"
AWS_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")






def model_hashes(repo: Path) -> dict[str, str]:
    models = repo / "models"
    found = {p.name for p in models.iterdir() if p.name != ".gitignore"}
    assert found == set(MODEL_FILES), f"models/ holds {sorted(found)}"
    return {name: hashlib.md5((models / name).read_bytes()).hexdigest() for name in MODEL_FILES}


@pytest.fixture(scope="module")
def pipeline_run(tiny_run) -> Path:
    """The session's tiny pipeline run; each test works on its own copy (round_trip)."""
    run, ran = tiny_run
    assert {"train", "quantize_static", "report"} <= ran
    return run


def round_trip(tmp_path: Path, run: Path, *, name: str, url: str,
               shared: dict[str, str] | None = None, secret: dict[str, str] | None = None,
               env_a: dict | None = None, env_b: dict | None = None) -> tuple[Path, Path]:
    """The team workflow against one remote; returns (A, B).

    A is a copy of `run` (a make_project repo after `dvc repro`: work tree, git, DVC cache).
    A configures the remote with the dvc CLI (`shared` settings committed in .dvc/config,
    `secret` ones with --local, i.e. in the git-ignored .dvc/config.local), commits, tags a
    static-model version and pushes outputs and run cache. B is a `git clone` of A: the committed remote
    config comes with it, so B only supplies credentials (env_b), pulls, and runs nothing.
    Then A's cache and models are wiped, and artifacts get / ls / pull restore them from the
    remote alone. env_a / env_b: environments of A's and B's dvc commands (default: ours).
    """
    a = tmp_path / "a"
    shutil.copytree(run, a, symlinks=True)
    assert reproduce(a) == {PROBE}  # a complete run
    before = model_hashes(a)

    dvc(a, "remote", "add", "-d", name, url)
    for key, value in (shared or {}).items():
        dvc(a, "remote", "modify", name, key, value)
    for key, value in (secret or {}).items():
        dvc(a, "remote", "modify", "--local", name, key, value)
    committed = (a / ".dvc/config").read_text()
    assert url in committed and all(v in committed for v in (shared or {}).values())
    if secret:
        local = (a / ".dvc/config.local").read_text()
        for value in secret.values():
            assert value in local and value not in committed
    git(a, "check-ignore", "-q", ".dvc/config.local")  # raises unless git ignores it

    # dvc.lock, metrics (cache: false) and the remote config go to git; outputs are ignored.
    git(a, "add", "-A")
    git(a, "commit", "-qm", "Pipeline run; remote storage")
    assert git(a, "status", "--porcelain") == ""
    # A model registry version (GTO tag, what `gto register static-model` makes):
    # `dvc artifacts get` resolves a name only through such an annotated tag.
    git(a, "tag", "-a", "static-model@v0.1.0", "-m", "Register static-model v0.1.0")
    dvc(a, "push", "--run-cache", env=env_a)

    b = tmp_path / "b"
    subprocess.run(["git", "clone", "-q", str(a), str(b)], check=True, capture_output=True)
    # A team commits the remote (url, endpoint) once; every clone inherits it, and nobody's
    # secrets: .dvc/config.local stays behind.
    assert not (b / ".dvc/config.local").exists()
    # DVC wraps a long URL at the terminal width: compare without the whitespace.
    listed = "".join(dvc(b, "remote", "list", env=env_b).stdout.split())
    assert name in listed and "".join(url.split()) in listed
    assert dvc(b, "remote", "default", env=env_b).stdout.strip() == name
    dvc(b, "pull", "--run-cache", env=env_b)
    assert model_hashes(b) == before
    assert reproduce(b) == {PROBE}  # every output came from the remote: nothing to run

    # Wipe A's cache and models: only the remote has them now.
    shutil.rmtree(a / ".dvc/cache")
    for model in MODEL_FILES:
        (a / "models" / model).unlink()
    out = tmp_path / "artifact" / "static.onnx"
    dvc(tmp_path, "artifacts", "get", str(a), "static-model", "-o", str(out), env=env_a)
    assert hashlib.md5(out.read_bytes()).hexdigest() == before["static.onnx"]
    listing = dvc(tmp_path, "ls", str(a), "models", env=env_a).stdout.split()
    assert set(MODEL_FILES) <= set(listing)
    dvc(a, "pull", env=env_a)
    assert model_hashes(a) == before
    assert json.loads(dvc(a, "status", "--json", env=env_a).stdout) == {PROBE: ["always changed"]}
    return a, b


# --- S3 (moto server, the `s3_endpoint` fixture in conftest.py) ----------------------------

@pytest.mark.slow  # the same round trip as the local remote's, through a moto S3 server
def test_s3_remote_round_trip(tmp_path, pipeline_run, s3_endpoint):
    ci_env = dict(os.environ)  # credentials in environment variables
    dev_env = {k: v for k, v in ci_env.items() if k not in AWS_CREDENTIALS}  # config.local only
    # A (a developer): endpoint committed, keys in .dvc/config.local; B (CI): keys from env.
    a, b = round_trip(tmp_path, pipeline_run, name="storage", url="s3://quantpipe/dvcstore",
                      shared={"endpointurl": s3_endpoint},
                      secret={"access_key_id": LOCAL_KEY_ID, "secret_access_key": LOCAL_SECRET},
                      env_a=dev_env, env_b=ci_env)

    # The clone got the remote but no secret: without credentials it cannot reach the bucket.
    denied = dvc(b, "status", "--cloud", env=dev_env, check=False)
    assert denied.returncode != 0
    assert "credentials" in (denied.stdout + denied.stderr).lower()
    assert "in sync" in dvc(b, "status", "--cloud", env=ci_env).stdout

    import boto3
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="quantpipe", Prefix="dvcstore/")
    keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    assert any(k.startswith("dvcstore/files/md5/") for k in keys)
    assert any(k.startswith("dvcstore/runs/") for k in keys)  # --run-cache was pushed


# --- Local directory ----------------------------------------------------------------------

def test_local_directory_remote_round_trip(tmp_path, pipeline_run):
    store = tmp_path / "dvc-storage"
    a, b = round_trip(tmp_path, pipeline_run, name="local", url=str(store))
    assert any((store / "files" / "md5").rglob("*"))
    assert any((store / "runs").rglob("*"))  # --run-cache was pushed

    # The review recipe in the clone: a default remote exists, so it fetches first; the base
    # (origin/main = A's main) is what B has checked out, so nothing differs.
    review = subprocess.run(["bash", str(REVIEW)], cwd=b, capture_output=True, text=True,
                            timeout=300)
    assert review.returncode == 0, review.stdout + review.stderr
    assert "Fetching cached metrics and plots from DVC remote 'local'" in review.stderr
    assert review.stdout.startswith("## quantpipe review: workspace vs origin/main")
    assert (b / "plots/review/index.html").is_file()
