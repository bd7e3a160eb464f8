"""Deprecated public names: a module ``__getattr__`` that warns and still answers (as optax).

A package keeps a table ``_deprecations = {old_name: (message, obj)}`` and sets
``__getattr__ = deprecation_getattr(__name__, _deprecations)``. The old name is then
absent from ``dir()`` and ``__all__`` but still resolves, with a ``DeprecationWarning``
whose message names the replacement, for one release; ``obj=None`` turns the name into an
``AttributeError`` with the same message (the release after).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def deprecation_getattr(module: str, deprecations: Mapping[str, tuple[str, Any]],
                        lazy: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the names in ``deprecations``; any other name is an AttributeError.

    ``lazy`` maps public names to the submodule (``"_x"``, relative to ``module``) that defines
    them: such a name is imported on first use and kept in the module's namespace (PEP 562).
    """

    def __getattr__(name: str) -> Any:
        if lazy is not None and name in lazy:
            value = getattr(importlib.import_module(f".{lazy[name]}", module), name)
            setattr(sys.modules[module], name, value)
            return value
        if name in deprecations:
            message, obj = deprecations[name]
            if obj is None:
                raise AttributeError(message)
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return obj
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def warn_old_signature(message: str, stacklevel: int = 3) -> None:
    """Warn, for one release, that a call used a function's old signature (``message`` names the new one).

    For a function whose arguments changed (loose run constants replaced by the run's
    record): the function keeps answering the old call, through this ``DeprecationWarning``.
    """
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)
