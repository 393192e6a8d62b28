"""Bring your own data and model: every prepare source, and an ONNX model trained elsewhere."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from conftest import TINY_PARAMS, make_project, reproduce, set_params
from helpers import TwoConvNet, export_to, trained_on
from quantpipe import data, machine, models, onnxutil, sources
from quantpipe.errors import UserError
from test_pipeline import ALL_STAGES

# Tiny end-to-end runs: small images, few samples, accuracy gates off (the models are toys).
E2E = {**TINY_PARAMS, "quantize_static": {"allow_accuracy_drop": True},
       "evaluate": {"batch_size": 32}}


def colour_folder(root: Path, classes: int = 3, per_class: int = 14, size: int = 20) -> Path:
    """RGB PNGs: class k is a square of colour k at a class-specific spot, on noise."""
    rng = np.random.default_rng(0)
    colours = [(230, 40, 40), (40, 230, 40), (40, 40, 230), (230, 230, 40)]
    for k in range(classes):
        (root / f"class_{k}").mkdir(parents=True)
        for i in range(per_class):
            img = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            o = 2 + 5 * k + int(rng.integers(0, 2))
            img[o:o + 6, o:o + 6] = colours[k]
            Image.fromarray(img, "RGB").save(root / f"class_{k}" / f"{i:03d}.png")
    return root


# --- sources, unit level ----------------------------------------------------------------------

def test_digits_source_is_the_bundled_8x8_digits():
    split, names = sources.load_source("digits", None, None, size=8)
    assert split.x.shape == (1797, 1, 8, 8) and split.x.dtype == np.uint8
    assert split.x.max() == 255 and set(np.unique(split.y)) == set(range(10)) and names is None


def test_imagefolder_reads_rgb_pngs_resized_with_class_names(tmp_path):
    root = colour_folder(tmp_path / "shapes")
    split, names = sources.load_source("imagefolder", str(root), None, size=16)
    assert split.x.shape == (42, 3, 16, 16) and names == ("class_0", "class_1", "class_2")
    assert np.bincount(split.y).tolist() == [14, 14, 14]
    grey, _ = sources.load_source("imagefolder", str(root), 1, size=16)
    assert grey.x.shape == (42, 1, 16, 16)


def test_imagefolder_mixed_channels_need_prepare_channels(tmp_path):
    root = colour_folder(tmp_path / "shapes", per_class=2)
    Image.fromarray(np.zeros((20, 20), np.uint8), "L").save(root / "class_0" / "grey.png")
    with pytest.raises(UserError, match="prepare.channels"):
        sources.load_source("imagefolder", str(root), None, size=16)
    split, _ = sources.load_source("imagefolder", str(root), 3, size=16)
    assert split.x.shape[1] == 3


def test_imagefolder_unreadable_image_is_named(tmp_path):
    root = colour_folder(tmp_path / "shapes", per_class=2)
    (root / "class_1" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(UserError, match="broken.png: unreadable image"):
        sources.load_source("imagefolder", str(root), None, size=16)


def test_imagefolder_missing_or_empty_path(tmp_path):
    with pytest.raises(UserError, match="prepare.path = .*not found"):
        sources.load_source("imagefolder", str(tmp_path / "nope"), None, size=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no class sub-folders"):
        sources.load_source("imagefolder", str(tmp_path / "empty"), None, size=16)


def test_npz_accepts_nhw_uint8_and_unit_floats(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (10, 12, 12), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", x=x, y=np.arange(10) % 2)
    split, _ = sources.load_source("npz", str(tmp_path / "a.npz"), None, size=12)
    assert split.x.shape == (10, 1, 12, 12) and np.array_equal(split.x[:, 0], x)
    np.savez(tmp_path / "b.npz", x=x[:, None] / 255.0, y=np.arange(10) % 2)
    split, _ = sources.load_source("npz", str(tmp_path / "b.npz"), 3, size=8)
    assert split.x.shape == (10, 3, 8, 8)


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.zeros((4, 8, 8), np.uint8)}, "no array named 'y'"),
    ({"x": np.full((4, 1, 8, 8), np.nan), "y": np.arange(4)}, r"x\[0\] contains NaN"),
    ({"x": np.full((4, 1, 8, 8), 300.0), "y": np.arange(4)}, r"span \[300, 300\]"),
    ({"x": np.zeros((4, 2, 8, 8), np.uint8), "y": np.arange(4)}, "C 1 or 3"),
    ({"x": np.zeros((4, 8, 8), np.uint8), "y": np.arange(3)}, "one label per image"),
])
def test_npz_errors_name_the_file_and_the_problem(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(UserError, match=message) as e:
        sources.load_source("npz", str(tmp_path / "bad.npz"), None, size=8)
    assert "bad.npz" in str(e.value)


def test_dataset_labels_are_checked():
    x = np.zeros((4, 1, 8, 8), np.uint8)
    with pytest.raises(UserError, match="only one class"):
        data.check_dataset(data.Split(x, np.zeros(4, np.int64)), "d")
    with pytest.raises(UserError, match="sample 2 has label -1"):
        data.check_dataset(data.Split(x, np.array([0, 1, -1, 1])), "d")
    assert data.check_dataset(data.Split(x, np.array([0, 3, 1, 1])), "d") == 4


def _write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX format of the MNIST files: magic (dtype 0x08 = uint8, ndim), sizes, bytes."""
    path.write_bytes(struct.pack(">HBB", 0, 0x08, array.ndim)
                     + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes())


def test_torchvision_dataset_read_from_disk_never_downloaded(tmp_path):
    with pytest.raises(UserError, match="files not found.*never downloads"):
        sources.load_source("torchvision:FashionMNIST", str(tmp_path), None, size=28)
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 12), ("t10k", 6)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", (np.arange(n) % 3).astype(np.uint8))
    split, _ = sources.load_source("torchvision:FashionMNIST", str(tmp_path), None, size=16)
    assert split.x.shape == (18, 1, 16, 16) and np.bincount(split.y).tolist() == [6, 6, 6]
    with pytest.raises(UserError, match="no dataset 'NotADataset'"):
        sources.load_source("torchvision:NotADataset", str(tmp_path), None, size=16)


# --- any torchvision classifier, 1 or 3 channels, any size --------------------------------------

@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "mobilenet_v3_small"])
def test_torchvision_models_export_at_tiny_sizes(name, tmp_path):
    torch.manual_seed(0)
    for channels in (1, 3):
        model = models.build_model(name, channels, 32, 5).eval()
        x = np.random.default_rng(0).standard_normal((3, channels, 32, 32)).astype(np.float32)
        expected = models.predict_torch(model, x)
        assert expected.shape == (3, 5)
    # The last one (3 channels) through ONNX: parity on a batch other than the example's.
    session = onnxutil.make_session(export_to(model, (3, 32, 32), tmp_path / "m.onnx"),
                                    level=onnxutil.ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert np.allclose(onnxutil.run_batched(session, x), expected, atol=1e-4)


@pytest.mark.parametrize("name", ["simple_cnn", "mnist_net"])
@pytest.mark.parametrize("size", [8, 20, 33])
def test_small_cnns_adapt_to_the_input_size(name, size):
    model = models.build_model(name, 3, size, 7)
    assert model(torch.zeros(2, 3, size, size)).shape == (2, 7)


def test_onnx_model_must_live_under_inputs():
    assert models.onnx_source("onnx:inputs/m.onnx") == Path("inputs/m.onnx")
    with pytest.raises(UserError, match="under inputs/"):
        models.onnx_source("onnx:/tmp/m.onnx")


class PooledNet(torch.nn.Module):
    """Conv -> global average pool -> Linear: nothing in the graph depends on the batch size."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, 6, 3)
        self.fc = torch.nn.Linear(6, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def export_fixed_batch(model: torch.nn.Module, shape: tuple[int, ...], path: Path) -> Path:
    """Export the way many tools do by default: batch 1 baked into the signature."""
    torch.onnx.export(model.eval(), (torch.zeros(1, *shape),), str(path), dynamo=True,
                      external_data=False, input_names=["pixels"], output_names=["scores"])
    assert onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1
    return path


LEVEL = onnxutil.ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_fixed_batch_signature_becomes_dynamic(tmp_path):
    torch.manual_seed(0)
    path = export_fixed_batch(PooledNet(1, 4), (1, 12, 12), tmp_path / "fixed.onnx")
    x = np.random.default_rng(0).standard_normal((6, 1, 12, 12)).astype(np.float32)
    proto, facts = onnxutil.import_onnx(path, (1, 12, 12), 4, x, LEVEL)
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert facts["batch_max_abs_diff"] < 1e-5
    with pytest.raises(UserError, match=r"shape \[.*\], but the data is \(batch, 3, 12, 12\)"):
        onnxutil.import_onnx(path, (3, 12, 12), 4, x, LEVEL)
    with pytest.raises(UserError, match="expected \\(batch, 10\\) logits"):
        onnxutil.import_onnx(path, (1, 12, 12), 10, x, LEVEL)


def test_batch_baked_into_the_graph_is_a_clear_error(tmp_path):
    # flatten() exports as Reshape to [1, -1]: batch 1 lives inside the graph, not just the signature.
    path = export_fixed_batch(TwoConvNet(1, 12, 4), (1, 12, 12), tmp_path / "fixed.onnx")
    x = np.zeros((6, 1, 12, 12), np.float32)
    with pytest.raises(UserError, match="fixed.onnx: fails on a batch of 6.*dynamic batch axis"):
        onnxutil.import_onnx(path, (1, 12, 12), 4, x, LEVEL)


# --- end to end ---------------------------------------------------------------------------------

def summary(repo: Path) -> dict:
    return json.loads((repo / "metrics/summary.json").read_text())


@pytest.mark.slow  # a whole pipeline on 3-channel images, ~70 s
def test_pipeline_from_an_image_folder_of_rgb_pngs(tmp_path):
    repo = make_project(tmp_path / "repo", {**E2E, "prepare": {
        "source": "imagefolder", "path": "inputs/shapes", "image_size": 16, "calib_size": 16,
        "val_fraction": 0.2, "test_fraction": 0.3}, "train": {"model": "simple_cnn", "epochs": 8,
                                                            "batch_size": 8}})
    colour_folder(repo / "inputs" / "shapes")
    assert reproduce(repo) == ALL_STAGES
    meta = json.loads((repo / "data/prepared/meta.json").read_text())
    assert meta["channels"] == 3 and meta["image_size"] == 16
    assert meta["class_names"] == ["class_0", "class_1", "class_2"]
    s = summary(repo)
    assert s["fp32"]["accuracy"] > 0.6  # three colours are easy; chance is 0.33
    # bf16 is measured only where the CPU has it natively; elsewhere "skipped" says why
    assert set(s) - {"bf16", "skipped"} == {"fp32", "dynamic", "static", "qat", "torch", "machine",
                                            "runtimes", "recommended", "server"}
    assert ("bf16" in s) != ("skipped" in s)


@pytest.mark.slow  # a whole pipeline from an ONNX file, ~100 s (make test stays under 15 min)
def test_pipeline_with_a_brought_onnx_model(tmp_path):
    repo = make_project(tmp_path / "repo", {**E2E, "prepare": {
        "source": "digits", "image_size": 8, "calib_size": 32},
        "train": {"model": "onnx:inputs/model.onnx"}})
    # A model trained elsewhere: a few steps on the same digits, exported with batch fixed to 1.
    split, _ = sources.load_source("digits", None, None, size=8)
    info = data.compute_info("digits", split, 10)
    torch.manual_seed(0)
    net = trained_on(TwoConvNet(1, 8, 10), data.normalize(split.x[:600], info), split.y[:600], steps=40)
    export_to(net, (1, 8, 8), repo / "inputs" / "model.onnx")
    # The file states no preprocessing: params say what it was trained with.
    set_params(repo, {"prepare": {"mean": list(info.mean), "std": list(info.std)}})
    ran = reproduce(repo)
    assert ran == ALL_STAGES
    assert json.loads((repo / "metrics/train.json").read_text())["skipped"]
    assert json.loads((repo / "metrics/export.json").read_text())["source"] == "inputs/model.onnx"
    s = summary(repo)
    assert "torch" not in s and s["fp32"]["accuracy"] > 0.5
    # No PyTorch weights to fine-tune: QAT says so instead of a row, and nothing crashed.
    why = "train.model is onnx:inputs/model.onnx: there is no PyTorch model to fine-tune"
    assert json.loads((repo / "metrics/quantize_qat.json").read_text()) == {"skipped": why}
    no_bf16 = machine.bf16_missing(s["machine"])  # the bf16 row's skip on a CPU without it
    assert "qat" not in s and s["skipped"] == {"qat": why, **({"bf16": no_bf16} if no_bf16 else {})}
    assert f"- INT8 ONNX, quantization-aware training (QAT): {why}." in (repo / "metrics/report.md").read_text()
    # The latency plot still draws: the variants without a row are null, not missing.
    latency = json.loads((repo / "metrics/plots/latency.json").read_text())
    assert all(row["qat"] is None and row["torch"] is None and row["static"] > 0 for row in latency)
    plots = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "-o", str(tmp_path / "plots")],
                           cwd=repo, capture_output=True, text=True, timeout=300)
    assert plots.returncode == 0 and "could not find provided field" not in plots.stderr, plots.stderr
    assert '"text": "latency vs batch size"' in (tmp_path / "plots" / "index.html").read_text()
    assert s["static"]["size_ratio"] < 1.0  # a toy: scales and zero points weigh as much as weights
    # The file is a dependency: replacing it re-runs export and everything after it. (train
    # depends on inputs/ too, for train.weights: it runs again and writes the same nothing.)
    skipped_train = (repo / "models/model.pt").read_bytes()
    torch.manual_seed(1)
    export_to(TwoConvNet(1, 8, 10).eval(), (1, 8, 8), repo / "inputs" / "model.onnx")
    again = reproduce(repo)
    assert {"export", "simplify", "quantize_static", "report"} <= again
    assert (repo / "models/model.pt").read_bytes() == skipped_train


def test_explicit_normalization_replaces_train_statistics():
    split = data.Split(np.full((4, 3, 8, 8), 255, np.uint8), np.arange(4) % 2)
    info = data.compute_info("npz", split, 2, mean_std=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))
    assert info.mean == (0.5, 0.5, 0.5) and np.allclose(data.normalize(split.x, info), 2.0)
    # One value serves every channel; two for three channels is one line naming the key.
    assert data.compute_info("npz", split, 2, mean_std=((0.5,), (0.25,))).std == (0.25,) * 3
    with pytest.raises(UserError, match="prepare.mean has 2 values; the images have 3"):
        data.compute_info("npz", split, 2, mean_std=((0.5, 0.5), (0.25, 0.25)))
