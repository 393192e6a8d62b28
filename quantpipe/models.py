"""The model zoo and the training loop.

Names: `simple_cnn` (the tutorial's one-conv CNN), `mnist_net` (2 conv + 2 fully connected with
dropout, the default), or any torchvision classification model (`resnet18`, `mobilenet_v2`, ...)
built with random weights for the dataset's channels and classes. Nothing is downloaded.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from quantpipe.errors import UserError

ZOO = ("simple_cnn", "mnist_net")


class SimpleCNN(nn.Module):
    """Conv2d(C->8, 3, padding 1) -> ReLU -> MaxPool2d(2) -> Linear(8*(S/2)^2 -> K)."""

    def __init__(self, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * (image_size // 2) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, S, S) -> (B, K)
        x = self.pool(F.relu(self.conv(x)))
        return self.fc(torch.flatten(x, 1))


class MnistNet(nn.Module):
    """pytorch/examples' MNIST net, sized from the input: 1.2M parameters at 28x28."""

    def __init__(self, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.pool = nn.MaxPool2d(2)
        self.drop1 = nn.Dropout(0.25)
        side = (image_size - 4) // 2  # two unpadded 3x3 convs, then a 2x2 pool
        self.fc1 = nn.Linear(64 * side * side, 128)
        self.drop2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, S, S) -> (B, K)
        x = F.relu(self.conv1(x))
        x = self.drop1(self.pool(F.relu(self.conv2(x))))
        x = self.drop2(F.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


def torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


# `train.model: onnx:<path>` brings an ONNX model trained elsewhere; kept under this folder,
# which the export stage depends on, so replacing the file re-runs the pipeline.
ONNX_PREFIX = "onnx:"
INPUTS_DIR = Path("inputs")


def onnx_source(name: str) -> Path | None:
    """The ONNX file named by `onnx:<path>`, or None for a model trained here."""
    if not name.startswith(ONNX_PREFIX):
        return None
    path = Path(name[len(ONNX_PREFIX):])
    if path.is_absolute() or INPUTS_DIR not in path.parents:
        raise UserError(f"train.model = {name!r}: put the model under {INPUTS_DIR}/ (e.g. "
                        f"onnx:{INPUTS_DIR}/model.onnx) so DVC tracks it as a dependency")
    return path


def check_model_name(name: str) -> None:
    if name in ZOO or onnx_source(name):
        return
    names = torchvision_names()
    if name not in names:
        raise UserError(f"train.model = {name!r} is not allowed; use one of {list(ZOO)}, "
                        f"a torchvision classification model such as resnet18, mobilenet_v2, "
                        f"or {ONNX_PREFIX}{INPUTS_DIR}/<file>.onnx")


def build_model(name: str, channels: int, image_size: int, num_classes: int) -> nn.Module:
    """A freshly initialised model; call torch.manual_seed first for reproducible weights."""
    if name == "simple_cnn":
        return SimpleCNN(channels, image_size, num_classes)
    if name == "mnist_net":
        if image_size < 6:
            raise UserError(f"train.model = mnist_net needs prepare.image_size >= 6, got {image_size}")
        return MnistNet(channels, image_size, num_classes)
    check_model_name(name)
    import torchvision

    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if channels != 3:
        _replace_first_conv(model, channels)
    return model


def _replace_first_conv(model: nn.Module, channels: int) -> None:
    """torchvision models expect RGB; swap the stem conv for one with `channels` inputs."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, child_name, nn.Conv2d(
                    channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                    child.dilation, child.groups, child.bias is not None, child.padding_mode))
                return
    raise UserError("train.model has no Conv2d to adapt to the input channels")


@dataclass(frozen=True)
class EpochStats:
    epoch: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    seconds: float


def train_model(model: nn.Module, x_train: np.ndarray, y_train: np.ndarray,
                x_val: np.ndarray, y_val: np.ndarray, *, epochs: int, batch_size: int,
                lr: float, max_shift: int, seed: int, progress: bool = True,
                on_step: Callable[[nn.Module, int], None] | None = None) -> list[EpochStats]:
    """Adam + cross-entropy on normalized float32 (N, C, S, S) inputs; returns per-epoch stats.

    on_step(model, step) runs after each optimizer step (1, 2, ...): quantization-aware
    training freezes BatchNorm and its ranges from there.

    Deterministic for a given seed on a given machine: seeded shuffling, augmentation and
    dropout, and deterministic kernels.
    """
    from tqdm import tqdm

    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout draws from the global generator
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x_all, y_all = torch.from_numpy(x_train), torch.from_numpy(y_train)
    # Pad with each channel's minimum, which is the normalized background (0 pixels).
    background = x_all.amin(dim=(0, 2, 3)).view(1, -1, 1, 1)
    history, step = [], 0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        model.train()
        order = torch.randperm(len(y_all), generator=gen)
        if len(order) % batch_size == 1:
            order = order[:-1]  # a batch of one breaks BatchNorm
        batches = order.split(batch_size)
        total_loss, correct = 0.0, 0
        for idx in tqdm(batches, desc=f"epoch {epoch}/{epochs}", unit="batch",
                        disable=not progress, leave=False):
            xb = _random_shift(x_all[idx], max_shift, background, gen)
            yb = y_all[idx]
            optimizer.zero_grad()
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            loss.backward()
            optimizer.step()
            step += 1
            if on_step is not None:
                on_step(model, step)
            total_loss += loss.item() * len(idx)
            correct += int((logits.argmax(1) == yb).sum())
        seen = sum(len(b) for b in batches)
        val_logits = predict_torch(model, x_val)
        val_loss = float(F.cross_entropy(torch.from_numpy(val_logits), torch.from_numpy(y_val)))
        history.append(EpochStats(
            epoch=epoch, train_loss=round(total_loss / seen, 6),
            train_accuracy=round(correct / seen, 6), val_loss=round(val_loss, 6),
            val_accuracy=round(float((val_logits.argmax(1) == y_val).mean()), 6),
            seconds=round(time.perf_counter() - start, 3)))
        if progress:
            h = history[-1]
            print(f"epoch {epoch}/{epochs}: loss {h.train_loss:.4f}, val accuracy "
                  f"{h.val_accuracy:.4f} ({h.seconds:.1f}s)", flush=True)
    model.eval()
    return history


def _random_shift(x: torch.Tensor, max_shift: int, background: torch.Tensor,
                  gen: torch.Generator) -> torch.Tensor:
    """Translate each image by up to max_shift pixels in x and y. (B, C, S, S) -> same."""
    if max_shift == 0:
        return x
    b, c, s, _ = x.shape
    padded = background.expand(b, c, s + 2 * max_shift, s + 2 * max_shift).clone()
    padded[:, :, max_shift:max_shift + s, max_shift:max_shift + s] = x
    offsets = torch.randint(0, 2 * max_shift + 1, (b, 2), generator=gen)
    return torch.stack([padded[i, :, dy:dy + s, dx:dx + s]
                        for i, (dy, dx) in enumerate(offsets.tolist())])


@torch.no_grad()
def predict_torch(model: nn.Module, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """Logits (N, K) float32 of a model in eval mode for normalized (N, C, S, S) inputs."""
    was_training = model.training
    model.eval()
    out = [model(torch.from_numpy(x[i:i + batch_size])).numpy()
           for i in range(0, len(x), batch_size)]
    model.train(was_training)
    return np.concatenate(out).astype(np.float32)


def state_dict_bytes(model: nn.Module) -> bytes:
    # torch.save records the file's base name inside its zip; saving through a BytesIO keeps
    # the bytes independent of the (temporary) file name, so re-training gives the same hash.
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getvalue()


def load_weights(model: nn.Module, path: Path | str) -> nn.Module:
    """Load a state_dict checkpoint safely (weights_only: no arbitrary unpickling)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: not found; run `dvc repro train` first") from None
    except Exception as e:  # a truncated zip or a pickle that weights_only refuses
        raise UserError(f"{path}: not a readable state_dict checkpoint ({type(e).__name__}); "
                        "re-run `dvc repro -f train`") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise UserError(f"{path}: does not match train.model ({first}); re-run `dvc repro train`") from None
    return model.eval()
