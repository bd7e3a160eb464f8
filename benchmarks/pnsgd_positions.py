"""Time to compute ε at every record position of PNSGD, for n = 1e4, 1e5, 1e6.

Claim: ``pnsgd_privacy`` gives every analysis (contraction, iteration, strongly convex,
composition, best) for all n positions in one call, in seconds on a CPU for n = 10^6.
The first call per n includes compilation (reported separately); later calls reuse it.
Baseline in the same run: the per-position bisection of ``pnsgd_contraction_epsilon``
(64 halvings per position) for the contraction analysis alone, and its ratio.

Run: ``python benchmarks/pnsgd_positions.py [--sizes 10000 100000 1000000] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np

from jaxdp.accounting import pnsgd_contraction_epsilon, pnsgd_privacy

RUN = dict(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=1.0, diameter=1.0, strong_convexity=0.2, delta=1e-5)


def _time(fn, repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return first, best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline-max", type=int, default=100_000, help="largest n for the bisection baseline")
    args = p.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__} ({jax.default_backend()})")
    print(f"{'n':>9} {'first call (s)':>15} {'steady (s)':>11} {'per position (µs)':>18} {'bisection (s)':>14} {'ratio':>7} {'best ε (i=1, n)':>22}")
    for n in args.sizes:
        first, steady = _time(lambda n=n: pnsgd_privacy(num_records=n, **RUN).best, args.repeats)
        out = pnsgd_privacy(num_records=n, **RUN)
        if n <= args.baseline_max:
            from jaxdp.accounting import step_contraction

            m = float(step_contraction(RUN["learning_rate"], RUN["smoothness"], RUN["strong_convexity"]))
            pos = np.arange(1, n + 1)
            _, base = _time(
                lambda pos=pos, n=n, m=m: pnsgd_contraction_epsilon(
                    RUN["delta"], pos, n, RUN["lipschitz"], RUN["noise_std"], RUN["learning_rate"], RUN["diameter"], m),
                1,
            )
            ref = np.asarray(pnsgd_contraction_epsilon(RUN["delta"], pos, n, RUN["lipschitz"], RUN["noise_std"], RUN["learning_rate"], RUN["diameter"], m))
            assert np.allclose(np.asarray(out.contraction), ref, rtol=1e-9, atol=1e-12)
            base_s, ratio = f"{base:14.3f}", f"{base / steady:7.1f}"
        else:
            base_s, ratio = f"{'-':>14}", f"{'-':>7}"
        b = np.asarray(out.best)
        print(f"{n:>9} {first:>15.2f} {steady:>11.3f} {1e6 * steady / n:>18.3f} {base_s} {ratio} {b[0]:>10.4g}, {b[-1]:<10.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
