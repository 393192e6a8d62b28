#!/usr/bin/env python3
"""One member of every torchvision classifier family through the real pipeline: README's table.

In a clone of this repository (its own DVC cache), one `dvc exp run` per model, as a new user
would try them:

    dvc exp run -S train.model=<name> -S prepare.image_size=32 -S prepare.channels=3 \\
        -S train.epochs=2 ...

with the bench narrowed to batches 1 and 32 on 1 thread (the table's column; a wider grid only
makes the sweep longer) and gates reported, not enforced (a model INT8 does not pay for, or a
variant that fails its check, is a row of the table, not a stop); everything else, QAT
included, at the defaults. A model that cannot take 32 px fails in one line naming the nearest
valid `prepare.image_size`; the script records that line and runs the model again at the
printed size, so the table shows both.

    python scripts/families.py                       # -> metrics/families.json + table
    python scripts/families.py --only vit_b_16 mnasnet0_5 -o /tmp/f.json
    python scripts/families.py --resume              # keep rows already in the output file
    make docs                                        # docs/families.md table from metrics/families.json

About 2-3 hours on 2 cores for all 21 (the transformers and wide CNNs take longest).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from quantpipe import report
from quantpipe.docs import families_table
from quantpipe.io import write_json
from quantpipe.schemas.all import load_params
from quantpipe.studies import dvc
from quantpipe.sweep import error_line

ROOT = Path(__file__).resolve().parents[1]

# (family, member): the ten models, and one member of each family it did not try.
MEMBERS = [
    ("AlexNet", "alexnet"), ("ResNet", "resnet18"), ("ResNeXt", "resnext50_32x4d"),
    ("Wide ResNet", "wide_resnet50_2"), ("VGG", "vgg11"), ("DenseNet", "densenet121"),
    ("SqueezeNet", "squeezenet1_1"), ("ShuffleNet", "shufflenet_v2_x1_0"),
    ("MobileNet v2", "mobilenet_v2"), ("MobileNet v3", "mobilenet_v3_small"),
    ("MNASNet", "mnasnet0_5"), ("EfficientNet", "efficientnet_b0"),
    ("EfficientNet v2", "efficientnet_v2_s"), ("RegNet", "regnet_y_400mf"),
    ("ConvNeXt", "convnext_tiny"), ("GoogLeNet", "googlenet"), ("Inception v3", "inception_v3"),
    ("ViT", "vit_b_16"), ("Swin", "swin_t"), ("Swin v2", "swin_v2_t"), ("MaxViT", "maxvit_t"),
]
SIZE, BATCH = 32, 32
# Same for every row; the model and image size come per run.
SETTINGS = {"prepare.channels": 3, "train.epochs": 2, "bench.batch_sizes": f"[1,{BATCH}]",
            "bench.threads": "[1]", "bench.warmup": 3, "bench.runs": 30, "bench.rounds": 3,
            "gates.enforce": "false"}
NEAREST = re.compile(r"nearest valid prepare\.image_size is (\d+)")


def experiment(repo: Path, log: Path, model: str, size: int, extra: dict[str, str]
               ) -> tuple[float, str | None]:
    """`dvc exp run` for one model and size: (seconds, None) or (seconds, the stage's error line)."""
    flags = [f"-S{k}={v}" for k, v in {"train.model": model, "prepare.image_size": size,
                                       **SETTINGS, **extra}.items()]
    start = time.perf_counter()
    mark = log.stat().st_size if log.exists() else 0
    try:
        dvc(repo, log, "exp", "run", *flags)
        return time.perf_counter() - start, None
    except SystemExit:
        seconds = time.perf_counter() - start
        text = log.read_bytes()[mark:].decode(errors="replace")  # mark is a byte offset
        return seconds, error_line(text)


def row(repo: Path, family: str, model: str, size: int, seconds: float) -> dict:
    read = lambda rel: json.loads((repo / rel).read_text())  # noqa: E731
    summary = read("metrics/summary.json")
    bs = f"bs{BATCH}"

    def one_thread(variant: str) -> float | None:
        s = summary.get(variant)
        return s["by_threads"]["threads1"]["speedup"][bs] if s else None

    recommended = summary["recommended"][bs]
    chosen = summary.get(recommended["variant"])
    # The contract the table checks: the recommended variant is no slower than FP32 in any
    # measurement at this batch size (every thread count, and its best configuration).
    never_slower = recommended["variant"] == "fp32" or (
        all(t["speedup"][bs] >= 1 for t in chosen["by_threads"].values())
        and chosen["best"]["latency"][bs]["speedup"] >= 1)
    gates = load_params(repo / "params.yaml").gates
    static_stage, qat_stage = read("metrics/quantize_static.json"), read("metrics/quantize_qat.json")

    def variant(name: str) -> dict:
        s = summary.get(name)
        if s is None:
            return {"skipped": summary.get("skipped", {}).get(name)}
        return {"accuracy": s["accuracy"], "agreement": s["agreement"],
                "speedup": one_thread(name), **({"failed": s["failed"]} if "failed" in s else {})}

    return {
        "family": family, "model": model, "image_size": size, "result": "ok",
        "fp32_accuracy": summary["fp32"]["accuracy"],
        "static": {**variant("static"), "pool_agreement": static_stage["pool"]["agreement"],
                   "rule": static_stage["rule"], "calibrate_method": static_stage.get("calibrate_method"),
                   "op_types_to_quantize": static_stage.get("op_types_to_quantize"),
                   "nodes_in_float": len(static_stage["nodes_in_float"])},
        "qat": {**variant("qat"), **({"parity_agreement": qat_stage["parity"]["agreement"],
                                      "parity_max_abs_diff": qat_stage["parity"]["max_abs_diff"]}
                                     if "parity" in qat_stage else {})},
        "dynamic": variant("dynamic"),
        "fp32_p50_ms": summary["fp32"]["by_threads"]["threads1"]["latency_p50_ms"][bs],
        "recommended": recommended, "recommended_never_slower": never_slower,
        "gate_failures": report.check_gates(summary, gates),
        "seconds": round(seconds, 1), "cpu": summary["machine"].get("cpu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-families"))
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "metrics/families.json")
    parser.add_argument("--only", nargs="+", metavar="MODEL", help="these members only")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --output")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more params for every run (e.g. a quantization setting to compare)")
    args = parser.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.set)
    members = [(f, m) for f, m in MEMBERS if not args.only or m in args.only]
    done = json.loads(args.output.read_text())["rows"] if args.resume and args.output.exists() else []
    repo, log = args.workdir / "repo", args.workdir / "exp.log"
    if not (args.resume and repo.exists()):
        shutil.rmtree(args.workdir, ignore_errors=True)
        args.workdir.mkdir(parents=True)
        subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    rows = list(done)
    order = {m: i for i, (_, m) in enumerate(MEMBERS)}
    for family, model in members:
        if any(r["model"] == model for r in done):
            continue
        size = SIZE
        while True:
            seconds, error = experiment(repo, log, model, size, extra)
            fix = NEAREST.search(error or "")
            latest = row(repo, family, model, size, seconds) if error is None else {
                "family": family, "model": model, "image_size": size,
                "result": error.removeprefix("error: "), "seconds": round(seconds, 1)}
            rows = sorted([*rows, latest], key=lambda r: order[r["model"]])  # stable
            write_json(args.output, {"settings": {**SETTINGS, **extra}, "rows": rows})
            print(families_table({"settings": SETTINGS, "rows": [latest]}).splitlines()[-1], flush=True)
            # The line names the size that works: run again at it, once.
            if not fix or int(fix.group(1)) == size:
                break
            size = int(fix.group(1))
    print(families_table({"settings": SETTINGS, "rows": rows}))


if __name__ == "__main__":
    main()
