"""Shared pieces of the ``jaxdp`` command: the parser, number and range parsing, errors.

Options are the library's parameter names with dashes (``noise_multiplier`` is
``--noise-multiplier``), so a library error naming a parameter maps to the option by name.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys

# Exit codes (docs/reference.md, "Exit codes"): 0 success; 2 the command as given has no answer (a bad
# option value or file, an unreachable target); 1 the run failed for another reason (full disk, diverged
# training, a plot that could not be written, an internal error).
EXIT_USAGE = 2
EXIT_FAILURE = 1  # the command was valid but the run could not finish (full disk, divergence)

# Upper bounds on sizes that would exhaust memory, checked before anything is allocated.
MAX_RANGE_POINTS = 10**6  # points of one LO:HI:N range or a,b,c list (a grid's axis): 8 MB as float64
SEED_RANGE = (-(2**63), 2**63 - 1)  # what jax.random.key accepts (a 64-bit integer)


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


def integer(option: str, lo: int | None = None, hi: int | None = None):
    """An argparse ``type``: an integer in ``[lo, hi]`` (bounds checked before any work), naming ``option``."""

    def parse(text: str) -> int:
        try:
            n = int(text.strip())
        except ValueError:
            n = None
        if n is None or (lo is not None and n < lo) or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"{option} must be an integer in {_interval(lo, hi)}; got {text!r}")
        return n

    return parse


def _interval(lo: int | None, hi: int | None) -> str:
    def show(v: int) -> str:
        sign = "-" if v < 0 else ""
        for k in (31, 32, 63, 64):  # powers of two read better than their digits
            if abs(v) == 2**k:
                return f"{sign}2**{k}"
            if abs(v) == 2**k - 1:
                return f"{sign}2**{k} - 1"
        return f"{v:_}" if abs(v) >= 10**5 else str(v)

    return f"[{'-inf' if lo is None else show(lo)}, {'inf' if hi is None else show(hi)}]"


def seed(option: str):
    """An argparse ``type`` for a PRNG seed: a 64-bit integer (larger ones overflow in jax.random.key)."""
    return integer(option, *SEED_RANGE)


def step_count(option: str):
    """An argparse ``type`` for a number of steps: a whole number >= 0 (``1e3`` is accepted, ``10.5`` is not).

    The accountants charge a fractional count as the next integer; the command refuses it
    instead, so the count it prints is the count it charges.
    """

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v >= 0 and v == math.floor(v)):
            raise argparse.ArgumentTypeError(f"{option} must be a whole number of steps >= 0; got {text!r}")
        return v + 0.0  # -0 is 0

    return parse


def values(option: str, text: str, *, log: bool) -> list[float]:
    """Parse ``a,b,c`` (a list) or ``lo:hi:n`` (n points, geometric when ``log``), at most MAX_RANGE_POINTS."""
    import numpy as np

    try:
        if ":" in text:
            lo_s, hi_s, n_s = text.split(":")
            lo, hi, n = float(lo_s), float(hi_s), int(n_s)
            if not 1 <= n <= MAX_RANGE_POINTS:  # checked before allocating (1e9 points asked for ~40 GB)
                raise UsageError(f"{option}: the point count N of LO:HI:N must be in [1, {MAX_RANGE_POINTS:_}]; "
                                 f"got {n}")
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise UsageError(f"{option}: LO and HI of LO:HI:N must be finite; got {text!r}")
            if log:
                if lo <= 0 or hi <= 0:
                    raise UsageError(f"{option}: a geometric range needs LO > 0 and HI > 0; got {text!r}")
                return [float(v) for v in np.geomspace(lo, hi, n)]
            return [float(v) for v in np.linspace(lo, hi, n)]
        if text.count(",") >= MAX_RANGE_POINTS:
            raise UsageError(f"{option} must list at most {MAX_RANGE_POINTS:_} values")
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
    """Create the output folder ``path`` and check it is writable, before any long work.

    A regular file in its place, a read-only folder or file system, or a path that cannot
    be created is a one-line ``UsageError`` naming ``option``. Writability is probed by
    creating and removing a file (``os.access`` alone says yes to root on a read-only mount).
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a file, not a folder; expected a folder (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise OSError(errno.EACCES, "permission denied")
        import tempfile

        fd, probe = tempfile.mkstemp(prefix=".jaxdp-write-check-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise UsageError(f"{option} cannot write to {path!r}: {exc.strerror or exc}; expected a writable folder") from None


def check_in_dir(path: str, option: str) -> None:
    """An input folder (e.g. checkpoints to read) must exist and be a folder, not a file."""
    if not os.path.exists(path):
        raise UsageError(f"{option} {path!r} does not exist; expected a folder")
    if not os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a file, not a folder; expected a folder")


def data_error(option: str, err: Exception) -> UsageError:
    """A data loader's error as one line naming ``option``.

    The loaders' messages name their parameter first (``path '/x.npz' is ...``); that
    becomes ``--data-path '/x.npz' is ...``. Other messages get ``option:`` in front.
    """
    msg = str(err).splitlines()[0] if str(err) else type(err).__name__
    if msg.startswith("path "):
        return UsageError(option + msg[len("path"):])
    return UsageError(f"{option}: {msg}")


def _free_space(path: str) -> str:
    """Free space of the file system holding ``path`` (or its nearest existing parent), for messages."""
    import shutil

    folder = os.path.abspath(path)
    while folder and not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "free space unknown"
    return f"{human_bytes(free)} free"


def human_bytes(n: float) -> str:
    """``n`` bytes in B, kB, MB, GB or TB (powers of 1000), 3 significant digits."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"  # pragma: no cover


def disk_full(exc: BaseException) -> str | None:
    """The one-line message for a full disk, if ``exc`` (or an exception it wraps) is ``ENOSPC``; else None.

    Orbax and other writers wrap the ``OSError`` (``__cause__`` / ``__context__``, or in an
    exception group), so the chain is searched. The message names the file (when the error
    carries one) and the free space left on its file system.
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            path = e.filename if isinstance(e.filename, (str, bytes, os.PathLike)) else None
            where = f" writing {os.fsdecode(path)!r}" if path is not None else ""
            space = _free_space(os.fsdecode(path)) if path is not None else _free_space(os.getcwd())
            return (f"no space left on the device{where} ({space}); free some space and run the command again "
                    "(finished work is kept)")
        todo.extend([e.__cause__, e.__context__, *getattr(e, "exceptions", ())])
    return None


def report_disk_full(exc: BaseException) -> int | None:
    """Print :func:`disk_full`'s line as ``jaxdp: error: ...`` and return exit status 1; None if not a full disk.

    For the command's catch-all: ``status = report_disk_full(exc); if status is not None: return status``.
    """
    msg = disk_full(exc)
    if msg is None:
        return None
    print(f"jaxdp: error: {msg}", file=sys.stderr)
    return EXIT_FAILURE


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
    owner, dot, field = head.partition(".")
    if dot and owner[:1].isupper() and owner.isidentifier():  # "PNSGD.batch_size must ...": an event's field
        head = field
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
