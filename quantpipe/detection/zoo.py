"""torchvision's detectors, built for quantpipe: random init, sized to the prepared data's
channels, classes and image size, and ending where quantpipe's post-processing starts.

torchvision's detection models end in their own post-processing (per-class score threshold,
NMS, top-k), written as a Python loop over the images of a batch: traced, that loop is fixed
to the batch size the export saw. Here the graph stops one step earlier, at decoded boxes and
class scores in Ultralytics' layout (batch, 4 + classes, anchors), so the ONNX file takes any
batch and every variant, engine and runtime is decoded by the same quantpipe.detection.post
code as the default detector and a YOLO export.

`ssdlite320_mobilenet_v3_large`: SSDLite (MobileNetV3-Large backbone with the reduced tail that
torchvision uses when the backbone is not pretrained, six feature maps, 6 default boxes per
cell). Its box decoding (BoxCoder) and softmax stay in the graph, after the last conv: they
are the tail quantize_static keeps in float. Trained with torchvision's own SSD loss (hard
negative mining 3:1, smooth L1 on the matched boxes).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class SSDLite(nn.Module):
    """torchvision's SSDLite320-MobileNetV3-Large at image_size x image_size, `channels` in,
    `num_classes` out (torchvision's background class is dropped from the output)."""

    def __init__(self, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        from torchvision.models.detection import ssdlite320_mobilenet_v3_large
        from torchvision.models.detection.image_list import ImageList
        from torchvision.models.detection.transform import GeneralizedRCNNTransform

        from quantpipe.models import _replace_first_conv

        det = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None,
                                            num_classes=num_classes + 1)
        # quantpipe feeds normalized images at the prepared size: torchvision's resize and
        # normalization become identities (they only run in training, through det.forward).
        det.transform = GeneralizedRCNNTransform(image_size, image_size, [0.0] * channels,
                                                 [1.0] * channels, size_divisible=1,
                                                 fixed_size=(image_size, image_size))
        if channels != 3:
            _replace_first_conv(det.backbone, channels)
        self.det = det
        det.eval()  # the probe below must not touch BatchNorm's statistics
        with torch.no_grad():
            x = torch.zeros(1, channels, image_size, image_size)
            features = list(det.backbone(x).values())
            anchors = det.anchor_generator(ImageList(x, [(image_size, image_size)]), features)[0]
        det.train()
        # The default boxes depend only on the image size: a constant of the graph, not a weight.
        self.register_buffer("anchors", anchors, persistent=False)  # (A, 4) x1, y1, x2, y2

    def raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, A, 4) box regressions and (B, A, 1 + K) class logits (0: background)."""
        head = self.det.head(list(self.det.backbone(x).values()))
        return head["bbox_regression"], head["cls_logits"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, S, S) -> (B, 4 + K, A)
        from torchvision.ops import box_convert

        reg, logits = self.raw(x)
        b, a = reg.shape[:2]
        xyxy = self.det.box_coder.decode_single(reg.reshape(-1, 4),
                                                self.anchors.repeat(b, 1)).reshape(b, a, 4)
        scores = logits.softmax(-1)[..., 1:]
        return torch.cat([box_convert(xyxy, "xyxy", "cxcywh"), scores], -1).transpose(1, 2)

    def loss(self, x: torch.Tensor, objects: list[np.ndarray]) -> torch.Tensor:
        """torchvision's SSD training loss (SSD.forward's training branch without the
        transform), in train or eval mode."""
        from torchvision.ops import box_iou

        reg, logits = self.raw(x)
        targets, matched = [], []
        for o in objects:
            boxes = torch.from_numpy(np.ascontiguousarray(o[:, :4], np.float32))
            targets.append({"boxes": boxes, "labels": torch.from_numpy(o[:, 4]).long() + 1})
            matched.append(self.det.proposal_matcher(box_iou(boxes, self.anchors)) if len(o)
                           else torch.full((len(self.anchors),), -1, dtype=torch.int64))
        losses = self.det.compute_loss(targets, {"bbox_regression": reg, "cls_logits": logits},
                                       [self.anchors] * len(objects), matched)
        return losses["bbox_regression"] + losses["classification"]
