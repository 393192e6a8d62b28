"""Detection data: the embedded digit canvases, boxes on disk, and COCO ground truth.

Each image's objects are one float32 array (n, 5): x1, y1, x2, y2 in input pixels (of the
image_size x image_size model input) and the class index. On disk a split's objects are one
(M, 5) array plus the count per image (np.save is byte-deterministic).
"""

from __future__ import annotations

import numpy as np


# Digits per canvas and how often: mostly 2-3, some alone, some crowded.
DIGITS_PER_CANVAS = (1, 2, 3, 4)
DIGITS_WEIGHTS = (0.2, 0.35, 0.3, 0.15)
# Longer side of a digit's box on a 64 px canvas (scaled with the canvas).
DIGIT_SIDE = (12, 30)
# Half the canvases are lit ("day": grey background, full contrast), half dark ("night": black
# background, dim digits): the validation split then holds both, as street scenes hold day and
# night, and a calibration set drawn from one half alone does not represent the test split.
LIGHTING = {"day": ((10, 50), (0.75, 1.0)), "night": ((0, 8), (0.22, 0.45))}
GAP = 2  # pixels kept free between boxes: one grid cell never centres two digits
GENERATOR_SEED = 20261202  # the dataset is fixed; prepare's seed only moves the split


# Per-pixel masks of the canvases (segmentation): a pixel is its digit's class + 1 where the
# scaled glyph's ink is at least INK, background (0) where it is below EDGE, and ignored (255)
# in between: the anti-aliased rim belongs to neither side.
INK, EDGE, IGNORE = 0.5, 0.15, 255


def digit_canvases(digits: np.ndarray, labels: np.ndarray, size: int, with_masks: bool = False):
    """Canvases of size x size from MNIST digits (uint8 (N, 1, 28, 28)), each digit used once so
    no digit is in two splits: images (M, 1, size, size) uint8, objects per image, and each
    canvas's lighting (0 day, 1 night); with_masks: also (M, size, size) uint8 masks (INK). The
    masks draw nothing from the generator: the canvases are the same either way."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(GENERATOR_SEED)
    order = rng.permutation(len(digits))
    images, objects, night, masks = [], [], [], []
    lo, hi = (max(6, round(s * size / 64)) for s in DIGIT_SIDE)
    cursor = 0
    while cursor < len(order):
        k = int(rng.choice(DIGITS_PER_CANVAS, p=DIGITS_WEIGHTS))
        picks, cursor = order[cursor:cursor + k], cursor + k
        dark = bool(rng.random() < 0.5)
        (b_lo, b_hi), (c_lo, c_hi) = LIGHTING["night" if dark else "day"]
        background = rng.uniform(b_lo, b_hi)
        canvas = np.full((size, size), background, np.float32)
        mask = np.zeros((size, size), np.uint8)
        boxes: list[list[float]] = []
        for i in picks:
            glyph = _tight_crop(digits[i, 0])
            side = rng.uniform(lo, hi)
            scale = side / max(glyph.shape)
            h, w = max(3, round(glyph.shape[0] * scale)), max(3, round(glyph.shape[1] * scale))
            spot = _free_spot(rng, size, w, h, boxes)
            if spot is None:
                continue  # no room left: the digit is not used
            x, y = spot
            t = torch.from_numpy(glyph.astype(np.float32))[None, None]
            scaled = F.interpolate(t, size=(h, w), mode="bilinear", antialias=True,
                                   align_corners=False)[0, 0].clamp(0, 255).numpy()
            contrast = rng.uniform(c_lo, c_hi)
            patch = canvas[y:y + h, x:x + w]
            np.maximum(patch, background + (255 - background) * contrast * scaled / 255, out=patch)
            boxes.append([x, y, x + w, y + h, float(labels[i])])
            region = mask[y:y + h, x:x + w]  # boxes never overlap (GAP)
            region[scaled >= 255 * EDGE] = IGNORE
            region[scaled >= 255 * INK] = int(labels[i]) + 1
        noise = rng.normal(0, 3.0, canvas.shape)
        images.append(np.clip(np.round(canvas + noise), 0, 255).astype(np.uint8))
        objects.append(np.asarray(boxes, np.float32).reshape(-1, 5))
        night.append(int(dark))
        masks.append(mask)
    out = np.stack(images)[:, None], objects, np.asarray(night, np.int64)
    return (*out, np.stack(masks)) if with_masks else out


def _tight_crop(img: np.ndarray) -> np.ndarray:
    """The digit's bounding box within its 28x28 MNIST frame (pixels above faint ink)."""
    ys, xs = np.nonzero(img > 40)
    return img[ys.min():ys.max() + 1, xs.min():xs.max() + 1]


def _free_spot(rng: np.random.Generator, size: int, w: int, h: int,
               boxes: list[list[float]]) -> tuple[int, int] | None:
    for _ in range(50):
        x, y = int(rng.integers(0, size - w + 1)), int(rng.integers(0, size - h + 1))
        if all(x + w + GAP <= b[0] or b[2] + GAP <= x or y + h + GAP <= b[1] or b[3] + GAP <= y
               for b in boxes):
            return x, y
    return None


def strata(objects: list[np.ndarray] | tuple[np.ndarray, ...], num_classes: int) -> np.ndarray:
    """What the split stratifies on: the class of each image's largest object (num_classes for
    an image without objects), so every class keeps its share in every split."""
    out = np.full(len(objects), num_classes, np.int64)
    for i, o in enumerate(objects):
        if len(o):
            area = (o[:, 2] - o[:, 0]) * (o[:, 3] - o[:, 1])
            out[i] = int(o[int(np.argmax(area)), 4])
    return out


def coco_ground_truth(objects: tuple[np.ndarray, ...], size: int,
                      category_ids: tuple[int, ...], names: tuple[str, ...]) -> dict:
    """COCO instances format for one split: image ids are the split's indices, boxes in input
    pixels, category ids the dataset's own (class index i -> category_ids[i])."""
    annotations = []
    for image_id, o in enumerate(objects):
        for x1, y1, x2, y2, label in o.tolist():
            w, h = x2 - x1, y2 - y1
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": category_ids[int(label)],
                                "bbox": [x1, y1, w, h], "area": w * h, "iscrowd": 0})
    return {"images": [{"id": i, "width": size, "height": size} for i in range(len(objects))],
            "annotations": annotations,
            "categories": [{"id": c, "name": n} for c, n in zip(category_ids, names)]}


def letterbox(img: np.ndarray, size: int, pad: int = 0) -> tuple[np.ndarray, float, int, int]:
    """(C, H, W) uint8 -> (C, size, size): resized to fit, aspect kept, centred on grey level
    `pad` (Ultralytics pads with 114); and the scale and x/y offsets that map a box onto it."""
    from quantpipe.data import resize_to

    c, h, w = img.shape
    scale, left, top, nh, nw = letterbox_geometry(h, w, size)
    out = np.full((c, size, size), pad, np.uint8)
    out[:, top:top + nh, left:left + nw] = resize_to(img[None], nh, nw)[0]
    return out, scale, left, top


def letterbox_geometry(h: int, w: int, size: int) -> tuple[float, int, int, int, int]:
    """Where an h x w image lands in the size x size letterbox: scale, left, top, new h, new w."""
    scale = size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    return scale, (size - nw) // 2, (size - nh) // 2, nh, nw


def letterbox_boxes(boxes: list[list[float]], h: int, w: int, size: int) -> np.ndarray:
    """Boxes (x1, y1, x2, y2, class) of an h x w image, moved onto its size x size letterbox."""
    scale, left, top, _, _ = letterbox_geometry(h, w, size)
    o = np.asarray(boxes, np.float64).reshape(-1, 5)
    o[:, [0, 2]] = np.clip(o[:, [0, 2]], 0, w) * scale + left
    o[:, [1, 3]] = np.clip(o[:, [1, 3]], 0, h) * scale + top
    return o.astype(np.float32)


def load_digits_detection(channels: int | None, size: int):
    """The embedded canvases (prepare.source digits_detection): images (N, C, size, size) uint8,
    objects per image, class names, category ids."""
    from quantpipe.data import load_mnist5k

    digits = load_mnist5k()
    x, objects, _ = digit_canvases(digits.x, digits.y, size)
    if channels == 3:
        x = np.repeat(x, 3, axis=1)
    return x, objects, tuple(str(d) for d in range(10)), tuple(range(1, 11))
