"""Image arrays larger than memory: .npy files written and read a batch of rows at a time.

A prepared split is one C-order .npy file, the same bytes np.save writes (so np.load reads it
and its DVC hash does not depend on how it was written). Readers take rows with pread instead of
a memory map: a map leaves every page a pass has touched resident in the process (RSS grows
with the split), while pread keeps only the batch; the kernel's page cache still serves repeated
passes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from quantpipe.errors import UserError


class NpyRows:
    """The rows of a C-order .npy file on disk: len, shape, dtype, and indexing by an int, a
    slice or an index array, each reading only the rows it returns."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                               (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                if read_header is None:
                    raise ValueError(f".npy format version {version}")
                shape, fortran, dtype = read_header(f)
                self.offset = f.tell()
        except FileNotFoundError:
            raise
        except (ValueError, OSError, EOFError) as e:
            raise UserError(f"{self.path}: unreadable ({type(e).__name__}: {e}); "
                            "re-run `dvc repro -f prepare`") from None
        if fortran or dtype.hasobject or not shape:
            raise UserError(f"{self.path}: not a C-order array of rows; re-run `dvc repro -f prepare`")
        self.shape, self.dtype = tuple(shape), dtype
        self.row_shape = self.shape[1:]
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * dtype.itemsize
        expected = self.offset + self.row_bytes * self.shape[0]
        if self.path.stat().st_size < expected:
            raise UserError(f"{self.path}: truncated ({self.path.stat().st_size} of {expected} "
                            "bytes); re-run `dvc repro -f prepare`")
        self._fd: int | None = None
        self._index: np.ndarray | None = None  # a subset's rows (subset())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def whole_file(self) -> bool:
        """Every row of the file, in order (not a subset)."""
        return self._index is None

    def subset(self, index: np.ndarray) -> "NpyRows":
        """These rows at `index`, still on disk: a pool or a calibration set drawn from a split
        costs nothing until it is read."""
        positions = np.arange(len(self))[np.asarray(index, dtype=np.int64)]
        view = NpyRows.__new__(NpyRows)
        view.__dict__.update(self.__getstate__())
        view._index = positions if self._index is None else self._index[positions]
        view.shape = (len(positions), *self.row_shape)
        return view

    def __getstate__(self) -> dict:  # worker processes open their own descriptor
        return {**self.__dict__, "_fd": None}

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def _read(self, start: int, count: int) -> np.ndarray:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = count * self.row_bytes
        buffer = bytearray(size)
        view, done = memoryview(buffer), 0
        while done < size:  # pread may return less than asked for
            n = os.preadv(self._fd, [view[done:]], self.offset + start * self.row_bytes + done)
            if n == 0:
                raise UserError(f"{self.path}: ended early; re-run `dvc repro -f prepare`")
            done += n
        return np.frombuffer(buffer, dtype=self.dtype).reshape(count, *self.row_shape)

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, tuple):  # rows first, then the rest of the index on what was read
            rows = self[key[0]]
            return rows[key[1:]] if isinstance(key[0], (int, np.integer)) else \
                rows[(slice(None), *key[1:])]
        if self._index is not None:
            return self._rows(self._index[np.arange(len(self))[key]])
        n = len(self)
        if isinstance(key, (int, np.integer)):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"row {key} of {n}")
            return self._read(i, 1)[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._read(start, max(0, stop - start))
            key = np.arange(start, stop, step)
        idx = np.asarray(key)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        idx = np.where(idx < 0, idx + n, idx).astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"rows {idx.min()}..{idx.max()} of {n}")
        return self._rows(idx)

    def _rows(self, idx: np.ndarray | np.integer) -> np.ndarray:
        """Rows of the file at absolute indices (an index array, or one index: one row)."""
        if np.ndim(idx) == 0:
            return self._read(int(idx), 1)[0]
        idx = np.asarray(idx, dtype=np.int64)
        out = np.empty((len(idx), *self.row_shape), dtype=self.dtype)
        # Runs of consecutive rows are read at once (calibration indices, evenly spaced pools
        # and shuffled batches are mostly single rows; slices of them are runs).
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        for run in np.split(np.arange(len(idx)), breaks):
            if run.size:
                out[run] = self._read(int(idx[run[0]]), len(run))
        return out

    def read(self) -> np.ndarray:
        """Every row in memory: for small files only (a calibration set, labels)."""
        return self[:]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # np.asarray(rows): all of them
        return self.read() if dtype is None else self.read().astype(dtype)


class NpyWriter:
    """Writes an .npy file of `shape` row block by row block, in any order (pwrite at each
    block's offset), from this process or from workers that reopen it by path. The header is
    np.save's, so the finished file is byte-identical to np.save of the whole array."""

    def __init__(self, path: Path | str, shape: tuple[int, ...], dtype=np.uint8) -> None:
        self.path, self.shape, self.dtype = Path(path), tuple(shape), np.dtype(dtype)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": self.shape}
        with open(self.path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, header)
            self.offset = f.tell()
            row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
            f.truncate(self.offset + row * self.shape[0])  # sparse until written
        self.row_bytes = row

    def write(self, start: int, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.shape[1:] or start + len(rows) > self.shape[0]:
            raise ValueError(f"{self.path}: rows {rows.shape} at {start} do not fit {self.shape}")
        fd = os.open(self.path, os.O_WRONLY)
        try:
            view, done = memoryview(rows).cast("B"), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], self.offset + start * self.row_bytes + done)
        finally:
            os.close(fd)


def save_rows(path: Path | str, x: np.ndarray | NpyRows, batch: int = 1024) -> None:
    """np.save of x, copied a batch of rows at a time when x is on disk."""
    writer = NpyWriter(path, x.shape, x.dtype)
    for start in range(0, len(x), batch):
        writer.write(start, x[start:start + batch])
