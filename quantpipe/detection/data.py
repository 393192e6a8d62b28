"""Detection data: the embedded digit canvases, boxes on disk, and COCO ground truth.

Each image's objects are one float32 array (n, 5): x1, y1, x2, y2 in input pixels (of the
image_size x image_size model input) and the class index. On disk a split's objects are one
(M, 5) array plus the count per image (np.save is byte-deterministic).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quantpipe.errors import UserError

# Digits per canvas and how often: mostly 2-3, some alone, some crowded.
DIGITS_PER_CANVAS = (1, 2, 3, 4)
DIGITS_WEIGHTS = (0.2, 0.35, 0.3, 0.15)
# Longer side of a digit's box on a 64 px canvas (scaled with the canvas).
DIGIT_SIDE = (12, 30)
# Half the canvases are lit ("day": grey background, full contrast), half dark ("night": black
# background, dim digits): the validation split then holds both, like the ORT chapter's street
# scenes, and a calibration set drawn from one half alone does not represent the test split.
LIGHTING = {"day": ((10, 50), (0.75, 1.0)), "night": ((0, 8), (0.22, 0.45))}
GAP = 2  # pixels kept free between boxes: one grid cell never centres two digits
GENERATOR_SEED = 20261202  # the dataset is fixed; prepare's seed only moves the split


def digit_canvases(digits: np.ndarray, labels: np.ndarray,
                   size: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Canvases of size x size from MNIST digits (uint8 (N, 1, 28, 28)), each digit used once so
    no digit is in two splits: images (M, 1, size, size) uint8, objects per image, and each
    canvas's lighting (0 day, 1 night)."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(GENERATOR_SEED)
    order = rng.permutation(len(digits))
    images, objects, night = [], [], []
    lo, hi = (max(6, round(s * size / 64)) for s in DIGIT_SIDE)
    cursor = 0
    while cursor < len(order):
        k = int(rng.choice(DIGITS_PER_CANVAS, p=DIGITS_WEIGHTS))
        picks, cursor = order[cursor:cursor + k], cursor + k
        dark = bool(rng.random() < 0.5)
        (b_lo, b_hi), (c_lo, c_hi) = LIGHTING["night" if dark else "day"]
        background = rng.uniform(b_lo, b_hi)
        canvas = np.full((size, size), background, np.float32)
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
        noise = rng.normal(0, 3.0, canvas.shape)
        images.append(np.clip(np.round(canvas + noise), 0, 255).astype(np.uint8))
        objects.append(np.asarray(boxes, np.float32).reshape(-1, 5))
        night.append(int(dark))
    return np.stack(images)[:, None], objects, np.asarray(night, np.int64)


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


def save_objects(directory: Path, name: str, objects: tuple[np.ndarray, ...]) -> None:
    counts = np.asarray([len(o) for o in objects], np.int64)
    flat = np.concatenate(list(objects)) if objects else np.zeros((0, 5), np.float32)
    np.save(directory / f"{name}_objects.npy", flat.astype(np.float32).reshape(-1, 5))
    np.save(directory / f"{name}_counts.npy", counts)


def load_objects(directory: Path | str, name: str) -> tuple[np.ndarray, ...]:
    directory = Path(directory)
    try:
        flat = np.load(directory / f"{name}_objects.npy", allow_pickle=False)
        counts = np.load(directory / f"{name}_counts.npy", allow_pickle=False)
    except FileNotFoundError as e:
        raise UserError(f"{e.filename}: not found; run `dvc repro prepare` first") from None
    return tuple(np.split(flat, np.cumsum(counts)[:-1])) if len(counts) else ()


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


def letterbox(img: np.ndarray, size: int) -> tuple[np.ndarray, float, int, int]:
    """(C, H, W) uint8 -> (C, size, size): resized to fit, aspect kept, centred on black (as
    Ultralytics' letterbox); and the scale and x/y offsets that map a box onto it."""
    from quantpipe.data import resize_to

    c, h, w = img.shape
    scale = size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    out = np.zeros((c, size, size), np.uint8)
    top, left = (size - nh) // 2, (size - nw) // 2
    out[:, top:top + nh, left:left + nw] = resize_to(img[None], nh, nw)[0]
    return out, scale, left, top


def _read_image(path: Path, channels: int | None, where: str) -> np.ndarray:
    """(C, H, W) uint8; channels None keeps grey as grey and anything else as RGB."""
    from PIL import Image, UnidentifiedImageError

    from quantpipe.data import channels_of

    try:
        with Image.open(path) as img:
            img.load()
            want = channels or channels_of(img)
            arr = np.asarray(img.convert("L" if want == 1 else "RGB"))
    except FileNotFoundError:
        raise UserError(f"{where}: image {path} not found; add it or remove its record") from None
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{path}: cannot be decoded ({type(e).__name__}); replace it or remove "
                        f"its record from {where}") from None
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _check_box(x1: float, y1: float, x2: float, y2: float, w: int, h: int, where: str) -> None:
    if x2 - x1 <= 0 or y2 - y1 <= 0:
        raise UserError(f"{where}: box has non-positive width or height "
                        f"({x2 - x1:g} x {y2 - y1:g}); fix or drop the record")
    slack = 1.0  # a pixel of rounding at the border, as exporters leave it
    if x1 < -slack or y1 < -slack or x2 > w + slack or y2 > h + slack:
        raise UserError(f"{where}: box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) lies outside its "
                        f"{w}x{h} image; fix the record")


def _letterboxed(img: np.ndarray, boxes: list[list[float]], size: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """An image (C, H, W) and its boxes (x1, y1, x2, y2, class) letterboxed to size x size."""
    h, w = img.shape[1:]
    out, scale, left, top = letterbox(img, size)
    o = np.asarray(boxes, np.float64).reshape(-1, 5)
    o[:, [0, 2]] = np.clip(o[:, [0, 2]], 0, w) * scale + left
    o[:, [1, 3]] = np.clip(o[:, [1, 3]], 0, h) * scale + top
    return out, o.astype(np.float32)


def _one_channel_count(images: list[np.ndarray], root: Path, channels: int | None) -> None:
    kinds = {im.shape[0] for im in images}
    if channels is None and len(kinds) > 1:
        raise UserError(f"{root}: images with 1 and 3 channels; set prepare.channels to 1 or 3 "
                        "to convert them all")


def load_coco(root: Path, channels: int | None, size: int):
    """A folder with images/ and annotations.json (COCO instances): letterboxed images, objects,
    class names and the COCO category ids (class index i is categories[i], sorted by id)."""
    import json

    ann_path = root / "annotations.json"
    try:
        doc = json.loads(ann_path.read_text())
        images, anns, cats = doc["images"], doc.get("annotations", []), doc["categories"]
    except FileNotFoundError:
        raise UserError(f"{ann_path}: not found; prepare.source = coco reads images/ and "
                        "annotations.json (COCO instances format) from prepare.path") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{ann_path}: not a COCO instances file ({type(e).__name__}: {e}); it "
                        "needs images, annotations and categories") from None
    cats = sorted(cats, key=lambda c: c["id"])
    index = {c["id"]: i for i, c in enumerate(cats)}
    by_image: dict = {im["id"]: [] for im in images}
    for a in anns:
        where = f"{ann_path}: annotation id {a.get('id')}"
        if a.get("category_id") not in index:
            raise UserError(f"{where}: category_id {a.get('category_id')} is not among the "
                            f"categories ({sorted(index)}); fix the record or add the category")
        if a.get("image_id") not in by_image:
            raise UserError(f"{where}: image_id {a.get('image_id')} is not among the images")
        by_image[a["image_id"]].append(a)
    xs, objects = [], []
    for im in images:
        arr = _read_image(root / "images" / im["file_name"], channels,
                          f"{ann_path} (image id {im['id']})")
        h, w = arr.shape[1:]
        boxes = []
        for a in by_image[im["id"]]:
            x, y, bw, bh = a["bbox"]
            _check_box(x, y, x + bw, y + bh, w, h,
                       f"{ann_path}: annotation id {a.get('id')} (image {im['file_name']})")
            boxes.append([x, y, x + bw, y + bh, index[a["category_id"]]])
        boxed, placed = _letterboxed(arr, boxes, size)
        xs.append(boxed)
        objects.append(placed)
    if not xs:
        raise UserError(f"{ann_path}: no images")
    _one_channel_count(xs, root, channels)
    return (np.stack(xs), objects, tuple(str(c["name"]) for c in cats),
            tuple(int(c["id"]) for c in cats))


def load_yolo(root: Path, channels: int | None, size: int):
    """Ultralytics' layout: data.yaml (names), images/ and labels/ (one .txt per image, lines
    `class cx cy w h` normalized to 0..1; no file or an empty one: no objects)."""
    import yaml

    from quantpipe.data import IMAGE_SUFFIXES

    spec_path = root / "data.yaml"
    try:
        names = yaml.safe_load(spec_path.read_text())["names"]
    except FileNotFoundError:
        raise UserError(f"{spec_path}: not found; prepare.source = yolo reads data.yaml, images/ "
                        "and labels/ from prepare.path") from None
    except (yaml.YAMLError, KeyError, TypeError) as e:
        raise UserError(f"{spec_path}: no class names ({type(e).__name__}: {e}); it needs "
                        "`names:` (a list, or a mapping id: name)") from None
    if isinstance(names, dict):
        ids = sorted(int(k) for k in names)
        if ids != list(range(len(ids))):
            raise UserError(f"{spec_path}: names ids {ids} must be 0..{len(ids) - 1}")
        names = [names[k] for k in sorted(names, key=int)]
    image_dir, label_dir = root / "images", root / "labels"
    files = sorted(f for f in image_dir.rglob("*") if f.is_file()
                   and f.suffix.lower() in IMAGE_SUFFIXES) if image_dir.is_dir() else []
    if not files:
        raise UserError(f"{image_dir}: no images ({', '.join(IMAGE_SUFFIXES)})")
    stems = {f.relative_to(image_dir).with_suffix("") for f in files}
    for label in sorted(label_dir.rglob("*.txt")) if label_dir.is_dir() else []:
        if label.relative_to(label_dir).with_suffix("") not in stems:
            raise UserError(f"{label}: no image of that name under {image_dir}; add the image "
                            "or remove the label file")
    xs, objects = [], []
    for f in files:
        arr = _read_image(f, channels, str(image_dir))
        h, w = arr.shape[1:]
        label = (label_dir / f.relative_to(image_dir)).with_suffix(".txt")
        boxes = []
        lines = label.read_text().splitlines() if label.exists() else []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{label}:{n}"
            try:
                cls, cx, cy, bw, bh = line.split()
                cls = int(cls)
                cx, cy, bw, bh = float(cx) * w, float(cy) * h, float(bw) * w, float(bh) * h
            except ValueError:
                raise UserError(f"{where}: expected `class cx cy w h` (class an integer, the "
                                f"rest normalized numbers), got {line.strip()!r}") from None
            if not 0 <= cls < len(names):
                raise UserError(f"{where}: class {cls} is not in {spec_path}'s names "
                                f"(0..{len(names) - 1})")
            _check_box(cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2, w, h, where)
            boxes.append([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2, cls])
        boxed, placed = _letterboxed(arr, boxes, size)
        xs.append(boxed)
        objects.append(placed)
    _one_channel_count(xs, root, channels)
    return np.stack(xs), objects, tuple(str(n) for n in names), tuple(range(1, len(names) + 1))


def load_detection_source(source: str, path: str | None, channels: int | None, size: int):
    """images (N, C, size, size) uint8, objects per image, class names, category ids."""
    x, objects, names, ids = _load(source, path, channels, size)
    if not any(len(o) for o in objects):
        raise UserError(f"{path or source}: no image has an object; a detector needs boxes")
    return x, objects, names, ids


def _load(source: str, path: str | None, channels: int | None, size: int):
    if source == "digits_detection":
        from quantpipe.data import load_mnist5k

        digits = load_mnist5k()
        x, objects, _ = digit_canvases(digits.x, digits.y, size)
        if channels == 3:
            x = np.repeat(x, 3, axis=1)
        return x, objects, tuple(str(d) for d in range(10)), tuple(range(1, 11))
    root = Path(path or "")
    if not path or not root.is_dir():
        raise UserError(f"prepare.path = {path!r}: not a directory; prepare.source = {source} "
                        "reads its data from there")
    return (load_coco if source == "coco" else load_yolo)(root, channels, size)
