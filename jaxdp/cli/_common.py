"""Shared pieces of the ``jaxdp`` command: the parser, number and range parsing, errors.

Options are the library's parameter names with dashes (``noise_multiplier`` is
``--noise-multiplier``), so a library error naming a parameter maps to the option by name.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (``jaxdp: error: ...``) and exits 2."""

    def error(self, message: str):  # argparse's API
        self.exit(EXIT_USAGE, f"jaxdp: error: {message}\n")


class UsageError(ValueError):
    """A bad command-line value, reported as one line."""


def number(option: str):
    """An argparse ``type`` that parses a float and names ``option`` when it cannot."""

    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} must be a number; got {text!r}") from None

    return parse


def values(option: str, text: str, *, log: bool) -> list[float]:
    """Parse ``a,b,c`` (a list) or ``lo:hi:n`` (n points, geometric when ``log``)."""
    import numpy as np

    try:
        if ":" in text:
            lo_s, hi_s, n_s = text.split(":")
            lo, hi, n = float(lo_s), float(hi_s), int(n_s)
            if n < 1:
                raise UsageError(f"{option}: the point count in LO:HI:N must be >= 1; got {n}")
            if log:
                if lo <= 0 or hi <= 0:
                    raise UsageError(f"{option}: a geometric range needs LO > 0 and HI > 0; got {text!r}")
                return [float(v) for v in np.geomspace(lo, hi, n)]
            return [float(v) for v in np.linspace(lo, hi, n)]
        out = [float(v) for v in text.split(",") if v.strip()]
    except UsageError:
        raise
    except ValueError:
        raise UsageError(f"{option} must be a comma-separated list or LO:HI:N; got {text!r}") from None
    if not out:
        raise UsageError(f"{option} must name at least one value; got {text!r}")
    return out


def orders(args):
    """The Rényi orders of ``--orders``, or the default grid."""
    from ..accounting import DEFAULT_ORDERS

    if args.orders is None:
        return DEFAULT_ORDERS
    return values("--orders", args.orders, log=False)


def add_conversion_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--orders", default=None, help="Renyi orders: a,b,c or LO:HI:N (default: dp_accounting's 156)")
    p.add_argument("--method", choices=("improved", "classic"), default="improved",
                   help="RDP to (epsilon, delta) conversion (default: improved, Canonne-Kamath-Steinke)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def emit(args, payload: dict, lines: list[str]) -> None:
    """Print ``payload`` as JSON with ``--json``, else the text ``lines``.

    The JSON is strict (RFC 8259): a non-finite number is written as the string ``"inf"``,
    ``"-inf"`` or ``"nan"``, never as the bare ``Infinity`` that strict parsers reject.
    """
    if args.json:
        print(json.dumps(_strict(payload), allow_nan=False))
    else:
        print("\n".join(lines))


def check_out_dir(path: str, option: str = "--out") -> None:
    """Create the output folder ``path`` and check it is writable, before any long work."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise OSError("not writable")
    except OSError as exc:
        raise UsageError(f"{option} cannot write to {path!r}: {exc}") from None


def _strict(x):
    if isinstance(x, float) and not math.isfinite(x):
        return fmt(x) if not math.isinf(x) or x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def fmt(x: float, spec: str = ".4g") -> str:
    if math.isinf(x):
        return "inf"
    if math.isnan(x):
        return "nan"
    return format(x, spec)


# Library parameters whose option is not simply the name with dashes.
_RENAMED = {"target_epsilon": "--epsilon", "noise_seed": "--insecure-noise-seed"}


def option_message(msg: str) -> str:
    """The first line of a library message, with a leading parameter name as its option.

    ``"noise_multiplier must be in (0, inf); got 0."`` becomes
    ``"--noise-multiplier must be in (0, inf); got 0."``.
    """
    first = msg.splitlines()[0] if msg else ""
    head, sep, rest = first.partition(" ")
    name = head.rstrip(":")
    if sep and name.isidentifier() and name == name.lower() and ("_" in name or name in _KNOWN):
        option = _RENAMED.get(name, "--" + name.replace("_", "-"))
        return option + head[len(name):] + sep + rest
    return first


_KNOWN = {"q", "delta", "epsilon", "orders", "passes", "radius", "diameter", "lipschitz", "smoothness", "schedule"}


def error(msg: str, status: int = EXIT_USAGE) -> int:
    """Print a one-line ``jaxdp: error: ...`` and return ``status`` (default: the usage exit status)."""
    print(f"jaxdp: error: {msg}", file=sys.stderr)
    return status
