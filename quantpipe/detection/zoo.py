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

from quantpipe.detection.model import Detector
from quantpipe.surgery import replace_first_conv


class SSDLite(Detector):
    """torchvision's SSDLite320-MobileNetV3-Large at image_size x image_size, `channels` in,
    `num_classes` out (torchvision's background class is dropped from the output)."""

    def __init__(self, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        from torchvision.models.detection import ssdlite320_mobilenet_v3_large
        from torchvision.models.detection.image_list import ImageList


        det = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None,
                                            num_classes=num_classes + 1)
        # quantpipe feeds normalized images at the prepared size: torchvision's resize and
        # normalization become identities (they only run in training, through det.forward).
        det.transform = _identity_transform(channels, image_size)
        if channels != 3:
            replace_first_conv(det.backbone, channels)
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

    def decode(self, raw: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from torchvision.ops import box_convert

        reg, logits = raw
        b, a = reg.shape[:2]
        xyxy = self.det.box_coder.decode_single(reg.reshape(-1, 4),
                                                self.anchors.repeat(b, 1)).reshape(b, a, 4)
        scores = logits.softmax(-1)[..., 1:]
        return torch.cat([box_convert(xyxy, "xyxy", "cxcywh"), scores], -1).transpose(1, 2)

    def raw_loss(self, raw: tuple[torch.Tensor, torch.Tensor],
                 objects: list[np.ndarray]) -> torch.Tensor:
        """torchvision's SSD training loss (SSD.forward's training branch without the
        transform), in train or eval mode."""
        from torchvision.ops import box_iou

        reg, logits = raw
        targets, matched = [], []
        for o in objects:
            boxes = torch.from_numpy(np.ascontiguousarray(o[:, :4], np.float32))
            targets.append({"boxes": boxes, "labels": torch.from_numpy(o[:, 4]).long() + 1})
            matched.append(self.det.proposal_matcher(box_iou(boxes, self.anchors)) if len(o)
                           else torch.full((len(self.anchors),), -1, dtype=torch.int64))
        losses = self.det.compute_loss(targets, {"bbox_regression": reg, "cls_logits": logits},
                                       [self.anchors] * len(objects), matched)
        return losses["bbox_regression"] + losses["classification"]


# Region proposals kept per image: the RPN's best by objectness, a fixed count so the graph
# keeps a fixed shape (torchvision's 320 model keeps 150 after NMS at test time).
PROPOSALS = 100
# The box head's width (torchvision: 1024). The 1024-wide head (12.8M of the model's 19M
# parameters) made one training step of 32 canvases take seconds on 2 cores; 256 is a quarter
# of its cost.
HEAD_WIDTH = 256


class FasterRCNN(Detector):
    """torchvision's Faster R-CNN with a MobileNetV3-Large FPN backbone (the 320 model) at
    image_size x image_size, cut into a graph of fixed shape that takes any batch.

    torchvision's inference keeps, per image, the RPN's proposals above a score after NMS (a
    varying count), then per class the boxes above a score after NMS again, in a Python loop
    over the images. Here the RPN's PROPOSALS best proposals by objectness go on without
    NMS, are pooled from their FPN level with RoIAlign (the level rule of torchvision's
    MultiScaleRoIAlign, every level computed and the right one kept, so the batch index stays
    a tensor), and each is decoded to the box of its best class: Ultralytics' layout with
    PROPOSALS anchors, so the one NMS is quantpipe's post-processing, as for every detector.
    Default anchor sizes (32-512 px at 320 px) scale with the image size, and the FPN reads
    the backbone stages that suit it (_fpn_backbone).

    Trained with torchvision's own losses (RPN and box head, with their sampling and NMS), in
    torchvision's training mode; the two-stage training has no loss on this graph's outputs,
    so quantization-aware training does not apply to it."""

    qat_unsupported = ("a two-stage detector: its training loss samples region proposals after "
                       "an NMS that the fixed-shape inference graph does not have")

    def __init__(self, channels: int, image_size: int, num_classes: int,
                 proposals: int = PROPOSALS) -> None:
        super().__init__()
        from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn
        from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
        from torchvision.models.detection.anchor_utils import AnchorGenerator
        from torchvision.models.detection.image_list import ImageList
        from torchvision.ops.poolers import _setup_scales


        det = fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None, num_classes=num_classes + 1,
            box_batch_size_per_image=64)
        det.backbone = _fpn_backbone(image_size)
        det.roi_heads.box_roi_pool = _FastRoIAlign(det.roi_heads.box_roi_pool)
        det.roi_heads.box_head = TwoMLPHead(det.backbone.out_channels * 7 * 7, HEAD_WIDTH)
        det.roi_heads.box_predictor = FastRCNNPredictor(HEAD_WIDTH, num_classes + 1)
        scale = image_size / 320
        det.rpn.anchor_generator = AnchorGenerator(
            (tuple(s * scale for s in (32, 64, 128, 256, 512)),) * 3, ((0.5, 1.0, 2.0),) * 3)
        det.transform = _identity_transform(channels, image_size)
        if channels != 3:
            replace_first_conv(det.backbone, channels)
        self.det, self.proposals, self.image_size = det, proposals, image_size
        det.eval()
        with torch.no_grad():
            x = torch.zeros(1, channels, image_size, image_size)
            features = det.backbone(x)
            anchors = det.rpn.anchor_generator(ImageList(x, [(image_size, image_size)]),
                                               list(features.values()))[0]
            pool = det.roi_heads.box_roi_pool.pool
            self.levels = [k for k in pool.featmap_names if k in features]
            self.scales, self.mapper = _setup_scales(
                [features[k] for k in self.levels], [(image_size, image_size)],
                pool.canonical_scale, pool.canonical_level)
        det.train()
        if len(anchors) < proposals:
            from quantpipe.errors import UserError

            raise UserError(f"train.model = fasterrcnn_mobilenet_v3_large_320_fpn at "
                            f"prepare.image_size {image_size} has {len(anchors)} anchors, fewer "
                            f"than the {proposals} proposals it keeps; use a larger image size")
        self.register_buffer("anchors", anchors, persistent=False)  # (A, 4) x1, y1, x2, y2

    def raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, P, 1 + K) class logits, (B, P, 4 (1 + K)) box regressions per class and
        (B, P, 4) the proposals they refine (x1, y1, x2, y2)."""
        from torchvision.models.detection.rpn import concat_box_prediction_layers
        from torchvision.ops import clip_boxes_to_image, roi_align

        det, b, p = self.det, x.shape[0], self.proposals
        features = det.backbone(x)
        objectness, deltas = concat_box_prediction_layers(*det.rpn.head(list(features.values())))
        boxes = det.rpn.box_coder.decode_single(deltas, self.anchors.repeat(b, 1)).reshape(b, -1, 4)
        top = objectness.reshape(b, -1).topk(p, dim=1).indices
        boxes = clip_boxes_to_image(boxes.gather(1, top[..., None].expand(-1, -1, 4)),
                                    (self.image_size, self.image_size)).detach()
        flat = boxes.reshape(-1, 4)
        image = torch.arange(b, dtype=flat.dtype, device=flat.device)[:, None].expand(b, p)
        rois = torch.cat([image.reshape(-1, 1), flat], 1)
        # torchvision's level rule on boxes of at least one pixel: a proposal clipped to nothing
        # has area 0, whose log is -inf inside the graph (ORT's calibration histograms every
        # float tensor and fails on it); either way it maps to the finest level.
        level = self.mapper([torch.cat([flat[:, :2], torch.maximum(flat[:, 2:], flat[:, :2] + 1)], 1)])
        pool = det.roi_heads.box_roi_pool.pool  # torchvision's roi_align: ONNX's RoiAlign
        pooled = sum(roi_align(features[k], rois, pool.output_size, scale, pool.sampling_ratio)
                     * (level == i).to(flat.dtype)[:, None, None, None]
                     for i, (k, scale) in enumerate(zip(self.levels, self.scales)))
        logits, regression = det.roi_heads.box_predictor(det.roi_heads.box_head(pooled))
        return logits.reshape(b, p, -1), regression.reshape(b, p, -1), boxes

    def decode(self, raw: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from torchvision.ops import box_convert, clip_boxes_to_image

        logits, regression, proposals = raw
        b, p, classes = logits.shape
        scores = logits.softmax(-1)[..., 1:]
        boxes = self.det.roi_heads.box_coder.decode_single(
            regression.reshape(b * p, -1), proposals.reshape(-1, 4)).reshape(b, p, classes, 4)
        best = (scores.argmax(-1) + 1)[..., None, None].expand(-1, -1, 1, 4)
        boxes = clip_boxes_to_image(boxes.gather(2, best).squeeze(2),
                                    (self.image_size, self.image_size))
        return torch.cat([box_convert(boxes, "xyxy", "cxcywh"), scores], -1).transpose(1, 2)

    def loss(self, x: torch.Tensor, objects: list[np.ndarray]) -> torch.Tensor:
        """torchvision's Faster R-CNN losses (RPN objectness and boxes, box head classes and
        boxes). torchvision computes them in training mode only: in eval mode (a validation
        loss) BatchNorm keeps its running statistics all the same."""
        targets = [{"boxes": torch.from_numpy(np.ascontiguousarray(o[:, :4], np.float32)),
                    "labels": torch.from_numpy(o[:, 4]).long() + 1} for o in objects]
        evaluating = not self.training
        if evaluating:
            self.det.train()
            for m in self.det.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    m.eval()
        try:
            losses = self.det(list(x), targets)
        finally:
            if evaluating:
                self.det.eval()
        return sum(losses.values())


# Cells across the finest FPN level: torchvision's 320 model has 10 (stride 32 at 320 px).
MIN_CELLS = 8


def _fpn_backbone(image_size: int):
    """torchvision's MobileNetV3-Large FPN backbone of the 320 model (random init, BatchNorm,
    every layer trainable), its two FPN inputs moved to the image size: the coarsest stage
    with at least MIN_CELLS cells across and the next one. At 320 px that is torchvision's
    own pair (two stride-32 maps of 10 cells); at 64 px it would be 2 x 2 cells, where a
    15-pixel digit is a quarter of one cell and the box head cannot tell digits apart (its
    classification loss stayed at 0.7 and val mAP@.5 at 0.0001 after 7 epochs): there the
    stride-8 and stride-16 stages (8 and 4 cells) are used."""
    from torchvision.models import mobilenet_v3_large
    from torchvision.models.detection.backbone_utils import _mobilenet_extractor

    body = mobilenet_v3_large(weights=None)
    stages = [0] + [i for i, b in enumerate(body.features) if getattr(b, "_is_cn", False)]
    stages.append(len(body.features) - 1)  # torchvision's stage indices (_mobilenet_extractor)
    cells, x = {}, torch.zeros(1, 3, image_size, image_size)
    with torch.no_grad():
        for i, block in enumerate(body.features):
            x = block(x)
            cells[i] = x.shape[-1]
    first = max([k for k, i in enumerate(stages) if cells[i] >= MIN_CELLS], default=0)
    first = min(first, len(stages) - 2)
    return _mobilenet_extractor(body, True, len(stages), returned_layers=[first, first + 1])


class _FastRoIAlign(torch.nn.Module):
    """torchvision's MultiScaleRoIAlign for training: the same pooling (level rule, sampling
    points, bilinear weights), computed as matrix products. torchvision's CPU RoIAlign
    backward scatters one sample at a time on one thread: at 64 px it was two thirds of a
    Faster R-CNN training step (3 of 4.4 s for 32 canvases). The exported graph keeps
    torchvision's roi_align (FasterRCNN.raw), which ONNX has as RoiAlign."""

    def __init__(self, pool) -> None:
        super().__init__()
        if pool.sampling_ratio <= 0:
            raise ValueError("adaptive RoIAlign sampling has no fixed weights")
        self.pool = pool

    def forward(self, x: dict, boxes: list[torch.Tensor], image_shapes: list) -> torch.Tensor:
        from torchvision.ops.poolers import _convert_to_roi_format, _filter_input, _setup_scales

        pool, features = self.pool, _filter_input(x, self.pool.featmap_names)
        if pool.scales is None or pool.map_levels is None:
            pool.scales, pool.map_levels = _setup_scales(
                features, image_shapes, pool.canonical_scale, pool.canonical_level)
        rois = _convert_to_roi_format(boxes)
        levels = pool.map_levels(boxes)
        out = features[0].new_zeros((len(rois), features[0].shape[1], *pool.output_size))
        for level, (feature, scale) in enumerate(zip(features, pool.scales)):
            index = torch.where(levels == level)[0]
            out[index] = roi_align_matmul(feature, rois[index], pool.output_size, scale,
                                          pool.sampling_ratio)
        return out


def roi_align_matmul(feature: torch.Tensor, rois: torch.Tensor, output_size: tuple[int, int],
                     spatial_scale: float, sampling_ratio: int) -> torch.Tensor:
    """torchvision.ops.roi_align (aligned=False, sampling_ratio > 0) as matrix products: a
    bin's mean over its sampling points of bilinear weights is separable in y and x, so each
    RoI is (bins_y x H) @ feature (H x W) @ (W x bins_x). The boxes get no gradient, as in
    torchvision."""
    (ph, pw), n = output_size, feature.shape[0]
    r = rois.detach()
    x1, y1, x2, y2 = (r[:, i] * spatial_scale for i in range(1, 5))
    wy = _bin_weights(y1, y2 - y1, ph, sampling_ratio, feature.shape[2], feature.dtype)
    wx = _bin_weights(x1, x2 - x1, pw, sampling_ratio, feature.shape[3], feature.dtype)
    image = r[:, 0].long()
    order = torch.argsort(image, stable=True)
    counts = torch.bincount(image, minlength=n).tolist()
    parts = [torch.einsum("riy,cyx,rjx->rcij", y, feature[b], x)
             for b, (y, x) in enumerate(zip(wy[order].split(counts), wx[order].split(counts)))]
    return torch.cat(parts)[torch.argsort(order)]


def _bin_weights(start: torch.Tensor, length: torch.Tensor, bins: int, sampling_ratio: int,
                 size: int, dtype: torch.dtype) -> torch.Tensor:
    """(R, bins, size): each bin's mean bilinear weight on the `size` pixels of one axis, with
    torchvision's RoIAlign rules (RoI at least 1 pixel; samples beyond one pixel outside the
    map count zero, others clamp to the edge)."""
    step = length.clamp(min=1.0) / bins
    offsets = (torch.arange(bins * sampling_ratio, dtype=dtype) + 0.5) / sampling_ratio
    pos = start[:, None] + offsets * step[:, None]  # (R, bins * sampling_ratio)
    inside = ((pos >= -1) & (pos <= size)).to(dtype)
    pos = pos.clamp(0, size - 1)
    low = pos.floor()
    high = (low + 1).clamp(max=size - 1)
    frac = pos - low
    weights = (((1 - frac) * inside)[..., None] * torch.nn.functional.one_hot(low.long(), size)
               + (frac * inside)[..., None] * torch.nn.functional.one_hot(high.long(), size))
    return weights.reshape(len(start), bins, sampling_ratio, size).mean(2)


def _identity_transform(channels: int, image_size: int):
    """torchvision's detection transform made an identity: quantpipe feeds normalized images
    at the prepared size (it only runs in training, through the torchvision model's forward)."""
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    return GeneralizedRCNNTransform(image_size, image_size, [0.0] * channels, [1.0] * channels,
                                    size_divisible=1, fixed_size=(image_size, image_size))
