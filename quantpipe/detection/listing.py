"""Detection folders (prepare.source coco, yolo), listed before anything is decoded: each image's
file, its boxes moved onto the letterbox, and the splits the dataset declares. prepare then
decodes the images a batch at a time straight into the split files (quantpipe.imagefolder), so
a dataset larger than memory never is in memory.

Declared splits are used as given: a YOLO data.yaml's train/val/test, COCO's per-split
annotation files (annotations/instances_<split>*.json). FP32 mAP is then scored on the images
`yolo val` scores. A folder with one pool of images (images/ + labels/, one annotations.json)
is split by prepare (stratified, seeded).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantpipe.detection.data import letterbox_boxes
from quantpipe.errors import UserError

DECLARED = ("train", "val", "test")


@dataclass(frozen=True)
class Listing:
    files: tuple[Path, ...]
    objects: tuple[np.ndarray, ...]  # per file (n, 5): x1, y1, x2, y2 in letterbox pixels, class
    class_names: tuple[str, ...]
    category_ids: tuple[int, ...]    # the dataset's id of each class index
    channels: int                    # every image's (prepare.channels null) or the one asked
    # The dataset's own splits: name -> indices into files, in file order; empty: one pool.
    declared: dict[str, np.ndarray] = field(default_factory=dict)


def list_source(source: str, path: str | None, channels: int | None, size: int) -> Listing:
    """The folder at prepare.path in the layout prepare.source names; one line naming the file
    and record when something is wrong."""
    root = Path(path or "")
    if not path or not root.is_dir():
        raise UserError(f"prepare.path = {path!r}: not a directory; prepare.source = {source} "
                        "reads its data from there")
    items, names, ids, declared = (_coco if source == "coco" else _yolo)(root)
    if not items:
        raise UserError(f"{root}: no images")
    images = _Images(channels, size)
    objects = tuple(images.place(item) for item in items)
    if not any(len(o) for o in objects):
        raise UserError(f"{path}: no image has an object; a detector needs boxes")
    return Listing(tuple(item.path for item in items), objects, names, ids, images.channels,
                   {k: np.asarray(v, np.int64) for k, v in declared.items()})


@dataclass(frozen=True)
class _Item:
    """One image as its annotation file lists it."""
    path: Path
    boxes: list[list[float]]  # x1, y1, x2, y2, class: in pixels, or 0..1 when normalized
    box_where: list[str]      # the record of each box, for errors
    where: str                # the record of the image
    normalized: bool = False


class _Images:
    """Reads each image's header (size, channel count) and places its boxes on the letterbox;
    with prepare.channels null every image must have the first one's channel count."""

    def __init__(self, channels: int | None, size: int) -> None:
        self.asked, self.size = channels, size
        self.channels, self.first = channels, None

    def place(self, item: _Item) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        from quantpipe.data import channels_of

        path, where = item.path, item.where
        try:
            with Image.open(path) as img:  # the header only: nothing is decoded here
                (w, h), native = img.size, channels_of(img)
        except FileNotFoundError:
            raise UserError(f"{where}: image {path} not found; add it or remove its record") from None
        except (UnidentifiedImageError, OSError) as e:
            raise UserError(f"{path}: cannot be decoded ({type(e).__name__}); replace it or "
                            f"remove its record from {where}") from None
        if self.asked is None:
            if self.channels is None:
                self.channels, self.first = native, path
            elif native != self.channels:
                raise UserError(f"{path}: {native} channel(s) where {self.first} has "
                                f"{self.channels}; set prepare.channels to 1 or 3 to convert "
                                "them all")
        boxes = np.asarray(item.boxes, np.float64).reshape(-1, 5)
        if item.normalized:
            boxes[:, [0, 2]] *= w
            boxes[:, [1, 3]] *= h
        for (x1, y1, x2, y2, _), box_where in zip(boxes.tolist(), item.box_where):
            _check_box(x1, y1, x2, y2, w, h, box_where)
        return letterbox_boxes(boxes.tolist(), h, w, self.size)


def _check_box(x1: float, y1: float, x2: float, y2: float, w: int, h: int, where: str) -> None:
    if x2 - x1 <= 0 or y2 - y1 <= 0:
        raise UserError(f"{where}: box has non-positive width or height "
                        f"({x2 - x1:g} x {y2 - y1:g}); fix or drop the record")
    slack = 1.0  # a pixel of rounding at the border, as exporters leave it
    if x1 < -slack or y1 < -slack or x2 > w + slack or y2 > h + slack:
        raise UserError(f"{where}: box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) lies outside its "
                        f"{w}x{h} image; fix the record")


# --- COCO -------------------------------------------------------------------------------------

def _coco(root: Path):
    """images/ and annotations.json (one pool), or annotations/<...train|val|test...>.json, one
    COCO instances file per split (e.g. instances_train2017.json), with each split's images in
    images/, images/<tag>/ or <tag>/ (tag: the file name without `instances_`, e.g. val2017)."""
    single = root / "annotations.json"
    per_split = _split_files(root / "annotations") if not single.exists() else {}
    if not per_split:
        if not single.exists():
            raise UserError(f"{single}: not found; prepare.source = coco reads images/ and "
                            "annotations.json (COCO instances format), or one file per split "
                            "under annotations/ (instances_train.json, instances_val.json, ...)")
        items, cats = _coco_file(single, [root / "images"])
        return items, *cats, {}
    items, declared, cats, first = [], {}, None, None
    for split, ann_path in per_split.items():
        tag = ann_path.stem.removeprefix("instances_")
        found, these = _coco_file(ann_path, [root / "images", root / "images" / tag, root / tag])
        if cats is not None and these != cats:
            raise UserError(f"{ann_path}: its categories differ from {first}'s; every split "
                            "needs the same categories")
        cats, first = these, first or ann_path
        declared[split] = range(len(items), len(items) + len(found))
        items += found
    return items, *cats, declared


def _split_files(directory: Path) -> dict[str, Path]:
    if not directory.is_dir():
        return {}
    found: dict[str, Path] = {}
    for f in sorted(directory.glob("*.json")):
        m = re.search(r"(?<![a-z])(train|val|test)", f.stem.lower())
        if m is None:
            continue
        if m.group(1) in found:
            raise UserError(f"{directory}: two annotation files for the {m.group(1)} split "
                            f"({found[m.group(1)].name}, {f.name}); keep one")
        found[m.group(1)] = f
    if found and "train" not in found:
        raise UserError(f"{directory}: annotation files for {sorted(found)} but none for train "
                        "(calibration and the criterion's pool come from train)")
    return {s: found[s] for s in DECLARED if s in found}


def _coco_file(ann_path: Path, image_dirs: list[Path]):
    """Items (file, boxes in image pixels, where) of one COCO instances file, and its
    (class names, category ids), class index i being the i-th category by id."""
    try:
        doc = json.loads(ann_path.read_text())
        images, anns, cats = doc["images"], doc.get("annotations", []), doc["categories"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{ann_path}: not a COCO instances file ({type(e).__name__}: {e}); it "
                        "needs images, annotations and categories") from None
    cats = sorted(cats, key=lambda c: c["id"])
    index = {c["id"]: i for i, c in enumerate(cats)}
    by_image: dict = {im["id"]: [] for im in images}
    wheres: dict = {im["id"]: [] for im in images}
    for a in anns:
        where = f"{ann_path}: annotation id {a.get('id')}"
        if a.get("category_id") not in index:
            raise UserError(f"{where}: category_id {a.get('category_id')} is not among the "
                            f"categories ({sorted(index)}); fix the record or add the category")
        if a.get("image_id") not in by_image:
            raise UserError(f"{where}: image_id {a.get('image_id')} is not among the images")
        x, y, w, h = a["bbox"]
        by_image[a["image_id"]].append([x, y, x + w, y + h, index[a["category_id"]]])
        wheres[a["image_id"]].append(where)
    items = []
    for im in images:
        name = im["file_name"]
        path = next((d / name for d in image_dirs if (d / name).is_file()), image_dirs[0] / name)
        items.append(_Item(path, by_image[im["id"]], [f"{w} (image {name})" for w in wheres[im["id"]]],
                           f"{ann_path} (image id {im['id']})"))
    return items, (tuple(str(c["name"]) for c in cats), tuple(int(c["id"]) for c in cats))


# --- YOLO (Ultralytics) -----------------------------------------------------------------------

def _yolo(root: Path):
    """data.yaml (names; train/val/test: folders or .txt lists of images) with labels beside
    each images/ folder as Ultralytics finds them (.../images/... -> .../labels/..., .txt);
    without train/val in data.yaml, images/ and labels/ under the root are one pool."""
    import yaml

    from quantpipe.data import IMAGE_SUFFIXES

    spec_path = root / "data.yaml"
    try:
        spec = yaml.safe_load(spec_path.read_text())
        names = spec["names"]
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
    names = tuple(str(n) for n in names)
    ids = tuple(range(1, len(names) + 1))
    if "train" not in spec:
        image_dir = root / "images"
        files = sorted(f for f in image_dir.rglob("*") if f.is_file()
                       and f.suffix.lower() in IMAGE_SUFFIXES) if image_dir.is_dir() else []
        if not files:
            raise UserError(f"{image_dir}: no images ({', '.join(IMAGE_SUFFIXES)})")
        _no_orphan_labels(root / "labels", image_dir, files)
        return [_yolo_item(f, names, spec_path) for f in files], names, ids, {}
    base = _yolo_base(root, spec, spec_path)
    items, declared, seen = [], {}, {}
    for split in DECLARED:
        if split not in spec or spec[split] in (None, ""):
            continue
        files = _yolo_files(base, spec[split], f"{spec_path}: {split}")
        key = tuple(files)
        if key in seen:  # `val: images/train`: no held-out split of its own
            continue
        seen[key] = split
        declared[split] = range(len(items), len(items) + len(files))
        items += [_yolo_item(f, names, spec_path) for f in files]
    if "val" not in declared and "test" not in declared:
        declared = {}  # one split only: prepare splits it
    return items, names, ids, declared


def _yolo_base(root: Path, spec: dict, spec_path: Path) -> Path:
    """Where data.yaml's split paths start: its `path` when that is a folder under the dataset
    (relative), else the folder of data.yaml (an absolute `path` from another machine is
    ignored: the data DVC tracks is the folder under inputs/)."""
    rel = spec.get("path")
    if rel and not Path(str(rel)).is_absolute() and (root / str(rel)).is_dir():
        return root / str(rel)
    return root


def _yolo_files(base: Path, entry, where: str) -> list[Path]:
    from quantpipe.data import IMAGE_SUFFIXES

    files: list[Path] = []
    for e in entry if isinstance(entry, list) else [entry]:
        p = base / str(e)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file()
                            and f.suffix.lower() in IMAGE_SUFFIXES)
        elif p.is_file() and p.suffix == ".txt":  # a list of images, relative to the base
            files += [(p.parent / line.strip()) if line.strip().startswith("./")
                      else base / line.strip() for line in p.read_text().splitlines() if line.strip()]
        else:
            raise UserError(f"{where}: {e!r} is neither a folder nor a .txt list of images under "
                            f"{base}")
    if not files:
        raise UserError(f"{where}: no images ({', '.join(IMAGE_SUFFIXES)})")
    return files


def label_path(image: Path) -> Path:
    """Ultralytics' rule: the last /images/ of the path becomes /labels/, the suffix .txt."""
    s = str(image)
    a, b = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    if a in s:
        head, _, tail = s.rpartition(a)
        s = head + b + tail
    return Path(s).with_suffix(".txt")


def _yolo_item(image: Path, names: tuple[str, ...], spec_path: Path) -> _Item:
    label = label_path(image)
    boxes, wheres = [], []
    lines = label.read_text().splitlines() if label.exists() else []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{label}:{n}"
        try:
            cls, cx, cy, bw, bh = line.split()
            cls, cx, cy, bw, bh = int(cls), float(cx), float(cy), float(bw), float(bh)
        except ValueError:
            raise UserError(f"{where}: expected `class cx cy w h` (class an integer, the "
                            f"rest normalized numbers), got {line.strip()!r}") from None
        if not 0 <= cls < len(names):
            raise UserError(f"{where}: class {cls} is not in {spec_path}'s names "
                            f"(0..{len(names) - 1})")
        boxes.append([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2, cls])
        wheres.append(where)
    return _Item(image, boxes, wheres, str(label), normalized=True)


def _no_orphan_labels(label_dir: Path, image_dir: Path, files: list[Path]) -> None:
    stems = {f.relative_to(image_dir).with_suffix("") for f in files}
    for label in sorted(label_dir.rglob("*.txt")) if label_dir.is_dir() else []:
        if label.relative_to(label_dir).with_suffix("") not in stems:
            raise UserError(f"{label}: no image of that name under {image_dir}; add the image "
                            "or remove the label file")


def load_folder(source: str, path: str | None, channels: int | None, size: int,
                pad_value: int = 0):
    """A whole folder in memory, pooled (small folders, tests): images (N, C, size, size) uint8,
    objects per image, class names, category ids."""
    from quantpipe import imagefolder

    listing = list_source(source, path, channels, size)
    t = imagefolder.Transform(listing.channels, size, pad_value=pad_value)
    return (imagefolder.decode_all(listing.files, t), list(listing.objects),
            listing.class_names, listing.category_ids)
