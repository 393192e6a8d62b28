"""Segmentation data: the embedded digit canvases with per-pixel masks (prepare.source:
digits_masks) and a folder of images with masks (prepare.source: masks).

A mask is uint8 (H, W): the class index of each pixel, 0 first (the canvases' background),
IGNORE (255) for pixels that count for nothing. Images and masks are squeezed to the model's
image_size x image_size: images bilinear (antialiased), masks nearest, so no class is invented
at a boundary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quantpipe.data import IMAGE_SUFFIXES, resize_to
from quantpipe.detection.data import IGNORE, digit_canvases
from quantpipe.errors import UserError

__all__ = ["IGNORE", "load_digit_masks", "load_mask_folder", "strata"]

CLASSES_FILE = "classes.txt"


def load_digit_masks(channels: int | None, size: int):
    """The embedded canvases (the detection task's digits) with their masks: images
    (N, C, size, size) uint8, masks (N, size, size) uint8, class names (background, 0..9)."""
    from quantpipe.data import load_mnist5k

    digits = load_mnist5k()
    x, _, _, masks = digit_canvases(digits.x, digits.y, size, with_masks=True)
    if channels == 3:
        x = np.repeat(x, 3, axis=1)
    return x, masks, ("background", *(str(d) for d in range(10)))


def strata(masks, num_classes: int) -> np.ndarray:
    """What the split stratifies on: each image's most frequent class other than 0 (0 when it
    has none), so every class keeps its share in every split."""
    out = np.zeros(len(masks), np.int64)
    for i, m in enumerate(masks):
        counts = np.bincount(m[m != IGNORE].ravel(), minlength=num_classes)[1:num_classes]
        if counts.any():
            out[i] = 1 + int(np.argmax(counts))
    return out


def load_mask_folder(root: Path, channels: int | None, size: int):
    """images/<stem>.png|jpg, masks/<stem>.png (8-bit, pixel = class index, 255 = ignore) and
    classes.txt (one name a line, index 0 first) under root: images (N, C, size, size) uint8,
    masks (N, size, size) uint8, class names. A bad record ends in one line naming the file."""
    names = _class_names(root / CLASSES_FILE)
    image_dir, mask_dir = root / "images", root / "masks"
    files = sorted(f for f in image_dir.iterdir() if f.is_file()
                   and f.suffix.lower() in IMAGE_SUFFIXES) if image_dir.is_dir() else []
    if not files:
        raise UserError(f"{image_dir}: no images ({', '.join(IMAGE_SUFFIXES)}); prepare.source "
                        "masks reads images/<stem>.png|jpg, masks/<stem>.png and classes.txt")
    images, masks = [], []
    for f in files:
        mask_path = mask_dir / f"{f.stem}.png"
        if not mask_path.is_file():
            raise UserError(f"{mask_path}: missing; every image in {image_dir} needs its mask "
                            f"(8-bit PNG, pixel = class index, {IGNORE} = ignore)")
        img = _read(f, lambda im: np.asarray(im.convert("RGB" if channels == 3 or (
            channels is None and im.mode not in ("L", "I;16", "I")) else "L")))
        mask = _read(mask_path, _mask_pixels)
        if mask.shape != img.shape[:2]:
            raise UserError(f"{mask_path}: {mask.shape[1]}x{mask.shape[0]} px, its image {f.name} "
                            f"is {img.shape[1]}x{img.shape[0]}: a mask must match its image")
        bad = np.unique(mask[(mask >= len(names)) & (mask != IGNORE)])
        if bad.size:
            raise UserError(f"{mask_path}: class index {int(bad[0])} out of range: "
                            f"{CLASSES_FILE} names {len(names)} classes (0..{len(names) - 1}; "
                            f"{IGNORE} = ignore)")
        chw = img[None] if img.ndim == 2 else img.transpose(2, 0, 1)
        images.append(resize_to(chw[None], size, size)[0])
        masks.append(_resize_nearest(mask, size))
    return np.stack(images), np.stack(masks), names


def _read(path: Path, convert):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return convert(im)
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _mask_pixels(im) -> np.ndarray:
    if im.mode not in ("L", "P"):
        raise UserError(f"{im.filename}: mode {im.mode}; a mask is an 8-bit PNG (grey or "
                        "palette) whose pixel values are class indices")
    return np.asarray(im)


def _class_names(path: Path) -> tuple[str, ...]:
    if not path.is_file():
        raise UserError(f"{path}: missing; list the class names there, one a line, index 0 first")
    names = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if len(names) < 2:
        raise UserError(f"{path}: {len(names)} class name(s); segmentation needs at least two "
                        "(e.g. background and one object class)")
    return names


def _resize_nearest(mask: np.ndarray, size: int) -> np.ndarray:
    """(H, W) -> (size, size), nearest neighbour: every pixel keeps a class of the original."""
    if mask.shape == (size, size):
        return mask.copy()
    rows = np.minimum((np.arange(size) + 0.5) * mask.shape[0] / size, mask.shape[0] - 1).astype(int)
    cols = np.minimum((np.arange(size) + 0.5) * mask.shape[1] / size, mask.shape[1] - 1).astype(int)
    return mask[rows][:, cols]
