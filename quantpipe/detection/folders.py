"""The embedded digit canvases written out as a dataset folder of the layout users bring:
Ultralytics' (data.yaml with train/val/test, images/<split>/, labels/<split>/) or COCO's
(images/ and one annotations file per split). Tests, the fixture script that trains real
Ultralytics models, and the detection study read the same folders, so FP32 scores can be
compared with Ultralytics' own validator on the same images.

    python -m quantpipe.detection.folders yolo inputs/digits_yolo --size 128 --classes 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from quantpipe.detection.data import digit_canvases

FOLDER_SPLITS = {"train": 0.7, "val": 0.15, "test": 0.15}
LAYOUTS = ("yolo", "coco")


def canvases(size: int, classes: int, images: int | None = None, rgb: bool = True):
    """Digit canvases of size x size holding only digits 0..classes-1: uint8 (N, C, S, S) and
    objects per image (x1, y1, x2, y2, class), deterministic; at most `images` of them."""
    from quantpipe.data import load_mnist5k

    digits = load_mnist5k()
    keep = digits.y < classes
    x, objects, _ = digit_canvases(digits.x[keep], digits.y[keep], size)
    if images is not None:
        x, objects = x[:images], objects[:images]
    return (np.repeat(x, 3, axis=1) if rgb else x), objects


def split_of(n: int) -> list[str]:
    """Each image's split, in order (the canvases are already shuffled): train, val, test."""
    bounds = np.cumsum([round(n * f) for f in FOLDER_SPLITS.values()])
    return [next(s for s, b in zip(FOLDER_SPLITS, bounds) if i < b) if i < bounds[-1] else "test"
            for i in range(n)]


def _png(path: Path, img: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)).save(path)


def write_yolo(root: Path, x: np.ndarray, objects: list[np.ndarray], names: list[str]) -> Path:
    """Ultralytics' layout with declared splits: data.yaml (train/val/test, names),
    images/<split>/<i>.png and labels/<split>/<i>.txt (`class cx cy w h`, normalized)."""
    size = x.shape[-1]
    for i, (img, o, split) in enumerate(zip(x, objects, split_of(len(x)))):
        _png(root / "images" / split / f"{i:05d}.png", img)
        label = root / "labels" / split / f"{i:05d}.txt"
        label.parent.mkdir(parents=True, exist_ok=True)
        label.write_text("".join(
            f"{int(c)} {(x1 + x2) / 2 / size:.6f} {(y1 + y2) / 2 / size:.6f} "
            f"{(x2 - x1) / size:.6f} {(y2 - y1) / size:.6f}\n" for x1, y1, x2, y2, c in o))
    (root / "data.yaml").write_text(
        "train: images/train\nval: images/val\ntest: images/test\n"
        f"nc: {len(names)}\nnames:\n" + "".join(f"  {i}: {n}\n" for i, n in enumerate(names)))
    return root


def write_coco(root: Path, x: np.ndarray, objects: list[np.ndarray], names: list[str]) -> Path:
    """COCO's layout with declared splits: images/<i>.png and annotations/instances_<split>.json
    (category ids from 1)."""
    size = x.shape[-1]
    docs = {s: {"images": [], "annotations": [],
                "categories": [{"id": c + 1, "name": n} for c, n in enumerate(names)]}
            for s in FOLDER_SPLITS}
    for i, (img, o, split) in enumerate(zip(x, objects, split_of(len(x)))):
        _png(root / "images" / f"{i:05d}.png", img)
        doc = docs[split]
        doc["images"].append({"id": i, "file_name": f"{i:05d}.png", "width": size, "height": size})
        for x1, y1, x2, y2, c in o.tolist():
            doc["annotations"].append({
                "id": sum(len(d["annotations"]) for d in docs.values()) + 1, "image_id": i,
                "category_id": int(c) + 1, "bbox": [x1, y1, x2 - x1, y2 - y1],
                "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    for split, doc in docs.items():
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(doc) + "\n")
    return root


def write_folder(layout: str, root: Path, size: int, classes: int,
                 images: int | None = None) -> Path:
    x, objects = canvases(size, classes, images)
    names = [f"digit{c}" for c in range(classes)]
    return (write_yolo if layout == "yolo" else write_coco)(Path(root), x, objects, names)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("layout", choices=LAYOUTS)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", type=int, default=64, help="canvas side in pixels")
    ap.add_argument("--classes", type=int, default=10, help="digits 0..classes-1")
    ap.add_argument("--images", type=int, default=None, help="at most this many images")
    args = ap.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        ap.error(f"{args.out} exists and is not empty")
    write_folder(args.layout, args.out, args.size, args.classes, args.images)
    print(f"{args.layout} folder -> {args.out}")


if __name__ == "__main__":
    main()
