"""Semantic segmentation, the third task: digit canvases with masks, a `masks` folder with its
errors, torchmetrics' mIoU, the task's parity on masks, and the pipeline end to end with no
stage of its own."""

import json

import numpy as np
import pytest
from PIL import Image

from conftest import TINY_PARAMS, make_project, reproduce
from quantpipe.data import DataInfo, Split
from quantpipe.detection.data import digit_canvases
from quantpipe.errors import UserError
from quantpipe.segmentation import data as seg_data
from quantpipe.segmentation import metrics
from quantpipe.sources import load_mnist5k
from quantpipe.tasks import bind

ALL_STAGES = {"machine", "prepare", "train", "export", "simplify", "quantize_dynamic",
              "quantize_static", "quantize_qat", "bench_torch", "report",
              *(f"{s}@{v}" for s in ("evaluate", "bench")
                for v in ("fp32", "dynamic", "static", "qat", "bf16"))}
SEG = {**TINY_PARAMS, "prepare": {"task": "segmentation", "image_size": 32, "calib_size": 32},
       "train": {"model": None, "epochs": 2, "batch_size": 16},
       "quantize_static": {"allow_accuracy_drop": True}, "evaluate": {"batch_size": 32}}


def test_digit_masks_cover_each_digit_on_the_detection_canvases():
    digits = load_mnist5k()
    x, objects, _ = digit_canvases(digits.x, digits.y, 32)
    x2, masks, names = seg_data.load_digit_masks(None, 32)
    assert np.array_equal(x, x2) and masks.shape == (len(x), 32, 32)  # the same canvases
    assert names[0] == "background" and len(names) == 11
    for i in range(20):  # every digit's box holds its class and nothing else does
        classes = set(np.unique(masks[i])) - {0, seg_data.IGNORE}
        assert classes == {int(o[4]) + 1 for o in objects[i]}
        for x1, y1, x2_, y2, label in objects[i]:
            inside = masks[i, int(y1):int(np.ceil(y2)), int(x1):int(np.ceil(x2_))]
            assert (inside == label + 1).any()
    strata = seg_data.strata(masks[:20], 11)
    assert all(s in {int(o[4]) + 1 for o in objects[i]} for i, s in enumerate(strata))


def _mask_folder(root, n=6, size=(20, 16)):
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    (root / "classes.txt").write_text("background\nsquare\ndisc\n")
    for i in range(n):
        img = rng.integers(0, 60, (size[1], size[0], 3), np.uint8)
        mask = np.zeros((size[1], size[0]), np.uint8)
        mask[2:8, 2:8] = 1 + i % 2
        mask[0, 0] = 255
        img[mask > 0] = (200, 50, 50) if i % 2 == 0 else (50, 200, 50)
        Image.fromarray(img).save(root / "images" / f"im{i}.png")
        Image.fromarray(mask).save(root / "masks" / f"im{i}.png")
    return root


def test_a_masks_folder_loads_squeezed_with_nearest_masks(tmp_path):
    root = _mask_folder(tmp_path / "seg")
    x, masks, names = seg_data.load_mask_folder(root, None, 8)
    assert x.shape == (6, 3, 8, 8) and masks.shape == (6, 8, 8) and names == ("background", "square", "disc")
    assert set(np.unique(masks)) <= {0, 1, 2, 255}  # nearest: no class invented at a boundary
    grey, _, _ = seg_data.load_mask_folder(root, 1, 8)
    assert grey.shape == (6, 1, 8, 8)


@pytest.mark.parametrize("spoil, message", [
    (lambda r: (r / "masks" / "im1.png").unlink(), r"im1.png: missing"),
    (lambda r: (r / "masks" / "im2.png").write_bytes(b"not a png"), r"im2.png: unreadable"),
    (lambda r: Image.fromarray(np.zeros((5, 5), np.uint8)).save(r / "masks" / "im3.png"),
     r"im3.png: 5x5 px, its image im3.png is 20x16"),
    (lambda r: Image.fromarray(np.full((16, 20), 7, np.uint8)).save(r / "masks" / "im4.png"),
     r"im4.png: class index 7 out of range: classes.txt names 3 classes"),
    (lambda r: Image.fromarray(np.zeros((16, 20, 3), np.uint8)).save(r / "masks" / "im5.png"),
     r"im5.png: mode RGB"),
    (lambda r: (r / "classes.txt").unlink(), r"classes.txt: missing"),
])
def test_a_bad_record_ends_in_one_line_naming_the_file(tmp_path, spoil, message):
    root = _mask_folder(tmp_path / "seg")
    spoil(root)
    with pytest.raises(UserError, match=message):
        seg_data.load_mask_folder(root, None, 8)


def test_miou_comes_from_torchmetrics_over_the_classes_present():
    target = np.array([[[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 255, 255], [2, 2, 0, 0]]], np.uint8)
    pred = target.copy()
    pred[0, 0, 2] = 0  # one class-1 pixel called background
    pred[0, 2, 2] = 1  # an ignored pixel: counts for nothing
    logits = np.eye(4, dtype=np.float32)[pred.astype(int) % 4].transpose(0, 3, 1, 2)  # class 3 unused
    s = metrics.scores(logits, target, 4)
    iou_0, iou_1 = 6 / 7, 3 / 4  # class 0: 6 of 7 in the union; class 1: 3 of 4
    assert s["per_class_iou"] == {"0": round(iou_0, 6), "1": 0.75, "2": 1.0}  # 3: absent
    assert s["miou"] == pytest.approx((iou_0 + iou_1 + 1.0) / 3, abs=1e-6)
    assert s["pixel_accuracy"] == pytest.approx(13 / 14, abs=1e-6)
    assert metrics.pixel_agreement(logits, logits) == 1.0


def test_predicted_masks_are_coco_rle_that_decode_back():
    from pycocotools import mask as rle

    logits = np.random.default_rng(0).normal(size=(2, 3, 6, 5)).astype(np.float32)
    results = metrics.results(logits, [0, 1, 2])
    for image in range(2):
        decoded = np.zeros((6, 5), np.int64)
        for r in (r for r in results if r["image_id"] == image):
            seg = {"size": r["segmentation"]["size"], "counts": r["segmentation"]["counts"].encode()}
            decoded[rle.decode(seg).astype(bool)] = r["category_id"]
        assert np.array_equal(decoded, logits[image].argmax(0))


def test_the_task_checks_its_output_layout_and_masks_at_every_hop():
    info = DataInfo(source="digits_masks", num_classes=3, channels=1, image_size=4, mean=(0.5,),
                    std=(0.5,), task="segmentation")
    task = bind.get("segmentation")(info)
    with pytest.raises(UserError, match=r"a segmenter must give \(batch, 3 classes, 4, 4\)"):
        task.check_output(np.zeros((2, 3), np.float32), "brought.onnx")
    out = np.random.default_rng(1).normal(size=(8, 3, 4, 4)).astype(np.float32)
    assert task.parity_record(out + 1e-7, out, "models/fp32.onnx", "models/exported.onnx") == {
        "mask_parity": {"samples": 8, "pixel_agreement": 1.0}}
    flipped = out.copy()
    flipped[:, 0] += 10  # every pixel becomes class 0
    with pytest.raises(UserError, match="models/fp32.onnx: its masks agree with models/exported"):
        task.parity_record(flipped, out, "models/fp32.onnx", "models/exported.onnx")
    masks = out.argmax(1).astype(np.uint8)
    judge = task.static_judge(out, out, Split(x=np.zeros((8, 1, 4, 4), np.uint8),
                                              y=np.zeros(8, np.int64), masks=masks),
                              _static_params())
    assert judge.fp32_score == 1.0 and not judge.check(out, out).real
    assert judge.check(flipped, flipped).real  # every object pixel lost


@pytest.mark.parametrize("name", ["tiny_segmenter", "lraspp_mobilenet_v3_large",
                                  "deeplabv3_mobilenet_v3_large"])
def test_every_segmenter_gives_per_pixel_logits_at_the_input_size(name):
    import torch

    from quantpipe import models

    model = models.build_model(name, 1, 64, 5).eval()  # grey canvases: the stem conv adapted
    with torch.no_grad():
        assert tuple(model(torch.zeros(2, 1, 64, 64)).shape) == (2, 5, 64, 64)
    bind.check_model("segmentation", name)
    with pytest.raises(UserError, match="is a segmentation model; set prepare.task: segmentation"):
        bind.check_model("classification", name)


def test_tiny_segmenter_names_the_image_sizes_it_takes():
    from quantpipe import models

    with pytest.raises(UserError, match="divisible by 8.*got 36; try 32"):
        models.build_model("tiny_segmenter", 1, 36, 5)


def _static_params():
    from quantpipe.schemas.quantize_static import QuantizeStaticParams

    return QuantizeStaticParams().for_task("segmentation")


def _digit_mask_folder(root, n=360, size=32):
    """The embedded canvases written as a `masks` folder: PNG images, 8-bit masks, classes.txt."""
    x, masks, names = seg_data.load_digit_masks(None, size)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    (root / "classes.txt").write_text("".join(f"{c}\n" for c in names))
    for i in range(n):
        Image.fromarray(x[i, 0]).save(root / "images" / f"{i:04d}.png")
        Image.fromarray(masks[i]).save(root / "masks" / f"{i:04d}.png")


@pytest.mark.slow  # two whole pipelines, ~4 minutes on 2 cores
@pytest.mark.parametrize("source", ["digits_masks", "masks"])
def test_the_pipeline_runs_segmentation_end_to_end_with_no_stage_of_its_own(tmp_path, source):
    params = SEG
    if source == "masks":
        params = {**SEG, "prepare": {**SEG["prepare"], "source": "masks", "path": "inputs/digits"}}
    repo = make_project(tmp_path / "repo", params)
    if source == "masks":
        _digit_mask_folder(repo / "inputs" / "digits")
    assert reproduce(repo) == ALL_STAGES
    summary = json.loads((repo / "metrics/summary.json").read_text())
    assert summary["task"] == "segmentation"
    fp32, static = summary["fp32"], summary["static"]
    assert 0 < fp32["miou"] <= 1 and "per_class_iou" in fp32 and "pixel_accuracy" in fp32
    assert "miou_drop_pts" in static and 0 <= static["agreement"] <= 1
    simplify = json.loads((repo / "metrics/simplify.json").read_text())
    assert simplify["mask_parity"]["pixel_agreement"] >= 0.999
    predictions = json.loads((repo / "data/predictions/static.json").read_text())
    test_images = json.loads((repo / "metrics/prepare.json").read_text())["test_samples"]
    assert {r["image_id"] for r in predictions} == set(range(test_images))
    report = (repo / "metrics/report.md").read_text()
    assert "mIoU" in report and "pixel agreement" in report
