"""``jaxdp grid``: ε of DP-SGD over a grid of (q, noise multiplier, steps, δ): CSV and heat maps.

The grid is streamed (:func:`jaxdp.grids.epsilon_grid`): evaluated in fixed-size chunks split
over all devices, each chunk written to ``OUT/chunks-<fingerprint>/`` as it finishes. Resuming
is automatic: running the same command again (same values, options and chunk size) skips
the finished chunks; changed arguments start a new grid. ``--restart`` recomputes anyway.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

from ._common import UsageError, add_conversion_options, check_out_dir, emit, fmt, orders, report_disk_full, values

MAX_PANELS = 24  # steps values drawn per heat map; beyond, evenly spaced ones (said in figure and output)


def _chunk_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--chunk-size must be an integer >= 1; got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--chunk-size must be an integer >= 1; got {text!r}")
    return n


def add_parser(sub) -> None:
    p = sub.add_parser("grid", help="epsilon over a grid of (q, noise multiplier, steps, delta): CSV and heat maps",
                       description="Evaluate epsilon on a grid, streamed in chunks over all devices (resumable: "
                       "re-running the same command continues from the chunks already written); write CSV and "
                       "PNG heat maps. Ranges are a,b,c lists or LO:HI:N (geometric for q, steps and delta, "
                       "linear for the noise multiplier).")
    p.add_argument("--q", required=True, help="sampling rates, e.g. 1e-4:1e-1:20")
    p.add_argument("--noise-multiplier", required=True, help="noise multipliers, e.g. 0.5:5:20")
    p.add_argument("--num-steps", required=True, help="step counts, e.g. 100:100000:4")
    p.add_argument("--delta", required=True, help="target deltas in (0, 1), e.g. 1e-5 or 1e-5,1e-6")
    p.add_argument("--out", default="jaxdp_grid", help="output folder (default: ./jaxdp_grid)")
    p.add_argument("--contours", default=None, help="target epsilon values marked as contours, e.g. 1,2,8")
    p.add_argument("--chunk-size", type=_chunk_size, default=None,
                   help="configurations per chunk (default 16384; 16 with --accountant pld)")
    p.add_argument("--restart", action="store_true", help="discard chunks written by an earlier run and recompute")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")
    add_conversion_options(p)
    p.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                   help="rdp (default) or pld (privacy loss distribution, tighter, slower)")
    p.set_defaults(func=run)


def run(args) -> int:
    import jax
    import numpy as np

    from .. import grids

    qs = values("--q", args.q, log=True)
    noise_multipliers = values("--noise-multiplier", args.noise_multiplier, log=False)
    steps = [float(math.ceil(s)) if math.isfinite(s) else s for s in values("--num-steps", args.num_steps, log=True)]
    deltas = values("--delta", args.delta, log=True)
    contours = [] if args.contours is None else values("--contours", args.contours, log=False)
    if any(not (c > 0 and math.isfinite(c)) for c in contours):
        raise UsageError(f"--contours values must be finite epsilon values > 0; got {args.contours!r}")
    check_out_dir(args.out)  # before the work, not after
    if args.restart:
        for name in os.listdir(args.out):
            if name.startswith("chunks-") and os.path.exists(os.path.join(args.out, name, "manifest.json")):
                shutil.rmtree(os.path.join(args.out, name), ignore_errors=True)
    try:
        res = grids.epsilon_grid(qs, noise_multipliers, steps, deltas, directory=args.out,
                                 chunk_size=args.chunk_size, accountant=args.accountant, orders=orders(args),
                                 method=args.method, progress=not args.no_progress and sys.stderr.isatty())
    except KeyboardInterrupt:
        print(f"jaxdp: interrupted; the finished chunks are kept in {args.out!r}: run the same command again "
              "to resume", file=sys.stderr)
        return 130
    except OSError as exc:  # a full disk: one line naming the file and the free space, exit 1
        status = report_disk_full(exc)
        if status is None:
            raise
        return status
    eps = res.epsilon
    n = eps.size
    csv_path = os.path.join(args.out, "epsilon_grid.csv")
    try:
        grids.write_grid_csv(csv_path, res)  # removes its temporary file on failure
    except OSError as exc:
        status = report_disk_full(exc)
        if status is None:
            raise
        return status
    eps_min, eps_max = float(np.nanmin(eps)), float(np.nanmax(eps))
    shown = _panels(len(steps))
    png_paths = [os.path.join(args.out, "epsilon_grid.png" if len(deltas) == 1 else f"epsilon_grid_delta{d:g}.png")
                 for d in deltas]
    plot_error = None
    try:  # the heat maps are optional: their failure must not lose the results (CSV written, summary printed)
        for i, (d, path) in enumerate(zip(deltas, png_paths)):
            _heatmap(path, qs, noise_multipliers, steps, np.asarray(eps[..., i]), d, shown, contours)
    except Exception as exc:  # matplotlib and OS errors alike, reported in one line
        plot_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    chunks = res.computed_chunks + res.resumed_chunks
    payload = dict(configurations=n, seconds=res.seconds, chunks=chunks, computed_chunks=res.computed_chunks,
                   resumed_chunks=res.resumed_chunks, devices=jax.device_count(), csv=csv_path,
                   png=None if plot_error else png_paths[0], pngs=None if plot_error else png_paths,
                   deltas=deltas, steps_shown=[steps[k] for k in shown], contours=contours,
                   epsilon_min=eps_min, epsilon_max=eps_max)
    resumed = f", {res.resumed_chunks} resumed from {res.directory}" if res.resumed_chunks else ""
    lines = [
        f"{n} configurations in {res.seconds:.2f} s ({res.computed_chunks} of {chunks} chunks computed{resumed}; "
        f"{jax.device_count()} device(s), compilation included)",
        f"epsilon from {fmt(eps_min)} to {fmt(eps_max)} at delta = {', '.join(f'{d:g}' for d in deltas)}",
        f"wrote {csv_path}",
    ]
    if not plot_error:
        if len(shown) < len(steps):
            lines.append(f"heat maps show {len(shown)} of the {len(steps)} steps values: "
                         f"{', '.join(f'{steps[k]:g}' for k in shown)} (all are in the CSV)")
        lines += [f"wrote {p}" for p in png_paths]
    emit(args, payload, lines)
    if plot_error:
        print(f"jaxdp: error: the heat map {png_paths[0]!r} could not be written ({plot_error})", file=sys.stderr)
        return 1
    return 0


def _panels(num_steps: int) -> list[int]:
    """Indices of the steps values drawn: all of them, or MAX_PANELS evenly spaced."""
    if num_steps <= MAX_PANELS:
        return list(range(num_steps))
    import numpy as np

    return sorted(set(np.linspace(0, num_steps - 1, MAX_PANELS).round().astype(int).tolist()))


def _heatmap(path, qs, noise_multipliers, steps, eps, delta, shown, contours) -> None:
    """One panel per shown steps value (rows of at most 4), contours at the target epsilons."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    ncols = min(4, len(shown))
    nrows = math.ceil(len(shown) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows + 0.4), squeeze=False,
                             constrained_layout=True)
    finite = eps[np.isfinite(eps) & (eps > 0)]
    norm = LogNorm(vmin=max(finite.min(), 1e-3), vmax=max(finite.max(), 1.0001e-3)) if finite.size else None
    xc, yc = np.arange(len(noise_multipliers)) + 0.5, np.arange(len(qs)) + 0.5
    xt = np.linspace(0, len(noise_multipliers) - 1, min(5, len(noise_multipliers))).round().astype(int)
    yt = np.linspace(0, len(qs) - 1, min(5, len(qs))).round().astype(int)
    im = None
    for ax, k in zip(axes.ravel(), shown):
        panel = eps[:, :, k]
        im = ax.pcolormesh(np.arange(len(noise_multipliers) + 1), np.arange(len(qs) + 1), panel, norm=norm,
                           cmap="viridis", shading="flat")
        levels = sorted(c for c in contours if np.nanmin(panel) < c < np.nanmax(panel[np.isfinite(panel)], initial=0))
        if levels and min(panel.shape) >= 2:
            cs = ax.contour(xc, yc, np.where(np.isfinite(panel), panel, np.nanmax(panel[np.isfinite(panel)]) * 10),
                            levels=levels, colors="white", linewidths=1.0)
            ax.clabel(cs, fmt={lv: f"ε={lv:g}" for lv in levels}, fontsize=7)
        ax.set_title(f"steps = {steps[k]:g}")
        ax.set_xlabel("noise multiplier")
        ax.set_ylabel("sampling rate q")
        ax.set_xticks(xt + 0.5, [f"{noise_multipliers[i]:.3g}" for i in xt])
        ax.set_yticks(yt + 0.5, [f"{qs[i]:.2g}" for i in yt])
    for ax in axes.ravel()[len(shown):]:
        ax.set_axis_off()
    which = "all steps values" if len(shown) == len(steps) else f"{len(shown)} of {len(steps)} steps values"
    marks = f"; contours at epsilon = {', '.join(f'{c:g}' for c in contours)}" if contours else ""
    fig.suptitle(f"epsilon at delta = {delta:g} ({which}{marks})", fontsize=10)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), label=f"epsilon at delta={delta:g}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
