#!/usr/bin/env python3
"""Accuracy vs latency of DVC experiments, with the Pareto front flagged.

Reads `dvc exp show --json` (stdin or a file) and writes one row per commit/experiment that
has metrics/summary.json:

    experiment, rev, static_accuracy, static_p50_ms, batch_size, pareto

`static_p50_ms` is the p50 latency at the largest benchmarked batch (`batch_size`, the
largest `bsN` key of `latency_p50_ms`). A row is on the Pareto front (`pareto` true) when no
other row is at least as accurate and at least as fast, and strictly better in one of the two.

    dvc exp show --json | python scripts/pareto.py -o pareto.csv
    python scripts/pareto.py exp.json -o pareto.json            # JSON: a list of records
    dvc plots show pareto.csv -x static_p50_ms -y static_accuracy --template scatter

CSV goes to stdout without -o; the format follows the -o suffix (.json or .csv) unless
--format says otherwise. Rows without the summary (queued or failed experiments) are skipped
with a note on stderr; the workspace row is skipped unless --include-workspace (it normally
repeats the checked-out commit). Only the standard library is used.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

FIELDS = ("experiment", "rev", "static_accuracy", "static_p50_ms", "batch_size", "pareto")


def _entries(exp_show: list, include_workspace: bool):
    """Yield (name, rev, data-or-None) for each baseline commit and each experiment."""
    for row in exp_show:
        rev = row.get("rev", "")
        if rev != "workspace" or include_workspace:
            yield row.get("name") or (rev if rev == "workspace" else rev[:7]), rev, row.get("data")
        for exp in row.get("experiments") or []:
            revs = exp.get("revs") or []
            if not revs:
                continue
            head = revs[0]  # the experiment's own commit
            yield (exp.get("name") or head.get("name") or head.get("rev", "")[:7],
                   head.get("rev", ""), head.get("data"))


def _point(data: dict | None, summary: str, variant: str) -> tuple[float, float, int] | None:
    """(accuracy, p50 ms at the largest batch, that batch) of `variant` in `summary`, or None."""
    try:
        stats = data["metrics"][summary]["data"][variant]
        latency = stats["latency_p50_ms"]
        batch = max(int(key.removeprefix("bs")) for key in latency)  # numerically: bs64 > bs8
        return float(stats["accuracy"]), float(latency[f"bs{batch}"]), batch
    except (KeyError, TypeError, ValueError):
        return None


def pareto_rows(exp_show: list, *, summary: str = "metrics/summary.json",
                include_workspace: bool = False, warn=None) -> list[dict]:
    """Rows sorted by latency, each flagged `pareto` (maximize accuracy, minimize latency)."""
    rows = []
    for name, rev, data in _entries(exp_show, include_workspace):
        point = _point(data, summary, "static")
        if point is None:
            if warn:
                warn(f"skipping {name} ({rev[:7]}): no static accuracy/latency in {summary}")
            continue
        accuracy, p50, batch = point
        rows.append({"experiment": name, "rev": rev, "static_accuracy": accuracy,
                     "static_p50_ms": p50, "batch_size": batch})
    for row in rows:
        row["pareto"] = not any(
            other["static_accuracy"] >= row["static_accuracy"]
            and other["static_p50_ms"] <= row["static_p50_ms"]
            and (other["static_accuracy"] > row["static_accuracy"]
                 or other["static_p50_ms"] < row["static_p50_ms"])
            for other in rows)
    return sorted(rows, key=lambda r: (r["static_p50_ms"], -r["static_accuracy"], r["experiment"]))


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({**row, "pareto": "true" if row["pareto"] else "false"})
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", nargs="?", default="-",
                        help="`dvc exp show --json` output; - or omitted: stdin")
    parser.add_argument("-o", "--output", help="file to write (.csv or .json); default stdout")
    parser.add_argument("--format", choices=("csv", "json"),
                        help="default: from the -o suffix, else csv")
    parser.add_argument("--summary", default="metrics/summary.json", help="metrics file")
    parser.add_argument("--include-workspace", action="store_true")
    args = parser.parse_args(argv)

    text = sys.stdin.read() if args.input == "-" else Path(args.input).read_text()
    rows = pareto_rows(json.loads(text), summary=args.summary,
                       include_workspace=args.include_workspace,
                       warn=lambda msg: print(f"pareto.py: {msg}", file=sys.stderr))
    fmt = args.format or ("json" if args.output and args.output.endswith(".json") else "csv")
    body = json.dumps(rows, indent=2) + "\n" if fmt == "json" else to_csv(rows)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)  # e.g. plots/ in a fresh clone
        Path(args.output).write_text(body)
        front = sum(row["pareto"] for row in rows)
        print(f"pareto.py: wrote {len(rows)} rows ({front} on the Pareto front) to {args.output}",
              file=sys.stderr)
    else:
        sys.stdout.write(body)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
