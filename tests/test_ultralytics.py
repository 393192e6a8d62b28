"""Real Ultralytics exports (tests/fixtures/ultralytics: YOLOv8n and YOLO11n graphs as
Ultralytics' exporter writes them, width-reduced, trained on the digit canvases) through the
README's YOLO recipe: the model's own preprocessing and the dataset's own splits give FP32 the
mAP Ultralytics' validator gives the same file on the same images, the convolutions go INT8,
the head's decode stays float, and the shipped model keeps the exporter's metadata."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from conftest import TINY_PARAMS, dvc, make_project
from quantpipe.detection import folders

FIXTURES = Path(__file__).parent / "fixtures" / "ultralytics"
RECORD = json.loads((FIXTURES / "fixtures.json").read_text())
# The dataset the fixtures were trained on: quantpipe writes it again, byte for byte.
SIZE, CLASSES = RECORD["imgsz"], RECORD["dataset"]["nc"]
# Correctness only: the fixtures are far too small for INT8 to pay (6 M MACs an image).
QUICK = {"bench": {**TINY_PARAMS["bench"], "batch_sizes": [1, 4], "threads": [1],
                   "runtimes": ["onnxruntime"]},
         "gates": {"enforce": False}}


def recipe_run(root: Path, family: str) -> Path:
    """The README's YOLO recipe on the fixture and its own dataset, in a fresh project."""
    # 64 calibration images, as the other tests' tiny runs: with the default 256, calibration is
    # most of the run (quantize_static took 92 s of 228 on an AVX2 EPYC, three ladder rungs).
    repo = make_project(root, {**QUICK, "prepare": {
        "task": "detection", "source": "yolo", "path": "inputs/digits", "calib_size": 64},
        "train": {"model": f"onnx:inputs/{family}.onnx"}})
    folders.write_folder("yolo", repo / "inputs" / "digits", size=SIZE, classes=CLASSES)
    shutil.copy(FIXTURES / f"{family}.onnx", repo / "inputs" / f"{family}.onnx")
    dvc(repo, "repro", timeout=1200)
    return repo


def read(repo: Path, rel: str) -> dict:
    return json.loads((repo / rel).read_text())


@pytest.mark.parametrize("family", [
    "yolo11n", pytest.param("yolov8n", marks=pytest.mark.slow)])
def test_an_ultralytics_export_runs_the_yolo_recipe_as_ultralytics_scores_it(tmp_path, family):
    repo = recipe_run(tmp_path / family, family)
    prepare = read(repo, "metrics/prepare.json")
    assert prepare["preprocessing_from"].startswith(f"Ultralytics 8.4.190 (inputs/{family}.onnx)")
    assert prepare["declared_splits"] == RECORD["dataset"]["images"]
    meta = read(repo, "data/prepared/meta.json")
    assert (meta["mean"], meta["std"], meta["pad_value"]) == ([0.0] * 3, [1.0] * 3, 114)

    # FP32 on the test split against Ultralytics' validator on the same file and images at
    # the model's imgsz (rect=False; `yolo val`'s default pads each batch by half a stride).
    ultralytics = RECORD["models"][family]["test_onnx"]["rect_false"]["mAP50-95"]
    fp32 = read(repo, "metrics/eval/fp32.json")
    assert abs(fp32["map_50_95"] - ultralytics) <= 0.005, (fp32["map_50_95"], ultralytics)

    q = read(repo, "metrics/quantize_static.json")
    graph = onnx.load(str(repo / "models/fp32.onnx")).graph
    nodes = {n.name: n for n in graph.node}
    head = "/model.23" if family == "yolo11n" else "/model.22"
    # Every convolution in INT8 but the DFL's fixed one; YOLO11's attention too.
    assert q["nodes_in_float"] == [f"{head}/dfl/conv/Conv"], q["nodes_in_float"]
    assert q["mac_share_int8"] > 0.99 and q["macs_by_op_type"]["Conv"] > 0.99
    # The decode float: the DFL, the class Sigmoid, the last Concat; no SiLU of the backbone.
    decode = set(q["decode_in_float"])
    last = next(n.name for n in graph.node if graph.output[0].name in n.output)
    assert {f"{head}/dfl/Softmax", f"{head}/dfl/conv/Conv", f"{head}/Sigmoid", last} <= decode
    readers = {i for n in graph.node if n.op_type == "Mul" for i in n.input}
    silu = [n.name for n in graph.node if n.op_type == "Sigmoid" and n.output[0] in readers]
    assert silu and not decode & set(silu)

    static = read(repo, "metrics/eval/static.json")
    assert static["map_drop_pts"] <= 1.0 and static["agreement"] >= 0.9, static
    summary = read(repo, "metrics/summary.json")
    assert summary["static"]["map_50_95"] == static["map_50_95"]
    # What ships keeps what the exporter stated: Ultralytics' own tools read it.
    kept = {p.key: p.value for p in onnx.load(str(repo / "models/static.onnx")).metadata_props}
    assert kept["author"] == "Ultralytics" and kept["imgsz"] == f"[{SIZE}, {SIZE}]"
