"""Compose a jitted accountant inside a JAX pipeline: calibrate σ in a vmapped sweep.

A hyper-parameter sweep over batch size B and epochs E for DP-SGD on N = 60,000 records at
a target (ε, δ) = (3, 1e-5) runs as **one** ``jax.jit``-compiled function: for every
configuration it sets q = B/N and T = ⌈E·N/B⌉, calls
``jaxdp.accounting.calibrate_noise_multiplier`` (vmapped) for the smallest noise multiplier σ meeting
the target, scores the configuration by the signal-to-noise proxy
``B·√T / σ`` (the summed clipped gradients against the summed noise), and picks the best,
all without leaving the compiled program. ε target, δ and N are traced arguments, so
changing them does not recompile.

What you should see: a table of σ per (B, E), the chosen configuration, and the checks
(asserted): the jitted, vmapped σ equal the eager one-by-one calibration; every σ reaches
ε ≤ target (recomputed with ``dpsgd_epsilon``); a second target reuses the compiled
function (one trace).

    python examples/12_calibrate_in_jit.py            # 6 × 5 grid
    python examples/12_calibrate_in_jit.py --smoke    # 3 × 2 grid
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.accounting import calibrate_noise_multiplier, dpsgd_epsilon

# The pipeline's inputs (q, δ, the ε target) are float32 outside an x64 scope (relative
# rounding ≤ 6e-8); σ moves by less than that. The accountant itself computes in float64.
SIGMA_RTOL = 1e-6

TRACES = []


@jax.jit
def sweep(target_epsilon, delta, n, batch_sizes, epochs):
    """σ, score and chosen index for every (B, E) pair; one compiled program."""
    TRACES.append(1)  # runs only while tracing
    b, e = jnp.meshgrid(batch_sizes, epochs, indexing="ij")
    q = b / n
    steps = jnp.ceil(e * n / b)
    calib = jax.vmap(jax.vmap(lambda q_, t_: calibrate_noise_multiplier(target_epsilon, q_, t_, delta)))(q, steps)
    score = b * jnp.sqrt(steps) / calib.noise_multiplier  # signal-to-noise of the summed update
    best = jnp.argmax(jnp.where(jnp.isfinite(score), score, -jnp.inf))
    return calib.noise_multiplier, calib.epsilon, steps, score, best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a 3 x 2 grid")
    args = ap.parse_args(argv)
    bs = [64.0, 256.0, 1024.0] if args.smoke else [64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0]
    es = [1.0, 10.0] if args.smoke else [1.0, 3.0, 10.0, 30.0, 100.0]
    n, delta, target = 60000.0, 1e-5, 3.0
    batch_sizes, epochs = jnp.asarray(bs), jnp.asarray(es)

    t = time.perf_counter()
    sigma, eps, steps, score, best = jax.block_until_ready(sweep(target, delta, n, batch_sizes, epochs))
    first = time.perf_counter() - t
    sigma, eps, steps, score = (np.asarray(v) for v in (sigma, eps, steps, score))
    i, j = np.unravel_index(int(best), sigma.shape)
    print(f"DP-SGD on N={n:.0f}, target epsilon={target:g}, delta={delta:g}: calibrated noise multiplier")
    print("   B \\ E " + "".join(f"{e:>9g}" for e in es))
    for r, b in enumerate(bs):
        print(f"{b:>8g} " + "".join(f"{sigma[r, c]:>9.3f}" for c in range(len(es))))
    print(f"best by B*sqrt(T)/sigma: B={bs[i]:g}, E={es[j]:g} (T={steps[i, j]:.0f} steps, sigma={sigma[i, j]:.4f})")
    print(f"first call (compile + run) {first:.2f} s")

    # Checks. 1) equal to eager, one configuration at a time.
    for r, c in {(0, 0), (len(bs) - 1, len(es) - 1), (len(bs) // 2, len(es) // 2)}:
        eager = calibrate_noise_multiplier(target, bs[r] / n, float(steps[r, c]), delta)
        np.testing.assert_allclose(sigma[r, c], float(eager.noise_multiplier), rtol=SIGMA_RTOL)
    # 2) every σ meets the target.
    assert np.all(np.isfinite(sigma))
    check = np.asarray(dpsgd_epsilon(np.asarray(bs)[:, None] / n, sigma, steps, delta))
    assert np.all(check <= target) and np.all(eps <= target), check.max()
    # 3) the choice is the best score.
    assert score[i, j] == score.max()
    # 4) another target: no retrace, σ decreases as the target grows.
    t = time.perf_counter()
    sigma2 = np.asarray(sweep(2 * target, delta, n, batch_sizes, epochs)[0])
    print(f"second call, target {2 * target:g} (no recompilation) {time.perf_counter() - t:.3f} s")
    assert len(TRACES) == 1
    assert np.all(sigma2 < sigma)
    print("all claims hold")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
