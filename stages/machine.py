"""machine: record this machine (CPU model, INT8-relevant ISA flags, cores, runtime versions) in
metrics/machine.json.

DVC runs this probe on every `dvc repro` (always_changed). On the machine that wrote the file
it comes out byte-identical, so nothing downstream re-runs; on another machine the stages that
measure (evaluate, bench, bench_torch, report) depend on a changed file and are re-measured.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe import machine  # noqa: E402
from quantpipe.io import run_stage, write_json  # noqa: E402


def main() -> None:
    info = machine.probe()
    write_json(machine.MACHINE_FILE, info)
    print(f"machine: {machine.describe(info)}")


if __name__ == "__main__":
    run_stage(main)
