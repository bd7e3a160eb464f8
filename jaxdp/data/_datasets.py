r"""Data sets for private training: bundled digits, local MNIST / Fashion-MNIST, user arrays.

Nothing here touches the network. The features are returned as float32 NumPy arrays,
flattened to ``(n, d)``, and (by default) every row is scaled to unit L2 norm:

.. math::

    x_i \leftarrow \frac{x_i}{\lVert x_i\rVert}\quad(\text{zero rows stay zero}),
    \qquad\text{so}\qquad \lVert x_i\rVert \le X = 1 .

The scaling is a fixed per-example map that looks at no other example, so it is
data-independent (it leaks nothing about other examples), and the bound :math:`X` is
known in advance rather than measured on the data. :math:`X` is what the convex models'
Lipschitz and smoothness constants are computed from (``Dataset.feature_norm_bound``;
see :func:`jaxdp.models.softmax_loss_constants`).
"""

from __future__ import annotations

import gzip
import math
import os
import zipfile
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["Dataset", "load_digits", "load_mnist", "load_fashion_mnist", "from_arrays", "read_idx"]

# Rows are divided by ‖x‖·(1 + _NORM_SLACK) in float64 before the cast to float32, so
# that the float32 row norms stay ≤ 1 after rounding (the cast perturbs each entry by at
# most 2^-24 relative, hence the norm by at most ~6e-8 relative; 4 float32 ulps of slack
# covers it with margin).
_NORM_SLACK = 4 * float(np.finfo(np.float32).eps)


class Dataset(NamedTuple):
    """A classification data set split into train and test parts.

    Attributes:
      x_train: float32 features, shape ``(n_train, d)``.
      y_train: int32 labels in ``0..num_classes-1``, shape ``(n_train,)``.
      x_test: float32 features, shape ``(n_test, d)``.
      y_test: int32 labels, shape ``(n_test,)``.
      num_classes: number of classes.
      feature_norm_bound: :math:`X`, an upper bound on every row's L2 norm (train and
        test). With ``normalize=True`` it is 1, fixed in advance.
      name: a short description.
      seed: the seed of the train/test split, or ``None`` when the split came with the
        data (MNIST's own train/test files).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    feature_norm_bound: float
    name: str
    seed: int | None


def _normalize_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    scale = np.where(norms > 0, 1.0 / (np.where(norms > 0, norms, 1.0) * (1.0 + _NORM_SLACK)), 1.0)
    out = (x * scale).astype(np.float32)
    if np.any(np.linalg.norm(out.astype(np.float64), axis=1) > 1.0):  # pragma: no cover
        raise RuntimeError("row normalisation left a norm above 1; please report this.")
    return out


def _max_row_norm(*arrays: np.ndarray) -> float:
    return float(max((np.linalg.norm(a.astype(np.float64), axis=1).max(initial=0.0) for a in arrays),
                     default=0.0))


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int):
    if not (0.0 <= test_fraction < 1.0):
        raise ValueError(f"test_fraction must be in [0, 1); got {test_fraction}.")
    n = x.shape[0]
    perm = np.random.default_rng(seed).permutation(n)
    n_test = int(round(test_fraction * n))
    if n - n_test < 1:
        raise ValueError(f"test_fraction={test_fraction} leaves no training example out of {n}.")
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def _check_features(name: str, x) -> np.ndarray:
    """``x`` as ``(n, d)`` real numbers, n ≥ 1 and d ≥ 1, all finite; errors name ``name``."""
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (n, d, ...) with one row per record; got shape {x.shape}.")
    if x.dtype.kind not in "iuf":  # bool, complex, strings, objects, dates are not features
        raise ValueError(f"{name} must hold real numbers (an integer or float dtype); got dtype {x.dtype}.")
    if x.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one record; got shape {x.shape}.")
    if math.prod(x.shape[1:]) == 0:
        raise ValueError(f"{name} must hold at least one feature per record; got shape {x.shape}.")
    x = x.reshape(x.shape[0], -1)
    if np.issubdtype(x.dtype, np.floating):
        nan_rows = np.flatnonzero(np.isnan(x).any(axis=1))
        if nan_rows.size:
            raise ValueError(
                f"{name} contains NaN features in {nan_rows.size} row(s) (first: row {nan_rows[0]}); "
                "expected finite features: remove or impute them before training."
            )
        inf_rows = np.flatnonzero(np.isinf(x).any(axis=1))
        if inf_rows.size:
            raise ValueError(
                f"{name} contains infinite features in {inf_rows.size} row(s) (first: row {inf_rows[0]}); "
                "expected finite features."
            )
    return x


def _check_labels(name: str, y, n: int) -> np.ndarray:
    """``y`` as int32 class labels ≥ 0, shape ``(n,)``; errors name ``name``."""
    y = np.asarray(y)
    if y.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), one label per record; got shape {y.shape}.")
    if y.dtype.kind == "f":
        if np.any(~np.isfinite(y)) or np.any(y != np.round(y)):
            raise ValueError(f"{name} must hold integer class labels; got non-integer values.")
    elif y.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer class labels; got dtype {y.dtype}.")
    if n and y.min() < 0:
        raise ValueError(f"{name} must hold labels >= 0; got {y.min():g}.")
    if n and y.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{name} must hold labels < 2**31; got {y.max():g}.")
    return y.astype(np.int32)


def from_arrays(x, y, *, x_test=None, y_test=None, num_classes: int | None = None,
                normalize: bool = True, feature_norm_bound: float | None = None,
                test_fraction: float = 0.2, seed: int = 0, name: str = "arrays") -> Dataset:
    r"""Wrap user-supplied NumPy arrays as a :class:`Dataset`.

    Without ``x_test``/``y_test`` the data are split deterministically: a permutation
    from ``np.random.default_rng(seed)``, the first ``round(test_fraction·n)`` examples
    go to the test part (the seed is recorded in ``Dataset.seed``). The split does not
    depend on the values, so it is data-independent.

    Args:
      x: features, shape ``(n, d)`` (or ``(n, ...)``, flattened to ``(n, d)``).
      y: integer labels, shape ``(n,)``.
      x_test: optional test features (then ``y_test`` too; no split is made).
      y_test: optional test labels.
      num_classes: number of classes; default ``max(label) + 1``.
      normalize: scale every row to unit L2 norm (then ``feature_norm_bound = 1``).
      feature_norm_bound: with ``normalize=False``, a bound :math:`X` known in advance;
        rows above it raise ``ValueError``. If omitted, the largest row norm is used,
        which is **computed from the data** (so it is data-dependent: do not use it to
        set a clip norm or Lipschitz constant for a privacy guarantee).
      test_fraction: share of the examples held out, in ``[0, 1)``.
      seed: seed of the split.
      name: description stored in the result.

    Returns:
      A :class:`Dataset` with float32 features and int32 labels.

    Raises:
      ValueError: naming the argument, for no records or no features, features that are not
        real numbers or not finite, mismatched shapes, non-integer or negative labels, labels
        ``>= num_classes``, or rows above ``feature_norm_bound``.

    Examples:
      >>> import numpy as np
      >>> ds = from_arrays(np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]]), np.array([0, 1, 1]),
      ...                  test_fraction=0.0)
      >>> ds.x_train.shape, ds.num_classes, ds.feature_norm_bound
      ((3, 2), 2, 1.0)
    """
    x = _check_features("x", x)
    y = _check_labels("y", y, x.shape[0])
    if (x_test is None) != (y_test is None):
        raise ValueError("pass both x_test and y_test, or neither.")
    if x_test is not None:
        x_test = _check_features("x_test", x_test)
        y_test = _check_labels("y_test", y_test, x_test.shape[0])
        if x_test.shape[1] != x.shape[1]:
            raise ValueError(
                f"x_test has {x_test.shape[1]} features per example but x has {x.shape[1]}."
            )
        split_seed = None
        x_train, y_train = x, y
    else:
        x_train, y_train, x_test, y_test = _split(x, y, test_fraction, seed)
        split_seed = seed
    top = int(max(y_train.max(initial=0), y_test.max(initial=0)))
    if num_classes is None:
        num_classes = top + 1
    elif isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be an integer >= 1; got {num_classes!r}.")
    elif top >= num_classes:
        which = "y" if y_train.max(initial=0) == top else "y_test"
        raise ValueError(f"{which} must hold labels in [0, num_classes) = [0, {num_classes}); got {top}.")
    if normalize:
        x_train, x_test = _normalize_rows(x_train), _normalize_rows(x_test)
        bound = 1.0
    else:
        x_train = x_train.astype(np.float32)
        x_test = x_test.astype(np.float32)
        largest = _max_row_norm(x_train, x_test)
        if feature_norm_bound is None:
            bound = largest
        else:
            if not (feature_norm_bound >= 0 and math.isfinite(feature_norm_bound)):
                raise ValueError(f"feature_norm_bound must be finite and >= 0; got {feature_norm_bound}.")
            if largest > feature_norm_bound:
                raise ValueError(
                    f"a row has L2 norm {largest:g} > feature_norm_bound={feature_norm_bound:g}."
                )
            bound = float(feature_norm_bound)
    return Dataset(x_train, y_train, x_test, y_test, int(num_classes), float(bound), name,
                   split_seed)


def load_digits(normalize: bool = True, *, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled handwritten digits (8×8 images, 1,797 examples, 10 classes).

    The data ship inside scikit-learn, so this works offline. Pixel values 0..16 are
    flattened to 64 features; with ``normalize=True`` each row is scaled to unit L2 norm
    (``feature_norm_bound = 1``). Without it, the bound is the largest possible row
    norm, :math:`16\\sqrt{64} = 128`, known in advance.

    Args:
      normalize: scale rows to unit norm.
      test_fraction: share held out for testing (deterministic split).
      seed: seed of the split (recorded in ``Dataset.seed``).

    Returns:
      A :class:`Dataset` named ``"digits"``.

    Examples:
      >>> ds = load_digits()
      >>> ds.x_train.shape[1], ds.num_classes, ds.feature_norm_bound, len(ds.x_train) + len(ds.x_test)
      (64, 10, 1.0, 1797)
    """
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "load_digits needs scikit-learn (it ships the digits data): pip install scikit-learn"
        ) from err
    bunch = _sk_load_digits()
    return from_arrays(
        bunch.data, bunch.target, num_classes=10, normalize=normalize,
        feature_norm_bound=None if normalize else 128.0, test_fraction=test_fraction,
        seed=seed, name="digits",
    )


# ----------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST from local files
# ----------------------------------------------------------------------------------------

_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path) -> np.ndarray:
    """Read one IDX file (as used by MNIST), gzip-compressed or not.

    Format: two zero bytes, a type byte (0x08 = uint8, ...), the number of dimensions,
    then each dimension as a big-endian uint32, then the data in C order.

    Raises:
      ValueError: naming ``path``, for a damaged gzip file or a file that is not IDX.
    """
    path = Path(path)
    gz = path.suffix == ".gz"
    try:
        with (gzip.open if gz else open)(path, "rb") as f:
            raw = f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise ValueError(f"path {str(path)!r} is a damaged gzip file ({_reason(err)}); expected a gzip-compressed "
                         "IDX file.") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"path {str(path)!r} is not an IDX file (bad magic number); expected two zero bytes, a "
                         f"type byte and the number of dimensions{' after decompression' if gz else ''}.")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"path {str(path)!r}: the IDX header announces {ndim} dimensions but the file ends after "
                         f"{len(raw)} bytes.")
    shape = tuple(int(d) for d in np.frombuffer(raw[4:header], dtype=">u4"))
    count = math.prod(shape)
    if len(raw) - header != count * dtype.itemsize:
        raise ValueError(
            f"path {str(path)!r}: the IDX header says shape {shape} ({count * dtype.itemsize} bytes) but the file "
            f"holds {len(raw) - header} data bytes."
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def _reason(err: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), for one-line errors."""
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


_NPZ_EXPECTED = ("expected a NumPy .npz archive (np.savez) holding the numeric arrays x_train, y_train, x_test, "
                 "y_test")


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """The four arrays of an MNIST-style ``.npz``; every failure is a one-line ``ValueError`` naming ``path``.

    Never unpickles: object arrays are refused (``allow_pickle=False``), and a file that is
    not a zip archive is refused before NumPy sees it (NumPy would try it as a pickle).
    """
    where = f"path {str(path)!r}"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise ValueError(f"{where} cannot be read ({err.strerror or _reason(err)}); {_NPZ_EXPECTED}.") from None
    if not head:
        raise ValueError(f"{where} is an empty file (0 bytes); {_NPZ_EXPECTED}.")
    if head not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise ValueError(f"{where} is not a .npz archive (no zip signature at its start); {_NPZ_EXPECTED}.")
    arrays = {}
    try:
        with np.load(path, allow_pickle=False) as z:
            absent = [k for k in _IDX_FILES if k not in z.files]
            if absent:
                raise ValueError(f"{where} lacks the arrays {', '.join(absent)}; {_NPZ_EXPECTED}.")
            for k in _IDX_FILES:
                try:
                    arrays[k] = z[k]
                except ValueError as err:
                    if "allow_pickle" in str(err):
                        raise ValueError(f"{where}: {k} is an object array (pickled Python objects, never loaded); "
                                         f"{_NPZ_EXPECTED}.") from None
                    raise
    except ValueError as err:
        if str(err).startswith(where):
            raise
        raise ValueError(f"{where} is a damaged .npz archive ({_reason(err)}); {_NPZ_EXPECTED}.") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise ValueError(f"{where} is a damaged .npz archive ({_reason(err)}); {_NPZ_EXPECTED}.") from None
    return arrays


def _find_idx(directory: Path, stem: str) -> Path | None:
    for candidate in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        p = directory / candidate
        if p.is_file():
            return p
    return None


def _missing(kind: str, path: Path, detail: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{kind} data not found at {str(path)!r}: {detail}. jaxdp never downloads data. Get the "
        f"{kind} files yourself and pass their location: either a .npz file with arrays "
        "x_train, y_train, x_test, y_test, or a directory holding the four IDX files "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
        "t10k-labels-idx1-ubyte (each may end in .gz), as distributed by the data set's "
        "authors. Then call, e.g., jaxdp.data.load_mnist('path/to/mnist.npz')."
    )


def _load_local(path, kind: str, normalize: bool) -> Dataset:
    if path is None:
        raise _missing(kind, Path("."), "no path given")
    path = Path(os.fspath(path)).expanduser()
    where = f"path {str(path)!r}"
    if path.is_file():
        if path.suffix != ".npz":
            raise ValueError(f"{where} must be a .npz file or a directory of IDX files; got a {path.suffix or 'plain'} "
                             "file.")
        arrays = _read_npz(path)
    elif path.is_dir():
        found = {k: _find_idx(path, stem) for k, stem in _IDX_FILES.items()}
        absent = [_IDX_FILES[k] for k, p in found.items() if p is None]
        if absent:
            raise _missing(kind, path, f"missing {', '.join(absent)} (optionally .gz)")
        arrays = {k: read_idx(p) for k, p in found.items()}
    else:
        raise _missing(kind, path, "no such file or directory")
    # Validated here, with the file's array names, before from_arrays sees them.
    xs = {}
    for part in ("train", "test"):
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        x = _check_features(f"{where}: x_{part}", x)
        if x.shape[1] != 784:
            raise ValueError(f"{where}: x_{part} must hold 28x28 images, shape (n, 28, 28) or (n, 784); got shape "
                             f"{arrays[f'x_{part}'].shape}.")
        if x.min() < 0 or x.max() > 255:
            raise ValueError(f"{where}: x_{part} must hold pixel values in [0, 255]; got values in "
                             f"[{x.min():g}, {x.max():g}].")
        y = _check_labels(f"{where}: y_{part}", y, x.shape[0])
        if y.max() >= 10:
            raise ValueError(f"{where}: y_{part} must hold labels in [0, 10); got {y.max()}.")
        xs[part] = (x.astype(np.float64) / 255.0, y)
    return from_arrays(
        xs["train"][0], xs["train"][1], x_test=xs["test"][0], y_test=xs["test"][1], num_classes=10,
        normalize=normalize, feature_norm_bound=None if normalize else 28.0, name=kind.lower(),
    )


def load_mnist(path, *, normalize: bool = True) -> Dataset:
    """MNIST from local files the user already has (never downloads).

    Args:
      path: a ``.npz`` with ``x_train, y_train, x_test, y_test`` (images ``(n, 28, 28)``
        of 0..255) or a directory with the four IDX files (optionally gzip'ed).
      normalize: scale rows to unit L2 norm (``feature_norm_bound = 1``); otherwise
        pixels are in [0, 1] and the bound is :math:`\\sqrt{784} = 28`.

    Returns:
      A :class:`Dataset` named ``"mnist"`` with the files' own train/test split
      (``seed=None``), features flattened to 784.

    Raises:
      FileNotFoundError: with instructions, if the files are absent.
      ValueError: one line naming ``path`` (and the array), for a damaged or foreign file (not a
        zip archive, empty, truncated, a damaged gzip), object or string arrays, no records,
        images that are not 28x28, pixels outside [0, 255], or labels outside [0, 10).
    """
    return _load_local(path, "MNIST", normalize)


def load_fashion_mnist(path, *, normalize: bool = True) -> Dataset:
    """Fashion-MNIST from local files the user already has (same formats as :func:`load_mnist`)."""
    return _load_local(path, "Fashion-MNIST", normalize)
