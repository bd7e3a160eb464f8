"""DP-SGD noise calibration: jaxdp against Opacus and dp_accounting, in one run.

Claim: ``calibrate_noise_multiplier`` answers one target in a few milliseconds after
compilation and 1,000 targets in one vmapped call in about a second, faster than the
peers' per-target searches. Prints the times and the ratios (peer / jaxdp).

    python benchmarks/calibration.py [--smoke]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np

import jaxdp

Q, STEPS, DELTA, TARGET = 256 / 60000, 14040, 1e-5, 1.0


def _time(fn, repeat):
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def main(smoke: bool = False) -> None:
    cal = jaxdp.accounting.calibrate_noise_multiplier
    n = 100 if smoke else 1000
    rng = np.random.default_rng(0)
    targets = 10 ** rng.uniform(-0.5, 1.0, n)
    t0 = time.perf_counter()
    cal(TARGET, Q, STEPS, DELTA).noise_multiplier.block_until_ready()
    first = time.perf_counter() - t0
    single = _time(lambda: cal(TARGET, Q, STEPS, DELTA).noise_multiplier.block_until_ready(), 5 if smoke else 20)
    batched = jax.jit(jax.vmap(lambda t: cal(t, Q, STEPS, DELTA).noise_multiplier))
    many = _time(lambda: batched(targets).block_until_ready(), 1 if smoke else 3)
    print(f"machine: {platform.processor() or platform.machine()}, jax {jax.__version__}, {jax.devices()[0].platform}")
    print(f"jaxdp first call            {first * 1e3:9.1f} ms")
    print(f"jaxdp one target (compiled) {single * 1e3:9.2f} ms")
    print(f"jaxdp {n} targets, vmapped  {many * 1e3:9.1f} ms")
    try:
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError as err:
        print(f"opacus not importable ({err}); skipped")
    else:
        op = _time(lambda: get_noise_multiplier(target_epsilon=TARGET, target_delta=DELTA, sample_rate=Q,
                                                steps=STEPS, accountant="rdp"), 3)
        print(f"opacus one target           {op * 1e3:9.2f} ms  ratio {op / single:6.1f}x")
    import dp_accounting

    def dpa_one(t=TARGET):
        def make(sigma):
            return dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma)), STEPS)
        return dp_accounting.calibrate_dp_mechanism(
            lambda: dp_accounting.rdp.RdpAccountant(), make, t, DELTA,
            dp_accounting.LowerEndpointAndGuess(0.05, 1.0))

    d1 = _time(dpa_one, 1 if smoke else 3)
    print(f"dp_accounting one target    {d1 * 1e3:9.2f} ms  ratio {d1 / single:6.1f}x")
    print(f"dp_accounting {n} targets (loop, extrapolated) {d1 * n:9.1f} s  ratio {d1 * n / many:6.1f}x")
    ref = dpa_one()
    ours = float(cal(TARGET, Q, STEPS, DELTA).noise_multiplier)
    print(f"sigma: jaxdp {ours:.12f}  dp_accounting {ref:.12f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    main(parser.parse_args().smoke)
