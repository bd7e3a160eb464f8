"""``jaxdp pnsgd``: per-record privacy of projected noisy SGD with hidden iterates.

Thin layer over :func:`jaxdp.accounting.pnsgd_privacy`: parses the run's constants, prints
a per-position summary (first, median, last and worst record for each analysis) or JSON,
and optionally plots ε against the position. The bounds assume a convex, L-Lipschitz,
β-smooth (and ρ-strongly convex) loss, hidden intermediate iterates and a fixed order; the
command cannot check convexity of the user's loss.
"""

from __future__ import annotations

import json
import math

from ._common import error, fmt, option_message

_ANALYSES = ("contraction", "iteration", "strongly_convex", "shifted_gdp", "composition", "best")
# Every analysis returns one value per record position (float64): 10^7 positions are ~0.5 GB
# in all. Larger runs are refused before any work (found by fuzzing: 10^12 asked for 8 TB).
MAX_NUM_RECORDS = 10**7


def add_parser(sub) -> None:
    p = sub.add_parser(
        "pnsgd",
        help="per-record (ε, δ) of projected noisy SGD with hidden iterates",
        description=(
            "ε per record position of projected noisy SGD (only the final iterate released), by the "
            "contraction-coefficient analysis (Asoodeh et al.), amplification by iteration (Feldman et al.), "
            "its strongly convex version (Balle et al.), shifted-interpolation GDP (Bok et al.), the composition "
            "baseline (every iterate released), "
            "and the best of them. Assumes a convex, L-Lipschitz, beta-smooth loss and a fixed order; the "
            "command cannot check convexity."
        ),
    )
    p.add_argument("--lipschitz", type=float, required=True, help="L: bound on every per-record gradient norm")
    p.add_argument("--smoothness", type=float, required=True, help="beta > 0: smoothness of the loss")
    p.add_argument("--learning-rate", type=float, required=True,
                   help="learning rate eta, with 0 < eta <= 2/(beta + rho) (the step-size rule)")
    p.add_argument("--noise-std", type=float, required=True,
                   help="standard deviation of the Gaussian noise on the (averaged) gradient: an absolute scale, "
                        "not a noise multiplier")
    p.add_argument("--diameter", type=float, required=True, help="diameter D > 0 of the constraint set")
    p.add_argument("--num-records", type=int, required=True, help="number of records n")
    p.add_argument("--delta", type=float, required=True, help="target delta in (0, 1)")
    p.add_argument("--strong-convexity", type=float, default=0.0, help="rho in [0, beta] (default 0)")
    p.add_argument("--batch-size", type=int, default=1, help="records per step (default 1)")
    p.add_argument("--passes", type=int, default=1, help="passes over the data in the same order (default 1)")
    p.add_argument("--plot", metavar="FILE", default=None, help="write a plot of epsilon against position")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _summary(values, positions):
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    n = v.size
    mid = (n - 1) // 2
    worst = int(np.argmax(np.where(np.isnan(v), np.inf, v)))
    return {
        "first": float(v[0]),
        "median_position": int(positions[mid]),
        "median": float(v[mid]),
        "last": float(v[-1]),
        "worst": float(v[worst]),
        "worst_position": int(positions[worst]),
    }


def _fmt(x: float) -> str:
    return fmt(x, ".6g")


def run(args) -> int:
    """Run the ``pnsgd`` subcommand; returns the exit code (2 for invalid arguments)."""
    import os

    import numpy as np

    from ..accounting import PNSGD, pnsgd_privacy

    if not 1 <= args.num_records <= MAX_NUM_RECORDS:
        return error(f"--num-records must be an integer in [1, {MAX_NUM_RECORDS}] (one value per record position "
                     f"is computed for every analysis); got {args.num_records}")
    if args.plot:  # check the plot's folder and format before the work, not after
        folder = os.path.dirname(os.path.abspath(args.plot))
        ext = os.path.splitext(args.plot)[1].lower().lstrip(".")
        if ext not in ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp", "svgz", "pgf", "raw", "rgba"):
            return error(f"--plot must name an image file (.png, .pdf, .svg, ...); got {args.plot!r}")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return error(f"--plot cannot write to {args.plot!r}: its folder does not exist or is not writable")
    try:
        run = PNSGD(args.lipschitz, args.smoothness, args.learning_rate, args.noise_std, args.diameter,
                    num_records=int(args.num_records), strong_convexity=args.strong_convexity,
                    batch_size=int(args.batch_size), passes=int(args.passes))
        out = pnsgd_privacy(run, args.delta)
    except ValueError as exc:  # the library names the parameter; the option has its name
        return error(option_message(str(exc)))
    positions = np.asarray(out.positions).astype(np.int64)
    results = {name: _summary(getattr(out, name), positions) for name in _ANALYSES}
    if args.json:
        payload = {
            "parameters": {
                "lipschitz": args.lipschitz,
                "smoothness": args.smoothness,
                "strong_convexity": args.strong_convexity,
                "learning_rate": args.learning_rate,
                "noise_std": args.noise_std,
                "diameter": args.diameter,
                "num_records": args.num_records,
                "batch_size": args.batch_size,
                "passes": args.passes,
                "delta": args.delta,
            },
            "epsilon": {
                name: {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                for name, r in results.items()
            },
        }
        print(json.dumps(payload, indent=2))
    else:
        mid_pos = results["best"]["median_position"]
        print(
            f"PNSGD, n = {args.num_records}, batch {args.batch_size}, passes {args.passes}, noise std = {args.noise_std:g}, "
            f"delta = {args.delta:g}: epsilon per record position (hidden iterates)"
        )
        header = f"{'analysis':<16} {'first (i=1)':>12} {f'median (i={mid_pos})':>18} {f'last (i={args.num_records})':>16} {'worst':>12}"
        print(header)
        print("-" * len(header))
        for name in _ANALYSES:
            r = results[name]
            print(
                f"{name:<16} {_fmt(r['first']):>12} {_fmt(r['median']):>18} {_fmt(r['last']):>16} "
                f"{_fmt(r['worst']):>12}"
            )
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4.5))
            for name in _ANALYSES:
                y = np.asarray(getattr(out, name))
                if np.all(np.isinf(y)):
                    continue
                ax.plot(positions, y, label=name, lw=2.5 if name == "best" else 1.2, ls="--" if name == "best" else "-")
            ax.set_xlabel("record position i")
            ax.set_ylabel(f"epsilon at delta = {args.delta:g}")
            ax.set_title(f"PNSGD, n = {args.num_records}, noise std = {args.noise_std:g}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
            plt.close(fig)
        except OSError as exc:
            return error(f"--plot cannot write {args.plot!r}: {exc}")
    return 0
