"""ε vs the number of steps T for PNSGD with Poisson batches: hidden-state bound vs composition.

Prints the table quoted in docs/hidden_state_poisson.md (and writes poisson_pnsgd.png next to
--out when matplotlib is installed). The run: q = 0.01, L = 1, β = 1, η = 0.5, σ = 1 (noise
std on the averaged gradient), D = 1, b = 10, n = 1000, batches cut at B = 20, δ = 1e-5.

    PYTHONPATH=$PWD python benchmarks/poisson_pnsgd.py [--out DIR]
"""

import argparse
import os
import pathlib
import platform
import time

import numpy as np

import jaxdp

A = jaxdp.accounting
RUN = (0.01, 1.0, 1.0, 0.5, 1.0, 1.0, 10.0)  # q, L, β, η, σ, D, b
STATIC = dict(num_records=1000, max_batch_size=20)
DELTA = 1e-5
STEPS = [1, 10, 100, 300, 1_000, 2_000, 3_000, 10_000, 100_000, 1_000_000]


def arguments():
    """``--out DIR``; prints the machine and its load first."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    return args


def main():
    args = arguments()
    t0 = time.perf_counter()
    step = A.truncated_poisson_rdp(A.DEFAULT_ORDERS, RUN[0], 1000, 20, RUN[4] * RUN[6] / RUN[1])
    rows = []
    for T in STEPS:
        hid = float(A.poisson_pnsgd_epsilon(DELTA, *RUN, T, **STATIC))
        comp = float(A.rdp_to_epsilon(T * step, A.DEFAULT_ORDERS, DELTA).epsilon)
        rows.append((T, hid, comp))
    _, tau = A.poisson_pnsgd_rdp(A.DEFAULT_ORDERS, *RUN, 10**6, **STATIC, return_burn_in=True)
    print("| T | hidden state (poisson_pnsgd_epsilon) | composition | ratio |")
    print("|---|---|---|---|")
    for T, h, c in rows:
        print(f"| {T:,} | {h:.4f} | {c:.4f} | {h / c:.3f} |")
    print(f"burn-in (best tau over the orders): {int(np.min(tau)):,}-{int(np.max(tau)):,} steps; "
          f"{time.perf_counter() - t0:.1f} s")
    if args.out:
        Ts = np.unique(np.geomspace(1, 1e6, 40).astype(int))
        h = [float(A.poisson_pnsgd_epsilon(DELTA, *RUN, int(T), **STATIC)) for T in Ts]
        c = [float(A.rdp_to_epsilon(int(T) * step, A.DEFAULT_ORDERS, DELTA).epsilon) for T in Ts]
        figure(args.out, "poisson_pnsgd.png", Ts, {"composition (every iterate released)": (c, "-"),
                                                   "hidden state (poisson_pnsgd_epsilon)": (h, "-")}, "steps T")


def figure(out_dir, name, xs, series, xlabel):
    """A log-log plot of ``series`` (label -> (values, line style)) against ``xs``, at 1e-5, if matplotlib is here."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure")
        return
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (ys, style) in series.items():
        ax.loglog(xs, ys, style, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("epsilon at delta = 1e-5")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
