"""The ``jaxdp`` command: thin wrappers over the library, one subcommand per job.

Every invalid argument ends with a one-line ``jaxdp: error: ...`` message naming the
argument and exit status 2; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

_EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (``jaxdp: error: ...``) and exits 2."""

    def error(self, message: str):  # argparse's API
        self.exit(_EXIT_USAGE, f"jaxdp: error: {message}\n")


class UsageError(ValueError):
    """A bad command-line value, reported as one line."""


def _float(name: str):
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number; got {text!r}") from None

    return parse


def _values(name: str, text: str, *, log: bool) -> list[float]:
    """Parse ``a,b,c`` (a list) or ``lo:hi:n`` (n points, geometric when ``log``)."""
    import numpy as np

    try:
        if ":" in text:
            lo_s, hi_s, n_s = text.split(":")
            lo, hi, n = float(lo_s), float(hi_s), int(n_s)
            if n < 1:
                raise UsageError(f"{name}: the point count in LO:HI:N must be >= 1; got {n}")
            if log:
                if lo <= 0 or hi <= 0:
                    raise UsageError(f"{name}: a geometric range needs LO > 0 and HI > 0; got {text!r}")
                return [float(v) for v in np.geomspace(lo, hi, n)]
            return [float(v) for v in np.linspace(lo, hi, n)]
        return [float(v) for v in text.split(",") if v.strip()]
    except UsageError:
        raise
    except ValueError:
        raise UsageError(f"{name} must be a comma-separated list or LO:HI:N; got {text!r}") from None


def _orders(args):
    from .accounting import DEFAULT_ORDERS

    if args.orders is None:
        return DEFAULT_ORDERS
    return _values("--orders", args.orders, log=False)


def _emit(args, payload: dict, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(payload))
    else:
        print("\n".join(lines))


def _cmd_epsilon(args) -> int:
    from . import accounting as A

    orders = _orders(args)
    rdp = A.heterogeneous_rdp(orders, [args.q], [args.sigma], [args.steps])
    res = A.rdp_to_epsilon(rdp, orders, args.delta, method=args.method)
    eps, order = float(res.epsilon), float(res.order)
    payload = dict(q=args.q, sigma=args.sigma, steps=args.steps, delta=args.delta, method=args.method,
                   epsilon=eps, order=order)
    _emit(args, payload, [
        f"DP-SGD, Poisson sampling q={args.q:g}, noise multiplier sigma={args.sigma:g}, steps={args.steps:g}",
        f"epsilon = {eps:.6f} at delta = {args.delta:g} (optimal Renyi order {order:g}, {args.method} conversion)",
    ])
    return 0


def _cmd_calibrate(args) -> int:
    from . import accounting as A

    res = A.calibrate_noise_multiplier(args.epsilon, args.q, args.steps, args.delta, orders=_orders(args), method=args.method)
    sigma, eps = float(res.noise_multiplier), float(res.epsilon)
    payload = dict(target_epsilon=args.epsilon, q=args.q, steps=args.steps, delta=args.delta, sigma=sigma, epsilon=eps)
    if not math.isfinite(sigma):
        lines = [f"no noise multiplier up to 1e4 reaches epsilon <= {args.epsilon:g}"]
        _emit(args, payload, lines)
        return 1
    _emit(args, payload, [
        f"smallest noise multiplier: sigma = {sigma:.6f}",
        f"it gives epsilon = {eps:.6f} <= {args.epsilon:g} at delta = {args.delta:g} "
        f"(q={args.q:g}, steps={args.steps:g})",
    ])
    return 0


def _cmd_grid(args) -> int:
    import time

    import numpy as np

    from . import accounting as A

    qs = _values("--q", args.q, log=True)
    sigmas = _values("--sigma", args.sigma, log=False)
    steps = _values("--steps", args.steps, log=True)
    steps = [float(math.ceil(s)) for s in steps]
    for name, vals, lo, hi, lo_open in (("--q", qs, 0.0, 1.0, False), ("--sigma", sigmas, 0.0, math.inf, True),
                                        ("--steps", steps, 0.0, math.inf, False)):
        for v in vals:
            if not (lo < v if lo_open else lo <= v) or not v <= hi or math.isnan(v):
                raise UsageError(f"{name} values must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]; got {v:g}")
    qg, sg, tg = np.meshgrid(np.array(qs), np.array(sigmas), np.array(steps), indexing="ij")
    n = qg.size
    start = time.perf_counter()
    eps = np.asarray(A.dpsgd_epsilon(qg, sg, tg, args.delta, orders=_orders(args), method=args.method))
    elapsed = time.perf_counter() - start
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "epsilon_grid.csv")
    with open(csv_path, "w") as fh:
        fh.write("q,sigma,steps,delta,epsilon\n")
        for q, s, t, e in zip(qg.ravel(), sg.ravel(), tg.ravel(), eps.ravel()):
            fh.write(f"{q:.10g},{s:.10g},{t:.10g},{args.delta:.10g},{e:.10g}\n")
    png_path = os.path.join(args.out, "epsilon_grid.png")
    _heatmap(png_path, qs, sigmas, steps, eps, args.delta)
    payload = dict(configurations=n, seconds=elapsed, csv=csv_path, png=png_path,
                   epsilon_min=float(np.nanmin(eps)), epsilon_max=float(np.nanmax(eps)))
    _emit(args, payload, [
        f"{n} configurations in {elapsed:.2f} s (one vmapped call, compilation included)",
        f"epsilon from {np.nanmin(eps):.4g} to {np.nanmax(eps):.4g} at delta = {args.delta:g}",
        f"wrote {csv_path}",
        f"wrote {png_path}",
    ])
    return 0


def _heatmap(path, qs, sigmas, steps, eps, delta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    picks = sorted(set(np.linspace(0, len(steps) - 1, min(4, len(steps))).round().astype(int).tolist()))
    fig, axes = plt.subplots(1, len(picks), figsize=(4.2 * len(picks), 3.6), squeeze=False, constrained_layout=True)
    finite = eps[np.isfinite(eps) & (eps > 0)]
    norm = LogNorm(vmin=max(finite.min(), 1e-3), vmax=finite.max()) if finite.size else None
    for ax, k in zip(axes[0], picks):
        im = ax.pcolormesh(np.arange(len(sigmas) + 1), np.arange(len(qs) + 1), eps[:, :, k], norm=norm,
                           cmap="viridis", shading="flat")
        ax.set_title(f"steps = {steps[k]:g}")
        ax.set_xlabel("noise multiplier sigma")
        ax.set_ylabel("sampling rate q")
        xt = np.linspace(0, len(sigmas) - 1, min(5, len(sigmas))).round().astype(int)
        yt = np.linspace(0, len(qs) - 1, min(5, len(qs))).round().astype(int)
        ax.set_xticks(xt + 0.5, [f"{sigmas[i]:.3g}" for i in xt])
        ax.set_yticks(yt + 0.5, [f"{qs[i]:.2g}" for i in yt])
    fig.colorbar(im, ax=axes[0].tolist(), label=f"epsilon at delta={delta:g}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _add_common(p: argparse.ArgumentParser, *, need_sigma: bool) -> None:
    p.add_argument("--q", type=_float("--q"), required=True, help="Poisson sampling rate in [0, 1]")
    if need_sigma:
        p.add_argument("--sigma", type=_float("--sigma"), required=True, help="noise multiplier (> 0)")
    p.add_argument("--steps", type=_float("--steps"), required=True, help="number of steps (>= 0)")
    p.add_argument("--delta", type=_float("--delta"), required=True, help="target delta in (0, 1)")


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--orders", default=None, help="Renyi orders: a,b,c or LO:HI:N (default: dp_accounting's 156)")
    p.add_argument("--method", choices=("improved", "classic"), default="improved",
                   help="RDP to (epsilon, delta) conversion (default: improved, Canonne-Kamath-Steinke)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxdp", description="JAX-native differential-privacy accounting.",
                     epilog="Compiled programs are kept in $XDG_CACHE_HOME/jaxdp/xla (~/.cache/jaxdp/xla) so that "
                            "later runs start faster; set JAXDP_CACHE_DIR to another folder, or to 'off'.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"jaxdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("epsilon", help="epsilon of DP-SGD (Poisson-sampled Gaussian, RDP accountant)",
                       description="Epsilon of DP-SGD at a target delta, from the exact sampled-Gaussian RDP.")
    _add_common(p, need_sigma=True)
    _add_output(p)
    p.set_defaults(func=_cmd_epsilon)

    p = sub.add_parser("calibrate", help="smallest noise multiplier for a target epsilon",
                       description="Smallest noise multiplier sigma meeting the target (epsilon, delta).")
    p.add_argument("--epsilon", type=_float("--epsilon"), required=True, help="target epsilon (> 0)")
    _add_common(p, need_sigma=False)
    _add_output(p)
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("grid", help="epsilon over a grid of (q, sigma, steps): CSV and heat map",
                       description="Evaluate epsilon on a grid in one vmapped call; write CSV and a PNG heat map. "
                       "Ranges are a,b,c lists or LO:HI:N (geometric for q and steps, linear for sigma).")
    p.add_argument("--q", required=True, help="sampling rates, e.g. 1e-4:1e-1:20")
    p.add_argument("--sigma", required=True, help="noise multipliers, e.g. 0.5:5:20")
    p.add_argument("--steps", required=True, help="step counts, e.g. 100:100000:4")
    p.add_argument("--delta", type=_float("--delta"), required=True, help="target delta in (0, 1)")
    p.add_argument("--out", default="jaxdp_grid", help="output folder (default: ./jaxdp_grid)")
    _add_output(p)
    p.set_defaults(func=_cmd_grid)

    from ._cli_pnsgd import add_pnsgd_parser
    from ._cli_train import add_train_parser

    add_pnsgd_parser(sub)
    add_train_parser(sub)
    return parser


_CACHE_OFF = ("", "0", "off", "no", "none", "false")
_CACHE_MAX_BYTES = 512 * 2**20


def _enable_compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache for this command; return its folder.

    The accountants and the training step take seconds to compile and the command runs
    them afresh in each process, so compiled programs are kept on disk: by default in
    ``$XDG_CACHE_HOME/jaxdp/xla`` (``~/.cache/jaxdp/xla``). ``JAXDP_CACHE_DIR`` names
    another folder, or turns the cache off with ``off`` (or ``0``, ``none``, empty).
    The folder is capped at 512 MiB (least recently used entries go first). If
    ``JAX_COMPILATION_CACHE_DIR`` is set, JAX's own setting is left alone. A folder
    that cannot be created or written is skipped silently (the command just compiles).
    Only the command does this; importing the library never changes JAX's settings.
    """
    choice = os.environ.get("JAXDP_CACHE_DIR")
    if choice is not None and choice.strip().lower() in _CACHE_OFF:
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    try:  # JAX needs it to cap the cache's size (a dependency; without it, no cache)
        import filelock  # noqa: F401
    except ImportError:
        return None
    if choice is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        choice = os.path.join(base, "jaxdp", "xla")
    path = os.path.abspath(os.path.expanduser(choice))
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _enable_compilation_cache()
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:  # validation errors name the parameter
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"jaxdp: error: {_cli_names(msg)}", file=sys.stderr)
        return _EXIT_USAGE
    except KeyboardInterrupt:
        print("jaxdp: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # never a traceback on the command line
        print(f"jaxdp: error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 1


def _cli_names(msg: str) -> str:
    """Map library parameter names in a message to the command's option names."""
    for lib, cli in (("target_epsilon", "--epsilon"), ("sigma", "--sigma"), ("delta", "--delta"),
                     ("steps", "--steps"), ("orders", "--orders"), ("epsilon", "--epsilon")):
        if msg.startswith(lib + " "):
            return cli + msg[len(lib):]
    if msg.startswith("q "):
        return "--q" + msg[1:]
    return msg


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
