"""The model zoo and the training loop.

Names: `simple_cnn` (the tutorial's one-conv CNN), `mnist_net` (2 conv + 2 fully connected with
dropout, the default), or any torchvision classification model (`resnet18`, `mobilenet_v2`, ...)
built with random weights for the dataset's channels and classes. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import io
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from quantpipe import budget
from quantpipe.budget import Budget, TrainingPlan
from quantpipe.errors import UserError
from quantpipe.modelinfo import INPUTS_DIR, ONNX_PREFIX, onnx_source  # noqa: F401 (re-exported)
from quantpipe.surgery import replace_first_conv
from quantpipe.training import accumulate

if TYPE_CHECKING:
    from quantpipe.data import Normalized

ZOO = ("simple_cnn", "mnist_net")
# Detectors (prepare.task: detection): quantpipe's own (quantpipe.detection.model) and
# torchvision's, ending in Ultralytics' output layout (quantpipe.detection.zoo).
DETECTORS = ("tiny_detector", "ssdlite320_mobilenet_v3_large", "fasterrcnn_mobilenet_v3_large_320_fpn")
# Segmenters (prepare.task: segmentation): quantpipe's own and torchvision's, (N, classes, H, W)
# logits (quantpipe.segmentation.model).
SEGMENTERS = ("tiny_segmenter", "lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large")


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


def weights_source(weights: str, model: str) -> Path:
    """The checkpoint named by train.weights, which must live under inputs/ (a DVC dependency
    of the train stage) and belong to a model trained here."""
    if onnx_source(model):
        raise UserError(f"train.weights = {weights!r} is for a PyTorch model; train.model = "
                        f"{model!r} carries its own weights: set train.weights: null")
    path = Path(weights)
    if path.is_absolute() or INPUTS_DIR not in path.parents:
        raise UserError(f"train.weights = {weights!r}: put the checkpoint under {INPUTS_DIR}/ "
                        f"(e.g. {INPUTS_DIR}/{path.name}) so DVC tracks it as a dependency")
    if not path.is_file():
        raise UserError(f"train.weights = {weights!r}: not found; save the state_dict there")
    return path


def check_model_name(name: str) -> None:
    """A classifier build_model makes: quantpipe's own or torchvision's (quantpipe.tasks
    checks train.model against the task's zoo first)."""
    if name in ZOO:
        return
    if name not in torchvision_names():
        raise UserError(f"train.model = {name!r} is not allowed; use one of {list(ZOO)}, "
                        f"a torchvision classification model such as resnet18, mobilenet_v2, "
                        f"or {ONNX_PREFIX}{INPUTS_DIR}/<file>.onnx")


def build_model(name: str, channels: int, image_size: int, num_classes: int) -> nn.Module:
    """A freshly initialised model; call torch.manual_seed first for reproducible weights.

    A model that cannot take (C, image_size, image_size) inputs raises UserError naming the
    constraint and the nearest prepare.image_size it takes.
    """
    if name == "simple_cnn":
        return SimpleCNN(channels, image_size, num_classes)
    if name == "tiny_detector":
        from quantpipe.detection.model import TinyDetector

        return TinyDetector(channels, image_size, num_classes)
    if name == "ssdlite320_mobilenet_v3_large":
        from quantpipe.detection.zoo import SSDLite

        return SSDLite(channels, image_size, num_classes)
    if name == "fasterrcnn_mobilenet_v3_large_320_fpn":
        from quantpipe.detection.zoo import FasterRCNN

        return FasterRCNN(channels, image_size, num_classes)
    if name in SEGMENTERS:
        from quantpipe.segmentation.model import build

        return build(name, channels, image_size, num_classes)
    if name == "mnist_net":
        if image_size < 6:
            raise UserError(f"train.model = mnist_net needs prepare.image_size >= 6, got {image_size}")
        return MnistNet(channels, image_size, num_classes)
    check_model_name(name)
    model = _torchvision_model(name, image_size, num_classes)
    if channels != 3:
        replace_first_conv(model, channels)
    if name in AUX_HEADS and not _runs_at(model, channels, image_size):
        # The auxiliary classifiers only help training and need larger maps than the network
        # (Inception v3's: 299 px); below that, the network without them.
        model = _torchvision_model(name, image_size, num_classes, aux_logits=False)
        if channels != 3:
            replace_first_conv(model, channels)
    check_input_size(model, name, channels, image_size)
    return model


# Models with auxiliary classifiers in training (their losses: _logits_and_loss).
AUX_HEADS = ("googlenet", "inception_v3")


# ViT cuts the image into patches of this many pixels (the name's last number: vit_b_16).
def _vit_patch(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


MAXVIT_STRIDE = 32  # MaxViT halves the image five times; every stage's map is partitioned


def _torchvision_model(name: str, image_size: int, num_classes: int, **kwargs) -> nn.Module:
    """torchvision's builder, given the image size where the architecture is sized from it."""
    import torchvision

    if name.startswith("vit_"):
        # Position embeddings are sized for the image at build time; it must be whole patches.
        patch = _vit_patch(name)
        if image_size % patch:
            nearest = max(patch, round(image_size / patch) * patch)
            raise UserError(f"train.model = {name} cuts images into {patch}x{patch} patches, so "
                            f"prepare.image_size must be a multiple of {patch} (got {image_size}); "
                            f"the nearest valid prepare.image_size is {nearest}")
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes,
                                            image_size=image_size)
    if name.startswith("maxvit"):
        return _maxvit(name, image_size, num_classes)
    # GoogLeNet/Inception: keep today's weight init (torchvision warns it will change).
    extra = {"init_weights": True} if name in AUX_HEADS else {}
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra,
                                        **kwargs)


def _maxvit(name: str, image_size: int, num_classes: int) -> nn.Module:
    """MaxViT with its attention partition fitted to the image: torchvision's maxvit_t uses 7x7
    windows, which only divide the feature maps of 224-multiples; the same network with the
    largest partition <= 7 that divides the last stage's map runs at any multiple of 32
    (224: torchvision's own maxvit_t)."""
    from torchvision.models.maxvit import MaxVit

    if image_size % MAXVIT_STRIDE:
        nearest = max(MAXVIT_STRIDE, round(image_size / MAXVIT_STRIDE) * MAXVIT_STRIDE)
        raise UserError(f"train.model = {name} halves the image five times and partitions every "
                        f"stage, so prepare.image_size must be a multiple of {MAXVIT_STRIDE} "
                        f"(got {image_size}); the nearest valid prepare.image_size is {nearest}")
    last = image_size // MAXVIT_STRIDE
    partition = max(p for p in range(1, 8) if last % p == 0)
    return MaxVit(input_size=(image_size, image_size), stem_channels=64, partition_size=partition,
                  block_channels=[64, 128, 256, 512], block_layers=[2, 2, 5, 2], head_dim=32,
                  stochastic_depth_prob=0.2, num_classes=num_classes)


def check_input_size(model: nn.Module, name: str, channels: int, image_size: int) -> None:
    """One forward pass at the configured size; if the model cannot take it (too small for its
    pooling and strides), a UserError with the smallest size it takes."""
    if _runs_at(model, channels, image_size):
        return
    low, high = image_size, 2 * image_size
    while not _runs_at(model, channels, high):
        low, high = high, 2 * high
        if high > 4096:
            raise UserError(f"train.model = {name} does not run on {channels}-channel images of "
                            f"{image_size} px, nor on larger ones up to 4096 px")
    while high - low > 1:  # the smallest size that runs, between a failing and a running one
        mid = (low + high) // 2
        low, high = (low, mid) if _runs_at(model, channels, mid) else (mid, high)
    raise UserError(f"train.model = {name} needs images of at least {high} px: its pooling and "
                    f"strides leave nothing of {image_size} px; the nearest valid "
                    f"prepare.image_size is {high}")


@torch.no_grad()
def _runs_at(model: nn.Module, channels: int, size: int) -> bool:
    """Whether the model runs on (C, size, size) images both for inference and in training,
    where GoogLeNet's and Inception's auxiliary classifiers need larger maps than the main
    head. BatchNorm's running statistics are restored: probing does not change the model."""
    was_training = model.training
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    try:
        model.eval()
        model(torch.zeros(1, channels, size, size))
        model.train()
        model(torch.zeros(2, channels, size, size))  # BatchNorm in training needs 2 samples
        return True
    except (RuntimeError, ValueError, AssertionError):  # what shape errors raise in torch
        return False
    finally:
        for name, buffer in model.named_buffers():  # in place: no load_state_dict hooks
            buffer.copy_(buffers[name])
        model.train(was_training)


@dataclass(frozen=True)
class EpochStats:
    epoch: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    seconds: float


def train_model(model: nn.Module, x_train: np.ndarray | Normalized, y_train: np.ndarray,
                x_val: np.ndarray | Normalized, y_val: np.ndarray, *, epochs: int, batch_size: int,
                lr: float, max_shift: int, seed: int, progress: bool = True,
                on_step: Callable[[nn.Module, int], None] | None = None,
                micro_batch: int | None = None, eval_batch: int = 256) -> list[EpochStats]:
    """Adam + cross-entropy on normalized float32 (N, C, S, S) inputs (an array, or a split read
    a batch at a time); returns per-epoch stats.

    on_step(model, step) runs after each optimizer step (1, 2, ...): quantization-aware
    training freezes BatchNorm and its ranges from there. micro_batch: samples per
    forward/backward, gradients accumulated over the batch (a memory budget's, see
    quantpipe.budget.training_plan; BatchNorm then sees micro-batches); eval_batch: samples per
    validation pass.

    Deterministic for a given seed on a given machine: seeded shuffling, augmentation and
    dropout, and deterministic kernels.
    """
    from tqdm import tqdm

    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout draws from the global generator
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    y_all = torch.from_numpy(y_train)
    # Pad with each channel's minimum, which is the normalized background (0 pixels).
    low = x_train.channel_min() if hasattr(x_train, "channel_min") else x_train.min(axis=(0, 2, 3))
    background = torch.from_numpy(np.asarray(low, dtype=np.float32)).view(1, -1, 1, 1)
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
            # A batch at a time: x_train may be a split on disk (quantpipe.data.Normalized).
            xb = _random_shift(torch.from_numpy(x_train[idx.numpy()]), max_shift, background, gen)
            yb = y_all[idx]
            optimizer.zero_grad()
            for part in accumulate(len(idx), micro_batch):
                logits, loss = _logits_and_loss(model(xb[part]), yb[part])
                share = (part.stop - part.start) / len(idx)
                (loss if share == 1 else loss * share).backward()
                total_loss += loss.item() * (part.stop - part.start)
                correct += int((logits.argmax(1) == yb[part]).sum())
            optimizer.step()
            step += 1
            if on_step is not None:
                on_step(model, step)
        seen = sum(len(b) for b in batches)
        val_logits = predict_torch(model, x_val, eval_batch)
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


def training_plan(memory: Budget, model: nn.Module, input_shape: tuple[int, ...],
                  batch_size: int, *, what: str, key: str) -> TrainingPlan:
    """Micro-batches and a validation batch for training `model` on (C, S, S) inputs within the
    memory budget (quantpipe.budget.training_plan), from what its forward pass saves."""
    return budget.training_plan(memory, saved_bytes(model, input_shape),
                                sum(t.numel() * t.element_size() for t in model.parameters()),
                                batch_size, what=what, key=key)


def eval_batch(memory: Budget, model: nn.Module, input_shape: tuple[int, ...], *,
               what: str) -> int:
    """Samples per no-grad pass of `model` within the memory budget (at most 256)."""
    return memory.batch(budget.EVAL_SAVED * saved_bytes(model, input_shape), cap=256,
                        fixed=sum(t.numel() * t.element_size() for t in model.parameters()),
                        what=what)


def saved_bytes(model: nn.Module, input_shape: tuple[int, ...], samples: int = 2) -> float:
    """Bytes per sample that autograd saves for backward in a training forward pass of `model`
    (activations, masks, fake-quant's): what a training batch costs beyond the weights
    (quantpipe.budget.training_plan). Measured on a copy, so BatchNorm statistics and
    quantization observers of `model` do not see the random inputs."""
    probe = copy.deepcopy(model).train()
    params = {p.untyped_storage().data_ptr() for p in probe.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        probe(torch.randn(samples, *input_shape))
    return sum(storages.values()) / samples


def _logits_and_loss(output, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the logits, plus the auxiliary classifiers' that GoogLeNet and Inception
    v3 return in training mode, weighted as torchvision's reference training does (0.3 each,
    0.4). In eval mode (export, evaluation) they return the logits alone."""
    from torchvision.models import GoogLeNetOutputs, InceptionOutputs

    if isinstance(output, GoogLeNetOutputs):
        aux, weight = [output.aux_logits1, output.aux_logits2], 0.3
    elif isinstance(output, InceptionOutputs):
        aux, weight = [output.aux_logits], 0.4
    else:
        return output, F.cross_entropy(output, y)
    logits = output.logits
    loss = F.cross_entropy(logits, y)
    for head in aux:
        if head is not None:
            loss = loss + weight * F.cross_entropy(head, y)
    return logits, loss


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
def predict_torch(model: nn.Module, x: np.ndarray | Normalized,
                  batch_size: int = 256) -> np.ndarray:
    """Logits (N, K) float32 of a model in eval mode for normalized (N, C, S, S) inputs."""
    was_training = model.training
    model.eval()
    out = [model(torch.from_numpy(x[i:i + batch_size])).numpy()
           for i in range(0, len(x), batch_size)]
    model.train(was_training)
    return np.concatenate(out).astype(np.float32)


def score_classifier(model: nn.Module, x: np.ndarray, y: np.ndarray,
                     batch_size: int = 256) -> dict[str, float]:
    """Accuracy and mean cross-entropy of a classifier on normalized inputs and their labels."""
    logits = predict_torch(model, x, batch_size)
    loss = float(F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y)))
    return {"accuracy": round(float((logits.argmax(1) == y).mean()), 6), "loss": round(loss, 6)}


def state_dict_bytes(model: nn.Module) -> bytes:
    # torch.save records the file's base name inside its zip; saving through a BytesIO keeps
    # the bytes independent of the (temporary) file name, so re-training gives the same hash.
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getvalue()


# Where training scripts keep the state_dict inside a checkpoint dict (torchvision's reference
# scripts: "model"; PyTorch Lightning: "state_dict"; many tutorials: "model_state_dict").
CHECKPOINT_KEYS = ("state_dict", "model", "model_state_dict")


def load_checkpoint(model: nn.Module, path: Path, name: str, num_classes: int) -> nn.Module:
    """Load the weights a user brings (train.weights) into `model`, a freshly built train.model.

    `path` holds a state_dict or a checkpoint dict with one under CHECKPOINT_KEYS, read with
    weights_only=True (a pickle cannot run code here). Keys saved through DataParallel
    ("module.") or without quantpipe's detector wrapper ("det.") are matched to the model's.
    Anything that does not fit raises a one-line UserError naming the file and the key.
    """
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if "Weights only load failed" in str(e):
            # "... Unsupported global: GLOBAL mymodule.Net ...": a pickled object (a whole
            # nn.Module, an optimizer with custom classes), not only tensors.
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = found.group(1) if found else "objects"
            raise UserError(f"{path}: torch.load(weights_only=True) refuses it: it pickles {what}, "
                            "not only tensors; save model.state_dict() with torch.save instead") from None
        # a truncated zip, a file that is not torch.save's
        raise UserError(f"{path}: not a torch.save file ({type(e).__name__}); save "
                        "model.state_dict() with torch.save") from None
    state = raw
    for key in CHECKPOINT_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        found = type(raw).__name__ if not isinstance(raw, dict) else \
            f"a dict with keys {sorted(map(str, raw))[:5]}"
        raise UserError(f"{path}: not a state_dict ({found}); expected a dict of tensors, or a "
                        f"checkpoint dict holding one under {' or '.join(CHECKPOINT_KEYS)}")
    expected = model.state_dict()
    state = _align_keys(state, expected)
    for key, tensor in state.items():
        if key in expected and tensor.shape != expected[key].shape:
            want = tuple(expected[key].shape)
            if (len(want) and want[0] == num_classes and tensor.ndim == len(want)
                    and tuple(tensor.shape[1:]) == want[1:]):
                raise UserError(
                    f"{path}: {key} has {tensor.shape[0]} classes, the data has {num_classes} "
                    f"(data/prepared/meta.json); bring a checkpoint trained on these classes")
            raise UserError(f"{path}: {key} has shape {tuple(tensor.shape)} in the checkpoint, "
                            f"{want} in train.model = {name}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing:
        raise UserError(f"{path}: layer {missing[0]} of train.model = {name} is missing from the "
                        f"checkpoint ({len(missing)} missing); is it a {name} checkpoint?")
    if unexpected:
        raise UserError(f"{path}: unexpected layer {unexpected[0]} ({len(unexpected)} not in "
                        f"train.model = {name}); is it a {name} checkpoint?")
    return model


def _align_keys(state: dict[str, torch.Tensor],
                expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's keys renamed the way that matches the most of the model's: as saved,
    without DataParallel's "module.", or under the model's one top-level wrapper ("det.")."""
    candidates = [state]
    if all(k.startswith("module.") for k in state):
        candidates.append({k[len("module."):]: v for k, v in state.items()})
    tops = {k.split(".", 1)[0] for k in expected}
    if len(tops) == 1:
        prefix = f"{tops.pop()}."
        candidates += [{prefix + k: v for k, v in c.items()} for c in list(candidates)]
    return max(candidates, key=lambda c: len(expected.keys() & c.keys()))


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
