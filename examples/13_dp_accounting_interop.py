"""A dp_accounting DpEvent evaluated by jaxdp: same ε on exact orders, one call for a batch.

Run:  python examples/13_dp_accounting_interop.py [--smoke]

What you should see: a typical DP-SGD pipeline written as a dp_accounting ``DpEvent``
(60 epochs of Poisson-sampled Gaussian steps on MNIST, q = 256/60000, sigma = 1.1, plus
a Laplace-noised count release) is converted with ``jaxdp.interop.from_dp_event``;
jaxdp prints epsilon = 2.6041, the same as dp_accounting's RdpAccountant on the default
156 orders (never above it: where dp_accounting's fractional-order series is an upper
bound, jaxdp's exact value is lower), and on integer orders only the two agree to 1e-9
relative (2.6044367333).
Without --smoke it then evaluates 200 noise multipliers as one batched event in one jitted
call and times it against 200 RdpAccountant runs.
"""

import argparse
import time

import jax
import numpy as np

import jaxdp
from jaxdp.interop import from_dp_event, to_dp_event

A = jaxdp.accounting
INT_ORDERS = [float(a) for a in range(2, 65)] + [128.0, 256.0]


def pipeline(dp_accounting, sigma):
    """The DpEvent a dp_accounting user would write for the run."""
    step = dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(sigma))
    return dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(step, 14040),
        dp_accounting.LaplaceDpEvent(20.0),  # a count released with Laplace noise of scale 20
    ])


def da_epsilon(dp_accounting, dp_event, delta, orders=None):
    acc = dp_accounting.rdp.RdpAccountant(orders)
    acc.compose(dp_event)
    return acc.get_epsilon(delta)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="seconds-long run (skips the batched timing)")
    args = p.parse_args(argv)
    import dp_accounting

    delta = 1e-5
    dp_ev = pipeline(dp_accounting, 1.1)
    event = from_dp_event(dp_ev)  # relation "add_remove", as RdpAccountant's default
    print("jaxdp event:", event)

    t0 = time.perf_counter()
    ours = float(A.epsilon(event, delta))
    t_ours_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = float(A.epsilon(event, delta))
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = da_epsilon(dp_accounting, dp_ev, delta)
    t_theirs = time.perf_counter() - t0
    assert abs(ours - 2.6041) < 5e-5
    print(f"default 156 orders: jaxdp epsilon = {ours:.4f} ({t_ours * 1e3:.1f} ms; first call with compilation "
          f"{t_ours_first:.2f} s)   dp_accounting RdpAccountant = {theirs:.4f} ({t_theirs * 1e3:.1f} ms)")
    assert ours <= theirs * (1 + 1e-9)  # never above: jaxdp's fractional orders are exact

    ours_int = float(A.epsilon(event, delta, orders=INT_ORDERS))
    theirs_int = da_epsilon(dp_accounting, dp_ev, delta, INT_ORDERS)
    print(f"integer orders 2..64, 128, 256: jaxdp {ours_int:.10f}   dp_accounting {theirs_int:.10f}")
    assert abs(ours_int / theirs_int - 1) < 1e-9

    back, relation = to_dp_event(event)
    assert relation == "add_remove" and da_epsilon(dp_accounting, back, delta) == theirs

    if args.smoke:
        return 0
    sigmas = np.linspace(0.7, 3.0, 200)
    batch = from_dp_event(pipeline(dp_accounting, 1.0))
    with jax.enable_x64(True):
        f = jax.jit(lambda s: A.epsilon(A.Composed((A.dpsgd_event(256 / 60000, s, 14040), batch.events[1])), delta))
        f(sigmas).block_until_ready()
        t0 = time.perf_counter()
        eps_batch = np.asarray(f(sigmas).block_until_ready())
        t_batch = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = np.array([da_epsilon(dp_accounting, pipeline(dp_accounting, float(s)), delta) for s in sigmas])
    t_ref = time.perf_counter() - t0
    print(f"200 noise multipliers: jaxdp one jitted call {t_batch * 1e3:.1f} ms, dp_accounting loop {t_ref:.2f} s "
          f"({t_ref / t_batch:,.0f}x); max (jaxdp - dp_accounting)/dp_accounting = {np.max(eps_batch / ref - 1):.2e}")
    assert np.all(eps_batch <= ref * (1 + 1e-9))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
