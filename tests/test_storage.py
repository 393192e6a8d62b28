"""Splits on disk read a batch at a time; image folders decoded in parallel with the model's own
preprocessing (torchvision's evaluation transform); evaluate's memory does not grow with the split."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import make_project
from helpers import TwoConvNet, export_to, structured_images
from quantpipe import data, imagefolder, sources
from quantpipe.schemas.prepare import PrepareParams
from quantpipe.storage import NpyRows, NpyWriter, save_rows


# --- storage ----------------------------------------------------------------------------------

def test_writer_gives_np_save_bytes_whatever_the_order(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, (300, 3, 5, 7), dtype=np.uint8)
    np.save(tmp_path / "a.npy", x)
    writer = NpyWriter(tmp_path / "b.npy", x.shape)
    for start in (256, 0, 128, 64, 192):
        writer.write(start, x[start:start + 64])
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
    save_rows(tmp_path / "c.npy", NpyRows(tmp_path / "a.npy"), batch=7)
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "c.npy").read_bytes()


def test_rows_index_like_the_array(tmp_path):
    x = np.random.default_rng(1).integers(0, 256, (50, 2, 3, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    rows = NpyRows(tmp_path / "x.npy")
    assert len(rows) == 50 and rows.shape == x.shape and rows.dtype == np.uint8
    idx = np.array([7, 8, 9, 3, 49, 0, 0])
    for key in (5, -1, slice(3, 17), slice(None, None, 4), slice(10, 10), idx, [1, 2],
                (slice(0, 4), 1), (6, 0)):
        assert np.array_equal(rows[key], x[key]), key
    sub = rows.subset(idx)
    assert len(sub) == len(idx) and np.array_equal(sub[1:4], x[idx][1:4])
    assert np.array_equal(sub.subset([0, 4])[:], x[[7, 49]])
    assert np.array_equal(pickle.loads(pickle.dumps(sub))[:], x[idx])  # worker processes
    assert np.array_equal(np.asarray(rows), x)


def test_normalized_reads_only_what_is_indexed(tmp_path):
    split = structured_images(40, channels=3, size=8)
    info = data.compute_info("t", split, 4)
    np.save(tmp_path / "x.npy", split.x)
    lazy = data.Normalized(NpyRows(tmp_path / "x.npy"), info)
    whole = data.normalize(split.x, info)
    assert lazy.shape == whole.shape and len(lazy) == 40
    assert np.array_equal(lazy[5:20], whole[5:20]) and np.array_equal(lazy[[3, 1]], whole[[3, 1]])
    assert np.array_equal(lazy[2], whole[2])
    assert np.array_equal(lazy.channel_min(), whole.min(axis=(0, 2, 3)))


def test_streamed_mean_std_is_numpys():
    x = np.random.default_rng(2).integers(0, 256, (600, 3, 9, 9), dtype=np.uint8)
    mean, std = data.channel_mean_std(x)
    pixels = x.astype(np.float64) / 255
    assert np.allclose(mean, pixels.mean(axis=(0, 2, 3)), atol=1e-12)
    assert np.allclose(std, pixels.std(axis=(0, 2, 3)), atol=1e-12)


# --- the model's own preprocessing -------------------------------------------------------------

def _photo_folder(root, sizes=((40, 52), (48, 36), (33, 33)), per_class=6, grey_every=0):
    """RGB images of several sizes (not square) in 3 class folders; every grey_every-th grey."""
    rng = np.random.default_rng(3)
    k = 0
    for c in range(3):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(per_class):
            h, w = sizes[(c + i) % len(sizes)]
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            k += 1
            if grey_every and k % grey_every == 0:
                img = img.convert("L")
            img.save(root / f"class_{c}" / f"{i:03d}.png")
    return root


def test_imagefolder_matches_torchvisions_eval_transform(tmp_path):
    """The pixels a model trained with torchvision's ImageFolder + Resize + CenterCrop sees."""
    import torchvision
    from torchvision import transforms

    root = _photo_folder(tmp_path / "photos", grey_every=4)
    split, classes = sources.load_source("imagefolder", str(root), 3, 24, resize=28, crop=24)
    reference = torchvision.datasets.ImageFolder(str(root), transform=transforms.Compose([
        transforms.Resize(28), transforms.CenterCrop(24), transforms.PILToTensor()]))
    assert classes == tuple(reference.classes)
    assert np.array_equal(split.y, np.array(reference.targets))
    expected = np.stack([reference[i][0].numpy() for i in range(len(reference))])
    assert split.x.shape == (18, 3, 24, 24) and np.array_equal(split.x, expected)
    # ToTensor + Normalize(ImageNet) on the same images: what quantpipe feeds the model.
    p = PrepareParams(source="imagefolder", path=str(root), resize=28, crop=24, mean="imagenet")
    info = data.DataInfo("imagefolder", 3, 3, 24, p.mean, p.std)
    tensors = torchvision.datasets.ImageFolder(str(root), transform=transforms.Compose([
        transforms.Resize(28), transforms.CenterCrop(24), transforms.ToTensor(),
        transforms.Normalize(p.mean, p.std)]))
    want = torch.stack([tensors[i][0] for i in range(len(tensors))]).numpy()
    assert np.abs(data.normalize(split.x, info) - want).max() < 1e-6


def test_parallel_decode_writes_the_serial_bytes(tmp_path, monkeypatch):
    root = _photo_folder(tmp_path / "photos", per_class=30)
    folder = imagefolder.list_folder(root)
    parts = data.stratified_split(folder.y, 0.1, 0.2, seed=0)
    t = imagefolder.transform_for(folder, None, 20, 24, 20)
    monkeypatch.setattr(imagefolder, "CHUNK", 7)
    monkeypatch.setattr(imagefolder, "PARALLEL_FROM", 1)
    (tmp_path / "serial").mkdir(), (tmp_path / "parallel").mkdir()
    serial, none = imagefolder.decode_into(folder, parts, tmp_path / "serial", t, workers=1,
                                           progress=False)
    parallel, peak = imagefolder.decode_into(folder, parts, tmp_path / "parallel", t, workers=2,
                                             progress=False)
    assert none is None and peak > 0
    for name in parts:
        assert serial[name].read_bytes() == parallel[name].read_bytes(), name
        assert np.array_equal(np.load(serial[name]), imagefolder.decode_all(
            [folder.files[i] for i in parts[name]], t))


def test_a_bad_image_in_a_worker_stops_prepare_in_one_line(tmp_path, monkeypatch):
    from quantpipe.errors import UserError

    root = _photo_folder(tmp_path / "photos", per_class=20)
    (root / "class_2" / "zz_broken.png").write_bytes(b"not a png")
    folder = imagefolder.list_folder(root)
    t = imagefolder.transform_for(folder, 3, 16, None, None)
    monkeypatch.setattr(imagefolder, "PARALLEL_FROM", 1)
    with pytest.raises(UserError, match="zz_broken.png: unreadable image"):
        imagefolder.decode_into(folder, {"all": np.arange(len(folder.files))}, tmp_path, t,
                                workers=2, progress=False)


def test_normalization_presets_and_crop_params():
    p = PrepareParams(mean="imagenet")
    assert p.mean == (0.485, 0.456, 0.406) and p.std == (0.229, 0.224, 0.225)
    p = PrepareParams(resize=256, crop=224)
    assert p.image_size == 224
    assert PrepareParams(crop=32).resize == 32 and PrepareParams(resize=40).crop == 40
    from quantpipe.errors import UserError

    for bad, key in ((dict(resize=200, crop=224), "prepare.crop"),
                     (dict(crop=32, image_size=28), "prepare.image_size"),
                     (dict(mean="cifar"), "prepare.mean"),
                     (dict(task="detection", crop=64), "prepare.")):
        with pytest.raises(UserError, match=key):
            PrepareParams(**bad)


# --- memory: evaluate reads the test split a batch at a time ----------------------------------

def _peak_rss_of_evaluate(repo, test_images: int) -> float:
    """evaluate@fp32 over a test split of `test_images` 3x64x64 images; its peak RSS (MB)."""
    prepared = repo / "data" / "prepared"
    prepared.mkdir(parents=True, exist_ok=True)
    train = structured_images(512, channels=3, size=64, seed=1)
    test = structured_images(test_images, channels=3, size=64, seed=2)
    info = data.compute_info("structured", train, 4)
    data.save_splits(prepared, {"train": train, "test": test}, info)
    out = repo / "metrics" / f"eval_{test_images}.json"
    result = subprocess.run(
        [sys.executable, "-m", "stages.evaluate", "fp32", "--model", "models/fp32.onnx",
         "--fp32", "models/fp32.onnx", "--data", "data/prepared", "--machine",
         "metrics/machine.json", "--metrics", str(out), "--confusion", str(out) + ".confusion",
         "--predictions", str(out) + ".predictions"],
        cwd=repo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads(out.read_text())
    assert metrics["samples"] == test_images
    return metrics["resources"]["peak_rss_mb"]


def test_evaluate_memory_does_not_grow_with_the_test_split(tmp_path):
    """6,000 test images instead of 1,500: whole-split float32 would add ~210 MB (uint8 read
    whole, ~50 MB more); read a batch at a time, only the logits and confusion rows grow."""
    repo = make_project(tmp_path / "repo", {"evaluate": {"batch_size": 256}})
    torch.manual_seed(0)
    (repo / "models").mkdir()
    export_to(TwoConvNet(3, 64, 4), (3, 64, 64), repo / "models" / "fp32.onnx")
    machine = subprocess.run([sys.executable, "-m", "stages.machine", "--out", "metrics/machine.json",
                              "--int8", "metrics/int8.json"], cwd=repo, capture_output=True, text=True)
    assert machine.returncode == 0, machine.stderr
    small = _peak_rss_of_evaluate(repo, 1500)
    large = _peak_rss_of_evaluate(repo, 6000)
    whole_split_float32 = 4500 * 3 * 64 * 64 * 4 / 2**20  # what the extra images would take
    assert large - small < 0.15 * whole_split_float32, (small, large)
