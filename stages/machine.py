"""machine: record this machine (CPU model, INT8-relevant ISA flags, cores, runtime versions) in
metrics/machine.json, and in metrics/int8.json whether its INT8 kernels overflow 8-bit weights.

DVC runs this probe on every `dvc repro` (always_changed). On the machine that wrote the file
it comes out byte-identical, so nothing downstream re-runs; on another machine the stages that
measure (evaluate, bench, bench_torch, report) depend on a changed file and are re-measured;
the quantize stages (reduce_range: auto) only where metrics/int8.json changes.
"""

from quantpipe import isa, machine
from quantpipe.io import run_stage, stage_args, write_json


def main(argv: list[str]) -> None:
    args = stage_args("machine", argv, "out", "int8")
    info = machine.probe()
    write_json(args.out, info)
    write_json(args.int8, isa.int8_record(info))
    print(f"machine: {machine.describe(info)}")


if __name__ == "__main__":
    run_stage(main)
