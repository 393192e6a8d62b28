"""Code review of a pipeline change against another revision (a pull request's base): the
regression gate of `make gate REV=main`, and the parts of the review comment scripts/review.sh
writes (the CI workflow posts it on the pull request).

The gate reads metrics/summary.json, metrics/machine.json and params.yaml of the work tree and,
through git, of REV (metrics are `cache: false`, committed to git: nothing is pulled), and fails,
one line per breach, when
- a variant's accuracy (a detector's mAP@[.5:.95]) fell by more than review.max_drop_pts;
- a speedup fell by more than review.max_speedup_regression of its value at REV, judged only when
  both revisions were measured on the same kind of machine (metrics/machine.json): on another
  CPU, core count or runtime version the change of machine is in the figures;
- a variant's size ratio (its size against FP32's) grew;
- a gate of the report (params `gates`) that held at REV fails now, both judged by the work
  tree's `gates`.
`dvc metrics diff` shows every change; the gate decides which of them stop a merge.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from quantpipe import params
from quantpipe.errors import UserError
from quantpipe.machine import differences, recorded_machine
from quantpipe.report import candidates_of, gate_failures, recommended_lines, score_keys, variants_of
from quantpipe.schemas.gates import GatesParams
from quantpipe.schemas.review import ReviewParams

SUMMARY = "metrics/summary.json"
# Where each revision's machine is recorded (recorded_machine: machine.json, or for revisions
# older than it the bench JSON's `machine`).
MACHINE_FILES = ("metrics/machine.json", "metrics/bench/static.json")

# The speedups the gate compares, by the place of `speedup` in their dotted path (as
# `dvc metrics diff` names them). Gated: the headline speedup at every batch size and thread
# count on ONNX Runtime, the best configurations' (the recommendation) and throughput with every
# core busy. Shown by `dvc metrics diff` but not gated: each runtime's own figures
# (runtimes.<runtime>.*, whose fastest is in best) and the ratios to bf16 (*_vs_bf16: two noisy
# measurements in one figure, and bf16's own speedup is gated).
GATED_SPEEDUPS = ("speedup", "by_threads", "best", "throughput")


@dataclass(frozen=True)
class Revision:
    """One side of the comparison: what a revision measured, and its name in messages."""
    name: str
    summary: dict
    machine: dict | None


@dataclass
class Verdict:
    breaches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.breaches


def flatten(tree: object, prefix: str = "") -> dict[str, float]:
    """Numeric leaves by dotted path: {"static": {"speedup": {"bs1": 1.9}}} -> static.speedup.bs1."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return {prefix: float(tree)}
    return {}


def speedup_family(path: str) -> str | None:
    """Which kind of speedup a summary path is (GATED_SPEEDUPS and the rest), None if none."""
    parts = path.split(".")[1:]  # without the variant
    if not any(p.startswith(("speedup", "throughput_speedup")) for p in parts[-2:]):
        return None
    if any(p.endswith("_vs_bf16") for p in parts):
        return "vs_bf16"
    if parts[0] == "runtimes":
        return "per_runtime"
    if parts[0] == "speedup":
        return "speedup"
    if parts[0] == "by_threads":
        return "by_threads"
    if parts[0] == "throughput_speedup" or parts[:2] == ["best", "throughput"]:
        return "throughput"
    if parts[:2] == ["best", "latency"]:
        return "best"
    return "other"


def speedups(summary: dict) -> dict[str, float]:
    """The gated speedups of the variants that may ship instead of FP32 (INT8 and bf16), by path."""
    return {path: value for variant in candidates_of(summary)
            for path, value in flatten(summary[variant], variant).items()
            if speedup_family(path) in GATED_SPEEDUPS}


def scores(summary: dict) -> dict[str, float]:
    """Every model row's accuracy (a detector's mAP@[.5:.95]): fp32, the variants, torch."""
    key = score_keys(summary)[0]
    return {f"{v}.{key}": entry[key] for v, entry in variants_of(summary).items() if key in entry}


def size_ratios(summary: dict) -> dict[str, float]:
    return {f"{v}.size_ratio": entry["size_ratio"] for v, entry in variants_of(summary).items()
            if "size_ratio" in entry}


def judge(base: Revision, head: Revision, review: ReviewParams, gates: GatesParams) -> Verdict:
    """The gate: every breach of review's tolerances from base to head, one line each."""
    verdict = Verdict()
    unit = score_keys(head.summary)[2]
    was, now, common = _both(scores, base, head)
    for path in common:
        drop = (was[path] - now[path]) * 100
        if drop > review.max_drop_pts:
            verdict.breaches.append(
                f"{path}: {was[path]:.4f} at {base.name} -> {now[path]:.4f} in {head.name} "
                f"(-{drop:.2f} {unit} > review.max_drop_pts = {review.max_drop_pts})")
    verdict.checked["accuracy"] = len(common)

    was, now, common = _both(size_ratios, base, head)
    for path in common:
        if now[path] > was[path]:
            verdict.breaches.append(f"{path}: {was[path]:.3f} at {base.name} -> {now[path]:.3f} "
                                    f"in {head.name} (the model grew against FP32)")
    verdict.checked["size"] = len(common)

    held_then = gate_failures(base.summary, gates)
    for key, message in gate_failures(head.summary, gates).items():
        if key not in held_then:
            verdict.breaches.append(f"report gate: {message} (held at {base.name})")

    machines = _machine_change(base, head)
    if machines:
        verdict.notes.append(f"Timing not compared: {machines}. Judging accuracy, size and "
                             "gates alone; re-measure both on one machine to compare speed.")
    else:
        was, now, common = _both(speedups, base, head)
        for path in common:
            fall = 1 - now[path] / was[path] if was[path] > 0 else 0.0
            if fall > review.max_speedup_regression:
                verdict.breaches.append(
                    f"{path}: x{was[path]:.2f} at {base.name} -> x{now[path]:.2f} in {head.name} "
                    f"(-{fall:.0%} > review.max_speedup_regression = {review.max_speedup_regression:.0%})")
        verdict.checked["speedup"] = len(common)

    for side, other in ((base, head), (head, base)):
        gone = sorted(set(variants_of(side.summary)) - set(variants_of(other.summary)))
        if gone:
            verdict.notes.append(f"Not compared: {', '.join(gone)} (measured in {side.name} only).")
    return verdict


def _both(figures, base: Revision, head: Revision) -> tuple[dict, dict, list[str]]:
    """figures(summary) of both sides, and the paths both have, sorted (one line per breach in
    a stable order)."""
    was, now = figures(base.summary), figures(head.summary)
    return was, now, sorted(was.keys() & now.keys())


def _machine_change(base: Revision, head: Revision) -> str | None:
    """Why timing cannot be compared (None when both were measured on the same kind of machine)."""
    if base.machine is None or head.machine is None:
        side = base.name if base.machine is None else head.name
        return f"{side} records no machine (metrics/machine.json)"
    diffs = differences(base.machine, head.machine)
    if diffs:
        return f"{base.name} and {head.name} were measured on different machines ({'; '.join(diffs)})"
    return None


# --- reading the two revisions ---------------------------------------------------------------

def git_show(rev: str, path: str, cwd: Path) -> str | None:
    """A file as committed at rev; None if rev does not have it."""
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=cwd, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def at_revision(rev: str, root: Path) -> Revision | None:
    """What rev committed (None when it has no summary yet: nothing to compare with)."""
    named = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--short", f"{rev}^{{commit}}"],
                           cwd=root, capture_output=True, text=True)
    if named.returncode:
        raise UserError(f"make gate: unknown revision {rev!r} (git rev-parse); give REV=<branch, "
                        "tag or commit>, e.g. REV=main")
    text = git_show(rev, SUMMARY, root)
    if text is None:
        return None
    machine = recorded_machine({p: git_show(rev, p, root) for p in MACHINE_FILES})
    return Revision(f"{rev} ({named.stdout.strip()})", _parse(text, f"{rev}:{SUMMARY}"), machine)


def in_work_tree(root: Path) -> Revision:
    path = root / SUMMARY
    if not path.exists():
        raise UserError(f"{SUMMARY}: not found; run `dvc repro` (make repro) before the gate")
    machine = recorded_machine({p: (root / p).read_text() for p in MACHINE_FILES if (root / p).exists()})
    return Revision("the workspace", _parse(path.read_text(), str(path)), machine)


def _parse(text: str, where: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None


def gate(rev: str, root: Path = Path(".")) -> tuple[Verdict | None, str]:
    """`make gate REV=rev` in the project at root: the verdict (None when rev has no metrics to
    compare with) and the Markdown lines saying it."""
    raw = params.read(root / params.PARAMS_FILE)
    review = params.section(ReviewParams, raw, "params.yaml")
    gates = params.section(GatesParams, raw, "params.yaml")
    head = in_work_tree(root)
    base = at_revision(rev, root)
    if base is None:
        return None, f"Gate: {rev} has no {SUMMARY}: nothing to compare with, passed."
    verdict = judge(base, head, review, gates)
    checked = ", ".join(f"{n} {what}" for what, n in verdict.checked.items()) + " checks and the report gates"
    lines = [f"**Gate failed**: {len(verdict.breaches)} regression(s) of the workspace against {base.name}:"
             if verdict.breaches else
             f"**Gate passed**: the workspace against {base.name} ({checked})."]
    lines += [f"- {b}" for b in verdict.breaches] + [f"- {n}" for n in verdict.notes]
    return verdict, "\n".join(lines)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantpipe.review")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gate", help="fail (exit 1) on a regression of the work tree against REV")
    g.add_argument("rev")
    sub.add_parser("recommended", help="the report's recommended lines of the work tree")
    args = parser.parse_args(argv)
    root = Path(".")
    try:
        if args.command == "recommended":
            print("\n".join(recommended_lines(in_work_tree(root).summary)))
            return 0
        verdict, text = gate(args.rev, root)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if verdict is None or verdict.passed else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
