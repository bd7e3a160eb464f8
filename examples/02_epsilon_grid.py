"""Epsilon over a grid of DP-SGD configurations in one vmapped call, with a plot.

Run:  python examples/02_epsilon_grid.py [--smoke] [--out DIR]

What you should see: the number of configurations and the time of one call (after
compilation), and `epsilon_vs_steps.png`: epsilon against the number of steps for several
noise multipliers at q = 0.01, every curve increasing, lower for more noise.
"""

import argparse
import os
import time

import jax
import numpy as np

import jaxdp

A = jaxdp.accounting


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    n = 8 if args.smoke else 60
    steps = np.geomspace(10, 1e5, n)
    sigmas = np.array([0.7, 1.0, 1.5, 2.5, 5.0])
    with jax.enable_x64(True):
        f = jax.jit(lambda s, t: A.dpsgd_epsilon(0.01, s, t, 1e-5))
        sg, tg = np.meshgrid(sigmas, steps, indexing="ij")
        f(sg, tg).block_until_ready()
        t0 = time.perf_counter()
        eps = np.asarray(f(sg, tg).block_until_ready())
        dt = time.perf_counter() - t0
    print(f"{eps.size} configurations in {dt * 1e3:.1f} ms ({dt / eps.size * 1e6:.1f} us each, after compilation)")
    assert np.all(np.diff(eps, axis=1) >= 0), "epsilon must not decrease with steps"
    assert np.all(np.diff(eps, axis=0) <= 0), "epsilon must not increase with sigma"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), constrained_layout=True)
    for s, row in zip(sigmas, eps):
        ax.loglog(steps, row, label=f"sigma = {s:g}")
    ax.set_xlabel("steps")
    ax.set_ylabel("epsilon at delta = 1e-5")
    ax.set_title("DP-SGD, Poisson sampling q = 0.01")
    ax.legend()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "epsilon_vs_steps.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
