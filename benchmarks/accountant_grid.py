"""Benchmark: ε for a grid of DP-SGD configurations, jaxdp vs dp_accounting vs Opacus.

All three run in this process on the same (q, σ, steps) grid with the same 156 orders
(dp_accounting's default; Opacus gets them too) and the improved conversion where the
library offers it. Prints configurations per second of each, the ratios, and the largest
relative ε differences. jaxdp's compile time is reported separately.

    python benchmarks/accountant_grid.py            # 2,000-point grid
    python benchmarks/accountant_grid.py --peer-sample 200   # time peers on a subsample

Peers are slow (tens of ms per configuration), so by default they run on a random
subsample of the grid and their rate is extrapolated per configuration; the accuracy
comparison uses the same subsample.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def grid(n_q=20, n_sigma=10, n_steps=10):
    q = np.geomspace(1e-4, 0.1, n_q)
    s = np.linspace(0.5, 5.0, n_sigma)
    t = np.round(np.geomspace(100, 100000, n_steps))
    qg, sg, tg = np.meshgrid(q, s, t, indexing="ij")
    return qg.ravel(), sg.ravel(), tg.ravel()


def bench_jaxdp(q, s, t, delta, repeats):
    import jax

    from jaxdp.accounting import dpsgd_epsilon

    # The user's jit boundary would round float64 NumPy inputs to float32 when x64 is off,
    # so the whole pipeline runs in an x64 scope (the accountant is float64 inside anyway).
    with jax.enable_x64(True):
        f = jax.jit(lambda a, b, c: dpsgd_epsilon(a, b, c, delta))
        t0 = time.perf_counter()
        f(q, s, t).block_until_ready()
        compile_s = time.perf_counter() - t0
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            eps = f(q, s, t).block_until_ready()
            best = min(best, time.perf_counter() - t0)
    return np.asarray(eps), compile_s, best


def bench_events(q, s, t, delta, repeats):
    """The same grid as one batched privacy event: epsilon(dpsgd_event(q, s, t), delta).

    Timed alternately with the primitive (best of ``repeats`` each), so that load changes
    on a shared machine affect both alike. Returns (ε, compile s, event s, primitive s).
    """
    import jax

    from jaxdp.accounting import dpsgd_epsilon, dpsgd_event, epsilon

    with jax.enable_x64(True):
        f_ev = jax.jit(lambda a, b, c: epsilon(dpsgd_event(a, b, c), delta))
        f_pr = jax.jit(lambda a, b, c: dpsgd_epsilon(a, b, c, delta))
        t0 = time.perf_counter()
        f_ev(q, s, t).block_until_ready()
        compile_s = time.perf_counter() - t0
        f_pr(q, s, t).block_until_ready()
        best_ev = best_pr = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            eps = f_ev(q, s, t).block_until_ready()
            best_ev = min(best_ev, time.perf_counter() - t0)
            t0 = time.perf_counter()
            f_pr(q, s, t).block_until_ready()
            best_pr = min(best_pr, time.perf_counter() - t0)
    return np.asarray(eps), compile_s, best_ev, best_pr


def bench_dp_accounting(q, s, t, delta):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    out = np.empty(q.size)
    t0 = time.perf_counter()
    for k in range(q.size):
        acc = RdpAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(q[k], dp_accounting.GaussianDpEvent(s[k])), int(t[k]))
        out[k] = acc.get_epsilon(delta)
    return out, time.perf_counter() - t0


def bench_opacus(q, s, t, delta, orders):
    rdp_mod = importlib.import_module("opacus.accountants.analysis.rdp")
    out = np.empty(q.size)
    t0 = time.perf_counter()
    for k in range(q.size):
        rdp = rdp_mod.compute_rdp(q=q[k], noise_multiplier=s[k], steps=int(t[k]), orders=orders)
        out[k] = rdp_mod.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0]
    return out, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--peer-sample", type=int, default=100, help="configurations timed for each peer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")

    import jax

    from jaxdp.accounting import DEFAULT_ORDERS, rdp_to_epsilon, sampled_gaussian_rdp

    q, s, t = grid()
    n = q.size
    print(f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} {jax.default_backend()} device(s), "
          f"jax {jax.__version__}")
    print(f"grid: {n} configurations (q in [1e-4, 0.1], sigma in [0.5, 5], steps in [100, 1e5]), "
          f"{DEFAULT_ORDERS.size} orders, delta={args.delta:g}")
    eps, compile_s, run_s = bench_jaxdp(q, s, t, args.delta, args.repeats)
    jaxdp_rate = n / run_s
    print(f"jaxdp: compile {compile_s:.2f} s; {run_s * 1e3:.1f} ms for the grid = {run_s / n * 1e6:.1f} us/config "
          f"= {jaxdp_rate:,.0f} configs/s")

    ev_eps, ev_compile_s, ev_run_s, pr_run_s = bench_events(q, s, t, args.delta, args.repeats)
    print(f"jaxdp events (the grid as one batched dpsgd_event): compile {ev_compile_s:.2f} s; {ev_run_s * 1e3:.1f} ms "
          f"= {ev_run_s / n * 1e6:.1f} us/config; timed alternately with dpsgd_epsilon ({pr_run_s * 1e3:.1f} ms): "
          f"event layer / primitive = {ev_run_s / pr_run_s:.3f}; max |rel diff| = {np.max(np.abs(ev_eps / eps - 1)):.1e}")

    rng = np.random.default_rng(args.seed)
    idx = rng.choice(n, size=min(args.peer_sample, n), replace=False)
    da, da_s = bench_dp_accounting(q[idx], s[idx], t[idx], args.delta)
    da_rate = idx.size / da_s
    print(f"dp_accounting RdpAccountant: {da_s / idx.size * 1e3:.2f} ms/config = {da_rate:,.1f} configs/s "
          f"-> jaxdp is {jaxdp_rate / da_rate:,.0f}x faster (events: {n / ev_run_s / da_rate:,.0f}x)")
    rel_da = (eps[idx] - da) / da
    print(f"  epsilon vs dp_accounting: max (jaxdp - da)/da = {rel_da.max():.3e} (must be <= 1e-9), "
          f"min = {rel_da.min():.3e} (negative: dp_accounting's fractional-order upper bound is looser)")
    try:
        importlib.import_module("opacus")
    except Exception as exc:
        print(f"opacus: not installed ({type(exc).__name__}); install the 'bench' extra")
        return 0
    orders = [float(o) for o in DEFAULT_ORDERS]
    op, op_s = bench_opacus(q[idx], s[idx], t[idx], args.delta, orders)
    op_rate = idx.size / op_s
    print(f"opacus compute_rdp + get_privacy_spent: {op_s / idx.size * 1e3:.2f} ms/config = {op_rate:,.1f} configs/s "
          f"-> jaxdp is {jaxdp_rate / op_rate:,.0f}x faster")
    # Same RDP, same conversion (Opacus uses Balle et al. 2020 Thm 21 = the improved bound):
    # compare RDP curves and epsilons where Opacus is finite.
    rdp_mod = importlib.import_module("opacus.accountants.analysis.rdp")
    ours_rdp = np.asarray(sampled_gaussian_rdp(DEFAULT_ORDERS, q[idx], s[idx])) * t[idx, None]
    worst_rdp, where = 0.0, None
    for j, k in enumerate(idx):
        ref = np.asarray(rdp_mod.compute_rdp(q=q[k], noise_multiplier=s[k], steps=int(t[k]), orders=orders))
        fin = np.isfinite(ref) & (ref > 0)
        d = np.abs(ours_rdp[j, fin] / ref[fin] - 1)
        if d.max() > worst_rdp:
            worst_rdp = float(d.max())
            m = int(np.argmax(d))
            where = (q[k], s[k], np.asarray(orders)[fin][m], ours_rdp[j, fin][m] / t[k], ref[fin][m] / t[k])
    ok = np.isfinite(op)
    rel_op = np.abs(eps[idx][ok] / op[ok] - 1)
    print(f"  RDP vs Opacus (exact signed series): max |rel diff| = {worst_rdp:.3e} over finite orders")
    if where is not None:
        try:
            import mpmath  # noqa: F401

            from tests.references import sgm_rdp_quad
        except ImportError:
            pass
        else:
            qq, ss, a, ours1, op1 = where
            ref1 = sgm_rdp_quad(qq, ss, a, dps=30)
            print(f"    worst at q={qq:.3g}, sigma={ss:.3g}, order={a:g}: 30-digit quadrature {ref1:.12e}; "
                  f"jaxdp rel err {abs(ours1 / ref1 - 1):.1e}, Opacus rel err {abs(op1 / ref1 - 1):.1e}")
    print(f"  epsilon vs Opacus: max |rel diff| = {rel_op.max():.3e} over {ok.sum()} finite configs")
    conv = np.asarray(rdp_to_epsilon(ours_rdp, DEFAULT_ORDERS, args.delta).epsilon)
    print(f"  (jaxdp epsilon recomputed from the RDP curves: max |rel diff| to jaxdp's one call = "
          f"{np.max(np.abs(conv / eps[idx] - 1)):.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
