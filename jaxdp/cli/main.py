"""The ``jaxdp`` command: the parser, the compilation cache and the entry point.

Each subcommand is one module of this package (``add_parser`` registers it, ``run``
executes it); nothing in the library imports this package. Every invalid argument ends
with a one-line ``jaxdp: error: ...`` naming the option and exit status 2; no traceback
reaches the user.

Start-up is kept short: the subcommand modules import only the standard library at the
top, the arguments are parsed (``--help`` printed, usage errors reported) and the scalar
ranges of ``epsilon`` and ``calibrate`` checked with the library's own validators before
JAX is imported; each subcommand imports the accountants, the trainer, flax, optax or
matplotlib in its ``run`` when it needs them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from . import audit, calibrate, epsilon, grid, per_instance, pnsgd, train
from ._common import Parser, error, option_message, report_disk_full

SUBCOMMANDS = (epsilon, calibrate, grid, pnsgd, train, per_instance, audit)


def build_parser() -> Parser:
    """The ``jaxdp`` argument parser with every subcommand."""
    from .. import __version__

    parser = Parser(prog="jaxdp", description="JAX-native differential-privacy accounting and private training.",
                    epilog="Compiled programs are kept in $XDG_CACHE_HOME/jaxdp (~/.cache/jaxdp) so that later "
                           "runs start faster; set JAXDP_CACHE_DIR to another folder, or to 'off'.")
    parser.add_argument("--version", action="version", version=f"jaxdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


_CACHE_MAX_BYTES = 512 * 2**20


# Commands that run only the accountants: jaxdp's program cache serves them.
_ACCOUNTANT_COMMANDS = ("epsilon", "calibrate", "pnsgd")


def _enable_compilation_cache(command: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for this command; return its folder.

    The training step takes seconds to compile and the command runs it afresh in each
    process, so compiled programs are kept on disk: by default in
    ``$XDG_CACHE_HOME/jaxdp/xla`` (``~/.cache/jaxdp/xla``); with ``JAXDP_CACHE_DIR`` set,
    in its ``xla`` folder (the accountants' own cache, :mod:`jaxdp._program_cache`, is
    its ``programs`` folder and works in the library as well). ``JAXDP_CACHE_DIR=off``
    (or ``0``, ``none``, empty) turns both off.
    The folder is capped at 512 MiB (least recently used entries go first). If
    ``JAX_COMPILATION_CACHE_DIR`` is set, JAX's own setting is left alone. A folder
    that cannot be created or written is skipped silently (the command just compiles).
    Only the command does this; importing the library never changes JAX's settings.

    Not for ``epsilon``, ``calibrate`` and ``pnsgd``: they run only the accountants, whose
    programs the program cache keeps (and loads without tracing); with JAX's cache on, the
    program cache steps aside (see :mod:`jaxdp._program_cache`).
    """
    if command in _ACCOUNTANT_COMMANDS or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    try:  # JAX needs it to cap the cache's size (a dependency; without it, no cache)
        import filelock  # noqa: F401
    except ImportError:
        return None
    from .._program_cache import cache_dir

    programs = cache_dir()  # <root>/programs
    if programs is None:
        return None
    path = os.path.join(os.path.dirname(programs), "xla")
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            return None
    except OSError:
        return None
    import jax

    # Least-recently-used entries are evicted beyond this size (entries are 0.1-1 MB).
    jax.config.update("jax_compilation_cache_max_size", _CACHE_MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def _check_ranges(args) -> None:
    """Check the scalar options of ``epsilon`` and ``calibrate`` before JAX is imported.

    The checks are the library's (:mod:`jaxdp._validate`, which loads no JAX), so a value
    out of range is reported in well under a second, with the message the accountant itself
    would give; the accountant still checks everything again.
    """
    if getattr(args, "command", None) not in ("epsilon", "calibrate"):
        return
    from .. import _validate

    inf = float("inf")
    checks = {
        "q": lambda v: _validate.check_in_range("q", v, 0.0, 1.0),
        "noise_multiplier": lambda v: _validate.check_in_range("noise_multiplier", v, 0.0, inf, lo_open=True),
        "num_steps": lambda v: _validate.check_in_range("num_steps", v, 0.0, inf),
        "delta": _validate.check_delta,
        "epsilon": lambda v: _validate.check_in_range("target_epsilon", v, 0.0, inf, lo_open=True),
    }
    for dest, check in checks.items():
        value = getattr(args, dest, None)
        if isinstance(value, float):
            check(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_ranges(args)
    except ValueError as exc:
        return error(option_message(str(exc)))
    _enable_compilation_cache(getattr(args, "command", None))
    try:
        return int(args.func(args) or 0)
    except Exception as exc:  # a full disk anywhere (also wrapped by orbax): one line naming the path, exit 1
        status = report_disk_full(exc)
        if status is not None:
            return status
        return _report(exc)
    except KeyboardInterrupt:
        print("jaxdp: interrupted", file=sys.stderr)
        return 130


def _report(exc: Exception) -> int:
    """One ``jaxdp: error:`` line for an exception: exit 2 for a bad value (it names the parameter), else 1."""
    if isinstance(exc, (ValueError, TypeError)):
        return error(option_message(str(exc) or type(exc).__name__))
    # Never a traceback on the command line.
    print(f"jaxdp: error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
    return 1
