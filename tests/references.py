"""Independent references for the accountant tests: mpmath at high precision.

Nothing here imports jaxdp. The sampled Gaussian RDP is computed from its definition,
by quadrature of the Rényi divergence of the mixture, or (integer orders) by the exact
binomial sum, in multiple precision.
"""

from __future__ import annotations

import math

import mpmath as mp


def sgm_rdp_quad(q: float, sigma: float, alpha: float, dps: int = 40) -> float:
    r"""ε(α) = log(A_α)/(α-1) with A_α - 1 = ∫ N(z; 0, σ²) h(z) dz by mpmath quadrature.

    h(z) = (1 + qX)^α - 1 - αqX with X = e^{(2z-1)/(2σ²)} - 1 (E[X] = 0, so this is A_α - 1;
    written so that the integrand is positive and the quadrature keeps relative
    precision for tiny q). Breakpoints every σ across the region that holds the mass.
    """
    with mp.workdps(dps):
        q_, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
        if q == 0:
            return 0.0
        if q == 1:
            return float(a / (2 * s**2))

        def integrand(z):
            x = mp.expm1((2 * z - 1) / (2 * s**2))
            t = q_ * x
            h = mp.power(1 + t, a) - 1 - a * t
            return mp.npdf(z, 0, s) * h

        # Mass lies between the k = 0 bump at 0 and the k = α bump at α; the weights of the
        # bumps in between peak where log-terms peak. Integrate over [-12σ, α + 12σ] with
        # breakpoints every σ (at most 400), plus the tails.
        lo = -12 * sigma
        hi = alpha + 12 * sigma
        n = min(400, max(8, int(math.ceil((hi - lo) / sigma))))
        pts = [mp.mpf(lo) + (mp.mpf(hi) - lo) * i / n for i in range(n + 1)]
        val = mp.quad(integrand, [-mp.inf] + pts + [mp.inf])
        return float(mp.log1p(val) / (a - 1))


def sgm_rdp_int(q: float, sigma: float, alpha: int, dps: int = 50) -> float:
    """Exact ε(α) for integer α from the binomial sum in multiple precision."""
    with mp.workdps(dps):
        q_, s = mp.mpf(q), mp.mpf(sigma)
        total = mp.mpf(0)
        for k in range(2, alpha + 1):
            total += mp.binomial(alpha, k) * q_**k * (1 - q_) ** (alpha - k) * mp.expm1((k * k - k) / (2 * s**2))
        return float(mp.log1p(total) / (alpha - 1))


def rdp_to_epsilon_improved(orders, rdp, delta):
    """Canonne–Kamath–Steinke conversion, written from the formula (dp_accounting's branches)."""
    best = math.inf
    for a, r in zip(orders, rdp):
        if delta**2 + math.expm1(-r) > 0:
            e = 0.0
        elif a > 1.01:
            e = r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1)
        else:
            e = math.inf
        best = min(best, e)
    return max(0.0, best)
