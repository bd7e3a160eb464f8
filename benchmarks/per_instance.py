"""Per-instance accounting at data-set scale: 60,000 points x 100 checkpoints.

Claim: ``per_instance_dpsgd_privacy`` (Thudi et al. 2024, Theorem 3.3 over a run whose
per-point clipped-norm ratios r were recorded at 100 checkpoints) handles a whole MNIST-size
training set in one call, in bounded memory, much faster than a per-point loop.

Peer, in the same run: a straightforward per-point Python loop with NumPy/SciPy that
computes the same quantity the same way: for each point, each checkpoint and each Rényi
order that the checkpoint's steps need (the same evaluation orders as jaxdp), the per-step
RDP of the sampled Gaussian at noise multiplier σ/r (integer orders: the binomial sum in
log space; fractional orders: the two-sided series of Mironov, Talwar, Zhang 2019 §3.3,
summed term by term until both terms fall below e^-30, Opacus's rule), then the Theorem 3.3
sum with the same step counts. It is timed on ``--peer-points`` points and extrapolated
to all points (stated in the output). The two are also compared for accuracy there.

Peak memory is the process's maximum resident set size (``resource.getrusage``),
which includes the Python/JAX runtime and the input array.

Run:  PYTHONPATH=. python benchmarks/per_instance.py [--points 60000] [--peer-points 5]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import time

import jax
import numpy as np
from scipy import special as sp

import jaxdp.accounting as A
from jaxdp.accounting import _per_instance as PI


def peer_rdp(q: float, sigma: float, alpha: float) -> float:
    """Sampled-Gaussian RDP at one (q, σ, α) with NumPy/SciPy, from the formulas."""
    if q == 0:
        return 0.0
    if float(alpha).is_integer():
        a = int(alpha)
        k = np.arange(2, a + 1, dtype=np.float64)
        log_comb = sp.gammaln(a + 1) - sp.gammaln(k + 1) - sp.gammaln(a - k + 1)
        x = (k * k - k) / (2 * sigma**2)
        log_expm1 = x + np.log(-np.expm1(-x))
        terms = log_comb + k * math.log(q) + (a - k) * math.log1p(-q) + log_expm1
        return float(np.logaddexp(0.0, sp.logsumexp(terms)) / (a - 1))
    # Fractional α: A_α = Σ_i [C(α,i) q^i (1-q)^(α-i) e^{(i²-i)/2σ²} Φ((z0-i)/σ)
    #                        + C(α,i) q^(α-i) (1-q)^i e^{((α-i)²-(α-i))/2σ²} Φ̄((z0-(α-i))/σ)]
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    total, i = 0.0, 0
    lq, l1q = math.log(q), math.log1p(-q)
    while True:
        coef = sp.binom(alpha, i)
        lc = math.log(abs(coef))
        j = alpha - i
        s0 = lc + i * lq + j * l1q + (i * i - i) / (2 * sigma**2) + sp.log_ndtr((z0 - i) / sigma)
        s1 = lc + j * lq + i * l1q + (j * j - j) / (2 * sigma**2) + sp.log_ndtr((j - z0) / sigma)
        term = math.copysign(math.exp(s0) + math.exp(s1), coef)
        total += term
        if i > alpha and max(s0, s1) < -30.0:  # Opacus's stopping rule (A_α ≥ 1)
            break
        i += 1
    return math.log(total) / (alpha - 1)


def peer_point(plan, q, sigma, r_point):
    """Theorem 3.3 for one point, R = 1, from the same plan (which orders at which checkpoint)."""
    values = []
    for cols, orders in plan.blocks:
        for c in cols:
            r = r_point[c]
            for a in orders:
                values.append(0.0 if r == 0 else peer_rdp(q, sigma / max(r, 1e-6), float(a)))
    values = np.asarray(values)
    out = []
    for a in range(len(plan.starts)):
        idx = plan.flat[plan.starts[a]:plan.stops[a]]
        out.append(values[plan.first[a]] + float(np.sum(values[idx] * plan.count[plan.starts[a]:plan.stops[a]])))
    return np.asarray(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=60000)
    ap.add_argument("--checkpoints", type=int, default=100)
    ap.add_argument("--steps", type=int, default=4700)
    ap.add_argument("--peer-points", type=int, default=5)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--r-grid", type=int, default=2**14,
                    help="also time r_grid=M (r rounded up to multiples of 1/M, a table lookup); 0 to skip")
    args = ap.parse_args()
    q, sigma, delta = 128 / 60000, 0.469, 1e-5  # MNIST, batch 128 (Thudi et al. App. B.1)
    n, n_ck = args.steps, args.checkpoints
    ckpt = (np.arange(n_ck) * (n // n_ck)).astype(np.int64)
    rng = np.random.default_rng(0)
    # Clipped-norm ratios shrinking over training, a heavy tail of points near the clip.
    drift = np.linspace(0.0, -3.0, n_ck)
    r = np.minimum(1.0, np.exp(np.log(0.5) + drift[None, :] + rng.normal(0.0, 1.2, size=(args.points, n_ck))))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"points {args.points}, checkpoints {n_ck}, steps {n}, orders {len(A.PER_INSTANCE_ORDERS)} "
          f"(default grid), q {q:.6g}, noise_multiplier {sigma}, delta {delta}")

    def run(x, r_grid=None):
        return A.per_instance_dpsgd_privacy(None, q, sigma, x, delta, num_steps=n, checkpoint_steps=ckpt,
                                            chunk_size=args.chunk_size, r_grid=r_grid)

    t = time.perf_counter()
    res = run(r[: args.chunk_size])
    res.epsilon.block_until_ready()
    t_compile = time.perf_counter() - t
    t = time.perf_counter()
    res = run(r)
    res.epsilon.block_until_ready()
    t_jax = time.perf_counter() - t
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.r_grid:
        t = time.perf_counter()
        run(r[: args.chunk_size], args.r_grid).epsilon.block_until_ready()
        t_compile_g = time.perf_counter() - t
        t = time.perf_counter()
        res_g = run(r, args.r_grid)
        res_g.epsilon.block_until_ready()
        t_grid = time.perf_counter() - t
        rss2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    plan = PI._plan(tuple(A.PER_INSTANCE_ORDERS.tolist()), n, tuple(ckpt.tolist()), 3.0 * n, "levels", 4)
    n_eval = sum(len(c) * len(o) for c, o in plan.blocks)
    print(f"evaluation orders {len(plan.grid)}; per-step RDP values per point {n_eval}")
    print(f"jaxdp: first call (compile + {args.chunk_size} points) {t_compile:.1f} s; all {args.points} points "
          f"{t_jax:.1f} s = {t_jax / args.points * 1e3:.3f} ms/point")
    print(f"peak RSS {rss1:.2f} GiB (before the accountant: {rss0:.2f} GiB; input r {r.nbytes / 2**20:.0f} MiB)")

    m = args.peer_points
    t = time.perf_counter()
    peer = np.stack([peer_point(plan, q, sigma, r[i]) for i in range(m)])
    t_peer = (time.perf_counter() - t) / m
    print(f"peer (NumPy/SciPy per-point loop): timed on {m} points, {t_peer * 1e3:.1f} ms/point; "
          f"extrapolated to {args.points} points: {t_peer * args.points / 3600:.2f} h")
    print(f"speed-up per point: {t_peer / (t_jax / args.points):.0f}x")
    if args.r_grid:
        eg, e0 = np.asarray(res_g.epsilon), np.asarray(res.epsilon)
        rel_e = (eg - e0) / e0
        print(f"jaxdp with r_grid={args.r_grid} (r rounded up to multiples of 1/{args.r_grid}, table lookup): "
              f"first call {t_compile_g:.1f} s; all {args.points} points {t_grid:.1f} s = "
              f"{t_grid / args.points * 1e3:.4f} ms/point; peak RSS {rss2:.2f} GiB")
        print(f"speed-up per point with r_grid (against the peer's exact loop): "
              f"{t_peer / (t_grid / args.points):.0f}x; epsilon above the exact estimate by: min {rel_e.min():.1e}, "
              f"median {np.median(rel_e):.1e}, max {rel_e.max():.1e} relative (never below: "
              f"{bool(np.all(eg >= e0))})")
    got = np.asarray(res.rdp[:m])
    rel = np.abs(got - peer) / np.maximum(np.abs(peer), 1e-300)
    print(f"relative difference of the per-point RDP curves, jaxdp vs peer: max {rel.max():.2e}, "
          f"median {np.median(rel):.2e} (the peer truncates the fractional series at e^-30)")
    eps = np.asarray(res.epsilon)
    base_rdp = n * np.asarray(A.sampled_gaussian_rdp(A.PER_INSTANCE_ORDERS, q, sigma))
    base = A.rdp_to_epsilon(base_rdp, A.PER_INSTANCE_ORDERS, delta)
    print(f"epsilon (estimate): median {np.median(eps):.3f}, 10th pct {np.percentile(eps, 10):.3f}, max "
          f"{eps.max():.3f}; data-independent epsilon at the same orders {float(base.epsilon):.3f}")


if __name__ == "__main__":
    main()
