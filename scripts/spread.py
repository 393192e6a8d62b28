#!/usr/bin/env python3
"""Run-to-run spread of what the review gate compares (`make gate`, quantpipe/review.py): the
measurements behind the defaults of params.yaml `review` (the table in docs/team.md).

    python scripts/spread.py                       # 5 bench runs, seeds 1 and 2
    python scripts/spread.py --runs 3 --seeds 1 --workdir /tmp/spread -o /tmp/spread.json
    python scripts/spread.py --other d674cad --update   # only: accuracy against another machine

In a clone of this repository (its own DVC cache), with the committed params:
- `dvc repro` once: the whole pipeline re-run on this machine; its accuracies against the
  committed metrics/summary.json are the re-run spread of accuracy (on the machine that measured
  the committed metrics: 0 expected, training is deterministic there);
- bench of every variant and report forced again, --runs times in all: for every speedup of
  summary.json, the largest relative fall between two runs of unchanged models, 1 - min/max,
  i.e. what the gate would see if nothing but the noise of the machine changed;
- the model re-trained with each of --seeds (train to evaluate, no bench): how far accuracy moves
  when only the random draws (of the split and of training) change;
- with --other REV, a commit whose metrics another kind of machine measured with the same
  pipeline: how far its accuracies are from the committed ones (training differs across CPUs),
  which the gate judges whatever the machines.
Run it on a quiet machine: anything else running adds its own noise. Time on 2 cores: ~25 min.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantpipe.io import VARIANTS, write_json
from quantpipe.review import at_revision, flatten, scores, speedup_family
from quantpipe.studies import clone, dvc, set_params

ROOT = Path(__file__).resolve().parents[1]


def summary(repo: Path) -> dict:
    return json.loads((repo / "metrics/summary.json").read_text())


def largest_fall(values: list[float]) -> float:
    """The largest relative fall from one run to another: 1 - min/max."""
    return 1 - min(values) / max(values) if max(values) > 0 else 0.0


def speedup_spread(runs: list[dict]) -> dict:
    """Per speedup path its values over the runs (the first: the committed run) and largest
    fall; per family the worst path."""
    paths: dict[str, list[float]] = {}
    for run in runs:
        for path, value in flatten(run).items():
            if speedup_family(path) and not path.startswith(("recommended.", "torch.")):
                paths.setdefault(path, []).append(value)
    falls = {p: round(largest_fall(v), 4) for p, v in paths.items() if len(v) == len(runs)}
    families: dict[str, dict] = {}
    for path, fall in falls.items():
        family = speedup_family(path)
        worst = families.get(family)
        if worst is None or fall > worst["largest_fall"]:
            families[family] = {"largest_fall": fall, "path": path, "values": paths[path]}
    values = {p: v for p, v in sorted(paths.items()) if len(v) == len(runs)}
    return {"families": dict(sorted(families.items())), "largest_fall": falls, "values": values}


def other_machine(rev: str) -> dict:
    """The committed accuracies against those rev measured on its machine, in pp."""
    from quantpipe.machine import describe

    theirs = at_revision(rev, ROOT)
    ours, other = scores(summary(ROOT)), scores(theirs.summary)
    return {"rev": rev, "machine": describe(theirs.machine or {}),
            "diff_pp": {p: round((other[p] - ours[p]) * 100, 2) for p in ours if p in other}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="bench runs in all (>= 2)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-spread"))
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "metrics" / "spread.json")
    parser.add_argument("--other", metavar="REV", help="a commit measured on another machine")
    parser.add_argument("--update", action="store_true",
                        help="measure nothing: add --other to the existing --out")
    args = parser.parse_args()
    if args.update:
        record = json.loads(args.out.read_text())
        record["accuracy"]["other_machine"] = other_machine(args.other)
        write_json(args.out, record)
        print(f"-> {args.out}")
        return
    from quantpipe import machine

    repo, log = clone(ROOT, args.workdir)
    print(f"dvc repro in {repo} (log: {log})")
    dvc(repo, log, "repro")
    committed = scores(summary(ROOT))
    rerun = scores(summary(repo))
    runs = [summary(repo)]
    benches = [f"bench@{v}" for v in VARIANTS]
    for i in range(1, args.runs):
        print(f"bench run {i + 1}/{args.runs}")
        dvc(repo, log, "repro", "-f", "-s", *benches)
        dvc(repo, log, "repro", "report")
        runs.append(summary(repo))

    by_seed = {0: rerun}
    for seed in args.seeds:
        print(f"seed {seed}: train to evaluate")
        set_params(repo, {"seed": seed})
        dvc(repo, log, "repro", *[f"evaluate@{v}" for v in VARIANTS])
        by_seed[seed] = {f"{v}.accuracy": json.loads((repo / f"metrics/eval/{v}.json").read_text())
                         .get("accuracy") for v in VARIANTS}
    seeds = {path: [by_seed[s].get(path) for s in by_seed] for path in rerun}
    seeds = {p: v for p, v in seeds.items() if None not in v}
    record = {
        "machine": machine.describe(machine.probe()),
        "bench_runs": args.runs,
        "speedup": speedup_spread(runs),
        "accuracy": {
            "rerun_pp": {p: round(abs(rerun[p] - committed[p]) * 100, 2) for p in rerun if p in committed},
            "seeds": list(by_seed),
            "by_seed": seeds,
            "seed_range_pp": {p: round((max(v) - min(v)) * 100, 2) for p, v in seeds.items()},
        },
    }
    if args.other:
        record["accuracy"]["other_machine"] = other_machine(args.other)
    write_json(args.out, record)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
