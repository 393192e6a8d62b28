"""Every fenced shell block of README.md and docs/*.md works as written.

A ```bash block either runs, in test_every_documented_shell_block_runs_as_written (slow), or
its first line is `# fragment: <why>`, which the reader sees too: what it needs that a test
cannot have (your GitHub repository, a cluster's hosts, hours). The fast tests check every
block, fragments included: each `-S key=value` is a valid params override, each `make` target,
script, module and `quantpipe` subcommand exists, and no block of commands is left unlabelled.

How the slow test runs a block, as a user would with small data:
- in its own copy of one project (this repository's files, the tests' small params committed,
  the pipeline run once and committed as `main`), whose inputs/ holds what the documents'
  commands name (an RGB image folder, a torchvision checkpoint, ONNX classifiers, COCO, YOLO and
  masks folders, an .npz, FashionMNIST's raw files, the Ultralytics fixture), and a home
  directory with what they name there (~/my-project: git + DVC, ~/runs, ~/model.onnx);
- with a virtualenv of its own (this environment's packages underneath) as the active one, so
  that `make`, `pip install` and `quantpipe` act there, and ./.venv pointing to it; pip offline;
  `make env` run in the copy first, as the README's two commands leave a checkout;
- line by line (a `\\`-continued line is one), in bash, stopping at the first that fails; the
  working directory carries from line to line;
- each `dvc exp run` from the committed params.yaml, as the documents present each as one
  command from a checkout (an exact command an earlier block ran is not run twice); after
  `quantpipe init`, the small params are merged into the params.yaml it wrote; `make test` and
  its kin are checked with `make -n` (they are the commands that run this test);
- a block under `<!-- docs-test: continues -->` runs in the copy the block before it left;
- queued experiments must all succeed before the block counts as run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ROOT, TINY_PARAMS, copy_project, dvc, git, make_project, reproduce

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
FRAGMENT = "# fragment:"
CONTINUES = "<!-- docs-test: continues -->"
SHELL = {"bash", "sh", "shell"}
# A line of an unlabelled block that reads as a command someone would type.
COMMAND_LIKE = re.compile(r"^\s*(\$ )?(dvc|make|python|pip|git|quantpipe) \S")


@dataclass(frozen=True)
class Block:
    doc: str          # README.md, docs/team.md
    line: int         # of the opening fence
    lang: str
    text: str
    continues: bool   # runs in the copy the block before it left

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def fragment(self) -> str | None:
        first = self.text.lstrip().splitlines()[0] if self.text.strip() else ""
        return first[len(FRAGMENT):].strip() if first.startswith(FRAGMENT) else None

    def lines(self) -> list[str]:
        """The commands, a `\\`-continued line joined; comment-only lines left out."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip().rsplit("\n", 1)[-1]
            found.append(Block(str(path.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1,
                               m.group(1), m.group(2), before.strip() == CONTINUES))
    return found


def shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang in SHELL]


def simple_commands(line: str) -> list[list[str]]:
    """A line's simple commands (split at &&, ||, |, ;), as words; trailing comments dropped."""
    words = shlex.split(line, comments=True)
    commands, current = [], []
    for word in words:
        if word in ("&&", "||", "|", ";"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [c for c in [*commands, current] if c]


def every_command() -> list[tuple[Block, list[str]]]:
    return [(b, c) for b in shell_blocks() for line in b.lines() for c in simple_commands(line)]


# --- fast: what every block says exists and is allowed --------------------------------------

def test_the_documents_have_shell_blocks_and_each_fragment_says_why():
    found = shell_blocks()
    assert len(found) >= 20, [b.name for b in found]
    for block in found:
        if block.fragment is not None:
            assert len(block.fragment) > 10, f"{block.name}: `# fragment:` needs its reason"
    assert [b for b in found if b.fragment is None], "every block a fragment"


def test_a_block_of_commands_is_labelled_as_shell():
    """An unlabelled block that holds commands would escape the run: label it ```bash."""
    for block in blocks():
        if block.lang not in SHELL and block.lang != "python":
            typed = [line for line in block.text.splitlines() if COMMAND_LIKE.match(line)]
            assert not typed or block.lang == "text" and all(t.startswith("$ ") for t in typed), \
                f"{block.name}: commands in a ```{block.lang} block; label it ```bash: {typed[:2]}"


def overrides(argv: list[str]) -> list[tuple[str, str]]:
    """The `-S key=value` / `--set-param key=value` pairs of a `dvc exp run` command."""
    pairs = []
    for flag, value in zip(argv, argv[1:]):
        if flag in ("-S", "--set-param"):
            key, _, raw = value.partition("=")
            pairs.append((key, raw))
    return pairs


def with_overrides(params: dict, pairs: list[tuple[str, str]]) -> list[dict]:
    """params.yaml with the overrides applied, as DVC does (YAML values; with --queue a comma
    list is one experiment per value): one dict per experiment."""
    grids = [[(k, yaml.safe_load(v)) for v in (split_top(raw))] for k, raw in pairs]
    results = [json.loads(json.dumps(params))]
    for grid in grids:
        results = [_set(json.loads(json.dumps(r)), k, v) for r in results for k, v in grid]
    return results


def split_top(raw: str) -> list[str]:
    """`a,b` -> [a, b]; a comma inside brackets stays (`[0.5,0.5]` is one value)."""
    parts, depth, cur = [], 0, ""
    for ch in raw:
        depth += ch in "[{" and 1 or ch in "]}" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _set(params: dict, dotted: str, value) -> dict:
    *path, last = dotted.split(".")
    node = params
    for key in path:
        node = node.setdefault(key, {})
    node[last] = value
    return params


def test_every_documented_params_override_is_a_valid_params_yaml():
    from quantpipe.errors import UserError
    from quantpipe.schemas.all import parse_params

    committed = yaml.safe_load((ROOT / "params.yaml").read_text())
    checked = 0
    for block, argv in every_command():
        if argv[:3] != ["dvc", "exp", "run"]:
            continue
        # A placeholder (`<name>`) takes the default: its key still must exist.
        pairs = [(k, "null" if "<" in raw else raw) for k, raw in overrides(argv)]
        for params in with_overrides(committed, pairs):
            try:
                parse_params(params, source=block.name)
            except UserError as e:
                pytest.fail(f"{block.name}: {' '.join(argv)}: {e}")
            checked += 1
    assert checked >= 20


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


def test_every_make_target_script_module_and_subcommand_named_exists():
    import importlib.util

    from quantpipe import cli

    targets = _make_targets()
    subcommands = set(cli.COMMANDS)
    for block, argv in every_command():
        word = argv[0]
        if word == "make":
            named = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
            assert set(named) <= targets, f"{block.name}: make {named}: not a target of the Makefile"
        elif word == "python" and len(argv) > 1:
            if argv[1] == "-m":
                assert importlib.util.find_spec(argv[2]), f"{block.name}: no module {argv[2]}"
            elif argv[1].endswith(".py"):
                assert (ROOT / argv[1]).is_file(), f"{block.name}: no file {argv[1]}"
        elif word == "quantpipe":
            assert argv[1] in subcommands, f"{block.name}: quantpipe {argv[1]}: no such command"


# --- slow: each block run ---------------------------------------------------------------------

# The small params of the tests but the task's own model (the documents' recipes change the task),
# plus: one runtime in bench, and a review gate that stops only on what breaks (the gate's logic has its
# own tests, tests/test_review.py).
SMALL = {**TINY_PARAMS,
         "train": {k: v for k, v in TINY_PARAMS["train"].items() if k != "model"},
         "bench": {**TINY_PARAMS["bench"], "runtimes": ["onnxruntime"], "seconds": 5.0},
         "review": {"max_speedup_regression": 0.95, "max_drop_pts": 50.0}}
# Files beyond a pipeline run that the documents' commands use.
EXTRA_FILES = ("Makefile", "pyproject.toml", "requirements.txt", "constraints.txt", "README.md",
               "docs", "scripts", "metrics")
PRELUDE = r"""
set -o pipefail
dvc() {
  if [ "$1" = exp ] && [ "$2" = run ]; then
    git checkout -q -- params.yaml 2>/dev/null || true
    if grep -qxF -- "$*" "$DOCS_TEST_RAN" 2>/dev/null; then
      echo "docs test: \`dvc $*\` ran in an earlier block"; return 0
    fi
    command dvc "$@" || return $?
    echo "$*" >> "$DOCS_TEST_RAN"
  else
    command dvc "$@"
  fi
}
quantpipe() {
  command quantpipe "$@" || return $?
  if [ "$1" = init ]; then python "$DOCS_TEST_SMALL" params.yaml; fi
}
make() {
  case "$1" in test|test-slow|test-all) command make -n "$@" ;; *) command make "$@" ;; esac
}
"""


def _flowers(root: Path, per_class: int = 24) -> None:
    """RGB JPEGs of several sizes, one colour cast per class (separable, like real flowers)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(("daisy", "rose", "tulip")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = 72 + 8 * (i % 3), 96 - 8 * (i % 2)
            img = rng.integers(0, 90, (h, w, 3)).astype(np.uint8)
            img[..., c] += 150
            Image.fromarray(img).save(root / name / f"{i:04d}.jpg", quality=90)


def _classifier_onnx(path: Path, size: int, classes: int) -> None:
    """A small RGB classifier exported as a user would (torch.onnx, dynamic batch)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes)).eval()
    torch.onnx.export(model, (torch.randn(1, 3, size, size),), str(path), input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}}, opset_version=18,
                      dynamo=False)


def _fashion_mnist(raw: Path, n_train: int = 300, n_test: int = 100) -> None:
    """FashionMNIST's four raw idx files, as torchvision's download leaves them (small)."""
    from helpers import structured_images

    raw.mkdir(parents=True)
    for part, n in (("train", n_train), ("t10k", n_test)):
        split = structured_images(n, size=28, num_classes=10, seed=len(part))
        (raw / f"{part}-images-idx3-ubyte").write_bytes(
            np.array([2051, n, 28, 28], ">i4").tobytes() + split.x[:, 0].tobytes())
        (raw / f"{part}-labels-idx1-ubyte").write_bytes(
            np.array([2049, n], ">i4").tobytes() + split.y.astype(np.uint8).tobytes())


def _inputs(inputs: Path) -> None:
    import torch
    import torchvision

    from helpers import structured_images
    from quantpipe.detection import folders
    from test_segmentation import _digit_mask_folder

    _flowers(inputs / "flowers")
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), inputs / "resnet18.pth")
    _classifier_onnx(inputs / "model.onnx", 224, 3)
    folders.write_folder("coco", inputs / "my_coco", size=64, classes=3, images=120)
    fixtures = ROOT / "tests/fixtures/ultralytics"
    record = json.loads((fixtures / "fixtures.json").read_text())
    folders.write_folder("yolo", inputs / "my_yolo", size=record["imgsz"], classes=record["dataset"]["nc"])
    shutil.copy(fixtures / "yolo11n.onnx", inputs / "yolo11n.onnx")
    _digit_mask_folder(inputs / "my_masks", n=240)
    split = structured_images(400, channels=3, size=32, num_classes=4)
    np.savez(inputs / "mydata.npz", x=split.x, y=split.y)
    _fashion_mnist(inputs / "torchvision/FashionMNIST/raw")


@pytest.fixture(scope="module")
def docs_env(tmp_path_factory) -> Iterator[dict]:
    """The virtualenv, the project run once, and the environment every block runs with."""
    top = tmp_path_factory.mktemp("docs-commands")
    # This environment's packages underneath, pinned versions included (a new virtualenv's own
    # pip and setuptools would shadow the pins and send pip to the network): no pip of its own,
    # `pip` runs this environment's pip for it, installing into it.
    venv = top / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    import site as this_site
    site = next(venv.glob("lib/python3.*/site-packages"))
    (site / "base.pth").write_text(this_site.getsitepackages()[0] + "\n")
    pip = venv / "bin/pip"
    pip.write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
    pip.chmod(0o755)

    base = make_project(top / "base", SMALL)
    for name in EXTRA_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, base / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, base / name)
    _inputs(base / "inputs")
    git(base, "add", "-A")
    git(base, "commit", "-qm", "docs, inputs")
    reproduce(base)
    git(base, "add", "-A")
    git(base, "commit", "-qm", "pipeline run")

    small = top / "small_params.py"
    small.write_text(
        "import sys, yaml\n"
        f"small = {SMALL!r}\n"
        "def merge(a, b):\n"
        "    for k, v in b.items():\n"
        "        a[k] = merge(a.get(k) or {}, v) if isinstance(v, dict) else v\n"
        "    return a\n"
        "p = yaml.safe_load(open(sys.argv[1]))\n"
        "open(sys.argv[1], 'w').write(yaml.safe_dump(merge(p, small), sort_keys=False))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"VIRTUAL_ENV": str(venv), "DVC_NO_ANALYTICS": "1",
                "PATH": f"{venv}/bin:{Path(sys.executable).parent}:{env['PATH']}",
                # offline: nothing is downloaded, the build uses what is installed
                "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "DOCS_TEST_RAN": str(top / "ran.txt"), "DOCS_TEST_SMALL": str(small)})
    yield {"top": top, "base": base, "venv": venv, "env": env, "copy": None}
    # Each block's copy is hundreds of MB: none outlives the module (the disk is shared with CI).
    shutil.rmtree(top, ignore_errors=True)


def _home(path: Path, base: Path) -> Path:
    """A home directory with what the documents' commands find there."""
    project = path / "my-project"
    project.mkdir(parents=True)
    (path / ".gitconfig").write_text("[user]\n\tname = docs test\n\temail = docs@example.com\n")
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=project, check=True, env={"HOME": str(path)})
    dvc(project, "init", "-q")
    (path / "runs").mkdir()
    shutil.copy(base / "inputs/resnet18.pth", path / "runs/resnet18_best.pth")
    _classifier_onnx(path / "model.onnx", 32, 4)
    return path


def _queue_done(repo: Path) -> None:
    """Queued experiments of a block must finish, and succeed."""
    from test_experiments import queue_statuses, wait_for

    if not (repo / ".dvc/tmp/exps").exists():
        return
    names = list(queue_statuses(repo))
    if names:
        statuses = wait_for(repo, names, started=0.0)
        failed = {n: s for n, s in statuses.items() if s != "Success"}
        assert not failed, f"queued experiments failed: {failed}"
    dvc(repo, "queue", "stop", "--kill", check=False)


def _shell_block_ids() -> list[Block]:
    return [b for b in shell_blocks() if b.fragment is None]


@pytest.mark.slow  # every documented command on small data: ~30 minutes on 2 cores
@pytest.mark.parametrize("block", _shell_block_ids(), ids=lambda b: b.name)
def test_every_documented_shell_block_runs_as_written(block, docs_env, tmp_path):
    # One copy at a time, outside tmp_path (a passed test's tmp_path is removed): a block marked
    # `continues` goes on in the copy of the block before it, in the same document.
    previous = docs_env["copy"]
    if block.continues and previous and previous[0] == block.doc:
        repo = previous[1]
    else:
        if previous:
            shutil.rmtree(previous[1], ignore_errors=True)
        repo = copy_project(docs_env["base"], docs_env["top"] / re.sub(r"\W", "_", block.name))
    docs_env["copy"] = (block.doc, repo)
    venv_link = repo / ".venv"
    if not venv_link.exists():
        venv_link.symlink_to(docs_env["venv"])
    home = _home(tmp_path / "home", docs_env["base"])
    env = {**docs_env["env"], "HOME": str(home)}
    # As the README's two commands leave a checkout: `make env` has installed it (editable).
    subprocess.run(["make", "env"], cwd=repo, env=env, check=True, capture_output=True, timeout=600)
    cwd_file = tmp_path / "cwd"
    cwd_file.write_text(str(repo))
    for line in block.lines():
        script = f'{PRELUDE}\ncd "$(cat {shlex.quote(str(cwd_file))})"\n{line}\nstatus=$?\n' \
                 f'pwd > {shlex.quote(str(cwd_file))}\nexit $status\n'
        proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                              timeout=1800)
        assert proc.returncode == 0, (f"{block.name}: `{line}` exited {proc.returncode}\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    _queue_done(repo)
