"""quantpipe.data: splits, calibration draw, normalization, resize, .npy round trip, mnist5k."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import structured_images
from quantpipe import data, sources
from quantpipe.errors import UserError

# Unequal class sizes, so "each class keeps its share" is not the same as "equal counts".
CLASS_SIZES = {0: 50, 1: 30, 2: 20, 3: 100}


@pytest.fixture
def labels() -> np.ndarray:
    y = np.repeat(np.array(list(CLASS_SIZES)), list(CLASS_SIZES.values()))
    return np.random.default_rng(7).permutation(y)


# --- stratified_split -------------------------------------------------------------------------

def test_split_is_disjoint_and_covers_all_indices(labels):
    parts = data.stratified_split(labels, 0.1, 0.2, seed=0)
    assert set(parts) == {"train", "val", "test"}
    together = np.concatenate(list(parts.values()))
    assert len(together) == len(labels)
    assert np.array_equal(np.sort(together), np.arange(len(labels)))
    for idx in parts.values():
        assert np.array_equal(idx, np.sort(idx))


def test_split_preserves_each_class_share(labels):
    parts = data.stratified_split(labels, 0.1, 0.2, seed=0)
    for cls, n in CLASS_SIZES.items():
        assert (labels[parts["test"]] == cls).sum() == round(n * 0.2)
        assert (labels[parts["val"]] == cls).sum() == round(n * 0.1)
        assert (labels[parts["train"]] == cls).sum() == n - round(n * 0.2) - round(n * 0.1)


def test_split_is_deterministic_for_a_seed(labels):
    a = data.stratified_split(labels, 0.1, 0.2, seed=3)
    b = data.stratified_split(labels, 0.1, 0.2, seed=3)
    c = data.stratified_split(labels, 0.1, 0.2, seed=4)
    for name in data.SPLITS:
        assert np.array_equal(a[name], b[name])
    assert not np.array_equal(a["test"], c["test"])


# --- draw_calibration -------------------------------------------------------------------------

def _ided(n: int) -> data.Split:
    """A split whose labels are unique sample ids, so we can see where samples came from."""
    x = (np.arange(n)[:, None, None, None] % 256 * np.ones((1, 1, 2, 2))).astype(np.uint8)
    return data.Split(x=x, y=np.arange(n, dtype=np.int64))


def test_calibration_draws_only_train_samples(labels):
    full = _ided(len(labels))
    parts = data.stratified_split(labels, 0.1, 0.2, seed=0)
    train = full.take(parts["train"])
    calib = data.draw_calibration(train, 40, seed=0)
    assert len(calib) == 40
    assert len(np.unique(calib.y)) == 40  # without replacement
    assert set(calib.y) <= set(parts["train"])
    assert not set(calib.y) & (set(parts["test"]) | set(parts["val"]))
    assert np.array_equal(calib.x, full.x[calib.y])  # images travel with their labels


def test_calibration_is_deterministic_and_depends_on_seed():
    train = _ided(200)
    a = data.draw_calibration(train, 30, seed=1)
    b = data.draw_calibration(train, 30, seed=1)
    c = data.draw_calibration(train, 30, seed=2)
    assert np.array_equal(a.y, b.y)
    assert not np.array_equal(a.y, c.y)


def test_changing_calib_size_does_not_change_the_split(labels):
    """The prepare stage's order of calls: split, then draw. Only the calibration set may move."""
    full = _ided(len(labels))

    def prepare(calib_size: int):
        parts = data.stratified_split(labels, 0.1, 0.2, seed=0)
        train_before = full.take(parts["train"])
        calib = data.draw_calibration(train_before, calib_size, seed=0)
        return parts, train_before, calib

    parts_a, train_a, calib_a = prepare(10)
    parts_b, train_b, calib_b = prepare(60)
    for name in data.SPLITS:
        assert np.array_equal(parts_a[name], parts_b[name])
    assert np.array_equal(train_a.x, train_b.x) and np.array_equal(train_a.y, train_b.y)
    assert len(calib_a) == 10 and len(calib_b) == 60


def test_calibration_larger_than_train_takes_half_of_it_leaving_the_pool_the_rest():
    train = _ided(20)
    assert len(data.draw_calibration(train, 20, seed=0)) == 20  # exactly all is fine
    assert len(data.draw_calibration(train, 21, seed=0)) == 10  # a small dataset: half
    assert len(data.draw_calibration(_ided(1), 5, seed=0)) == 1


# --- compute_info / normalize -----------------------------------------------------------------

@pytest.fixture
def rgb_train() -> data.Split:
    rng = np.random.default_rng(0)
    # Three channels with clearly different statistics.
    x = np.stack([rng.integers(0, 60, (30, 10, 10)), rng.integers(100, 256, (30, 10, 10)),
                  rng.integers(0, 256, (30, 10, 10))], axis=1).astype(np.uint8)
    return data.Split(x=x, y=np.arange(30) % 3)


def test_compute_info_is_per_channel_train_statistics(rgb_train):
    info = data.compute_info("rgb", rgb_train, num_classes=3)
    pixels = rgb_train.x.astype(np.float64) / 255
    for c in range(3):
        assert info.mean[c] == pytest.approx(pixels[:, c].mean(), abs=1e-6)
        assert info.std[c] == pytest.approx(pixels[:, c].std(), abs=1e-6)
    assert (info.source, info.num_classes, info.channels, info.image_size) == ("rgb", 3, 3, 10)
    assert info.input_shape == (3, 10, 10)
    assert info.mean[1] > info.mean[0]  # really per channel, not pooled


def test_normalized_train_data_has_zero_mean_unit_std(rgb_train):
    info = data.compute_info("rgb", rgb_train, num_classes=3)
    z = data.normalize(rgb_train.x, info)
    assert z.dtype == np.float32 and z.shape == rgb_train.x.shape
    assert np.allclose(z.mean(axis=(0, 2, 3)), 0, atol=1e-3)
    assert np.allclose(z.std(axis=(0, 2, 3)), 1, atol=1e-3)


def test_normalize_formula():
    info = data.DataInfo("t", 2, 2, 2, mean=(0.5, 0.25), std=(0.5, 0.25))
    x = np.zeros((1, 2, 2, 2), np.uint8)
    x[0, 0] = 255
    z = data.normalize(x, info)
    assert np.allclose(z[0, 0], (1 - 0.5) / 0.5)
    assert np.allclose(z[0, 1], (0 - 0.25) / 0.25)


def test_constant_channel_does_not_divide_by_zero():
    x = np.full((4, 1, 3, 3), 9, np.uint8)
    info = data.compute_info("c", data.Split(x=x, y=np.zeros(4, np.int64)), 1)
    assert info.std[0] > 0
    assert np.isfinite(data.normalize(x, info)).all()


# --- resize -----------------------------------------------------------------------------------

def test_resize_down_and_up_keeps_uint8():
    x = structured_images(3, size=28).x
    small = data.resize(x, 12)
    assert small.shape == (3, 1, 12, 12) and small.dtype == np.uint8
    big = data.resize(small, 16)
    assert big.shape == (3, 1, 16, 16) and big.dtype == np.uint8


def test_resize_keeps_content():
    x = np.zeros((1, 1, 28, 28), np.uint8)
    x[..., :14, :] = 200  # top half bright
    small = data.resize(x, 14)
    assert small[..., :5, :].min() == 200 and small[..., 9:, :].max() == 0
    flat = data.resize(np.full((2, 3, 20, 20), 77, np.uint8), 8)
    assert (flat == 77).all()


def test_resize_to_same_size_is_identity():
    x = structured_images(2, size=12).x
    assert np.array_equal(data.resize(x, 12), x)


# --- save_splits / load_split / load_info -----------------------------------------------------

def _splits_and_info():
    full = structured_images(40, size=8, seed=3)
    parts = data.stratified_split(full.y, 0.1, 0.2, seed=0)
    splits = {name: full.take(idx) for name, idx in parts.items()}
    return splits, data.compute_info("structured", splits["train"], 4)


def test_save_and_load_round_trip(tmp_path):
    splits, info = _splits_and_info()
    data.save_splits(tmp_path, splits, info)
    for name, split in splits.items():
        loaded = data.load_split(tmp_path, name)
        assert loaded.x.dtype == np.uint8 and loaded.y.dtype == np.int64
        assert np.array_equal(loaded.x, split.x) and np.array_equal(loaded.y, split.y)
    assert data.load_info(tmp_path) == info
    assert isinstance(data.load_info(tmp_path).mean, tuple)


def test_saved_bytes_are_identical_across_saves(tmp_path):
    splits, info = _splits_and_info()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    data.save_splits(a, splits, info)
    data.save_splits(b, splits, info)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert data.META_FILE in names and "train_x.npy" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_loading_missing_files_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="train_x.npy"):
        data.load_split(tmp_path, "train")
    with pytest.raises(UserError, match=data.META_FILE):
        data.load_info(tmp_path)


def test_truncated_npy_is_a_user_error(tmp_path):
    splits, info = _splits_and_info()
    data.save_splits(tmp_path, splits, info)
    path = tmp_path / "train_x.npy"
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError, match="train_x.npy"):
        data.load_split(tmp_path, "train")


@pytest.mark.parametrize("content", ['{"source": ', '{"source": "x"}'])
def test_corrupt_meta_json_is_a_user_error(tmp_path, content):
    (tmp_path / data.META_FILE).write_text(content)
    with pytest.raises(UserError, match=data.META_FILE):
        data.load_info(tmp_path)


# --- the embedded dataset ---------------------------------------------------------------------

def test_load_mnist5k():
    mnist = sources.load_mnist5k()
    assert len(mnist) == 5000
    assert mnist.x.shape == (5000, 1, 28, 28) and mnist.x.dtype == np.uint8
    assert np.array_equal(np.bincount(mnist.y), np.full(10, 500))
    assert mnist.x.max() > 200 and mnist.x.min() == 0  # real digits, not a blank array
    # Digits are centred: the border is almost always background.
    assert mnist.x[:, :, 0, :].mean() < 1 < mnist.x[:, :, 10:18, 10:18].mean()


def test_unknown_source_is_a_user_error():
    with pytest.raises(UserError, match="prepare.source"):
        sources.load_source("cifar10", None, None, size=28)
