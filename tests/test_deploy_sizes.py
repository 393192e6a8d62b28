"""scripts/deploy_sizes.py's reading of a pipeline run and the docs table it feeds: on the tiny
pipeline's run (the study itself runs ResNet-50 and its peers for an hour)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from quantpipe import criterion
from quantpipe.tables.deploy_sizes import deploy_sizes_table

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("deploy_sizes", ROOT / "scripts/deploy_sizes.py")
deploy_sizes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deploy_sizes)


def test_every_stage_of_a_run_is_read_with_its_time_and_memory(tiny_run):
    repo, ran = tiny_run
    stages = deploy_sizes.stage_resources(repo)
    expected = {s for s in ran if s not in ("machine", "report")}
    assert expected <= set(stages), expected - set(stages)
    assert all(r["seconds"] >= 0 and r["peak_rss_mb"] > 0 for r in stages.values())


def test_each_variant_on_each_runtime_against_the_best_fp32_of_its_rounds(tiny_run):
    repo, _ = tiny_run
    rows = deploy_sizes.variant_rows(repo)
    assert {"fp32", "dynamic", "static", "qat"} <= set(rows)
    static = json.loads((repo / "metrics/bench/static.json").read_text())
    cell = rows["static"]["latency"]["onnxruntime"]["threads1"]["bs8"]
    ort_fp32 = static["latency"]["threads1"]["bs8"]["baseline_p50_ms"]
    ov_fp32 = static["runtimes"]["openvino"]["baseline"]["latency"]["threads1"]["bs8"]["p50_ms"]
    assert cell["p50_ms"] == static["latency"]["threads1"]["bs8"]["p50_ms"]
    assert cell["speedup"] == round(min(ort_fp32, ov_fp32) / cell["p50_ms"], 3)
    # FP32's own row: 1.0 on the faster runtime, below 1 on the slower.
    fp32 = rows["fp32"]["latency"]
    assert max(fp32[rt]["threads1"]["bs8"]["speedup"] for rt in fp32) == 1.0


def test_a_model_at_chance_is_marked_so_in_the_table():
    assert criterion.above_chance(19, 72, 6) and not criterion.above_chance(13, 72, 6)
    cell = {"p50_ms": 10.0, "speedup": 2.0}
    model = {"image_size": 224, "green": True, "repro_seconds": 1800, "git_revision": "abc1234",
             "machine": {"cpu": "A CPU", "cores": 2, "cpu_flags": {}}, "classes": 6,
             "test_samples": 72, "above_chance": False,
             "variants": {"fp32": {"accuracy": 0.18, "size_bytes": 10**8, "latency": {
                 "onnxruntime": {"threads1": {"bs1": cell, "bs64": cell},
                                 "threads2": {"bs1": cell, "bs64": cell}}}}},
             "recommended": {"bs64": {"variant": "fp32", "runtime": "onnxruntime", "threads": 2}},
             "stages": {"train": {"seconds": 300.0, "peak_rss_mb": 5000.0}}}
    text = deploy_sizes_table({"models": {"resnet50": model}})
    assert "### ResNet-50 at 224 px" in text and "**at chance** (6 classes)" in text
    assert "| train | 300 | 4.9 GB |" in text and "10.0 ms (x2.00)" in text
