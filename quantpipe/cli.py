"""`quantpipe init` and `quantpipe upgrade`: the pipeline in a git + DVC repository of your own.

`init` writes dvc.yaml and params.yaml (this repository's own, packaged as quantpipe.template:
the pipeline that runs and is tested here), a quantpipe block in .gitignore, inputs/ (where your
datasets and brought models go) and .quantpipe/state.yaml (the quantpipe version that wrote them
and its params defaults). In the written dvc.yaml the stages run from the installed package
(`python -m quantpipe.stages.<name>`) and depend on that version instead of the library's source
files, which live in site-packages, outside the repository.

`upgrade`, after installing a newer quantpipe, rewrites what quantpipe owns (dvc.yaml and the
version: `dvc repro` then re-runs what the new code computes), keeps every value of your
params.yaml (a renamed key moves to its new name), adds the keys the new version has with their
defaults, and names every default that changed since the version that wrote it.

Neither overwrites a file it did not write: `init` stops, naming the file, when dvc.yaml or
params.yaml exist. Both work on the current directory.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata, resources
from pathlib import Path

import yaml

from quantpipe.errors import UserError
from quantpipe.io import write_bytes
from quantpipe.params import RENAMED

STATE = Path(".quantpipe/state.yaml")
DVC_YAML, PARAMS_YAML, GITIGNORE, INPUTS = (Path(p) for p in ("dvc.yaml", "params.yaml",
                                                                ".gitignore", "inputs"))
GITIGNORE_BLOCK = ("# quantpipe (written by quantpipe init)\n/plots/\n/dvc_plots/\n.*.tmp/\n"
                   "__pycache__/\n")
INPUTS_README = ("Your own data and models (prepare.path: inputs/<dataset>, train.model:\n"
                 "onnx:inputs/<file>.onnx, train.weights: inputs/<file>.pt). Track large ones with\n"
                 "`dvc add inputs/<name>`. Stages depend on this directory.\n")
# In this repository a stage depends on its script and the library modules it imports; where
# quantpipe is installed, those are site-packages' files: the version stands for them.
CODE_DEP = re.compile(r"^\s+- (stages|quantpipe)/\S+\.py\s*$")
PARAMS_KEY = re.compile(r"^(\s+)params:\s*$")
HEADER = ("# The quantpipe pipeline, written by `quantpipe init` from the installed package; `quantpipe\n"
          "# upgrade` rewrites it after you install a newer one (your settings go in params.yaml).\n"
          "# Each stage lists its data and model inputs, the params keys it reads and the quantpipe\n"
          f"# version ({STATE.as_posix()}), so a change re-runs exactly the stages it affects.\n")


def version() -> str:
    try:
        return metadata.version("quantpipe")
    except metadata.PackageNotFoundError:  # a checkout imported in place, not installed
        return "0+unknown"


# The packaged files (links to this repository's own): DVC would take a file named dvc.yaml
# anywhere in the repository for a pipeline of its own.
TEMPLATE_FILES = {"dvc.yaml": "pipeline.yaml", "params.yaml": "params.yaml"}


def template(name: str) -> str:
    """This repository's `name` (dvc.yaml or params.yaml) as packaged."""
    return resources.files("quantpipe.template").joinpath(TEMPLATE_FILES[name]).read_text()


def render_dvc_yaml(text: str) -> str:
    """This repository's dvc.yaml as a repository with quantpipe installed runs it."""
    lines = [HEADER]
    body = text.splitlines(keepends=True)
    while body and body[0].startswith("#"):  # the template's header speaks of this repository
        body.pop(0)
    for line in body:
        if CODE_DEP.match(line):
            continue
        lines.append(line.replace("python -m stages.", "python -m quantpipe.stages."))
        indent = PARAMS_KEY.match(line)
        if indent:  # every stage with params also re-runs when the version changes
            pad = indent.group(1)
            lines.append(f"{pad}  - {STATE.as_posix()}:\n{pad}      - version\n")
    # A stage whose only deps were code (machine) keeps no empty `deps:`.
    def listed(i: int) -> bool:  # the next line that is not a comment is a list item
        rest = [line.lstrip() for line in lines[i + 1:] if not line.lstrip().startswith("#")]
        return bool(rest) and rest[0].startswith("- ")

    lines = [line for i, line in enumerate(lines) if line.strip() != "deps:" or listed(i)]
    rendered = "".join(lines)
    for name, stage in yaml.safe_load(rendered)["stages"].items():
        body = stage.get("do", stage)
        deps = [d for d in body.get("deps", []) if isinstance(d, str)]
        if not body["cmd"].startswith("python -m quantpipe.stages.") or any(
                d.startswith(("stages/", "quantpipe/")) for d in deps):
            raise AssertionError(f"the dvc.yaml template's stage {name} did not render")
    return rendered


def _write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())  # atomic, its folder made (quantpipe.io.atomic_path)


def _check_repository() -> None:
    if not Path(".git").exists() or not Path(".dvc").is_dir():
        raise UserError(f"{Path.cwd()}: not the top of a git + DVC repository; run `git init` "
                        "and `dvc init` there first (or cd to the repository's top)")


def _state(defaults: dict) -> str:
    return yaml.safe_dump({"version": version(), "defaults": defaults}, sort_keys=False)


def init() -> list[str]:
    """Write the pipeline into the current repository; the lines to print."""
    _check_repository()
    for path in (DVC_YAML, PARAMS_YAML):
        if path.exists():
            raise UserError(f"{path}: exists; quantpipe init writes a new pipeline and never "
                            "overwrites a file (`quantpipe upgrade` renews one it wrote)")
    params_text = template("params.yaml")
    _write_text(DVC_YAML, render_dvc_yaml(template("dvc.yaml")))
    _write_text(PARAMS_YAML, params_text)
    _write_text(STATE, _state(yaml.safe_load(params_text)))
    written = [DVC_YAML, PARAMS_YAML, STATE]
    if not (INPUTS / "README.md").exists():
        _write_text(INPUTS / "README.md", INPUTS_README)
        written.append(INPUTS / "README.md")
    ignored = GITIGNORE.read_text() if GITIGNORE.exists() else ""
    if GITIGNORE_BLOCK not in ignored:
        _write_text(GITIGNORE, ignored + ("\n" if ignored and not ignored.endswith("\n") else "")
                    + GITIGNORE_BLOCK)
        written.append(GITIGNORE)
    return [f"quantpipe {version()}: wrote {', '.join(map(str, written))}",
            "next: set your data and model in params.yaml (prepare, train), `git add -A`, "
            "then `dvc repro`"]


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _pop(d: dict, dotted: str):
    """Remove and return the value at a dotted key, or KeyError."""
    *parents, last = dotted.split(".")
    for key in parents:
        d = d[key]
    return d.pop(last)


def _merge(user: dict, defaults: dict, prefix: str, notes: list[str]) -> dict:
    out = {}
    for key, default in defaults.items():
        if key not in user:
            out[key] = default
            notes.append(f"new key {prefix}{key}: {_shown(default)}")
        elif isinstance(default, dict) and default and isinstance(user[key], dict):
            out[key] = _merge(user[key], default, f"{prefix}{key}.", notes)
        else:  # a value, or a free-form mapping (extra_options): the user's, whole
            out[key] = user[key]
    notes += [f"{prefix}{key} is no longer read (removed; it was {_shown(user[key])})"
              for key in user if key not in defaults]
    return out


def merge_params(user: dict, new_defaults: dict) -> tuple[dict, list[str]]:
    """The new params.yaml: the new version's keys in its order, each with the user's value
    where the user has one (under its old name if it was renamed); notes for what moved, was
    added or is gone."""
    user, notes = yaml.safe_load(yaml.safe_dump(user)) or {}, []  # a copy to take keys from
    for old, new in RENAMED.items():
        try:
            value = _pop(user, old)
        except (KeyError, TypeError):
            continue
        section, _, key = new.rpartition(".")
        user.setdefault(section, {}).setdefault(key, value)
        notes.append(f"{old} is now {new} (your value kept)")
    return _merge(user, new_defaults, "", notes), notes


def _shown(value) -> str:
    """A params value as the user reads it: YAML's null for None, else Python's repr."""
    return "null" if value is None else repr(value)


def changed_defaults(old: dict, new: dict) -> list[str]:
    was, now = _flatten(old), _flatten(new)
    return [f"default of {key}: {_shown(was[key])} -> {_shown(now[key])}" for key in now
            if key in was and was[key] != now[key]]


def upgrade() -> list[str]:
    """Renew what quantpipe owns in the current repository; the lines to print."""
    _check_repository()
    if not STATE.exists():
        raise UserError(f"{STATE}: not found; this repository's pipeline was not written by "
                        "`quantpipe init` (run it in a repository without dvc.yaml)")
    state = yaml.safe_load(STATE.read_text()) or {}
    try:
        user = yaml.safe_load(PARAMS_YAML.read_text()) or {}
    except FileNotFoundError:
        user = {}
    new_defaults = yaml.safe_load(template("params.yaml"))
    merged, notes = merge_params(user, new_defaults)
    notes += changed_defaults(state.get("defaults", {}), new_defaults)
    _write_text(DVC_YAML, render_dvc_yaml(template("dvc.yaml")))
    _write_text(PARAMS_YAML, yaml.safe_dump(merged, sort_keys=False))
    _write_text(STATE, _state(new_defaults))
    lines = [f"quantpipe {state.get('version', '?')} -> {version()}: rewrote {DVC_YAML}, "
             f"{STATE}; {PARAMS_YAML} keeps your values"]
    return lines + [f"  {note}" for note in notes]


# The subcommands: what each does, and its help line.
COMMANDS = {"init": (init, "write the pipeline into this git + DVC repository"),
            "upgrade": (upgrade, "renew the pipeline after installing a newer quantpipe, keeping "
                                 "your params")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quantpipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"quantpipe {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, text) in COMMANDS.items():
        commands.add_parser(name, help=text)
    args = parser.parse_args(argv)
    try:
        lines = COMMANDS[args.command][0]()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
