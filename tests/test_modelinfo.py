"""What a brought model states about its inputs (Ultralytics' ONNX metadata), the presets, and
the splits a detection dataset declares: prepare takes them as given."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import TINY_PARAMS, make_project
from quantpipe import data, modelinfo
from quantpipe.detection import folders
from quantpipe.detection.listing import list_source
from quantpipe.errors import UserError
from quantpipe.schemas.prepare import PrepareParams
from test_failures import error_line, run_script, snapshot, temp_leftovers

ULTRALYTICS_META = {"description": "Ultralytics YOLO11n model trained on data.yaml",
                    "author": "Ultralytics", "version": "8.4.190", "license": "AGPL-3.0",
                    "stride": "32", "task": "detect", "batch": "1", "imgsz": "[64, 64]",
                    "names": "{0: 'digit0', 1: 'digit1', 2: 'digit2'}", "channels": "3"}


def identity_model(path: Path, meta: dict[str, str] | None = None) -> Path:
    """A one-node ONNX file carrying `meta` as its metadata_props."""
    x = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, "h", "w"])
    y = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 3, "h", "w"])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["images"], ["out"])],
                                                "g", [x], [y]))
    for k, v in (meta or {}).items():
        model.metadata_props.add(key=k, value=v)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def test_an_ultralytics_export_states_rgb_unit_pixels_letterboxed_grey_its_size_and_classes(tmp_path):
    s = modelinfo.stated(identity_model(tmp_path / "y.onnx", ULTRALYTICS_META))
    assert s.task == "detection" and s.image_size == 64 and s.channels == 3
    assert s.pad_value == 114 and s.class_names == ("digit0", "digit1", "digit2")
    assert s.by.startswith("Ultralytics 8.4.190")
    # pixel/255 as it is: mean 0, std 1 on every channel.
    assert modelinfo.broadcast(s.mean, 3, "m") == (0.0,) * 3
    assert modelinfo.broadcast(s.std, 3, "s") == (1.0,) * 3
    assert modelinfo.stated(identity_model(tmp_path / "plain.onnx")) is None


@pytest.mark.parametrize("meta, named", [
    ({"imgsz": "[480, 640]"}, "square"), ({"task": "pose"}, "task 'pose'"),
    ({"names": "{0: 'a'"}, "names")])
def test_what_quantpipe_cannot_take_from_the_metadata_is_one_line(tmp_path, meta, named):
    path = identity_model(tmp_path / "y.onnx", {**ULTRALYTICS_META, **meta})
    with pytest.raises(UserError, match=named):
        modelinfo.stated(path)


def test_the_model_fills_what_params_leave_null_and_explicit_params_win(tmp_path):
    s = modelinfo.stated(identity_model(tmp_path / "y.onnx", ULTRALYTICS_META))
    p = PrepareParams(task="detection").for_model(s)
    assert (p.image_size, p.channels, p.pad_value, p.mean, p.std) == (64, 3, 114, (0.0,), (1.0,))
    p = PrepareParams(task="detection", image_size=96, pad_value=0, mean="imagenet").for_model(s)
    assert (p.image_size, p.pad_value, p.mean) == (96, 0, (0.485, 0.456, 0.406))
    # Nothing stated: the task's defaults, black padding for quantpipe's own detectors.
    p = PrepareParams(task="detection").for_model(None)
    assert (p.image_size, p.pad_value, p.mean) == (64, 0, None)
    assert PrepareParams().for_model(None).image_size == 28


def test_presets_and_one_value_lists_broadcast_to_the_channel_count():
    split = data.Split(x=np.zeros((4, 3, 8, 8), np.uint8), y=np.arange(4))
    info = data.compute_info("x", split, 4, mean_std=((0.0,), (1.0,)))
    assert info.mean == (0.0, 0.0, 0.0) and info.std == (1.0, 1.0, 1.0)
    assert PrepareParams(mean="unit").std == (1.0,)
    grey = data.Split(x=np.zeros((4, 1, 8, 8), np.uint8), y=np.arange(4))
    with pytest.raises(UserError, match="prepare.mean has 3 values; the images have 1 channel"):
        data.compute_info("x", grey, 4, mean_std=PRESETS_IMAGENET)


PRESETS_IMAGENET = modelinfo.PRESETS["imagenet"]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    return make_project(tmp_path_factory.mktemp("brought"), TINY_PARAMS)


def _prepare(repo: Path, params: dict) -> object:
    from conftest import set_params

    original = (repo / "params.yaml").read_text()
    set_params(repo, params)
    try:
        return run_script(repo, "prepare")
    finally:
        (repo / "params.yaml").write_text(original)


def test_a_brought_onnx_that_states_nothing_asks_for_mean_and_std_and_writes_nothing(fresh):
    identity_model(fresh / "inputs" / "plain.onnx")
    before = snapshot(fresh)
    line = error_line(_prepare(fresh, {"train": {"model": "onnx:inputs/plain.onnx"}}))
    assert "inputs/plain.onnx" in line and "prepare.mean/prepare.std" in line
    assert "prepare.mean=unit" in line and "imagenet" in line
    assert snapshot(fresh) == before and temp_leftovers(fresh) == []
    # Stated in params instead: prepare runs (pixel/255 on the digits' one channel).
    result = _prepare(fresh, {"train": {"model": "onnx:inputs/plain.onnx"},
                              "prepare": {"mean": "unit"}})
    assert result.returncode == 0, result.stderr
    meta = json.loads((fresh / "data/prepared/meta.json").read_text())
    assert meta["mean"] == [0.0] and meta["std"] == [1.0]


def test_a_model_whose_classes_are_not_the_datasets_is_one_line_naming_both(fresh, tmp_path):
    identity_model(fresh / "inputs" / "yolo.onnx", ULTRALYTICS_META)
    folders.write_folder("yolo", fresh / "inputs" / "digits4", size=64, classes=4, images=40)
    before = snapshot(fresh)
    line = error_line(_prepare(fresh, {"train": {"model": "onnx:inputs/yolo.onnx"}, "prepare": {
        "task": "detection", "source": "yolo", "path": "inputs/digits4"}}))
    assert "'digit3'" in line and "['digit0', 'digit1', 'digit2']" in line, line
    assert "Ultralytics 8.4.190" in line
    assert snapshot(fresh) == before


def test_an_ultralytics_model_on_its_own_dataset_takes_its_splits_and_preprocessing(fresh):
    identity_model(fresh / "inputs" / "yolo.onnx", ULTRALYTICS_META)
    root = folders.write_folder("yolo", fresh / "inputs" / "digits3", size=48, classes=3,
                                images=120)
    result = _prepare(fresh, {"train": {"model": "onnx:inputs/yolo.onnx"}, "prepare": {
        "task": "detection", "source": "yolo", "path": "inputs/digits3", "calib_size": 256}})
    assert result.returncode == 0, result.stderr
    assert "calibrating on half of them" in result.stderr  # 256 > the train split
    prep = json.loads((fresh / "metrics/prepare.json").read_text())
    declared = {s: len(list((root / "images" / s).iterdir())) for s in ("train", "val", "test")}
    assert prep["declared_splits"] == declared
    # Declared train/val/test are used as given: the reported score is on the dataset's test.
    assert (prep["train_samples"], prep["val_samples"], prep["test_samples"]) == \
        (declared["train"], declared["val"], declared["test"])
    assert prep["calib_samples"] == declared["train"] // 2
    assert prep["preprocessing_from"].startswith("Ultralytics 8.4.190 (inputs/yolo.onnx)")
    meta = json.loads((fresh / "data/prepared/meta.json").read_text())
    assert meta["image_size"] == 64 and meta["channels"] == 3 and meta["pad_value"] == 114
    assert meta["mean"] == [0.0] * 3 and meta["std"] == [1.0] * 3
    assert meta["model_family"] == "ultralytics"  # its mAP is scored as its validator does
    assert np.load(fresh / "data/prepared/test_x.npy").shape[1:] == (3, 64, 64)
    files = (fresh / "data/prepared/test_files.txt").read_text().split()
    assert files and all(f.startswith("images/test/") for f in files)


def test_a_dataset_declaring_train_and_val_reports_on_val_and_judges_on_part_of_train(tmp_path):
    root = folders.write_folder("yolo", tmp_path / "d", size=32, classes=3, images=100)
    spec = (root / "data.yaml").read_text().replace("test: images/test\n", "")
    (root / "data.yaml").write_text(spec)
    listing = list_source("yolo", str(root), None, 32)
    assert set(listing.declared) == {"train", "val"}
    y = np.zeros(len(listing.files), np.int64)
    parts = data.declared_split(listing.declared, y, 0.1, seed=0)
    assert np.array_equal(parts["test"], listing.declared["val"])
    assert set(parts["val"]) <= set(listing.declared["train"])
    assert not set(parts["val"]) & set(parts["train"])
    assert len(parts["train"]) + len(parts["val"]) == len(listing.declared["train"])


def test_coco_per_split_annotation_files_are_the_splits(tmp_path):
    root = folders.write_folder("coco", tmp_path / "c", size=32, classes=3, images=60)
    listing = list_source("coco", str(root), None, 32)
    counts = {s: len(json.loads((root / "annotations" / f"instances_{s}.json").read_text())["images"])
              for s in ("train", "val", "test")}
    assert {s: len(i) for s, i in listing.declared.items()} == counts
    assert listing.category_ids == (1, 2, 3) and listing.class_names == ("digit0", "digit1", "digit2")
    assert listing.channels == 3


def test_a_wide_image_is_letterboxed_on_the_stated_grey(tmp_path):
    from PIL import Image

    from quantpipe import imagefolder

    Image.fromarray(np.full((24, 48, 3), 200, np.uint8)).save(tmp_path / "wide.png")
    out = imagefolder.decode(tmp_path / "wide.png", imagefolder.Transform(3, 64, pad_value=114))
    # 48 x 24 scaled to 64 x 32, centred: grey bands of 16 rows above and below.
    assert (out[:, :16] == 114).all() and (out[:, -16:] == 114).all() and (out[:, 16:48] == 200).all()


def test_an_ultralytics_model_is_scored_as_its_validator_scores_it():
    from quantpipe.detection import post
    from quantpipe.schemas.detect import DetectParams

    assert DetectParams().for_model("ultralytics").decode_args(for_map=True) == {
        "score_threshold": 0.001, "iou_threshold": 0.7, "max_detections": 300, "multi_label": True}
    ours = DetectParams().for_model(None)
    assert ours.map_protocol == "quantpipe" and "multi_label" not in ours.decode_args(for_map=True)
    assert DetectParams(map_protocol="quantpipe").for_model("ultralytics").map_protocol == "quantpipe"
    # One anchor, two classes above the threshold: two candidates multi-label, one otherwise.
    out = np.array([[[10.0], [10.0], [4.0], [4.0], [0.6], [0.3], [0.0]]], np.float32)
    assert [len(d) for d in post.decode(out, score_threshold=0.1, iou_threshold=0.7,
                                        max_detections=300)] == [1]
    both = post.decode(out, score_threshold=0.1, iou_threshold=0.7, max_detections=300,
                       multi_label=True)[0]
    assert sorted(both.labels.tolist()) == [0, 1] and sorted(both.scores.tolist()) == [
        pytest.approx(0.3), pytest.approx(0.6)]
