"""Segmentation models (train.model with prepare.task: segmentation) and their training.

Every model maps (N, C, S, S) normalized images to (N, classes, S, S) per-pixel class logits,
the layout a brought ONNX segmenter must have too:

- tiny_segmenter (the default): quantpipe's own small U-Net (3x3 conv + BatchNorm + ReLU,
  three stride-2 stages, nearest upsampling with skip connections). Convolutions hold nearly all
  of its multiply-accumulates, so static INT8 pays; nearest upsampling is exact in INT8.
- torchvision's lraspp_mobilenet_v3_large and deeplabv3_mobilenet_v3_large, random init,
  adapted to the data's channels and classes (their auxiliary head off); their bilinear
  upsampling to the input size is the Resize that engines compute differently, which is why
  the task checks masks, not just logits, at every hop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from quantpipe.errors import UserError
from quantpipe.segmentation.data import IGNORE
from quantpipe.surgery import replace_first_conv
from quantpipe.training import fit_epochs

# Channels of the own model's four stages (full size, 1/2, 1/4, 1/8): thin where the pixels
# are many, wide where the receptive field spans a whole digit.
WIDTHS = (16, 32, 64, 128)
STRIDE = 8


def _block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class TinySegmenter(nn.Module):
    def __init__(self, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        if image_size % STRIDE:
            raise UserError(f"train.model = tiny_segmenter needs prepare.image_size divisible by "
                            f"{STRIDE} (three stride-2 stages), got {image_size}; try "
                            f"{max(STRIDE, image_size // STRIDE * STRIDE)}")
        a, b, c, d = WIDTHS
        self.enc1 = nn.Sequential(_block(channels, a), _block(a, a))
        self.enc2 = nn.Sequential(_block(a, b, 2), _block(b, b))
        self.enc3 = nn.Sequential(_block(b, c, 2), _block(c, c))
        self.enc4 = nn.Sequential(_block(c, d, 2), _block(d, d))
        self.dec3 = _block(d + c, c)
        self.dec2 = _block(c + b, b)
        self.dec1 = _block(b + a, a)
        self.head = nn.Conv2d(a, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in (self.enc1, self.enc2, self.enc3):
            x = stage(x)
            skips.append(x)
        x = self.enc4(x)
        for dec, skip in zip((self.dec3, self.dec2, self.dec1), reversed(skips)):
            x = dec(torch.cat([F.interpolate(x, scale_factor=2.0, mode="nearest"), skip], 1))
        return self.head(x)


class TorchvisionSegmenter(nn.Module):
    """A torchvision segmentation model returning its logits tensor (not the dict)."""

    def __init__(self, name: str, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        from torchvision.models import segmentation

        self.net = getattr(segmentation, name)(weights=None, weights_backbone=None,
                                               num_classes=num_classes, aux_loss=False)
        if channels != 3:
            replace_first_conv(self.net, channels)
        if image_size < 32:
            raise UserError(f"train.model = {name} needs prepare.image_size >= 32 (its backbone "
                            f"downsamples 16x), got {image_size}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)["out"]


def build(name: str, channels: int, image_size: int, num_classes: int) -> nn.Module:
    if name == "tiny_segmenter":
        return TinySegmenter(channels, image_size, num_classes)
    return TorchvisionSegmenter(name, channels, image_size, num_classes)


@dataclass(frozen=True)
class SegEpoch:
    epoch: int
    train_loss: float
    val_loss: float
    val_miou: float  # on the validation split (quantpipe.segmentation.metrics, torchmetrics)
    seconds: float


def class_weights(masks, num_classes: int) -> torch.Tensor:
    """Median-frequency balancing (Eigen & Fergus): each class weighted by the median class
    frequency over its own, so a background of 90% of the pixels does not drown the classes
    that make the mIoU. Classes absent from the masks weigh 1."""
    counts = np.zeros(num_classes, np.int64)
    for start in range(0, len(masks), 256):
        m = np.asarray(masks[start:start + 256])
        counts += np.bincount(m[m != IGNORE].ravel(), minlength=num_classes)[:num_classes]
    freq = counts / max(1, counts.sum())
    present = freq > 0
    weights = np.ones(num_classes)
    weights[present] = np.median(freq[present]) / freq[present]
    return torch.tensor(weights, dtype=torch.float32)


def pixel_loss(logits: torch.Tensor, masks: torch.Tensor,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pixel cross-entropy, IGNORE pixels left out."""
    return F.cross_entropy(logits, masks.long(), weight=weights, ignore_index=IGNORE)


def train_segmenter(model: nn.Module, x_train, m_train, x_val, m_val, *, num_classes: int,
                    epochs: int, batch_size: int, lr: float, seed: int,
                    score_miou: Callable[[nn.Module], float], progress: bool = True,
                    on_step: Callable[[nn.Module, int], None] | None = None,
                    micro_batch: int | None = None) -> list[SegEpoch]:
    """AdamW with a one-cycle schedule on normalized (N, C, S, S) inputs and (N, S, S) masks,
    minimising class-weighted pixel cross-entropy (class_weights; the validation loss is
    unweighted);
    score_miou(model) is the validation mIoU after each epoch; on_step(model, step) after each
    optimizer step, as in models.train_model. Deterministic for a seed on a given machine."""
    weights = class_weights(m_train, num_classes)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        i = np.sort(idx.numpy())  # rows on disk read in order
        return pixel_loss(model(torch.from_numpy(x_train[i])), torch.from_numpy(m_train[i]), weights)

    def end_epoch(epoch: int, train_loss: float, start: float) -> SegEpoch:
        with torch.no_grad():
            val_loss = np.mean([float(pixel_loss(model(torch.from_numpy(x_val[j:j + 256])),
                                                 torch.from_numpy(m_val[j:j + 256])))
                                for j in range(0, len(x_val), 256)])
        h = SegEpoch(epoch=epoch, train_loss=train_loss, val_loss=round(float(val_loss), 6),
                     val_miou=round(score_miou(model), 6),
                     seconds=round(time.perf_counter() - start, 3))
        if progress:
            print(f"epoch {epoch}/{epochs}: loss {h.train_loss:.4f}, val loss {h.val_loss:.4f}, "
                  f"val mIoU {h.val_miou:.4f} ({h.seconds:.1f}s)", flush=True)
        return h

    return fit_epochs(model, len(x_train), batch_loss, end_epoch, epochs=epochs,
                      batch_size=batch_size, lr=lr, seed=seed, on_step=on_step,
                      micro_batch=micro_batch)
