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


def wor_theorem27_rdp(q: float, sigma: float, alpha: int, dps: int = 0) -> float:
    """Theorem 27 of Wang, Balle & Kasiviswanathan (2019) at integer α, exactly (mpmath).

    The forward differences Δ^ℓ of e^{x(x+1)/(2σ²)} at x = -1 are the alternating binomial
    sums, evaluated with enough digits to survive their cancellation; the rest is the
    theorem's formula (the form dp_accounting evaluates in double precision).
    """
    if q == 0:
        return 0.0
    if q == 1:
        return alpha / (2 * sigma**2)
    dps = dps or 60 + int(alpha * alpha / (2 * sigma**2 * 2.3)) + alpha
    with mp.workdps(dps):
        q_, s2 = mp.mpf(q), mp.mpf(sigma) ** 2

        def cgf(x):
            return mp.mpf(x) * (x + 1) / (2 * s2)

        def fdiff(ell):  # Δ^ell e^{cgf}(-1)
            return mp.fsum((-1) ** (ell - k) * mp.binomial(ell, k) * mp.exp(cgf(k - 1)) for k in range(ell + 1))

        cache = {}

        def d(ell):
            if ell not in cache:
                cache[ell] = abs(fdiff(ell))
            return cache[ell]

        e2 = 1 / s2
        total = 1 + q_**2 * mp.binomial(alpha, 2) * min(4 * mp.expm1(e2), 2 * mp.exp(e2))
        for j in range(3, alpha + 1):
            lo, hi = 2 * (j // 2), 2 * ((j + 1) // 2)
            t = min(4 * mp.sqrt(d(lo) * d(hi)), 2 * mp.exp(cgf(j - 1)))
            total += q_**j * mp.binomial(alpha, j) * t
        return float(mp.log(total) / (alpha - 1))


def mixture_renyi(alpha: float, p_weights, p_means, q_weights, q_means, sigma: float, dps: int = 20) -> float:
    """D_α(P‖Q) of two 1-D Gaussian mixtures with common σ, by mpmath quadrature."""
    with mp.workdps(dps):
        s = mp.mpf(sigma)

        def dens(ws, ms, z):
            return mp.fsum(w * mp.npdf(z, m, s) for w, m in zip(ws, ms))

        def f(z):
            p, q = dens(p_weights, p_means, z), dens(q_weights, q_means, z)
            return p**alpha * q ** (1 - alpha) if q > 0 else mp.mpf(0)

        means = list(p_means) + list(q_means)
        lo, hi = min(means) - 14 * sigma, max(means) + 14 * sigma
        n = max(4, int((hi - lo) / sigma))  # a breakpoint every σ
        pts = [mp.mpf(lo) + (mp.mpf(hi) - lo) * i / n for i in range(n + 1)]
        val = mp.quad(f, [-mp.inf] + pts + [mp.inf])
        return float(mp.log(val) / (alpha - 1))


def allocation_remove_moment(t: int, sigma: float, alpha: int, dps: int = 40) -> float:
    """log E_Q[(P/Q)^α] of one balls-in-bins epoch, by brute force over compositions (mpmath).

    P = (1/t)Σ_i N(e_i, σ²I_t), Q = N(0, σ²I_t): (P/Q)(x) = (1/t)Σ_i exp((2x_i − 1)/(2σ²)),
    and E_Q of Π_i exp(a_i x_i/σ²) is exp(Σa_i²/(2σ²)). Every ordered composition
    (a_1..a_t) of α is enumerated with its multinomial coefficient (no grouping).
    """
    with mp.workdps(dps):
        s2 = mp.mpf(sigma) ** 2
        total = mp.mpf(0)

        def rec(i, rem, coef, sq):
            nonlocal total
            if i == t - 1:
                total += coef / mp.factorial(rem) * mp.exp((sq + rem * rem) / (2 * s2))
                return
            for a in range(rem + 1):
                rec(i + 1, rem - a, coef / mp.factorial(a), sq + a * a)

        rec(0, alpha, mp.mpf(1), 0)
        total *= mp.factorial(alpha)
        return float(mp.log(total) - alpha * mp.log(t) - alpha / (2 * s2))


def allocation_k_remove_moment(t: int, k: int, sigma: float, alpha: int, dps: int = 40) -> float:
    """log E_Q[(P/Q)^α] of one epoch of random allocation of k of t steps, by brute force (mpmath).

    P = C(t,k)^{-1} Σ_S N(1_S, σ²I_t) over the k-subsets S, Q = N(0, σ²I_t): for subsets
    S_1..S_α with c_i = #{j : i ∈ S_j}, E_Q Π_j (P_{S_j}/Q) = exp((Σ_i c_i² − αk)/(2σ²)).
    The α-tuples of subsets are counted exactly by their count vector c (integers), not
    through any reduction to k = 1.
    """
    import itertools
    from collections import Counter

    subsets = list(itertools.combinations(range(t), k))
    counts = Counter({(0,) * t: 1})
    for _ in range(alpha):
        nxt: Counter = Counter()
        for c, n in counts.items():
            for s in subsets:
                c2 = list(c)
                for i in s:
                    c2[i] += 1
                nxt[tuple(c2)] += n
        counts = nxt
    with mp.workdps(dps):
        s2 = mp.mpf(sigma) ** 2
        total = mp.fsum(n * mp.exp((sum(ci * ci for ci in c) - alpha * k) / (2 * s2)) for c, n in counts.items())
        return float(mp.log(total) - alpha * mp.log(len(subsets)))


def allocation_renyi_t2(alpha: float, sigma: float, direction: str, dps: int = 30) -> float:
    """D_α(P‖Q) ("remove") or D_α(Q‖P) ("add") of one balls-in-bins epoch with t = 2 steps (mpmath).

    P = ½N((1,0), σ²I) + ½N((0,1), σ²I), Q = N(0, σ²I). In the rotated coordinates
    u = (x−y)/√2, v = (x+y)/√2 (iid N(0, σ²) under Q) the density ratio separates:
    P/Q = e^{−1/(2σ²)} e^{v/(√2σ²)} cosh(u/(√2σ²)), so with c = 1/(√2σ²) and γ = α
    (remove) or 1 − α (add), E_Q[(P/Q)^γ] = e^{−γ/(2σ²)} e^{γ²/(4σ²)} E[cosh^γ(cu)], a 1-D
    quadrature. (Checked once against a direct 2-D mpmath quadrature of the densities at
    σ = 1: α = 3 remove and α = 2 add agree to 1e-14; that takes minutes, so not here.)
    """
    with mp.workdps(dps):
        s = mp.mpf(sigma)
        a = mp.mpf(alpha)
        g = a if direction == "remove" else 1 - a
        c = 1 / (mp.sqrt(2) * s**2)

        def f(u):
            return mp.npdf(u, 0, s) * mp.cosh(c * u) ** g

        lim = 40 * s + 40 * s**2 * abs(g)
        pts = [mp.mpf(-lim) + 2 * lim * mp.mpf(i) / 64 for i in range(65)]
        val = mp.quad(f, pts)
        log_m = -g / (2 * s**2) + g**2 / (4 * s**2) + mp.log(val)
        return float(log_m / (a - 1))


def sgm_pld_epsilon_lower(q: float, sigma: float, steps: int, delta: float, *, step: float = 1e-6,
                          window: tuple[float, float] = (-0.05, 9.0), tilt_at: float | None = None) -> float:
    r"""A lower bound on ε(δ) of ``steps`` Poisson-sampled Gaussians (remove direction), in NumPy.

    Independent of jaxdp and of dp_accounting. Each step's privacy loss
    ℓ(x) = log(1 − q + q e^{(2x−1)/(2σ²)}), x ~ (1−q)N(0, σ²) + qN(1, σ²), is rounded *down* to
    the grid ``step``·ℤ (bin masses from normal CDFs in log space); the sum of ``steps`` such
    losses is composed by binary powering with zero-padded FFT convolutions of the
    exponentially tilted masses (tilt λ with steps·E_λ[ℓ] = ``tilt_at``, so that the region
    that sets ε(δ) carries relative, not absolute, round-off), dropping mass outside
    ``window``. Rounding down and dropping mass only lower δ(ε) = E[(1 − e^{ε−L})₊], so the ε
    solved from it is below the true one (up to FFT round-off relative to the tilted mass).
    Matches dp_accounting's optimistic PLD to 2e-10 at q = 0.01, σ = 1, 1,000 steps, δ = 1e-5.
    """
    import numpy as np
    from scipy.optimize import brentq
    from scipy.special import log_ndtr

    lo, hi = window
    h = step

    def logmass(a, b, mu):  # log P(a <= X < b) for X ~ N(mu, sigma^2), stable in both tails
        za, zb = (a - mu) / sigma, (b - mu) / sigma
        la = np.where(za > 0, log_ndtr(-za), log_ndtr(zb))
        lb = np.where(za > 0, log_ndtr(-zb), log_ndtr(za))
        with np.errstate(invalid="ignore"):
            out = la + np.log1p(-np.exp(np.minimum(lb - la, -1e-300)))
        return np.where(np.isfinite(out), out, -np.inf)

    k = np.arange(int(np.floor(np.log1p(-q) / h)) - 1, int(hi / h) + 2)
    edges = np.append(k, k[-1] + 1) * h
    v = (np.exp(edges) - (1 - q)) / q  # x(l): inverse of the increasing loss
    with np.errstate(divide="ignore", invalid="ignore"):
        xe = np.where(v > 0, sigma**2 * np.log(np.where(v > 0, v, 1.0)) + 0.5, -np.inf)
        lm = np.logaddexp(np.log1p(-q) + logmass(xe[:-1], xe[1:], 0.0), np.log(q) + logmass(xe[:-1], xe[1:], 1.0))
    lm = np.where(np.isfinite(lm), lm, -np.inf)
    lv = k * h

    def log_mgf(lam):
        a = lm + lam * lv
        m = a.max()
        return m + np.log(np.exp(a - m).sum())

    def tilted_mean(lam):
        a = lm + lam * lv
        w = np.exp(a - a.max())
        return (w * lv).sum() / w.sum()

    target = tilt_at if tilt_at is not None else 0.5 * hi
    lam = brentq(lambda x: steps * tilted_mean(x) - target, 0.0, 500.0)
    kmin, kmax = int(lo / h), int(hi / h)

    def trunc(off, arr):
        s, e = max(off, kmin), min(off + len(arr) - 1, kmax)
        return s, arr[s - off: e - off + 1]

    def conv(o1, x, o2, y):
        n = len(x) + len(y) - 1
        size = 1 << (n - 1).bit_length()
        z = np.fft.irfft(np.fft.rfft(x, size) * np.fft.rfft(y, size), size)[:n]
        return trunc(o1 + o2, np.maximum(z, 0.0))

    base, acc, n = trunc(int(k[0]), np.exp(lm + lam * lv - log_mgf(lam))), None, steps
    while n:
        if n & 1:
            acc = base if acc is None else conv(*acc, *base)
        n >>= 1
        if n:
            base = conv(*base, *base)
    off, pt = acc
    total = (off + np.arange(len(pt))) * h
    with np.errstate(divide="ignore"):
        logp = np.log(pt) + steps * log_mgf(lam) - lam * total

    def delta_of(eps):
        m = total > eps
        return np.sum(np.exp(logp[m]) * -np.expm1(eps - total[m]))

    if delta_of(0.0) <= delta:
        return 0.0
    return float(brentq(lambda e: np.log(delta_of(e)) - math.log(delta), 0.0, hi - 1e-9))


def sampled_approx_dp_epsilon(q: float, eps0: float, delta0: float, k: int, delta: float) -> float:
    r"""Exact ε(δ) of ``k`` Poisson-sampled (ε₀, δ₀)-DP steps (add/remove, both directions), in NumPy.

    Independent of jaxdp. The (ε₀, δ₀) pair (Kairouz, Oh, Viswanath 2015) has four outcomes,
    P = (δ₀, w₊, w₋, 0) and Q = (0, w₋, w₊, δ₀) with w₊ = (1 − δ₀)e^{ε₀}/(1 + e^{ε₀}),
    w₋ = (1 − δ₀)/(1 + e^{ε₀}); sampled, the remove pair is ((1 − q)Q + qP, Q) and the add
    pair its swap. The k-fold product is enumerated by outcome counts (a multinomial over
    four outcomes, k³/6 terms), δ(ε) = Σ (P^k − e^ε Q^k)₊ summed exactly in float64, and
    ε solved by ``brentq`` to 1e-14 (δ(ε) is decreasing). Practical for k ≤ ~200.
    """
    import numpy as np
    from scipy.optimize import brentq
    from scipy.special import gammaln

    w_hi = (1 - delta0) * np.exp(eps0) / (1 + np.exp(eps0))
    w_lo = (1 - delta0) / (1 + np.exp(eps0))
    p = np.array([delta0, w_hi, w_lo, 0.0])
    qq = np.array([0.0, w_lo, w_hi, delta0])
    pm = (1 - q) * qq + q * p
    counts = np.array([(a, b, c, k - a - b - c) for a in range(k + 1) for b in range(k + 1 - a)
                       for c in range(k + 1 - a - b)], float)
    log_c = gammaln(k + 1) - gammaln(counts + 1).sum(1)

    def log_prob(v):
        with np.errstate(divide="ignore", invalid="ignore"):
            t = counts * np.log(v)[None, :]
        t[:, v == 0] = np.where(counts[:, v == 0] > 0, -np.inf, 0.0)
        return log_c + t.sum(1)

    out = []
    for first, second in ((pm, qq), (qq, pm)):  # remove, add
        la, lb = log_prob(first), log_prob(second)

        def hockey(eps):
            return float(np.sum(np.maximum(np.exp(la) - np.exp(eps + lb), 0.0)))

        out.append(0.0 if hockey(0.0) <= delta else
                   brentq(lambda e: hockey(e) - delta, 0.0, 200.0, xtol=1e-14, rtol=1e-13))
    return max(out)
