"""Epsilon of DP-SGD with the exact RDP accountant, and what the exact fractional orders buy.

Run:  python examples/01_dpsgd_epsilon.py [--smoke]

What you should see: for Abadi et al.'s MNIST setting (q = 256/60000, sigma = 1.1, 60
epochs = 14,040 steps, delta = 1e-5) epsilon = 2.5944 at Renyi order 8.1; the smallest
noise multiplier for epsilon = 1 is sigma = 2.1769; and a table where jaxdp's epsilon is
at most dp_accounting's (equal where dp_accounting's RDP is exact, lower where its
fractional orders are an upper bound), e.g. 8.8990 vs 8.9003 at q = 0.05, sigma = 1.5.
"""

import argparse

import numpy as np

import jaxdp

A = jaxdp.accounting


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="seconds-long run (skips the dp_accounting comparison)")
    args = p.parse_args(argv)

    q, sigma, steps, delta = 256 / 60000, 1.1, 14040, 1e-5
    rdp = A.heterogeneous_rdp(A.DEFAULT_ORDERS, [q], [sigma], [steps])
    res = A.rdp_to_epsilon(rdp, A.DEFAULT_ORDERS, delta)
    print(f"MNIST DP-SGD: epsilon = {float(res.epsilon):.4f} at delta = {delta:g} (order {float(res.order):g})")
    assert abs(float(res.epsilon) - 2.594363355) < 1e-6  # notes 004 §3.2, exact RDP

    cal = A.calibrate_noise_multiplier(1.0, q, steps, delta)
    print(f"smallest sigma for epsilon <= 1: {float(cal.noise_multiplier):.4f} (epsilon {float(cal.epsilon):.6f})")
    assert float(cal.epsilon) <= 1.0

    cases = [(0.01, 1.1, 10000), (0.001, 0.8, 1000), (0.05, 1.5, 2000), (0.01, 4.0, 10000)]
    qs, ss, ts = (np.array(c, dtype=float) for c in zip(*cases))
    ours = np.asarray(A.dpsgd_epsilon(qs, ss, ts, delta))
    if args.smoke:
        for c, e in zip(cases, ours):
            print(f"q={c[0]:<6g} sigma={c[1]:<4g} steps={c[2]:<6d} epsilon={e:.6f}")
        return 0
    import dp_accounting

    print(f"{'q':>6} {'sigma':>5} {'steps':>6} {'jaxdp':>10} {'dp_accounting':>14}")
    for (qq, s, t), e in zip(cases, ours):
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(qq, dp_accounting.GaussianDpEvent(s)), t)
        ref = acc.get_epsilon(delta)
        print(f"{qq:>6g} {s:>5g} {t:>6d} {e:>10.6f} {ref:>14.6f}")
        assert e <= ref * (1 + 1e-9)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
