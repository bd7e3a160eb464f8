"""Data loading without network access: bundled digits, local MNIST files, user arrays."""

from ._datasets import Dataset as Dataset
from ._datasets import from_arrays as from_arrays
from ._datasets import load_digits as load_digits
from ._datasets import load_fashion_mnist as load_fashion_mnist
from ._datasets import load_mnist as load_mnist
from ._datasets import read_idx as read_idx

__all__ = ["Dataset", "from_arrays", "load_digits", "load_fashion_mnist", "load_mnist", "read_idx"]
