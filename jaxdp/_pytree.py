"""Frozen dataclasses as pytrees whose structures never compare equal across classes.

``jax.tree_util.register_dataclass`` (jax/jaxlib 0.10.2) builds tree structures that
compare *equal* for two different classes with the same number of data fields and equal
static values, while their hashes differ::

    tree_structure(Gaussian(1.0)) == tree_structure(Laplace(1.0))  # True under register_dataclass

JAX's compilation caches are keyed by the tree structure of the arguments. Their hash
tables compare a stored key with ``==`` when a few bits of the two hashes agree, and the
hashes change from process to process: so now and then, and never on a rerun, ``jax.jit``
ran the program compiled for one class on an instance of the other (measured: 9 of 600
fresh jitted functions called with ``Laplace`` then ``Gaussian`` ran Laplace's program).
That is how two CI runs got ε of ``Laplace(19.89)`` (0.067) for ``Gaussian(19.89)`` (0.182)
and δ of ``Gaussian(3.744)`` (0.0498) for ``Laplace(3.744)`` (1e-5).

:func:`register_dataclass` registers the class as an ordinary custom node instead
(``register_pytree_with_keys``), whose structures compare the registered class as well.
Flattening, key paths (``GetAttrKey``) and unflattening (``cls(**fields)``, so
``__post_init__`` runs as before) are those of JAX's ``register_dataclass``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.tree_util import GetAttrKey

__all__ = ["register_dataclass"]


def register_dataclass(cls: type, data_fields: Sequence[str], meta_fields: Sequence[str]) -> type:
    """Register ``cls`` as a pytree: ``data_fields`` are children, ``meta_fields`` static.

    Same arguments and behaviour as ``jax.tree_util.register_dataclass``, except that the
    tree structures of two different classes never compare equal (see the module
    docstring). Returns ``cls``.
    """
    data, meta = tuple(data_fields), tuple(meta_fields)
    keys = tuple(GetAttrKey(name) for name in data)

    def flatten(obj):
        return tuple(getattr(obj, name) for name in data), tuple(getattr(obj, name) for name in meta)

    def flatten_with_keys(obj):
        return tuple(zip(keys, (getattr(obj, name) for name in data))), tuple(getattr(obj, name) for name in meta)

    def unflatten(aux, children):
        return cls(**dict(zip(meta, aux)), **dict(zip(data, children)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten_func=flatten)
    return cls
