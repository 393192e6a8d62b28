"""Tiny models and data shared by the unit tests (kept out of conftest.py on purpose).

Everything here is small enough for a 2-core machine: a few channels, 12x12 images, a few
dozen samples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from quantpipe import data, onnxutil

ROOT = Path(__file__).resolve().parents[1]
# The opset the pipeline exports with by default (quantpipe.schemas.export.ExportParams).
OPSET = 18


class TwoConvNet(nn.Module):
    """Conv(C->4, 3) -> ReLU -> Conv(4->8, 3) -> ReLU -> flatten -> Linear(8*(S-4)^2 -> K)."""

    def __init__(self, channels: int = 1, image_size: int = 12, num_classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc = nn.Linear(8 * (image_size - 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, S, S) -> (B, K)
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(x, 1))



class TinyViT(nn.Module):
    """A one-block vision transformer: 4x4 patches of a (1, 12, 12) image, self-attention, a
    linear head. Its graph has what marks attention: MatMuls of two activations, Softmax,
    LayerNormalization."""

    def __init__(self, num_classes: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, dim, 4, stride=4)
        self.encoder = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, 9, dim)
        return self.head(self.encoder(x).mean(1))

def structured_images(n: int, *, channels: int = 1, size: int = 12, num_classes: int = 4,
                      seed: int = 0) -> data.Split:
    """uint8 (n, C, S, S) images: a bright square whose position encodes the class, plus noise.

    Random but not white noise: the classes are separable, so a model's logits carry signal and
    quantization error shows up as a change of the top-1 class only if it is large.
    """
    rng = np.random.default_rng(seed)
    y = np.arange(n) % num_classes
    rng.shuffle(y)
    x = rng.integers(0, 40, size=(n, channels, size, size)).astype(np.int64)  # dark noise
    half = size // 2
    for i, cls in enumerate(y):
        row, col = divmod(int(cls) % 4, 2)  # one quadrant per class (classes beyond 4 wrap)
        x[i, :, row * half:(row + 1) * half, col * half:(col + 1) * half] += 180
    return data.Split(x=np.clip(x, 0, 255).astype(np.uint8), y=y.astype(np.int64))


def info_for(split: data.Split, num_classes: int = 4) -> data.DataInfo:
    return data.compute_info("test", split, num_classes)


def trained_on(model: nn.Module, x: np.ndarray, y: np.ndarray, steps: int = 15,
               lr: float = 0.05, seed: int = 0) -> nn.Module:
    """A few full-batch Adam steps so the logits have real margins (well under a second)."""
    torch.manual_seed(seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        optimizer.step()
    return model.eval()


def export_to(model: nn.Module, input_shape: tuple[int, int, int], path: Path) -> Path:
    """Export with the pipeline's exporter and write the .onnx file; returns the path."""
    proto = onnxutil.export_onnx(model, input_shape, OPSET)
    path.write_bytes(proto.SerializeToString())
    return path


def optimized_ops(model, tmp_path: Path) -> list[str]:
    """The op types ORT runs after its graph optimizations (what the bench times)."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]


def torch_logits(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(x)).numpy()


# --- the real pipeline in a throw-away repo (test_failures.py, test_determinism.py) ------------



def lock_md5s(repo: Path, prefixes: tuple[str, ...] = ("data/", "models/")) -> dict[str, str]:
    """{out path: md5} of the cached outputs recorded in repo/dvc.lock under the given prefixes."""
    import yaml

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values()
            for out in stage.get("outs", []) if out["path"].startswith(prefixes)}


def content_md5s(root: Path, rel: str) -> dict[str, str]:
    """{relative path: md5} of a file, or of every file under a directory."""
    import hashlib

    path = root / rel
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() for p in files}
