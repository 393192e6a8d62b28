"""Where a dataset comes from (prepare.source): the bundled digits, an image folder, arrays, a
torchvision dataset, loaded as uint8 images at the prepared size. Only prepare reads sources;
every later stage reads the prepared splits (quantpipe.data).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quantpipe.data import STREAM_ROWS, Split, load_mnist5k, resize_to
from quantpipe.errors import UserError


def load_digits() -> Split:
    """scikit-learn's bundled 8x8 digits (1,797 images, 16 grey levels scaled to 0..255)."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # (N, 1, 8, 8)
    return Split(x=x, y=bunch.target.astype(np.int64))


def load_imagefolder(root: Path, channels: int | None, size: int, resize: int | None = None,
                     crop: int | None = None) -> tuple[Split, tuple[str, ...]]:
    """torchvision's ImageFolder layout, in memory: one sub-folder of images per class (sorted
    names). prepare decodes large folders in parallel straight to disk instead
    (quantpipe.imagefolder)."""
    from quantpipe import imagefolder

    folder = imagefolder.list_folder(root)
    t = imagefolder.transform_for(folder, channels, size, resize, crop)
    return Split(x=imagefolder.decode_all(folder.files, t), y=folder.y), folder.classes


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


def load_source(source: str, path: str | None, channels: int | None, size: int,
                resize: int | None = None,
                crop: int | None = None) -> tuple[Split, tuple[str, ...] | None]:
    """The dataset named by prepare.source (and prepare.path) as uint8 size x size images,
    converted to `channels` (None: as stored); class names when known. With resize/crop,
    torchvision's evaluation transform (shorter side to resize, centre crop, size = crop);
    otherwise each image is squeezed to size x size."""
    split, names = _load_raw(source, path, channels, size, resize, crop)
    if channels is not None and split.x.shape[1] != channels:
        # 1 -> 3 repeats the grey channel; 3 -> 1 takes the luma (ITU-R 601-2, as Pillow's "L").
        split = Split(x=np.repeat(split.x, 3, axis=1) if channels == 3 else np.round(
            np.tensordot(split.x.astype(np.float32), np.array([0.299, 0.587, 0.114], np.float32),
                         axes=([1], [0])))[:, None].astype(np.uint8), y=split.y)
    if source == "imagefolder":  # decoded to size already, each image on its own
        return split, names
    x = eval_transform(split.x, resize, crop) if resize else resize_to(split.x, size, size)
    return Split(x=x, y=split.y), names


def eval_transform(x: np.ndarray, resize: int, crop: int) -> np.ndarray:
    """torchvision's Resize(resize) + CenterCrop(crop) on uint8 (N, C, H, W) arrays (tensor
    path: bilinear, antialiased), a batch of same-size images at a time."""
    if x.shape[-1] == x.shape[-2] == crop and crop == resize:
        return x
    import torch
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    out = np.empty((len(x), x.shape[1], crop, crop), np.uint8)
    for start in range(0, len(x), STREAM_ROWS):
        t = torch.from_numpy(np.ascontiguousarray(x[start:start + STREAM_ROWS]))
        t = TF.center_crop(TF.resize(t, resize, InterpolationMode.BILINEAR, antialias=True), crop)
        out[start:start + len(t)] = t.numpy()
    return out


def source_root(source: str, path: str | None) -> Path:
    """prepare.path, checked: it exists (an image folder: a directory)."""
    root = Path(path or "")
    if not path or not root.exists():
        raise UserError(f"prepare.path = {path!r}: not found; prepare.source = {source} reads "
                        "its data from there")
    if source == "imagefolder" and not root.is_dir():
        raise UserError(f"prepare.path = {path!r} is not a directory of class folders")
    return root


def _load_raw(source: str, path: str | None, channels: int | None, size: int,
              resize: int | None, crop: int | None) -> tuple[Split, tuple[str, ...] | None]:
    if source == "mnist5k":
        return load_mnist5k(), None
    if source == "digits":
        return load_digits(), None
    if source not in ("imagefolder", "npz") and not source.startswith("torchvision:"):
        raise UserError(f"prepare.source = {source!r} is not supported; use mnist5k, digits, "
                        "imagefolder, npz or torchvision:<Name>")
    root = source_root(source, path)
    if source == "imagefolder":
        return load_imagefolder(root, channels, size, resize, crop)
    if source == "npz":
        return load_npz(root), None
    return load_torchvision(source.split(":", 1)[1], root), None
