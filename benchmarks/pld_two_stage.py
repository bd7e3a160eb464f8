"""Design probe (issue 27, not library code): two-stage PLD composition at 2^14 bins per stage.

Why: at 2^14 bins the default PLD upper bound is within 2e-4 of dp_accounting (value step 1e-5)
on one of issue 27's five DP-SGD configurations only. Its error is connect-the-dots' second
order term, about K·h²/6 of added loss variance for K steps at spacing h, so it needs
h ≲ 6.4e-5 on q = 0.001, σ = 1, 10⁴ steps (docs/pld.md). One tilted FFT cannot give that
there: its window must keep both circular folds below δ (fold up e^{-λW}·P(L < top − W),
fold down e^{λW}·P(L > ε + W)), which needs W ≈ 4.6 (h = 2.8e-4), not ≤ 1.07.

The probe: stage 1 composes a = ⌊K/m⌋ steps (m = 10) on a fine grid whose window W1 only has
to hold the single step and the a-fold sum (h1 = W1/n); the result is re-discretised onto
the stage-2 grid (connect-the-dots of atoms: each atom is split between its two neighbours
preserving E[e^{-L}], a dominating pair) and composed m times with the rest (K − a·m steps)
on the usual window. Numpy, tilted by a fixed λ, both directions, the larger ε reported.
Not certified (no fold or tail bounds: the windows are set by hand below); it measures only
the discretisation error the design leaves. dp_accounting's values (value step 1e-5) are
those benchmarks/pld.py printed; ``--dpa`` recomputes them (minutes).

Run: ``python benchmarks/pld_two_stage.py [--dpa]``.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

from jaxdp.accounting import _pld_curves  # noqa: E402

# (q, σ, steps), dp_accounting at 1e-5, stage-1 window [lo1, hi1], final window [lo2, hi2], tilt λ.
ROWS = [
    ((256 / 60000, 1.1, 14063), 2.381691, (-1.0, 1.5), (-1.5, 5.0), 5.0),
    ((0.001, 0.8, 1000), 0.303554, (-0.3, 1.3), (-1.5, 2.5), 5.0),
    ((0.1, 2.0, 100), 2.337400, (-1.5, 1.6), (-3.0, 6.0), 2.5),
    ((0.01, 1.0, 10000), 6.187713, (-2.0, 3.7), (-3.0, 12.0), 2.5),
    ((0.001, 1.0, 10000), 0.475764, (-0.25, 0.55), (-1.5, 2.5), 5.0),
]


def _tilted_power(p, o, h, k, lam, start):
    """k-fold composition of masses p on bins (o + i)h, tilted by λ, rolled to start at bin ``start``."""
    n = p.shape[0]
    t = p * np.exp(lam * (o + np.arange(n)) * h)
    a = np.log(t.sum())
    out = np.maximum(np.fft.irfft(np.fft.rfft(t / t.sum()) ** k, n), 0.0)
    out = np.roll(out, -int((start - k * o) % n))
    return out * np.exp(k * a - lam * (start + np.arange(n)) * h)


def _regrid(p, o1, h1, lo2, h2, n2):
    """Connect-the-dots of atoms onto the coarser grid (o2 + i)h2 (a dominating pair)."""
    loss = (o1 + np.arange(p.shape[0])) * h1
    o2 = math.floor(lo2 / h2)
    idx = np.floor(loss / h2 - o2).astype(int)
    w = -np.expm1(-(loss - (o2 + idx) * h2)) / -np.expm1(-h2)
    out = np.zeros(n2)
    np.add.at(out, idx, p * (1 - w))
    np.add.at(out, idx + 1, p * w)
    return o2, out


def _epsilon(p, o, h, p_inf, delta):
    loss = (o + np.arange(p.shape[0])) * h
    lo, hi = 0.0, 20.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        d = np.sum(p * np.maximum(-np.expm1(mid - loss), 0.0)) + p_inf
        lo, hi = (mid, hi) if d > delta else (lo, mid)
    return hi


def two_stage(q, sigma, steps, w1, w2, lam, n1=2**14, n2=2**14, m=10, delta=1e-5):
    a, r = steps // m, steps % m
    h1, h2 = (w1[1] - w1[0]) / n1, (w2[1] - w2[0]) / n2
    out = []
    for direction in ("remove", "add"):
        lq = math.log1p(-q)
        start = lq - 1e-3 if direction == "remove" else -lq + 1e-3 - (w1[1] - w1[0])
        o = math.floor(start / h1)
        grid = (o + np.arange(n1)) * h1
        p, p_inf = _pld_curves.masses("sampled_gaussian", (jnp.float64(q), jnp.float64(sigma)), jnp.asarray(grid),
                                      h1, direction, "upper", jnp.float64(grid[-1]))
        p, p_inf = np.asarray(p), float(p_inf)
        a1 = math.floor(w1[0] / h1)
        x = _tilted_power(p, o, h1, a, lam, a1)
        rest = _tilted_power(p, o, h1, r, lam, a1)
        ox, xc = _regrid(x, a1, h1, w1[0], h2, n2)
        _, rc = _regrid(rest, a1, h1, w1[0], h2, n2)
        tx = xc * np.exp(lam * (ox + np.arange(n2)) * h2)
        tr = rc * np.exp(lam * (ox + np.arange(n2)) * h2)
        ax, ar = np.log(tx.sum()), np.log(tr.sum())
        a2 = math.floor(w2[0] / h2)
        pt = np.maximum(np.fft.irfft(np.fft.rfft(tx / tx.sum()) ** m * np.fft.rfft(tr / tr.sum()), n2), 0.0)
        pt = np.roll(pt, -int((a2 - (m * ox + ox)) % n2)) * np.exp(m * ax + ar - lam * (a2 + np.arange(n2)) * h2)
        out.append(_epsilon(pt, a2, h2, 1.0 - (1.0 - p_inf) ** steps, delta))
    return max(out), h1, h2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dpa", action="store_true", help="recompute dp_accounting at value step 1e-5")
    args = ap.parse_args()
    print("| (q, σ, steps) | two-stage ε (2^14 + 2^14, m = 10) | h1 / h2 | dp_accounting 1e-5 | rel. |")
    print("|---|---|---|---|---|")
    for (q, s, t), ref, w1, w2, lam in ROWS:
        if args.dpa:
            import dp_accounting
            from dp_accounting import pld

            acc = pld.PLDAccountant(value_discretization_interval=1e-5)
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), t)
            ref = acc.get_epsilon(1e-5)
        e, h1, h2 = two_stage(q, s, t, w1, w2, lam)
        print(f"| ({q:.5g}, {s}, {t}) | {e:.6f} | {h1:.1e} / {h2:.1e} | {ref:.6f} | {e / ref - 1:+.1e} |", flush=True)


if __name__ == "__main__":
    main()
