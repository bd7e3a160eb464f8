"""PLD accounting: jaxdp (vmapped, jitted FFT) vs dp_accounting's PLD and Opacus's PRV accountant.

Claim: on a 1,000-configuration DP-SGD grid, jaxdp's PLD upper bound costs less per
configuration than dp_accounting's PLDAccountant at its default discretisation (1e-4), at
matched accuracy (jaxdp's default grid is within 0.25% of dp_accounting there), and the
PLD calibration of σ for a target ε is faster than dp_accounting's calibrate_dp_mechanism
with a PLDAccountant factory. The peers are host Python, one configuration at a time: a
random sample of the grid is timed and extrapolated (said in the output).

Also (issue 27) the five DP-SGD configurations of the acceptance table: jaxdp's default
bracket (upper, lower) against dp_accounting's PLD at value step 1e-5 (and its default
1e-4), with each library's time per configuration; opake-accounting where it installs
(Python 3.13; skipped otherwise, said in the output).

The table also prints the two-stage upper bound (``stages=2``); ``--stages`` times it on the
configuration grid, alternated with the default in the same process.

Run: ``python benchmarks/pld.py [--sample 20] [--configs 1000] [--no-table] [--no-calibration] [--stages]``.
Prints ratios; figures go into benchmarks/README.md with the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np

import jaxdp.accounting as A


def _grid(n, seed=0):
    rng = np.random.default_rng(seed)
    q = 10 ** rng.uniform(-3, -1, n)
    sigma = rng.uniform(0.7, 3.0, n)
    steps = np.round(10 ** rng.uniform(1, 4, n))
    return q, sigma, steps


def _dpa_epsilon(q, s, t, delta, interval=1e-4):
    import dp_accounting
    from dp_accounting import pld

    acc = pld.PLDAccountant(value_discretization_interval=interval)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), int(t))
    return acc.get_epsilon(delta)


def _opacus_epsilon(q, s, t, delta):
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = [(s, q, int(t))]
    return acc.get_epsilon(delta)


# The acceptance table (issue 27): five DP-SGD configurations (q, σ, steps), δ = 1e-5.
TABLE = [(256 / 60000, 1.1, 14063), (0.001, 0.8, 1000), (0.1, 2.0, 100), (0.01, 1.0, 10000), (0.001, 1.0, 10000)]


def _table(delta) -> None:
    """jaxdp's default bracket against dp_accounting's PLD at value step 1e-5 (and 1e-4), with costs."""
    q, s, t = (np.array(x, dtype=float) for x in zip(*TABLE))
    f = jax.jit(lambda q, s, t: A.pld_bracket(A.dpsgd_event(q, s, t), delta))
    f2 = jax.jit(lambda q, s, t: A.epsilon(A.dpsgd_event(q, s, t), delta, accountant="pld", stages=2))
    jax.block_until_ready(f(q, s, t))
    t0 = time.perf_counter()
    b = jax.block_until_ready(f(q, s, t))
    ours = (time.perf_counter() - t0) / len(TABLE)
    two = np.asarray(f2(q, s, t))
    print(f"five-configuration table, delta={delta:g}: jaxdp bracket (upper + lower) {ours * 1e3:.1f} ms/config")
    print("| (q, σ, steps) | jaxdp upper (default grid) | dp_accounting 1e-5 | rel. | jaxdp upper, stages=2 | rel. | "
          "dp_accounting 1e-4 | rel. | jaxdp lower | lower/upper | dp_accounting 1e-4 time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (qi, si, ti) in enumerate(TABLE):
        fine = _dpa_epsilon(qi, si, ti, delta, interval=1e-5)
        t0 = time.perf_counter()
        coarse = _dpa_epsilon(qi, si, ti, delta, interval=1e-4)
        c_t = time.perf_counter() - t0
        up, lo = float(b.upper[i]), float(b.lower[i])
        print(f"| ({qi:.5g}, {si}, {ti}) | {up:.6f} | {fine:.6f} | {up / fine - 1:+.1e} | {two[i]:.6f} | "
              f"{two[i] / fine - 1:+.1e} | {coarse:.6f} | "
              f"{coarse / fine - 1:+.1e} | {lo:.4f} | {lo / up:.3f} | {c_t * 1e3:.0f} ms |", flush=True)
    try:
        import opake_accounting  # noqa: F401  (Python 3.13 wheels only)
    except Exception as exc:
        print(f"opake-accounting: skipped ({type(exc).__name__}: {exc})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", type=int, default=1000)
    ap.add_argument("--sample", type=int, default=20, help="peer configurations timed (extrapolated)")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--no-table", action="store_true", help="skip the five-configuration accuracy table")
    ap.add_argument("--no-calibration", action="store_true", help="skip the calibration timing")
    ap.add_argument("--stages", action="store_true", help="also time stages=2, alternated with the default")
    ap.add_argument("--grid-size", type=int, default=None,
                    help="jaxdp's grid_size for the timed batch (default: the library's default); the CPU time "
                         "per configuration is printed too, the figure to compare across code versions")
    args = ap.parse_args()
    jax.config.update("jax_enable_x64", True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}, "
          f"backend {jax.default_backend()}, load average {os.getloadavg()[0]:.1f}")
    if not args.no_table:
        _table(args.delta)
    q, s, t = _grid(args.configs)
    grid_kw = {} if args.grid_size is None else {"grid_size": args.grid_size}
    f = jax.jit(lambda q, s, t: A.epsilon(A.dpsgd_event(q, s, t), args.delta, accountant="pld", **grid_kw))
    t0 = time.perf_counter()
    jax.block_until_ready(f(q[:2], s[:2], t[:2]))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(f(q, s, t))  # compile for the full batch shape
    t0, c0 = time.perf_counter(), time.process_time()
    eps = np.asarray(jax.block_until_ready(f(q, s, t)))
    ours = (time.perf_counter() - t0) / args.configs
    cpu = (time.process_time() - c0) / args.configs
    print(f"jaxdp PLD (grid {args.grid_size or A.PLD_GRID_SIZE}): {ours * 1e3:.2f} ms/config wall, {cpu * 1e3:.2f} ms CPU, "
          f"over {args.configs} configs (one vmapped call; first compile {compile_s:.1f} s)")
    if args.stages:  # the two-stage upper bound, alternated with the default in the same process
        f2 = jax.jit(lambda q, s, t: A.epsilon(A.dpsgd_event(q, s, t), args.delta, accountant="pld", stages=2))
        t0 = time.perf_counter()
        jax.block_until_ready(f2(q, s, t))
        c2 = time.perf_counter() - t0
        times = {1: [], 2: []}
        for _ in range(2):
            for st, fn in ((1, f), (2, f2)):
                t0 = time.perf_counter()
                e = np.asarray(jax.block_until_ready(fn(q, s, t)))
                times[st].append((time.perf_counter() - t0) / args.configs * 1e3)
        ratio = e / eps
        print(f"stages=1 vs stages=2 (alternated, ms/config): {times[1]} vs {times[2]} (first compile of stages=2 "
              f"{c2:.1f} s); stages=2 / stages=1 epsilon: median {np.median(ratio):.6f}, "
              f"min {ratio.min():.6f}, max {ratio.max():.6f}; load {os.getloadavg()[0]:.1f}")
    idx = np.random.default_rng(1).choice(args.configs, size=min(args.sample, args.configs), replace=False)
    dpa, errs = [], []
    t0 = time.perf_counter()
    for i in idx:
        dpa.append(_dpa_epsilon(q[i], s[i], t[i], args.delta))
    dpa_t = (time.perf_counter() - t0) / len(idx)
    errs = [(eps[i] / d - 1) for i, d in zip(idx, dpa)]
    print(f"dp_accounting PLD (1e-4): {dpa_t * 1e3:.1f} ms/config (sample of {len(idx)}, extrapolated); "
          f"jaxdp - dp_accounting: {min(errs) * 100:+.3f}% .. {max(errs) * 100:+.3f}%; speed-up {dpa_t / ours:.1f}x")
    try:
        t0 = time.perf_counter()
        op = [_opacus_epsilon(q[i], s[i], t[i], args.delta) for i in idx[: max(1, len(idx) // 2)]]
        op_t = (time.perf_counter() - t0) / len(op)
        oerr = [(eps[i] / o - 1) for i, o in zip(idx, op)]
        print(f"Opacus PRV (eps_error 0.01): {op_t * 1e3:.1f} ms/config (sample of {len(op)}); "
              f"jaxdp - Opacus: {min(oerr) * 100:+.3f}% .. {max(oerr) * 100:+.3f}%; speed-up {op_t / ours:.1f}x")
    except Exception as exc:  # opacus not installed or failing on a configuration
        print(f"Opacus PRV: skipped ({type(exc).__name__}: {exc})")
    if args.no_calibration:
        return
    # Calibration of σ for ε = 1 (q = 256/60000, 14040 steps).
    cal = jax.jit(lambda e: A.calibrate_noise_multiplier(e, 256 / 60000, 14040, args.delta, accountant="pld"))
    t0 = time.perf_counter()
    jax.block_until_ready(cal(1.0))
    c_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = jax.block_until_ready(cal(0.999))
    c_ours = time.perf_counter() - t0
    import dp_accounting
    from dp_accounting import pld

    def make_event(sig):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(sig)), 14040)

    t0 = time.perf_counter()
    sig_dpa = dp_accounting.calibrate_dp_mechanism(lambda: pld.PLDAccountant(), make_event, 0.999, args.delta)
    c_dpa = time.perf_counter() - t0
    print(f"calibration (eps=0.999): jaxdp sigma={float(r.noise_multiplier):.5f} in {c_ours:.2f} s "
          f"(compile {c_compile:.1f} s); dp_accounting sigma={sig_dpa:.5f} in {c_dpa:.2f} s; "
          f"speed-up {c_dpa / c_ours:.1f}x")


if __name__ == "__main__":
    main()
