"""An image folder (torchvision's ImageFolder layout) decoded in parallel, straight into split files.

Decoding is what a large folder costs (ImageNet's 50,000 validation JPEGs: minutes), so worker
processes decode it, each writing its images' rows into the split's .npy file at their place
(quantpipe.storage.NpyWriter): nothing the size of the dataset passes through pipes or sits in
memory, and the bytes do not depend on the number of workers.

Each image becomes uint8 (C, S, S) one of two ways:
- `resize`/`crop` set: torchvision's evaluation transform (Resize(resize) on the shorter side,
  bilinear and antialiased, then CenterCrop(crop)), on the PIL image as torchvision's own
  ImageFolder loader gives it, so a model trained with that transform sees the same pixels;
- otherwise the whole image squeezed to size x size (bilinear, antialiased; quantpipe.data.resize).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantpipe.data import IMAGE_SUFFIXES, Split, channels_of
from quantpipe.errors import UserError
from quantpipe.storage import NpyRows, NpyWriter

# Images per task: big enough that a task's overhead is small, small enough that the progress
# bar moves and every worker stays busy to the end.
CHUNK = 64
# Below this many images, starting worker processes (each imports PIL and torch) costs more
# than it saves.
PARALLEL_FROM = 512


@dataclass(frozen=True)
class Folder:
    root: Path
    files: tuple[Path, ...]    # sorted by class, then by name
    y: np.ndarray              # (N,) int64 class index of each file
    classes: tuple[str, ...]   # sub-folder names, sorted: the class indices

    def relative(self, i: int) -> str:
        return self.files[i].relative_to(self.root).as_posix()


@dataclass(frozen=True)
class Transform:
    """How one image becomes uint8 (channels, size, size)."""
    channels: int
    size: int
    resize: int | None = None   # shorter side first (torchvision's eval transform), or
    crop: int | None = None     # None: the whole image squeezed to size x size
    # Each image's own channel count must be this one (prepare.channels null: the dataset's, and
    # a folder mixing grey and colour is an error); None converts every image.
    native: int | None = None
    first: Path | None = None   # the image `native` came from, for that error
    # Detection: letterboxed to size x size instead (aspect kept, centred, padded with this
    # grey level; quantpipe.detection.data.letterbox).
    pad_value: int | None = None


def list_folder(root: Path) -> Folder:
    """The class sub-folders of root and their image files; one line naming what is wrong."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise UserError(f"{root}: no class sub-folders; expected {root}/<class>/<image files>")
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(f for f in (root / name).iterdir()
                       if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise UserError(f"{root / name}: no images ({', '.join(IMAGE_SUFFIXES)})")
        files += found
        labels += [label] * len(found)
    return Folder(root, tuple(files), np.asarray(labels, dtype=np.int64), tuple(classes))


def transform_for(folder: Folder, channels: int | None, size: int, resize: int | None,
                  crop: int | None) -> Transform:
    """The Transform for prepare's settings; channels None takes the first image's."""
    if channels is not None:
        return Transform(channels, size, resize, crop)
    first = folder.files[0]
    native = _open(first, lambda img: channels_of(img))
    return Transform(native, size, resize, crop, native=native, first=first)


def _open(path: Path, use):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            return use(img)
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{path}: unreadable image ({type(e).__name__}); remove or replace it") from None


def decode(path: Path, t: Transform) -> np.ndarray:
    """One image file -> uint8 (channels, size, size)."""
    def convert(img) -> np.ndarray:
        if t.native is not None and channels_of(img) != t.native:
            raise UserError(f"{path.parent.parent}: images with {t.native} and {channels_of(img)} "
                            f"channels ({t.first}, {path}); set prepare.channels to 1 or 3 to "
                            "convert them all")
        img = img.convert("L" if t.channels == 1 else "RGB")
        if t.resize:
            import torchvision.transforms.functional as TF
            from torchvision.transforms import InterpolationMode

            img = TF.center_crop(TF.resize(img, t.resize, InterpolationMode.BILINEAR), t.crop)
            hwc = np.asarray(img)
            return hwc[None] if hwc.ndim == 2 else hwc.transpose(2, 0, 1)
        hwc = np.asarray(img)
        chw = hwc[None] if hwc.ndim == 2 else hwc.transpose(2, 0, 1)
        if t.pad_value is not None:
            from quantpipe.detection.data import letterbox

            return letterbox(chw, t.size, t.pad_value)[0]
        from quantpipe.data import resize

        return resize(chw[None], t.size)[0]
    return _open(path, convert)


def decode_all(files: tuple[Path, ...] | list[Path], t: Transform) -> np.ndarray:
    """Files -> uint8 (N, channels, size, size) in memory, in this process."""
    out = np.empty((len(files), t.channels, t.size, t.size), np.uint8)
    for i, f in enumerate(files):
        out[i] = decode(f, t)
    return out


def _decode_rows(writer: NpyWriter, start: int, files: list[Path],
                 t: Transform) -> tuple[int, float]:
    """A worker's task: decode files into rows start.. of the writer's file. Returns how many,
    and the worker's peak RSS so far (MB)."""
    from quantpipe.memprobe import high_water_mb

    writer.write(start, decode_all(files, t))
    return len(files), high_water_mb()


def decode_into(folder: Folder | tuple[Path, ...], parts: dict[str, np.ndarray], directory: Path, t: Transform,
                workers: int | None = None, progress: bool = True) -> tuple[dict[str, Path], float | None]:
    """Decode the files (a folder's, or a list) of each split (parts: split name -> sorted file
    indices) into
    directory/<split>_x.npy, rows in index order. workers: processes (None: one per core the
    process may run on; 1: this process). Returns the files written and the largest worker's
    peak RSS in MB (None without workers)."""
    from tqdm import tqdm

    files = folder.files if isinstance(folder, Folder) else folder
    root = folder.root if isinstance(folder, Folder) else os.path.commonpath(files)
    tasks, written = [], {}
    for name, idx in parts.items():
        path = directory / f"{name}_x.npy"
        writer = NpyWriter(path, (len(idx), t.channels, t.size, t.size))
        written[name] = path
        for start in range(0, len(idx), CHUNK):
            tasks.append((writer, start, [files[i] for i in idx[start:start + CHUNK]], t))
    total = sum(len(idx) for idx in parts.values())
    workers = workers or len(os.sched_getaffinity(0))
    if total < PARALLEL_FROM:
        workers = 1
    bar = tqdm(total=total, unit="img", desc=f"prepare: decoding {root}",
               disable=not progress, smoothing=0.1)
    pool, peak = None, None
    try:
        if workers == 1:
            for task in tasks:
                bar.update(_decode_rows(*task)[0])
        else:
            # spawn: a forked child would inherit the parent's threads (torch's among them).
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            pending = {pool.submit(_decode_rows, *task) for task in tasks}
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    count, worker_peak = future.result()  # a worker's UserError stops here
                    bar.update(count)
                    peak = max(peak or 0.0, worker_peak)
    finally:
        bar.close()
        if pool is not None:  # after an error: drop the queued tasks, not wait for them
            pool.shutdown(wait=True, cancel_futures=True)
    return written, peak


def splits_of(listing, parts: dict[str, np.ndarray], directory: Path,
              root: str | None) -> tuple[dict[str, Split], int | None]:
    """A task's listing (quantpipe.tasks.base.Listing) cut into `parts` (split name -> indices):
    taken in memory, or its folder decoded in parallel straight into `directory`'s split files
    with `<split>_files.txt` beside them (which image went where, relative to `root`,
    prepare.path, for tracing a prediction). Also the decoders' peak (None in memory)."""
    if listing.folder is None:
        return {name: listing.full.take(idx) for name, idx in parts.items()}, None
    folder = listing.folder
    written, workers_peak = decode_into(folder, parts, directory, listing.transform)
    splits = {name: Split(x=NpyRows(written[name]), y=listing.y[idx],
                          objects=None if listing.objects is None else
                          tuple(listing.objects[i] for i in idx))
              for name, idx in parts.items()}
    for name, idx in parts.items():
        (directory / f"{name}_files.txt").write_text("".join(
            f"{_relative(folder, i, root)}\n" for i in idx))
    return splits, workers_peak


def _relative(folder, i: int, root: str | None) -> str:
    """File i of an image folder or a detection listing, relative to `root`."""
    if isinstance(folder, Folder):
        return folder.relative(i)
    return folder[i].relative_to(root).as_posix() if root else folder[i].as_posix()
