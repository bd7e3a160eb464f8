r"""Per-record privacy of projected noisy SGD with hidden iterates: every analysis at once.

:func:`pnsgd_privacy` returns, for each record position i = 1..n, the ε (for a target δ)
given by the contraction-coefficient analysis (Asoodeh et al.), the amplification-by-
iteration analysis (Feldman et al.), its strongly convex refinement (Balle et al.), the
shifted-interpolation GDP analysis (Bok et al.), the composition baseline that releases
every iterate, and the best (smallest) of them.
Random stopping (one pass stopped at a secret uniform step, mini-batches included) has its
own analyses, in the same :class:`PNSGDPrivacy`. :func:`calibrate_pnsgd_noise_std`
(``_pnsgd_calibrate.py``) finds the smallest noise meeting a target (ε, δ); the two
inversions per position live in ``_pnsgd_invert.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._deprecations import warn_old_signature
from .._numerics import f64, float64
from .._program_cache import persistent, prepare
from .._validate import check_integer, check_learning_rate, check_positions, is_int, learning_rate_valid, nan_unless
from ._contraction import _batch_geometry, _eps_bracket, _log_delta_from, _solve_eps, step_contraction
from ._contraction import stop_pnsgd_contraction_epsilon
from ._conversion import rdp_to_epsilon
from ._events import PNSGD
from ._iteration import _linear_eps_masked, _pabi_coefficient, _sc_coefficient, stop_pnsgd_iteration_rdp
from ._pnsgd_invert import _contraction_gdp_eps
from . import _pnsgd_shuffle
from ._pnsgd_poisson import event_rdp as _poisson_event_rdp
from ._rdp import DEFAULT_ORDERS
from ._shifted import _log_contraction, _shifted_energy

__all__ = ["PNSGDPrivacy", "pnsgd_privacy"]

_ANALYSES = ("best", "contraction", "iteration", "strongly_convex", "shifted_gdp", "composition")
_SC_FORMS = ("proposition1", "shifted")


class PNSGDPrivacy(NamedTuple):
    """ε per record position for each analysis (float64 arrays of the positions' shape).

    For a randomly stopped run (``schedule="random_stop"``): ``contraction`` is Asoodeh et
    al. Theorem 5, ``iteration`` Feldman et al. Theorem 26, ``strongly_convex`` and
    ``shifted_gdp`` +inf (not derived); for ``hidden=False`` only ``composition`` is finite.

    Attributes:
      positions: the 1-based record positions i.
      contraction: Theorem 4 of Asoodeh et al. (with the mini-batch / multi-pass extensions).
      iteration: Theorem 23 of Feldman et al. (with extensions), improved RDP conversion.
      strongly_convex: Balle et al. as quoted in Proposition 1 of Asoodeh et al.,
        improved RDP conversion (+inf for several passes: not derived).
      composition: every iterate released (no amplification): the exact ε of the
        composition of the record's k Gaussian steps.
      best: the element-wise minimum of the five (a minimum of valid bounds is valid).
      shifted_gdp: Bok, Su & Altschuler's shifted interpolation: the record is μ-GDP
        (:func:`pnsgd_shifted_gdp`), converted exactly (any number of passes, convex or
        strongly convex, with the start at the diameter when that is better).
    """

    positions: jax.Array
    contraction: jax.Array
    iteration: jax.Array
    strongly_convex: jax.Array
    composition: jax.Array
    best: jax.Array
    shifted_gdp: jax.Array


def _validate_run(lipschitz, smoothness, learning_rate, noise_std, diameter, strong_convexity, batch_size, passes) -> None:
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf)
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("diameter", diameter, 0.0, math.inf, lo_open=True)
    check_learning_rate(learning_rate, smoothness, strong_convexity)
    check_integer("batch_size", batch_size)
    check_integer("passes", passes)


def _contraction_factor(learning_rate, smoothness, strong_convexity):
    eta, beta, rho = f64(learning_rate), f64(smoothness), f64(strong_convexity)
    valid = learning_rate_valid(eta, beta, rho)
    denom = jnp.where(valid, beta + rho, 1.0)
    m2 = jnp.maximum(1.0 - 2.0 * eta * beta * rho / denom, 0.0)
    m = jnp.where(m2 > 0, jnp.sqrt(jnp.where(m2 > 0, m2, 1.0)), 0.0)
    return valid, jnp.where(rho == 0, 1.0, m)


def _composition_r(pos, n, lip, sig, b, k):
    """r = 2L√k/(b_j σ): the record's k uses composed are one Gaussian mechanism with this ratio."""
    _, _, b_eff = _batch_geometry(pos, n, b)
    return 2.0 * lip * jnp.sqrt(k) / (b_eff * sig)


def _bucket(size: int) -> int:
    """The padded length for ``size`` positions, so that nearby sizes share compiled programs.

    At least 8; with P the next power of two, the next multiple of P/4 (one of 3P/4, P:
    at most 50% padding, for P ≤ 1024, where compiling dominates), or of P/16 beyond
    (at most 12.5% padding, where running dominates).
    """
    if size <= 8:
        return 8
    p = 1 << (size - 1).bit_length()
    step = p // 4 if p <= 1024 else p // 16
    return -(-size // step) * step


def _privacy_core(pos, n, lip, beta, rho, eta, sig, dia, b, k, dlt, sc_form, size=None, shape=None):
    """All analyses for scalar run parameters and a flat vector of positions.

    Three compiled programs, not one: the setup (with the composition's two values and the
    RDP analyses), the shifted-interpolation μ, and the two inversions (contraction and the
    GDP conversion, one loop with one traced copy of θ) with the minimum. XLA's compile time
    grows faster than the size of a program, so the large parts compile in less time apart
    than as a whole; each program also has a fixed cost, so the small parts ride with a
    neighbour. An eager call first prepares the three programs at once
    (:func:`jaxdp._program_cache.prepare`: each traced in turn, compiled in a thread while
    the next is traced); under a caller's ``jit`` they are inlined. The outputs are the
    first ``size`` entries reshaped to ``shape`` (default: all, flat).
    """
    size = pos.shape[0] if size is None else size
    shape = (size,) if shape is None else tuple(shape)
    args = (pos, n, lip, beta, rho, eta, sig, dia, b, k, dlt)
    prepare(_privacy_chain, *args, sc_form=sc_form, size=size, shape=shape)
    return _privacy_chain(*args, sc_form=sc_form, size=size, shape=shape)


def _privacy_chain(pos, n, lip, beta, rho, eta, sig, dia, b, k, dlt, sc_form, size, shape):
    """The three programs of :func:`_privacy_core` in turn (each on the previous ones' results)."""
    st = _privacy_setup(pos, n, lip, beta, rho, eta, sig, dia, b, k, dlt, sc_form=sc_form)
    mu = _shifted_mu_part(st["pos_s"], st["n_s"], st["lip_s"], beta, rho, st["eta_s"], st["sig_s"], st["dia_s"],
                          st["b_s"], st["k_s"], st["scal_ok"])
    return _invert_combine(st["valid"], st["sel"], st["r_first2"], st["rc"], st["later"], st["eps_i"], st["eps_s"],
                           st["eps_g2"], mu, st["log_t"], size=size, shape=shape)


@persistent("pnsgd_setup", static_argnames=("sc_form",))
@functools.partial(jax.jit, static_argnames=("sc_form",))
def _privacy_setup(pos, n, lip, beta, rho, eta, sig, dia, b, k, dlt, sc_form):
    step_ok, m_c = _contraction_factor(eta, beta, rho)
    scal_ok = (
        step_ok
        & is_int(n)
        & (lip >= 0)
        & jnp.isfinite(lip)
        & (sig > 0)
        & jnp.isfinite(sig)
        & (dia > 0)
        & jnp.isfinite(dia)
        & is_int(b)
        & is_int(k)
        & (dlt > 0)
        & (dlt < 1)
    )
    valid = scal_ok & is_int(pos) & (pos <= n)
    sig_s = jnp.where(scal_ok, sig, 1.0)
    eta_s = jnp.where(scal_ok, eta, 1.0)
    dia_s = jnp.where(scal_ok, dia, 1.0)
    b_s = jnp.where(scal_ok, b, 1.0)
    k_s = jnp.where(scal_ok, k, 1.0)
    n_s = jnp.where(scal_ok, n, 1.0)
    lip_s = jnp.where(scal_ok, lip, 1.0)
    log_t = jnp.log(jnp.where(scal_ok, dlt, 0.5))
    pos_s = jnp.where(valid, pos, 1.0)
    # The two possible batch sizes: a full batch and the last batch.
    m = jnp.ceil(n_s / b_s)
    b_last = n_s - (m - 1.0) * b_s
    b2 = jnp.stack([b_s, b_last])
    r1 = 2.0 * lip_s / (b2 * sig_s)
    rc = m_c * dia_s / (eta_s * sig_s)
    r_first2 = jnp.where(k_s > 1, r1 + rc, r1)
    j = jnp.ceil(pos_s / b_s)
    sel = (j >= m).astype(jnp.int32)
    later = m - j
    # Composition: one Gaussian mechanism with r = 2L√k/(b_j σ); two values.
    r_comp2 = 2.0 * lip_s * jnp.sqrt(k_s) / (b2 * sig_s)
    return dict(scal_ok=scal_ok, valid=valid, sig_s=sig_s, eta_s=eta_s, dia_s=dia_s, b_s=b_s, k_s=k_s, n_s=n_s,
                lip_s=lip_s, log_t=log_t, pos_s=pos_s, m_c=m_c, rc=rc, r_first2=r_first2, sel=sel, later=later,
                r_comp2=r_comp2, eps_g2=_composition_part(r_comp2, log_t),
                **dict(zip(("eps_i", "eps_s"), _rdp_part(pos_s, n_s, lip_s, sig_s, b_s, k_s, m_c, dlt, scal_ok, sc_form))))


def _rdp_part(pos_s, n_s, lip_s, sig_s, b_s, k_s, m_c, dlt, scal_ok, sc_form):
    # Iteration (Feldman): valid for ρ ≥ 0 because η ≤ 2/(β+ρ) ≤ 2/β.
    v_i, c_i = _pabi_coefficient(pos_s, n_s, lip_s, sig_s, b_s, k_s)
    v_s, c_s = _sc_coefficient(pos_s, n_s, lip_s, sig_s, m_c, b_s, sc_form)
    # Both RDP coefficients converted in one call (one traced copy of the order search).
    eps_is = _linear_eps_masked(jnp.stack([c_i, c_s], -1), dlt, jnp.stack([v_i, v_s], -1) & scal_ok, "improved")
    eps_i, eps_s = eps_is[..., 0], eps_is[..., 1]
    return eps_i, jnp.where(k_s > 1, jnp.inf, eps_s)


def _composition_part(r_comp2, log_t):
    """The exact ε of the two possible composed Gaussian mechanisms (full and last batch)."""
    zero2 = jnp.zeros(2)
    return _solve_eps(
        lambda e, r_, lt_: _log_delta_from(e, r_, r_, zero2) - lt_,
        (r_comp2, log_t),
        zero2,
        _eps_bracket(r_comp2, log_t),
    )


# Shifted interpolation: μ-GDP per record, exact conversion δ(ε) = θ_{e^ε}(μ). The energy
# search is a program of its own (XLA compiled it and the conversion in ~3 s apart, ~4.2 s
# as one); the conversion shares the contraction's inversion loop (one traced copy of θ for
# both) in the last program, with the minimum. The composition (two values) and the RDP
# analyses share the setup's program: small parts ride with others.
_shifted_mu_part = persistent("pnsgd_shifted")(jax.jit(lambda *a: _shifted_mu(*a)))


@persistent("pnsgd_invert", static_argnames=("size", "shape"))
@functools.partial(jax.jit, static_argnames=("size", "shape"))
def _invert_combine(valid, sel, r_first2, rc, later, eps_i, eps_s, eps_g2, mu, log_t, size, shape):
    eps_c, eps_sh = _contraction_gdp_eps(r_first2, rc, later, sel, log_t, mu)
    eps_g = jnp.where(sel == 1, eps_g2[1], eps_g2[0])
    best = jnp.minimum(jnp.minimum(jnp.minimum(eps_c, eps_i), jnp.minimum(eps_s, eps_g)), eps_sh)
    nan = lambda x: jnp.reshape(nan_unless(valid, x)[:size], shape)  # noqa: E731
    return nan(eps_c), nan(eps_i), nan(eps_s), nan(eps_g), nan(eps_sh), nan(best)


def _shifted_mu(pos, n, lip, beta, rho, eta, sig, dia, b, k, ok):
    """μ of :func:`pnsgd_shifted_gdp` (safe stand-ins where ``ok`` is False)."""
    lc = _log_contraction(eta, jnp.where(ok, beta, 1.0), jnp.where(ok, rho, 0.0))
    shape = jnp.shape(pos)
    n, lip, eta, sig, dia, b, k, lc = (jnp.broadcast_to(x, shape) for x in (n, lip, eta, sig, dia, b, k, lc))
    energy = _shifted_energy(pos, n, lip, eta, dia, b, k, lc)
    pos_e = energy > 0
    return jnp.where(pos_e, jnp.sqrt(jnp.where(pos_e, energy, 1.0)), 0.0) / sig


@float64
def pnsgd_privacy(
    event: PNSGD | None = None,
    delta=None,
    *,
    positions=None,
    strongly_convex_form: str = "proposition1",
    orders=DEFAULT_ORDERS,
    **old_keywords,
) -> PNSGDPrivacy:
    r"""ε per record position of a projected noisy SGD run, for every analysis.

    The run is :math:`Y ← Π_K(Y - η(\frac1b\sum_{x∈B}∇ℓ(Y, x) + Z))`, :math:`Z \sim N(0, σ^2 I)`,
    over n records in consecutive batches of b, for k passes in the same fixed order, and
    only the final iterate is released. For each position i it returns the ε at which the
    record is (ε, δ)-DP according to:

    * ``contraction``: :math:`δ = θ_{e^ε}(2L/(b_jσ))\,θ_{e^ε}(MD/(ησ))^{m-j}`
      (Asoodeh et al. Theorem 4; see :func:`pnsgd_contraction_delta` for the mini-batch and
      multi-pass extensions), inverted by bisection;
    * ``iteration``: :math:`(α, \frac{2αL^2}{b_j^2σ^2}(\frac{k-1}{m} + \frac1{m-j+1}))`-RDP
      (Feldman et al. Theorem 23 with extensions, :func:`pnsgd_iteration_rdp`);
    * ``strongly_convex``: Balle et al. as quoted in Proposition 1 of Asoodeh et al.
      (:func:`strongly_convex_iteration_rdp`; ``strongly_convex_form="shifted"`` uses our
      tighter derivation); +inf when k > 1 (not derived);
    * ``shifted_gdp``: the record is μ-GDP by shifted interpolation (Bok et al.;
      :func:`pnsgd_shifted_gdp`: the exact shift allocation with contraction
      :math:`c = \max(|1-ηρ|, |1-ηβ|)`, started at the run's start or, at distance D, at
      a later step), converted exactly: :math:`δ = θ_{e^ε}(μ)`; valid for any number of
      passes, convex or strongly convex;
    * ``composition``: every iterate released, i.e. the k Gaussian steps that use the
      record, composed exactly: :math:`δ = θ_{e^ε}(2L\sqrt k/(b_jσ))`;
    * ``best``: the minimum of the five. Each is a valid upper bound for the hidden-iterate
      run (the composition one too, by post-processing), so their minimum is valid.

    The run is given by its record, the :class:`~jaxdp.accounting.PNSGD` event (L, β, η, σ,
    D, ρ, n, b, k, schedule, hidden): ``epsilon(event, delta)`` is the worst record's ``best``
    and ``pnsgd_record_epsilon(event, delta)`` the per-record ``best`` (docs/events.md).
    ``event.hidden=False`` (every iterate released): only ``composition`` holds; the other
    analyses are +inf and ``best`` is ``composition``.

    ``event.schedule="random_stop"`` (one pass, stopped after a secret uniform number of
    steps :math:`T \in \{1..m\}`, :math:`m = \lceil n/b\rceil` batches, only :math:`Y_T`
    released): batches are the steps, and step j's averaged gradient has sensitivity
    :math:`2L/b_j`, so each random-stop analysis (stated for b = 1) applies with Lipschitz
    constant :math:`L/b_{\min}` (the smallest batch, conservatively) and m steps, a record's
    position being its batch's index j:

    * ``contraction``: Asoodeh et al. Theorem 5, exact sum per position
      (:func:`stop_pnsgd_contraction_epsilon`);
    * ``iteration``: Feldman et al. Theorem 26 (Stop-PNSGD) in the ``"logmeanexp"`` form
      of :func:`stop_pnsgd_iteration_rdp` (no condition on σ), converted over ``orders``
      with the improved conversion;
    * ``composition``: each record used once, the Gaussian mechanism with ratio
      :math:`2L/(b_jσ)` (valid whatever T);
    * ``strongly_convex`` and ``shifted_gdp``: +inf (not derived for random stopping);
      ``best``: the minimum of the three.

    ``event.sampling="shuffle"`` (k passes, each over a fresh secret uniform permutation cut
    into consecutive batches; replace-one neighbours): every record gets the same ε.
    ``iteration`` is the hidden-state bound of :func:`shuffle_pnsgd_rdp` (log-mean-exp over
    the record's secret batch of the fixed-order shift bound; for k ≥ 2 the last pass only,
    flat in k), ``shifted_gdp`` the hockey-stick mixture of the same schedules as GDP
    (:func:`shuffle_pnsgd_epsilon`), ``composition`` the k passes composed, ``best`` their
    minimum; the other fields +inf.

    ``event.sampling="poisson"`` (T = ``num_steps`` steps on Poisson samples at rate q, cut
    to ``max_batch_size``, sum divided by b; add/remove neighbours): every record gets the
    same ε. ``iteration`` is the hidden-state bound of :func:`poisson_pnsgd_rdp` (shifted
    Rényi divergence with the noise split, flat in T after a burn-in), ``composition`` the
    T sampled Gaussian steps composed (RDP, converted with :func:`rdp_to_epsilon`),
    ``best`` their minimum; the other fields +inf (the fixed-order analyses do not apply).

    RDP bounds are converted with the improved conversion optimised over continuous α
    (:func:`linear_rdp_epsilon`). The ε values are rounded up (bisection returns the
    certified end of its bracket). For the last record the best bound equals the exact
    ε of one Gaussian step (with one pass), and it never goes below it. ε is non-decreasing
    in the position (fewer later steps, less amplification) for every analysis.

    Assumptions (not checked by the library, which cannot verify convexity of a user's
    loss): for every record x, :math:`y ↦ ℓ(y, x)` is convex, L-Lipschitz, β-smooth and
    ρ-strongly convex on a compact convex set K of diameter D; the gradient noise is fresh,
    independent and isotropic Gaussian; the starting point is data-independent; only the
    final iterate is released; the order of the records is fixed in advance.

    Args:
      event: the run's record, a :class:`~jaxdp.accounting.PNSGD` event: L ≥ 0, β > 0, η with
        0 < η ≤ 2/(β + ρ) (see :func:`step_contraction`), σ > 0 the noise standard
        deviation on the averaged gradient, D > 0, ρ in [0, β], n ≥ 1 records, batch size
        b ≥ 1, k ≥ 1 passes (one with random stopping), ``schedule`` and ``hidden``. The
        old keyword form ``pnsgd_privacy(lipschitz=..., ..., delta=...)`` still answers
        for one release, with a ``DeprecationWarning``.
      delta: target δ in (0, 1).
      positions: record positions in 1..n (any shape); default all of 1..n.
      strongly_convex_form: ``"proposition1"`` (default, as the paper quotes Balle et al.)
        or ``"shifted"`` (static).
      orders: Rényi orders (static) of the random-stop RDP analysis.

    Returns:
      :class:`PNSGDPrivacy` of float64 arrays shaped like ``positions``. Invalid inputs
      raise ``ValueError`` naming the parameter eagerly and give NaN under ``jit``.

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Theorems 4, Proposition 1; Feldman,
      Mironov, Talwar, Thakurta (arXiv:1808.06651), Theorems 22, 23, 35; Balle, Barthe,
      Gaboardi, Geumlek (NeurIPS 2019), Theorem 5; Bok, Su, Altschuler, "Shifted
      Interpolation for Differential Privacy" (ICML 2024), §3-4; random stopping: Asoodeh
      et al. Theorem 5, Feldman et al. Theorem 26.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> out = A.pnsgd_privacy(A.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=40), 1e-5)
      >>> [round(float(out.best[i]), 6) for i in (0, 38, 39)]
      [0.0, 2.754009, 4.377178]
      >>> bool(out.composition[0] == out.composition[39])
      True
    """
    if not isinstance(event, PNSGD):
        if event is None and old_keywords:
            warn_old_signature(_OLD_SIGNATURE, stacklevel=_WARN_LEVEL)
            return _loose_privacy(**old_keywords, delta=delta, positions=positions,
                                  strongly_convex_form=strongly_convex_form)
        raise TypeError("pnsgd_privacy(event, delta) takes the run's record, a PNSGD event; got "
                        f"{type(event).__name__}.")
    if old_keywords:
        raise TypeError(f"pnsgd_privacy(event, delta): the run's constants come from the record; got also "
                        f"{', '.join(sorted(old_keywords))}.")
    if delta is None:
        raise TypeError("pnsgd_privacy(event, delta): delta is missing.")
    return run_privacy(event, delta, positions=positions, strongly_convex_form=strongly_convex_form, orders=orders)


_OLD_SIGNATURE = ("pnsgd_privacy(lipschitz=..., ..., delta=...) is deprecated: pass the run's record, "
                  "pnsgd_privacy(PNSGD(lipschitz, smoothness, learning_rate, noise_std, diameter, num_records=n, "
                  "strong_convexity=..., batch_size=..., passes=...), delta); the keyword form goes in the next "
                  "release.")
# The caller's frame: warn_old_signature <- pnsgd_privacy <- float64's wrapper <- caller.
_WARN_LEVEL = 4


def run_privacy(event: PNSGD, delta, *, positions=None, strongly_convex_form: str = "proposition1",
                orders=DEFAULT_ORDERS) -> PNSGDPrivacy:
    """:func:`pnsgd_privacy` of a record (no deprecation door; the accountants call this)."""
    if event.sampling in ("poisson", "shuffle"):
        return _poisson_privacy(event, delta, positions, orders)
    if event.relation != "replace_one":
        raise ValueError(f"the PNSGD analyses cover relation 'replace_one' only; got relation {event.relation!r}.")
    if event.schedule == "random_stop":
        return _stop_privacy(event, delta, positions, orders)
    out = _loose_privacy(lipschitz=event.lipschitz, smoothness=event.smoothness, learning_rate=event.learning_rate,
                         noise_std=event.noise_std, diameter=event.diameter, num_records=event.num_records, delta=delta,
                         strong_convexity=event.strong_convexity, batch_size=event.batch_size, passes=event.passes,
                         positions=positions, strongly_convex_form=strongly_convex_form)
    if event.hidden:
        return out
    comp = out.composition
    none = jnp.where(jnp.isnan(comp), jnp.nan, jnp.inf)  # not certified when every iterate is released
    return out._replace(contraction=none, iteration=none, strongly_convex=none, shifted_gdp=none, best=comp)


def _poisson_privacy(event: PNSGD, delta, positions, orders) -> PNSGDPrivacy:
    """Poisson or shuffled batches (see :func:`pnsgd_privacy`): every record alike; ``iteration`` is the
    hidden-state bound."""
    event_rdp = _pnsgd_shuffle.event_rdp if event.sampling == "shuffle" else _poisson_event_rdp
    _validate.check_delta(delta)
    orders = _validate.concrete_orders(orders)
    n = event.num_records
    if positions is None:
        pos = jnp.arange(1, n + 1, dtype=jnp.float64)
    else:
        check_positions(positions, n)
        pos = f64(positions)
    ones = jnp.ones(jnp.shape(pos))
    comp = rdp_to_epsilon(event_rdp(dataclasses.replace(event, hidden=False), orders), orders, delta).epsilon * ones
    none = jnp.where(jnp.isnan(comp), jnp.nan, jnp.inf)
    if not event.hidden:
        return PNSGDPrivacy(positions=pos, contraction=none, iteration=none, strongly_convex=none, composition=comp,
                            best=comp, shifted_gdp=none)
    hid = rdp_to_epsilon(event_rdp(event, orders), orders, delta).epsilon * ones
    gdp = _pnsgd_shuffle.gdp_epsilon(event, delta) * ones if event.sampling == "shuffle" else none
    return PNSGDPrivacy(positions=pos, contraction=none, iteration=hid, strongly_convex=none, composition=comp,
                        best=jnp.minimum(jnp.minimum(hid, comp), gdp), shifted_gdp=gdp)


def stop_geometry(num_records: int, batch_size: int) -> tuple[int, int]:
    """(m, b_min): the steps of one randomly stopped pass in batches of b, and its smallest batch."""
    m = -(-int(num_records) // int(batch_size))
    return m, min(int(batch_size), int(num_records) - (m - 1) * int(batch_size))


def _stop_privacy(event: PNSGD, delta, positions, orders) -> PNSGDPrivacy:
    """The random-stop analyses per record (see :func:`pnsgd_privacy`), batches as steps."""
    if event.passes != 1:
        raise ValueError(f"random stopping covers one pass (passes=1); got passes={event.passes}.")
    if not event.hidden:
        raise ValueError("random stopping with hidden=False is not supported: releasing every iterate reveals the "
                         "stopping time.")
    n, b = event.num_records, event.batch_size
    m, b_min = stop_geometry(n, b)
    orders = _validate.concrete_orders(orders)
    if positions is None:
        pos = jnp.arange(1, n + 1, dtype=jnp.float64)
        batches, take = jnp.arange(1, m + 1, dtype=jnp.float64), np.arange(n) // b
    else:
        check_positions(positions, n)
        pos = f64(positions)
        batches, take = jnp.ceil(pos / b), None
    lip = f64(event.lipschitz) / b_min
    m_c = step_contraction(event.learning_rate, event.smoothness, event.strong_convexity)
    thm5 = stop_pnsgd_contraction_epsilon(delta, m, lip, event.noise_std, event.learning_rate, event.diameter, m_c,
                                          positions=batches)
    rdp = stop_pnsgd_iteration_rdp(orders, m, lip, event.noise_std, positions=batches, form="logmeanexp")
    thm26 = rdp_to_epsilon(rdp, orders, delta).epsilon
    if take is not None:
        thm5, thm26 = thm5[take], thm26[take]
    comp = _loose_privacy(lipschitz=event.lipschitz, smoothness=event.smoothness, learning_rate=event.learning_rate,
                          noise_std=event.noise_std, diameter=event.diameter, num_records=n, delta=delta,
                          strong_convexity=event.strong_convexity, batch_size=b, passes=1,
                          positions=pos).composition
    none = jnp.where(jnp.isnan(comp), jnp.nan, jnp.inf)
    best = jnp.minimum(jnp.minimum(thm5, thm26), comp)
    return PNSGDPrivacy(positions=pos, contraction=thm5, iteration=thm26, strongly_convex=none, composition=comp,
                        best=best, shifted_gdp=none)


def _loose_privacy(
    *,
    lipschitz,
    smoothness,
    learning_rate,
    noise_std,
    diameter,
    num_records,
    delta,
    strong_convexity=0.0,
    batch_size=1,
    passes=1,
    positions=None,
    strongly_convex_form: str = "proposition1",
) -> PNSGDPrivacy:
    """:func:`pnsgd_privacy` of a fixed-schedule run given by its loose constants (the old signature)."""
    _validate.check_static_choice("strongly_convex_form", strongly_convex_form, _SC_FORMS)
    _validate_run(lipschitz, smoothness, learning_rate, noise_std, diameter, strong_convexity, batch_size, passes)
    _validate.check_delta(delta)
    if positions is None:
        if not isinstance(num_records, (int, np.integer)) or isinstance(num_records, bool):
            if _validate.is_concrete(num_records) and np.ndim(num_records) == 0 and float(num_records) == int(float(num_records)):
                num_records = int(float(num_records))
            else:
                raise ValueError(
                    "num_records must be a Python int when positions is None (it fixes the output shape); "
                    f"got {num_records!r}. Pass positions explicitly to trace num_records."
                )
        check_integer("num_records", num_records)
        pos = jnp.asarray(np.arange(1, num_records + 1, dtype=np.float64))
    else:
        check_positions(positions, num_records)
        pos = f64(positions)
    _validate.check_not_above("batch_size", batch_size, "num_records", num_records)
    scalars = {}
    for name, value in (
        ("num_records", num_records),
        ("lipschitz", lipschitz),
        ("smoothness", smoothness),
        ("strong_convexity", strong_convexity),
        ("learning_rate", learning_rate),
        ("noise_std", noise_std),
        ("diameter", diameter),
        ("batch_size", batch_size),
        ("passes", passes),
        ("delta", delta),
    ):
        arr = f64(value)
        if arr.ndim != 0:
            raise ValueError(
                f"{name} must be a scalar in pnsgd_privacy (got shape {arr.shape}); use jax.vmap to "
                "evaluate several runs."
            )
        scalars[name] = arr
    shape = jnp.shape(pos)
    size = math.prod(shape)
    if _validate.is_concrete(pos):
        # Concrete positions are padded (with position 1) to a bucket size, so that runs of
        # nearby sizes reuse one compiled program; the padding is cut off in _combine.
        flat_np = np.asarray(pos, np.float64).reshape(-1)
        flat = jnp.asarray(np.concatenate([flat_np, np.ones(_bucket(size) - size)]))
    else:
        flat = jnp.reshape(pos, (-1,))
    s = scalars
    outs = _privacy_core(
        flat,
        s["num_records"],
        s["lipschitz"],
        s["smoothness"],
        s["strong_convexity"],
        s["learning_rate"],
        s["noise_std"],
        s["diameter"],
        s["batch_size"],
        s["passes"],
        s["delta"],
        sc_form=strongly_convex_form,
        size=size,
        shape=shape,
    )
    eps_c, eps_i, eps_s, eps_g, eps_sh, best = outs
    return PNSGDPrivacy(
        positions=pos,
        contraction=eps_c,
        iteration=eps_i,
        strongly_convex=eps_s,
        composition=eps_g,
        best=best,
        shifted_gdp=eps_sh,
    )
