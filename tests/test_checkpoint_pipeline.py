"""The model you already trained: a torchvision resnet18 trained elsewhere (scripts/
torchvision_checkpoint.py, plain torchvision) on an image folder, brought as a state_dict with its
own preprocessing, quantized as it is (train.epochs 0) and fine-tuned (train.epochs 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT, TINY_PARAMS, make_project, reproduce, set_params

RESIZE, CROP = 36, 32


def photo_folder(root: Path, classes: int = 3, per_class: int = 30) -> Path:
    """RGB photos of several sizes, none square: class k is a patch of colour k on noise."""
    rng = np.random.default_rng(0)
    colours = [(230, 40, 40), (40, 230, 40), (40, 40, 230)]
    for k in range(classes):
        (root / f"class_{k}").mkdir(parents=True)
        for i in range(per_class):
            h, w = (40, 52) if i % 2 else (50, 38)
            img = rng.integers(0, 80, (h, w, 3), dtype=np.uint8)
            top, left = rng.integers(4, h - 20), rng.integers(4, w - 20)
            img[top:top + 14, left:left + 14] = colours[k]
            Image.fromarray(img, "RGB").save(root / f"class_{k}" / f"{i:03d}.jpg", quality=90)
    return root


@pytest.mark.slow  # a whole pipeline with resnet18, then its train stage again: ~4 minutes
def test_a_resnet18_trained_elsewhere_is_quantized_as_it_is(tmp_path):
    repo = make_project(tmp_path / "repo", {
        **TINY_PARAMS,
        "prepare": {"source": "imagefolder", "path": "inputs/photos", "resize": RESIZE,
                    "crop": CROP, "mean": "imagenet", "std": "imagenet", "calib_size": 32},
        "train": {"model": "resnet18", "weights": "inputs/resnet18.pth", "epochs": 0,
                  "batch_size": 16},
        "quantize_static": {"allow_accuracy_drop": True},
        "quantize_qat": {"epochs": 1, "batch_size": 16},
        "evaluate": {"batch_size": 16}})
    photos = photo_folder(repo / "inputs" / "photos")
    trained = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "torchvision_checkpoint.py"), "--folder", str(photos),
         "--model", "resnet18", "--epochs", "1", "--resize", str(RESIZE), "--crop", str(CROP),
         "--out", str(repo / "inputs" / "resnet18.pth"),
         "--predictions", str(tmp_path / "predictions.json")],
        capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-2000:]
    own = json.loads((tmp_path / "predictions.json").read_text())

    reproduce(repo)
    meta = json.loads((repo / "data/prepared/meta.json").read_text())
    assert (meta["resize"], meta["crop"], meta["image_size"]) == (RESIZE, CROP, CROP)
    assert meta["mean"] == [0.485, 0.456, 0.406] and meta["std"] == [0.229, 0.224, 0.225]
    # The FP32 ONNX model's test predictions are the checkpoint's own, image by image.
    test_files = (repo / "data/prepared/test_files.txt").read_text().split()
    confusion = json.loads((repo / "metrics/plots/confusion_fp32.json").read_text())
    assert len(test_files) == len(confusion) == 18
    assert [row["predicted"] for row in confusion] == [own[f] for f in test_files]
    train = json.loads((repo / "metrics/train.json").read_text())
    assert train["epochs"] == 0 and train["weights"] == "inputs/resnet18.pth"
    labels = [row["actual"] for row in confusion]
    assert train["test_accuracy"] == pytest.approx(
        np.mean([own[f] == y for f, y in zip(test_files, labels)]), abs=1e-6)
    # model.pt holds the checkpoint's weights, unchanged.
    brought = torch.load(repo / "inputs/resnet18.pth", weights_only=True)
    kept = torch.load(repo / "models/model.pt", weights_only=True)
    assert brought.keys() == kept.keys() and all(torch.equal(brought[k], kept[k]) for k in brought)
    # Every variant was made from it and measured.
    summary = json.loads((repo / "metrics/summary.json").read_text())
    for variant in ("fp32", "dynamic", "static", "qat"):
        assert (repo / f"models/{variant}.onnx").stat().st_size > 0, variant
        assert summary[variant]["accuracy"] >= 0 and summary[variant]["latency_p50_ms"], variant
        assert variant == "fp32" or summary[variant]["speedup"], variant
    assert summary["fp32"]["accuracy"] == train["test_accuracy"]

    # train.epochs 1: fine-tuned from the checkpoint (its scores kept beside the new ones).
    set_params(repo, {"train": {"epochs": 1}})
    assert "train" in reproduce(repo, "train")
    tuned = json.loads((repo / "metrics/train.json").read_text())
    assert tuned["epochs"] == 1 and tuned["checkpoint"]["val_accuracy"] == train["val_accuracy"]
    assert "val_accuracy" in tuned and "train_loss" in tuned
    after = torch.load(repo / "models/model.pt", weights_only=True)
    assert not all(torch.equal(after[k], kept[k]) for k in kept)
