"""quantpipe's own detector (train.model: tiny_detector) and its training.

Anchor-free and single-stage like YOLOv8: a stride-8 conv backbone, one prediction per grid
cell, a box as distances from the cell centre to its four sides. Its output is Ultralytics'
layout (batch, 4 + classes, anchors) with boxes decoded to centre/size pixels and class scores
through a sigmoid, so quantpipe.detection.post decodes it like a YOLO export.

The box and class predictions come from two 1x1 convs rather than one split conv: quantized,
each gets a range of its own (box log-distances and class logits differ by an order of
magnitude). The decode after them (softplus, grid, sigmoid, concat) is the graph's tail that
quantize_static keeps in float by default (docs/detection.md has the measurement).
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
from quantpipe.training import fit_epochs

STRIDE = 8


def _conv(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class Detector(nn.Module):
    """What quantpipe needs of a detector, in two parts: `raw(x)`, every learned layer (the
    part quantization-aware training fake-quantizes), and `decode(raw)`, the float tail to
    Ultralytics' layout (batch, 4 + classes, anchors); `raw_loss(raw, objects)` trains it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, S, S) -> (B, 4 + K, A)
        return self.decode(self.raw(x))

    def loss(self, x: torch.Tensor, objects: list[np.ndarray]) -> torch.Tensor:
        return self.raw_loss(self.raw(x), objects)


class TinyDetector(Detector):
    """Six 3x3 conv-BN-ReLU (to stride 8, 128 channels), box and class 1x1 heads, decode.

    Widths of 32-128 channels are where INT8 pays on a CPU: at 16-64 the convs are too small
    for the VNNI kernels to beat FP32 by much at batch 1 (x1.3-1.6 measured, vs x2.4)."""

    def __init__(self, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        if image_size % STRIDE or image_size < 4 * STRIDE:
            nearest = max(4 * STRIDE, round(image_size / STRIDE) * STRIDE)
            raise UserError(f"train.model = tiny_detector predicts on a stride-{STRIDE} grid: "
                            f"prepare.image_size must be a multiple of {STRIDE}, at least "
                            f"{4 * STRIDE} (got {image_size}); the nearest valid is {nearest}")
        self.backbone = nn.Sequential(
            _conv(channels, 32, 2), _conv(32, 64, 2), _conv(64, 64, 1),
            _conv(64, 128, 2), _conv(128, 128, 1), _conv(128, 128, 1))
        self.box = nn.Conv2d(128, 4, 1)
        self.cls = nn.Conv2d(128, num_classes, 1)
        # Rare classes start unlikely (RetinaNet's prior): early training is not swamped by
        # the loss of thousands of background cells.
        nn.init.constant_(self.cls.bias, -4.0)
        side = image_size // STRIDE
        ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        centres = (torch.stack([xs, ys]).reshape(1, 2, -1).float() + 0.5) * STRIDE
        self.register_buffer("centres", centres, persistent=False)  # (1, 2, A), not a weight

    def raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 4, A) box distances before softplus and (B, K, A) class logits."""
        f = self.backbone(x)
        return self.box(f).flatten(2), self.cls(f).flatten(2)

    def decode(self, raw: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        box, cls = raw
        return torch.cat([boxes_xywh(box, self.centres), cls.sigmoid()], 1)

    def raw_loss(self, raw: tuple[torch.Tensor, torch.Tensor],
                 objects: list[np.ndarray]) -> torch.Tensor:
        return detection_loss(raw, self.centres, objects)


def distances_xyxy(box: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Raw (B, 4, A) -> (B, 4, A) x1, y1, x2, y2: softplus distances in cells from the centres."""
    d = F.softplus(box) * STRIDE
    return torch.cat([centres - d[:, :2], centres + d[:, 2:]], 1)


def boxes_xywh(box: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    xyxy = distances_xyxy(box, centres)
    return torch.cat([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1)


def assign(objects: list[np.ndarray], centres: np.ndarray) -> np.ndarray:
    """(N, A): the index of the object each anchor predicts (-1: background). An anchor whose centre lies inside an object's box predicts it (the smallest one when
    boxes nest); the cell holding a box's centre always does, so a small object gets one."""
    n, a = len(objects), centres.shape[1]
    owner = np.full((n, a), -1, np.int64)
    cx, cy = centres
    for i, o in enumerate(objects):
        if not len(o):
            continue
        area = (o[:, 2] - o[:, 0]) * (o[:, 3] - o[:, 1])
        inside = ((cx[None] > o[:, :1]) & (cx[None] < o[:, 2:3]) &
                  (cy[None] > o[:, 1:2]) & (cy[None] < o[:, 3:4]))  # (n_obj, A)
        side = int(round(np.sqrt(a)))
        gx = np.clip(((o[:, 0] + o[:, 2]) / 2 // STRIDE).astype(int), 0, side - 1)
        gy = np.clip(((o[:, 1] + o[:, 3]) / 2 // STRIDE).astype(int), 0, side - 1)
        inside[np.arange(len(o)), gy * side + gx] = True
        cost = np.where(inside, area[:, None], np.inf)
        best = cost.argmin(0)
        owner[i] = np.where(np.isfinite(cost.min(0)), best, -1)
    return owner


@dataclass(frozen=True)
class DetEpoch:
    epoch: int
    train_loss: float
    val_loss: float
    val_map_50: float  # COCO mAP@.5 on the validation split (pycocotools)
    seconds: float


def detection_loss(raw: tuple[torch.Tensor, torch.Tensor], centres: torch.Tensor,
                   objects: list[np.ndarray]) -> torch.Tensor:
    """Per positive anchor: GIoU loss of its box; every anchor: BCE of the class scores (one-hot
    on positives, zero on background), normalised by the number of positives."""
    from torchvision.ops import generalized_box_iou_loss

    box, cls = raw
    owner = torch.from_numpy(assign(objects, centres[0].numpy()))
    target = torch.zeros_like(cls)
    pos = owner >= 0
    b_idx, a_idx = torch.nonzero(pos, as_tuple=True)
    gt = torch.from_numpy(np.concatenate(
        [objects[int(b)][int(owner[b, a])][None] for b, a in zip(b_idx, a_idx)])
        if len(b_idx) else np.zeros((0, 5), np.float32))
    target[b_idx, gt[:, 4].long(), a_idx] = 1.0
    n_pos = max(len(b_idx), 1)
    loss = F.binary_cross_entropy_with_logits(cls, target, reduction="sum") / n_pos
    if len(b_idx):
        pred = distances_xyxy(box, centres)[b_idx, :, a_idx]  # (P, 4)
        loss = loss + 2.0 * generalized_box_iou_loss(pred, gt[:, :4], reduction="mean")
    return loss


def train_detector(model: nn.Module, x_train: np.ndarray, obj_train: tuple[np.ndarray, ...],
                   x_val: np.ndarray, obj_val: tuple[np.ndarray, ...], *,
                   epochs: int, batch_size: int, lr: float, seed: int,
                   score_map_50: Callable[[nn.Module], float], progress: bool = True,
                   on_step: Callable[[nn.Module, int], None] | None = None,
                   micro_batch: int | None = None) -> list[DetEpoch]:
    """AdamW with a cosine schedule on normalized (N, C, S, S) inputs, minimising the model's
    own `loss(x, objects)`; score_map_50(model) is the validation mAP@.5 after each epoch, and
    on_step(model, step) runs after each optimizer step (1, 2, ...) as in models.train_model.
    Deterministic for a seed on a given machine."""
    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        # A batch at a time: x_train may be a split on disk (quantpipe.data.Normalized).
        return model.loss(torch.from_numpy(x_train[idx.numpy()]), [obj_train[i] for i in idx.tolist()])

    def end_epoch(epoch: int, train_loss: float, start: float) -> DetEpoch:
        with torch.no_grad():
            val_loss = float(model.loss(torch.from_numpy(x_val[:]), list(obj_val)))
        h = DetEpoch(epoch=epoch, train_loss=train_loss, val_loss=round(val_loss, 6),
                     val_map_50=round(score_map_50(model), 6),
                     seconds=round(time.perf_counter() - start, 3))
        if progress:
            print(f"epoch {epoch}/{epochs}: loss {h.train_loss:.4f}, val loss {h.val_loss:.4f}, "
                  f"val mAP@.5 {h.val_map_50:.4f} ({h.seconds:.1f}s)", flush=True)
        return h

    return fit_epochs(model, len(x_train), batch_loss, end_epoch, epochs=epochs,
                      batch_size=batch_size, lr=lr, seed=seed, on_step=on_step,
                      micro_batch=micro_batch)
