#!/usr/bin/env python3
"""Quantization-aware training on a PTQ-hard model: the numbers behind README's QAT section.

The model is the default pipeline's, trained as usual, then given one outlier activation
channel in PyTorch — the first conv's output channel 5 times 300 (weights and bias), the second
conv's input from that channel divided by 300: the same FP32 function (ReLU and max-pooling
commute with a positive factor), the PyTorch twin of the accuracy study's `ptq_hard` ONNX model
(scripts/engines.py). One per-tensor activation range then spans 300 times the other channels'
values, and post-training quantization crushes them.

In a clone of this repository it runs the real pipeline: `dvc repro train`, replaces
models/model.pt by its twin (`dvc commit -f train`), then `dvc repro` with plain post-training
quantization (quantize_static.max_fallback_steps: 0) and again with the recovery ladder
(the params.yaml value), QAT with the params.yaml settings both times; and reads back test
accuracy, drop, flips and speed of static and qat.

    python scripts/qat_hard.py                          # -> metrics/qat_hard.json + table
    python scripts/qat_hard.py --workdir /tmp/qat-hard -o /tmp/qat_hard.json

About 2.5 minutes on 2 cores. The clone has its own DVC cache (see main).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from quantpipe.docs import qat_hard_table
from quantpipe.io import write_json
from quantpipe.studies import HARD_CHANNEL, HARD_SCALE, clone, dvc, repro, set_params

ROOT = Path(__file__).resolve().parents[1]

MODEL = "models/model.pt"


def outlier_twin(repo: Path) -> float:
    """Rewrite repo's models/model.pt (mnist_net) as its outlier twin; returns the largest
    logit difference between the two on the test split (float rounding only)."""
    import torch

    from quantpipe import data, models

    info = data.load_info(repo / "data/prepared")
    x = data.normalize(data.load_split(repo / "data/prepared", "test").x, info)
    model = models.load_weights(models.build_model("mnist_net", info.channels, info.image_size,
                                                   info.num_classes), repo / MODEL)
    before = models.predict_torch(model, x)
    with torch.no_grad():
        model.conv1.weight[HARD_CHANNEL] *= HARD_SCALE
        model.conv1.bias[HARD_CHANNEL] *= HARD_SCALE
        model.conv2.weight[:, HARD_CHANNEL] /= HARD_SCALE
    (repo / MODEL).write_bytes(models.state_dict_bytes(model))
    return float(abs(models.predict_torch(model, x) - before).max())


def rows(repo: Path, ladder: bool) -> list[dict]:
    read = lambda rel: json.loads((repo / rel).read_text())  # noqa: E731
    summary, static, qat = read("metrics/summary.json"), read("metrics/quantize_static.json"), \
        read("metrics/quantize_qat.json")
    out = []
    for variant in ("static", "qat"):
        s, ev = summary[variant], read(f"metrics/eval/{variant}.json")
        big = max(s["speedup"], key=lambda k: int(k[2:]))
        out.append({
            "variant": variant, "ladder": ladder if variant == "static" else None,
            "fp32_accuracy": summary["fp32"]["accuracy"], "accuracy": s["accuracy"],
            "drop_pp": s["accuracy_drop_pp"], "agreement": s["agreement"],
            "fp32_right_int8_wrong": ev["fp32_right_int8_wrong"],
            "int8_right_fp32_wrong": ev["int8_right_fp32_wrong"], "test_samples": ev["samples"],
            "nodes_in_float": len(static["nodes_in_float"]) if variant == "static" else 0,
            "batch": big, "speedup": s["speedup"][big],
            "speedup_1thread": s["by_threads"].get("threads1", {}).get("speedup", {}).get(big),
            "seconds": static["seconds"] if variant == "static" else qat["seconds"],
            "cpu": summary["machine"].get("cpu")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantpipe-qat-hard"))
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "metrics/qat_hard.json")
    args = parser.parse_args()
    repo, log = clone(ROOT, args.workdir)
    # Its own DVC cache: `dvc commit -f train` records the twin as train's output in the run
    # cache, which a shared cache would hand to this repository's next `dvc repro`.
    steps = yaml.safe_load((ROOT / "params.yaml").read_text())["quantize_static"]["max_fallback_steps"]
    set_params(repo, {"quantize_static": {"max_fallback_steps": 0, "allow_accuracy_drop": True},
                      "gates": {"enforce": False}})
    dvc(repo, log, "repro", "train")
    diff = outlier_twin(repo)
    if diff > 1e-3:
        raise SystemExit(f"the outlier twin is not the same function (max logit diff {diff:.3g})")
    dvc(repo, log, "commit", "-f", "train")  # the twin is train's output from now on
    repro(repo, log)
    table = rows(repo, ladder=False)
    set_params(repo, {"quantize_static": {"max_fallback_steps": steps}})
    repro(repo, log)  # only the static branch re-runs
    table = table[:1] + rows(repo, ladder=True)[:1] + table[1:]
    record = {"twin_max_logit_diff": diff, "scale": HARD_SCALE, "channel": HARD_CHANNEL,
              "rows": table}
    write_json(args.output, record)
    print(qat_hard_table(record))


if __name__ == "__main__":
    main()
