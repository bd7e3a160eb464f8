"""Time to compute ε at every record position of PNSGD, for n = 1e4, 1e5, 1e6.

Claim: ``pnsgd_privacy`` gives every analysis (contraction, iteration, strongly convex,
composition, best) for all n positions in one call, in seconds on a CPU for n = 10^6.
The first call per n includes compilation (reported separately); later calls reuse it.
Baseline in the same run: the per-position bisection of ``pnsgd_contraction_epsilon``
(64 halvings per position) for the contraction analysis alone, and its ratio.

Second table (issue 13): the shifted-interpolation GDP analysis alone
(``pnsgd_shifted_gdp``: exact allocation, min over start times) for every position, at
10^4 and 10^6 positions, in two runs each: one pass with b = 1 (t = n steps), and
t = 10^4 steps as 100 passes of 100 batches (b = n/100). Peer in the same run: Feldman et
al.'s closed-form coefficient (``pnsgd_iteration_rdp`` at one order) for the same positions.

Run: ``python benchmarks/pnsgd_positions.py [--sizes 10000 100000 1000000] [--repeats 3]
[--shifted-sizes 10000 1000000]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np

from jaxdp.accounting import PNSGD, pnsgd_contraction_epsilon, pnsgd_iteration_rdp, pnsgd_privacy, pnsgd_shifted_gdp

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
    p.add_argument("--shifted-sizes", type=int, nargs="*", default=[10_000, 1_000_000])
    args = p.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__} ({jax.default_backend()})")
    print(f"{'n':>9} {'first call (s)':>15} {'steady (s)':>11} {'per position (µs)':>18} {'bisection (s)':>14} {'ratio':>7} {'best ε (i=1, n)':>22}")
    for n in args.sizes:
        run = PNSGD(RUN["lipschitz"], RUN["smoothness"], RUN["learning_rate"], RUN["noise_std"], RUN["diameter"],
                    num_records=n, strong_convexity=RUN["strong_convexity"])
        first, steady = _time(lambda run=run: pnsgd_privacy(run, RUN["delta"]).best, args.repeats)
        out = pnsgd_privacy(run, RUN["delta"])
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
    if args.shifted_sizes:
        _shifted(args.shifted_sizes, args.repeats)
    return 0


def _shifted(sizes, repeats):
    print("\nshifted-interpolation GDP (pnsgd_shifted_gdp), every position; peer: Feldman coefficient")
    print(f"{'n':>9} {'b':>6} {'passes':>6} {'steps':>7} {'first (s)':>10} {'steady (s)':>11} {'µs/position':>12}"
          f" {'peer (s)':>9} {'ratio':>6} {'mu (i=1, n)':>22}")
    for n in sizes:
        for b, k in ((1, 1), (n // 100, 100)):
            pos = np.arange(1, n + 1, dtype=np.float64)
            kw = dict(smoothness=RUN["smoothness"], strong_convexity=RUN["strong_convexity"], batch_size=b, passes=k)

            def shifted(pos=pos, n=n, kw=kw):
                return pnsgd_shifted_gdp(pos, n, RUN["lipschitz"], RUN["noise_std"], RUN["learning_rate"],
                                         RUN["diameter"], **kw)

            def peer(pos=pos, n=n, b=b, k=k):
                return pnsgd_iteration_rdp([2.0], pos, n, RUN["lipschitz"], RUN["noise_std"], batch_size=b, passes=k)

            first, steady = _time(shifted, repeats)
            _, peer_s = _time(peer, repeats)
            mu = np.asarray(shifted())
            print(f"{n:>9} {b:>6} {k:>6} {n // b * k:>7} {first:>10.2f} {steady:>11.3f} {1e6 * steady / n:>12.3f}"
                  f" {peer_s:>9.3f} {steady / peer_s:>6.1f} {mu[0]:>10.4g}, {mu[-1]:<10.4g}")


if __name__ == "__main__":
    raise SystemExit(main())
