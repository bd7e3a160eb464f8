"""``jaxdp grid``: ε of DP-SGD over a grid of (q, noise multiplier, steps): CSV and heat map."""

from __future__ import annotations

import math
import os
import sys

from ._common import UsageError, add_conversion_options, emit, number, orders, values


def add_parser(sub) -> None:
    p = sub.add_parser("grid", help="epsilon over a grid of (q, noise multiplier, steps): CSV and heat map",
                       description="Evaluate epsilon on a grid in one vmapped call; write CSV and a PNG heat map. "
                       "Ranges are a,b,c lists or LO:HI:N (geometric for q and steps, linear for the noise "
                       "multiplier).")
    p.add_argument("--q", required=True, help="sampling rates, e.g. 1e-4:1e-1:20")
    p.add_argument("--noise-multiplier", required=True, help="noise multipliers, e.g. 0.5:5:20")
    p.add_argument("--num-steps", required=True, help="step counts, e.g. 100:100000:4")
    p.add_argument("--delta", type=number("--delta"), required=True, help="target delta in (0, 1)")
    p.add_argument("--out", default="jaxdp_grid", help="output folder (default: ./jaxdp_grid)")
    add_conversion_options(p)
    p.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                   help="rdp (default) or pld (privacy loss distribution, tighter, slower)")
    p.set_defaults(func=run)


def run(args) -> int:
    import time

    import numpy as np

    from .. import accounting as A

    qs = values("--q", args.q, log=True)
    noise_multipliers = values("--noise-multiplier", args.noise_multiplier, log=False)
    steps = values("--num-steps", args.num_steps, log=True)
    steps = [float(math.ceil(s)) for s in steps]
    ranges = (("--q", qs, 0.0, 1.0, False), ("--noise-multiplier", noise_multipliers, 0.0, math.inf, True),
              ("--num-steps", steps, 0.0, math.inf, False))
    for name, vals, lo, hi, lo_open in ranges:
        for v in vals:
            if not (lo < v if lo_open else lo <= v) or not v <= hi or math.isnan(v):
                raise UsageError(f"{name} values must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]; got {v:g}")
    qg, sg, tg = np.meshgrid(np.array(qs), np.array(noise_multipliers), np.array(steps), indexing="ij")
    n = qg.size
    try:  # check the output folder before the work, not after
        os.makedirs(args.out, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise OSError("not writable")
    except OSError as exc:
        raise UsageError(f"--out cannot write to {args.out!r}: {exc}") from None
    start = time.perf_counter()
    if getattr(args, "accountant", "rdp") == "pld":
        eps = np.asarray(A.pld_epsilon(A.dpsgd_event(qg, sg, tg), args.delta))
    else:
        eps = np.asarray(A.dpsgd_epsilon(qg, sg, tg, args.delta, orders=orders(args), method=args.method))
    elapsed = time.perf_counter() - start
    csv_path = os.path.join(args.out, "epsilon_grid.csv")
    with open(csv_path, "w") as fh:
        fh.write("q,noise_multiplier,num_steps,delta,epsilon\n")
        for q, s, t, e in zip(qg.ravel(), sg.ravel(), tg.ravel(), eps.ravel()):
            fh.write(f"{q:.10g},{s:.10g},{t:.10g},{args.delta:.10g},{e:.10g}\n")
    png_path = os.path.join(args.out, "epsilon_grid.png")
    try:  # the heat map is optional: its failure must not lose the results (CSV written, summary printed)
        _heatmap(png_path, qs, noise_multipliers, steps, eps, args.delta)
        plot_error = None
    except Exception as exc:  # matplotlib and OS errors alike, reported in one line
        plot_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    payload = dict(configurations=n, seconds=elapsed, csv=csv_path, png=None if plot_error else png_path,
                   epsilon_min=float(np.nanmin(eps)), epsilon_max=float(np.nanmax(eps)))
    emit(args, payload, [
        f"{n} configurations in {elapsed:.2f} s (one vmapped call, compilation included)",
        f"epsilon from {np.nanmin(eps):.4g} to {np.nanmax(eps):.4g} at delta = {args.delta:g}",
        f"wrote {csv_path}",
    ] + ([] if plot_error else [f"wrote {png_path}"]))
    if plot_error:
        print(f"jaxdp: error: the heat map {png_path!r} could not be written ({plot_error})", file=sys.stderr)
        return 1
    return 0


def _heatmap(path, qs, noise_multipliers, steps, eps, delta) -> None:
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
        im = ax.pcolormesh(np.arange(len(noise_multipliers) + 1), np.arange(len(qs) + 1), eps[:, :, k], norm=norm,
                           cmap="viridis", shading="flat")
        ax.set_title(f"steps = {steps[k]:g}")
        ax.set_xlabel("noise multiplier")
        ax.set_ylabel("sampling rate q")
        xt = np.linspace(0, len(noise_multipliers) - 1, min(5, len(noise_multipliers))).round().astype(int)
        yt = np.linspace(0, len(qs) - 1, min(5, len(qs))).round().astype(int)
        ax.set_xticks(xt + 0.5, [f"{noise_multipliers[i]:.3g}" for i in xt])
        ax.set_yticks(yt + 0.5, [f"{qs[i]:.2g}" for i in yt])
    fig.colorbar(im, ax=axes[0].tolist(), label=f"epsilon at delta={delta:g}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
