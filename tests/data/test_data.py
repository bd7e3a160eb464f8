"""Data loading: bundled digits offline, local MNIST files written here, user arrays."""

import gzip
import struct

import numpy as np
import pytest

from jaxdp.data import Dataset, from_arrays, load_digits, load_fashion_mnist, load_mnist, read_idx


def _row_norms(x):
    return np.linalg.norm(np.asarray(x, np.float64), axis=1)


def test_digits_offline_and_normalised():
    ds = load_digits()
    assert isinstance(ds, Dataset)
    assert ds.name == "digits" and ds.num_classes == 10 and ds.seed == 0
    assert len(ds.x_train) + len(ds.x_test) == 1797
    assert len(ds.x_test) == round(0.2 * 1797)
    assert ds.x_train.shape[1] == 64 and ds.x_train.dtype == np.float32
    assert ds.y_train.dtype == np.int32 and set(np.unique(ds.y_train)) == set(range(10))
    assert ds.feature_norm_bound == 1.0
    # The stated bound holds exactly in float64 on the float32 values the model sees.
    assert _row_norms(ds.x_train).max() <= 1.0 and _row_norms(ds.x_test).max() <= 1.0
    assert _row_norms(ds.x_train).min() > 0.999  # rows are unit vectors (no digit is blank)


def test_digits_split_is_deterministic():
    a, b, c = load_digits(seed=3), load_digits(seed=3), load_digits(seed=4)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert a.seed == 3 and c.seed == 4
    assert not np.array_equal(a.y_train, c.y_train)


def test_digits_unnormalised():
    ds = load_digits(normalize=False)
    assert ds.feature_norm_bound == 128.0  # 16·√64, known in advance
    assert _row_norms(ds.x_train).max() <= 128.0
    assert ds.x_train.max() == 16.0


def _write_idx(path, array, gz):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def _fake_mnist(seed=0, n_train=5, n_test=3):
    rng = np.random.default_rng(seed)
    return {
        "x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, n_train).astype(np.uint8),
        "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, n_test).astype(np.uint8),
    }


NAMES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
         "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}


def _check_mnist(ds, raw, name):
    assert ds.name == name and ds.seed is None and ds.num_classes == 10
    assert ds.x_train.shape == (5, 784) and ds.x_test.shape == (3, 784)
    np.testing.assert_array_equal(ds.y_train, raw["y_train"])
    np.testing.assert_array_equal(ds.y_test, raw["y_test"])
    assert ds.feature_norm_bound == 1.0 and _row_norms(ds.x_train).max() <= 1.0
    # Row i is image i, flattened in C order, scaled to unit norm.
    ref = raw["x_train"].reshape(5, -1).astype(np.float64)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(ds.x_train, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_from_idx_files(tmp_path, gz):
    raw = _fake_mnist()
    for key, stem in NAMES.items():
        _write_idx(tmp_path / stem, raw[key], gz)
    _check_mnist(load_mnist(tmp_path), raw, "mnist")
    _check_mnist(load_fashion_mnist(str(tmp_path)), raw, "fashion-mnist")


def test_mnist_from_npz(tmp_path):
    raw = _fake_mnist(1)
    np.savez(tmp_path / "mnist.npz", **raw)
    _check_mnist(load_mnist(tmp_path / "mnist.npz"), raw, "mnist")
    ds = load_mnist(tmp_path / "mnist.npz", normalize=False)
    assert ds.feature_norm_bound == 28.0 and ds.x_train.max() <= 1.0


def test_missing_files_give_instructions(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads") as err:
        load_mnist(tmp_path / "nowhere.npz")
    assert "x_train" in str(err.value) and "train-images-idx3-ubyte" in str(err.value)
    _write_idx(tmp_path / NAMES["x_train"], _fake_mnist()["x_train"], gz=False)
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_fashion_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="Fashion-MNIST"):
        load_fashion_mnist(tmp_path / "missing")


def test_bad_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="magic"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(struct.pack(">BBBBI", 0, 0, 8, 1, 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="bytes"):
        read_idx(short)
    np.savez(tmp_path / "partial.npz", x_train=np.zeros((2, 28, 28)))
    with pytest.raises(ValueError, match="y_train"):
        load_mnist(tmp_path / "partial.npz")


def test_from_arrays_split_and_normalisation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3)) * 10
    y = rng.integers(0, 3, 50)
    ds = from_arrays(x, y, test_fraction=0.2, seed=5)
    assert ds.x_train.shape == (40, 3) and ds.x_test.shape == (10, 3) and ds.seed == 5
    assert ds.num_classes == 3 and ds.feature_norm_bound == 1.0
    assert _row_norms(ds.x_train).max() <= 1.0
    # The split is a permutation of the examples: every (x, y) pair is kept once.
    merged = np.concatenate([ds.x_train, ds.x_test]).astype(np.float64)
    ref = x / np.linalg.norm(x, axis=1, keepdims=True)
    order = np.lexsort(merged.T)
    np.testing.assert_allclose(merged[order], ref[np.lexsort(ref.T)], rtol=1e-6)
    # With given test arrays there is no split.
    ds2 = from_arrays(x[:40], y[:40], x_test=x[40:], y_test=y[40:])
    assert ds2.seed is None and len(ds2.x_test) == 10


def test_from_arrays_zero_rows_and_known_bound():
    ds = from_arrays(np.array([[0.0, 0.0], [3.0, 4.0]]), np.array([0, 1]), test_fraction=0.0)
    np.testing.assert_array_equal(_row_norms(ds.x_train) > 0, [False, True])
    ds = from_arrays(np.array([[0.3, 0.4]]), np.array([0]), normalize=False, feature_norm_bound=1.0,
                     test_fraction=0.0)
    assert ds.feature_norm_bound == 1.0
    with pytest.raises(ValueError, match="feature_norm_bound"):
        from_arrays(np.array([[3.0, 4.0]]), np.array([0]), normalize=False, feature_norm_bound=1.0,
                    test_fraction=0.0)


@pytest.mark.parametrize(
    "x,y,kwargs,match",
    [
        (np.array([[1.0, np.nan], [0.0, 1.0]]), np.array([0, 1]), {}, "NaN"),
        (np.array([[1.0, np.inf], [0.0, 1.0]]), np.array([0, 1]), {}, "infinite"),
        (np.ones((3, 2)), np.array([0, 1]), {}, "shape"),
        (np.ones(3), np.array([0, 1, 1]), {}, "shape"),
        (np.ones((2, 2)), np.array([0.5, 1.0]), {}, "integer"),
        (np.ones((2, 2)), np.array([-1, 1]), {}, ">= 0"),
        (np.ones((2, 2)), np.array([0, 3]), {"num_classes": 3}, "num_classes"),
        (np.ones((4, 2)), np.array([0, 1, 0, 1]), {"test_fraction": 1.0}, "test_fraction"),
        (np.ones((2, 2)), np.array([0, 1]), {"x_test": np.ones((1, 2))}, "y_test"),
    ],
)
def test_from_arrays_rejects_bad_input(x, y, kwargs, match):
    with pytest.raises(ValueError, match=match):
        from_arrays(x, y, **kwargs)


def test_nan_in_test_features_named():
    with pytest.raises(ValueError, match="x_test contains NaN"):
        from_arrays(np.ones((2, 2)), np.array([0, 1]), x_test=np.array([[np.nan, 0.0]]), y_test=np.array([0]))


# ---------------------------------------------------------------------------------------
# Damaged or foreign files: one-line ValueError naming the path, the array and what was expected
# (issue 26: numpy's pickle hint, EOFError, BadZipFile, reshape and BadGzipFile messages before)
# ---------------------------------------------------------------------------------------


def _npz_bytes(tmp_path, **arrays):
    np.savez(tmp_path / "ok.npz", **arrays)
    return (tmp_path / "ok.npz").read_bytes()


def _corrupt(kind, tmp_path):
    """Write the damaged file ``kind`` and return its path and the words the error must contain."""
    path = tmp_path / f"{kind}.npz"
    raw = _fake_mnist()
    if kind == "random_bytes":
        path.write_bytes(np.random.default_rng(0).bytes(1000))
        return path, "not a .npz archive"
    if kind == "empty":
        path.write_bytes(b"")
        return path, "empty file"
    if kind == "truncated_zip":
        data = _npz_bytes(tmp_path, **raw)
        path.write_bytes(data[: len(data) // 2])
        return path, "damaged .npz archive"
    if kind == "zero_records":
        np.savez(path, **_fake_mnist(n_train=0, n_test=0))
        return path, "x_train must hold at least one record"
    if kind == "strings":
        np.savez(path, **dict(raw, y_train=np.array(["7"] * 5)))
        return path, "y_train must hold integer class labels"
    if kind == "object_arrays":
        np.savez(path, **dict(raw, x_train=np.array([None] * 5, dtype=object)))
        return path, "x_train is an object array"
    if kind == "test_shape":
        np.savez(path, **dict(raw, x_test=np.zeros((3, 14, 14), np.uint8)))
        return path, "x_test must hold 28x28 images"
    if kind == "corrupt_gz":
        folder = tmp_path / "gz"
        folder.mkdir()
        for key, stem in NAMES.items():
            _write_idx(folder / stem, raw[key], gz=True)
        (folder / (NAMES["x_train"] + ".gz")).write_bytes(b"\x1f\x8b\x08\x00garbage")
        return folder, "damaged gzip file"
    raise AssertionError(kind)


CORRUPT = ["random_bytes", "empty", "truncated_zip", "zero_records", "strings", "object_arrays", "test_shape",
           "corrupt_gz"]


@pytest.mark.parametrize("kind", CORRUPT)
@pytest.mark.parametrize("loader", [load_mnist, load_fashion_mnist])
def test_damaged_files_give_one_line_naming_path(tmp_path, kind, loader):
    path, words = _corrupt(kind, tmp_path)
    with pytest.raises(ValueError) as err:
        loader(path)
    msg = str(err.value)
    assert msg.startswith("path '") and str(path) in msg and words in msg, msg
    assert "\n" not in msg and "pickle" not in msg.replace("pickled Python objects, never loaded", ""), msg


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(y_train=np.array([0, 1, 2, 3, 10], np.uint8)), "y_train must hold labels in [0, 10)"),
        (dict(y_test=np.array([0, -1, 2], np.int8)), "y_test must hold labels >= 0"),
        (dict(x_train=np.full((5, 28, 28), 256.0)), "x_train must hold pixel values in [0, 255]"),
        (dict(x_test=np.full((3, 28, 28), np.nan)), "x_test contains NaN"),
        (dict(y_train=np.array([0.5, 1, 2, 3, 4])), "y_train must hold integer class labels"),
        (dict(y_train=np.array([0, 1, 2], np.uint8)), "y_train must have shape (5,)"),
        (dict(x_train=np.ones((5, 28, 28), bool)), "x_train must hold real numbers"),
    ],
)
def test_npz_contents_are_validated_naming_the_array(tmp_path, change, words):
    np.savez(tmp_path / "m.npz", **dict(_fake_mnist(), **change))
    with pytest.raises(ValueError, match=r"^path '.*m\.npz': ") as err:
        load_mnist(tmp_path / "m.npz")
    assert words in str(err.value), str(err.value)


def test_read_idx_names_the_file(tmp_path):
    p = tmp_path / "x.gz"
    p.write_bytes(b"\x1f\x8bnot gzip")
    with pytest.raises(ValueError, match="damaged gzip file") as err:
        read_idx(p)
    assert str(p) in str(err.value)
    p = tmp_path / "header"
    p.write_bytes(struct.pack(">BBBB", 0, 0, 8, 3) + b"\x00\x00")
    with pytest.raises(ValueError, match="announces 3 dimensions"):
        read_idx(p)


@pytest.mark.parametrize(
    "x,y,kwargs,words",
    [
        (np.zeros((0, 3)), np.zeros(0, int), {}, "x must hold at least one record; got shape (0, 3)"),
        (np.zeros((2, 0)), np.zeros(2, int), {}, "x must hold at least one feature per record"),
        (np.ones((2, 2)), np.array([0, 1]), dict(x_test=np.zeros((0, 2)), y_test=np.zeros(0, int)),
         "x_test must hold at least one record"),
        (np.ones((2, 2), complex), np.array([0, 1]), {}, "x must hold real numbers"),
        (np.ones((2, 2), bool), np.array([0, 1]), {}, "x must hold real numbers"),
        (np.ones((2, 2)), np.array([True, False]), {}, "y must hold integer class labels"),
        (np.ones((2, 2)), np.array(["0", "1"]), {}, "y must hold integer class labels"),
        (np.ones((2, 2)), np.array([0, 2**40]), {}, "y must hold labels < 2**31"),
        (np.ones((2, 2)), np.array([0, 1]), {"num_classes": 0}, "num_classes must be an integer >= 1"),
        (np.ones((2, 2)), np.array([0, 1]), dict(x_test=np.ones((1, 2)), y_test=np.array([5]), num_classes=3),
         "y_test must hold labels in [0, num_classes) = [0, 3); got 5"),
    ],
)
def test_from_arrays_names_the_argument(x, y, kwargs, words):
    with pytest.raises(ValueError) as err:
        from_arrays(x, y, test_fraction=0.0, **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
